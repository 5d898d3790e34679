"""The soak's faults: what each kind does to the live job, and the evidence (controller
events, workers' log lines, metrics) that proves it was handled."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from _soak_env import S3Endpoint, Tmpfs, log_lines, wait_until

from examples.local_cluster import LocalCluster

#: kind -> (weight in the schedule, what it does)
FAULTS: dict[str, tuple[int, str]] = {
    "kill_node": (2, "SIGKILL of a node's agent and worker"),
    "kill_worker": (2, "SIGKILL of a training process only (its agent restarts it)"),
    "kill_controller": (2, "SIGKILL of the controller, restarted 2-6 s later with the same command line"),
    "freeze_node": (2, "SIGSTOP of a node for 3-6 s (past the heartbeat timeout), then SIGCONT"),
    "freeze_worker": (2, "SIGSTOP of a training process only (its agent lives: its watchdog kills it) for 3-6 s, "
                         "then SIGCONT"),
    "spot_notice": (2, "SIGTERM to an agent (graceful leave)"),
    "join": (2, "a new node"),
    "storage_outage": (1, "S3 refuses every connection for 10-20 s"),
    "slow_storage": (1, "every S3 request takes 1.5-4 s longer, for 10-25 s"),
    "shm_full": (1, "the nodes' snapshot tmpfs filled by a filler file while a node joins, then freed"),
    "kill_during_join": (1, "SIGKILL of a member the moment a join's plan is issued"),
    "kill_during_reconfig": (1, "SIGKILL of a node the moment the plan for an earlier node kill is issued"),
    "kill_controller_away": (1, "SIGKILL of a node while the controller is down (killed, restarted 3-6 s later)"),
    "kill_two_in_grace": (1, "SIGKILL of two nodes within --failure-grace"),
    "spot_notice_persist_hung": (1, "SIGTERM to an agent while S3 holds every request (a persist is stuck)"),
}
KINDS = tuple(FAULTS)
#: ``--network netns`` (every node, the controller and S3 on hosts of their own): the
#: network's faults, added to the kinds above, which lose the three that need the
#: loopback proxy in front of S3 (PROXY_KINDS)
NETNS_FAULTS: dict[str, tuple[int, str]] = {
    "partition": (2, "a node's switch port down for 5-12 s (it reaches nothing), then up"),
    "cut_controller": (2, "a node cut from the controller only (nft, both ways) for 5-12 s"),
    "cut_peers": (1, "a node cut from every other node only (both ways) for 8-15 s"),
    "cut_peers_in": (1, "a node cut from what every other node sends it for 8-15 s"),
    "cut_peers_out": (1, "a node cut from sending to every other node for 8-15 s"),
    "cut_storage": (1, "a node cut from the S3 host only (both ways) for 10-20 s"),
    "flap": (1, "a node's link down and up, each state 1-5 s (seeded), for 2 minutes"),
}
NETNS_KINDS = tuple(NETNS_FAULTS)
PROXY_KINDS = ("storage_outage", "slow_storage", "spot_notice_persist_hung")
ALL_FAULTS = {**FAULTS, **NETNS_FAULTS}
FLAP_S = 120.0
#: the controller's --flap-hold-down default: a flapping node joins again this long after
#: its link is steady, so a flap needs this much training left on top of END_MARGIN_S
FLAP_HOLD_DOWN_S = 60.0
#: the controller's --flap-limit default: a flap costs at most this many drops, their
#: joins, and the final join (and one more: a collective error's plan)
FLAP_LIMIT = 3
MIN_NODES, MAX_NODES = 3, 5
#: no fault is injected with less training than this left: the longest ones (a join under
#: a full tmpfs, a leave while storage hangs) take ~30 s to play out and be seen handled
END_MARGIN_S = 45.0
#: training left a kind needs to play out (the others: END_MARGIN_S)
_MARGIN = {"flap": FLAP_S + FLAP_HOLD_DOWN_S + END_MARGIN_S}
#: live nodes a kind needs before it is injected (min, max); outside it a join (too few)
#: or a node kill (too many) is injected instead, so the world stays within 3-5 nodes
_NEEDS = {"kill_node": (4, MAX_NODES), "spot_notice": (4, MAX_NODES), "spot_notice_persist_hung": (4, MAX_NODES),
          "kill_controller_away": (4, MAX_NODES), "kill_during_reconfig": (5, MAX_NODES),
          "kill_two_in_grace": (5, MAX_NODES), "join": (MIN_NODES, 4), "shm_full": (MIN_NODES, 4),
          "kill_during_join": (MIN_NODES, 4),
          # a network fault drops its node for a while: from 4, as a kill
          **{k: (4, MAX_NODES) for k in ("partition", "cut_controller", "cut_peers", "cut_peers_in", "cut_peers_out",
                                         "flap")}}
#: time-lost targets per kind (issue 28): seconds, and steps where one is set
TARGETS: dict[str, tuple[float, int | None]] = {
    "kill_node": (2.0, None), "kill_worker": (2.0, None), "kill_controller": (2.0, 0), "storage_outage": (0.0, None),
    # issue 44: the others train again <= 3 s after a worker is SIGSTOPped under its live agent
    "freeze_worker": (3.0, None),
    # node kills too, at the worst moments: the same 2 s (a kill during a reconfiguration
    # cost 30 s once, unflagged while these kinds had no target)
    "kill_during_join": (2.0, None), "kill_during_reconfig": (2.0, None), "kill_two_in_grace": (2.0, None)}


@dataclass
class Fault:
    kind: str
    t: float                       # injected (wall clock)
    node: str | None = None
    t_end: float | None = None     # thawed / restarted / storage back / filler removed
    t_hit: float | None = None     # when training was hit, where later than ``t`` (time lost counts from it)
    step_before: int = -1          # high-water mark of recorded steps at injection
    detail: dict[str, Any] = field(default_factory=dict)
    accounted: bool = False
    evidence: list[str] = field(default_factory=list)
    time_lost: float | None = None
    steps_lost: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "t": self.t, "node": self.node, "t_end": self.t_end, "t_hit": self.t_hit,
                "step_before": self.step_before, "detail": self.detail, "accounted": self.accounted,
                "evidence": self.evidence, "time_lost": self.time_lost, "steps_lost": self.steps_lost}


def schedule(seed: int, minutes: float, kinds: tuple[str, ...] = KINDS,
             spacing: tuple[float, float] = (12.0, 24.0)) -> list[tuple[float, str]]:
    """Offsets (seconds after the warm-up) and kinds, from the seed alone."""
    rng = random.Random(seed)
    kinds = tuple(k for k in (*KINDS, *NETNS_KINDS) if k in kinds)
    weights = [ALL_FAULTS[k][0] for k in kinds]
    out, t = [], 0.0
    while True:
        t += rng.uniform(*spacing)
        if t > minutes * 60:
            return out
        out.append((t, rng.choices(kinds, weights)[0]))


class Soak:
    """Injects faults into a live :class:`LocalCluster` job and keeps the list of live nodes."""

    def __init__(self, c: LocalCluster, s3: S3Endpoint, steps: int, seed: int, *, tmpfs: Tmpfs | None = None,
                 leave_timeout: float = 60.0) -> None:
        self.c, self.s3, self.steps, self.tmpfs = c, s3, steps, tmpfs
        self.rng = random.Random(seed + 1)
        self.alive: list[str] = []
        self.next_id = 0
        self.faults: list[Fault] = []
        self.leave_timeout = leave_timeout
        self.log = open(c.dir / "soak.log", "a")
        self.net = c.network    # a NetnsNetwork (--network netns) or None

    def say(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} step {self.c.current_step()}: {text}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def new_node(self) -> str:
        node = f"n{self.next_id}"
        self.next_id += 1
        self.c.add_node(node)
        self.alive.append(node)
        return node

    def members(self) -> list[str]:
        plan = self.c.latest_plan()
        return list(plan["members"]) if plan else []

    def healthy(self, since_step: int) -> bool:
        """Every live node a member of the newest plan, training past ``since_step``, and a
        restarted controller done resuming (its members back or given up on)."""
        if sorted(self.members()) != sorted(self.alive) or self.c.current_step() <= since_step + 2:
            return False
        events = self.c.events()
        started = [e for e in events if e.get("event") == "controller_started"]
        if started and started[-1].get("resumed"):
            return any(e.get("event") == "resumed" and e["t"] >= started[-1]["t"] for e in events)
        return True

    def wait_healthy(self, timeout: float = 180.0) -> bool:
        since = max([f.step_before for f in self.faults], default=-1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.healthy(since):
                return True
            if self.c.controller is not None and self.c.controller.poll() is not None:
                return False
            time.sleep(0.2)
        return False

    def seconds_left(self) -> float:
        """Training time left to the last step at the recent rate (median of the last 50
        steps' gaps)."""
        recs = sorted(self.c.steps(), key=lambda m: m["t"])[-51:]
        gaps = sorted(b["t"] - a["t"] for a, b in zip(recs, recs[1:]) if b["step"] == a["step"] + 1)
        step_s = gaps[len(gaps) // 2] if gaps else 0.5
        return (self.steps - self.c.current_step()) * step_s

    def pick_kind(self, kind: str) -> str:
        lo, hi = _NEEDS.get(kind, (MIN_NODES, MAX_NODES))
        if len(self.alive) < lo:
            return "join"
        if len(self.alive) > hi:
            return "kill_node"
        return kind

    # -- injection ---------------------------------------------------------------------------
    def _kill(self, node: str) -> float:
        t = self.c.kill_node(node)
        self.alive.remove(node)
        return t

    def _plan_event(self, pred: Callable[[dict[str, Any]], bool], since: float, timeout: float):
        return wait_until(lambda: next((e for e in self.c.events() if e.get("event") == "plan"
                                        and e.get("t", 0) >= since and pred(e)), None), timeout)

    def inject(self, kind: str) -> Fault:
        c, rng = self.c, self.rng
        f = Fault(kind, time.time(), step_before=c.current_step())
        if kind in ("kill_node", "kill_worker", "freeze_node", "freeze_worker", "spot_notice",
                    "spot_notice_persist_hung", "kill_controller_away", *NETNS_KINDS):
            f.node = rng.choice(sorted(self.alive))
        getattr(self, f"_inject_{kind}")(f)
        self.faults.append(f)
        extra = " ".join(f"{k}={v}" for k, v in f.detail.items())
        self.say(f"{kind} {f.node or ''}".rstrip() + (f" ({f.t_end - f.t:.1f} s)" if f.t_end else "")
                 + (f" {extra}" if extra else ""))
        return f

    def _inject_kill_node(self, f: Fault) -> None:
        f.t = self._kill(f.node)

    def _inject_kill_worker(self, f: Fault) -> None:
        f.t = self.c.kill_worker(f.node)

    def _inject_spot_notice(self, f: Fault) -> None:
        f.t = self.c.leave(f.node)
        self.alive.remove(f.node)

    def _inject_freeze_node(self, f: Fault) -> None:
        f.t = self.c.freeze_node(f.node)
        time.sleep(self.rng.uniform(3.0, 6.0))
        self.c.thaw_node(f.node)
        f.t_end = time.time()

    def _inject_freeze_worker(self, f: Fault) -> None:
        f.t, pids = self.c.freeze_worker(f.node)
        time.sleep(self.rng.uniform(3.0, 6.0))
        self.c.thaw(pids)   # killed by its agent long before: nothing to wake
        f.t_end = time.time()

    def _inject_kill_controller(self, f: Fault) -> None:
        f.t = self.c.kill_controller()
        time.sleep(self.rng.uniform(2.0, 6.0))
        self.c.restart_controller()
        f.t_end = time.time()

    def _inject_join(self, f: Fault) -> None:
        f.node = self.new_node()

    def _inject_storage_outage(self, f: Fault) -> None:
        self.s3.proxy.refuse()
        time.sleep(self.rng.uniform(10.0, 20.0))
        self.s3.proxy.heal()
        f.t_end = time.time()

    def _inject_slow_storage(self, f: Fault) -> None:
        delay = self.rng.uniform(1.5, 4.0)
        before = self.s3.proxy.requests
        self.s3.proxy.slow(timedelta(seconds=delay))
        time.sleep(self.rng.uniform(10.0, 25.0))
        self.s3.proxy.heal()
        f.t_end = time.time()
        f.detail.update(delay_s=round(delay, 1), requests=self.s3.proxy.requests - before)

    def _inject_shm_full(self, f: Fault) -> None:
        if self.tmpfs is None:
            raise RuntimeError("shm_full needs the soak's tmpfs")
        f.detail["filled_mib"] = round(self.tmpfs.fill() / 2**20, 1)
        f.node = self.new_node()           # its snapshot buffers must be allocated now
        plan = self._plan_event(lambda e: f.node in e.get("joined", []), f.t, 90.0)
        time.sleep(self.rng.uniform(4.0, 8.0) if plan else 0.0)
        self.tmpfs.drain()
        f.t_end = time.time()

    def _inject_kill_during_join(self, f: Fault) -> None:
        victim = self.rng.choice(sorted(self.alive))
        f.node = self.new_node()
        plan = self._plan_event(lambda e: f.node in e.get("joined", []), f.t, 90.0)
        f.detail["victim"] = victim
        f.detail["join_plan"] = bool(plan)
        f.t = self._kill(victim)

    def _inject_kill_during_reconfig(self, f: Fault) -> None:
        first, second = self.rng.sample(sorted(self.alive), 2)
        f.node = first
        f.t = self._kill(first)
        plan = self._plan_event(lambda e: first in e.get("lost", []), f.t, 30.0)
        f.detail.update(second=second, first_plan=bool(plan))
        self._kill(second)

    def _inject_kill_controller_away(self, f: Fault) -> None:
        f.t = self.c.kill_controller()
        time.sleep(self.rng.uniform(1.0, 2.0))
        f.t_hit = self._kill(f.node)
        time.sleep(self.rng.uniform(2.0, 4.0))
        self.c.restart_controller()
        f.t_end = time.time()

    def _inject_kill_two_in_grace(self, f: Fault) -> None:
        first, second = self.rng.sample(sorted(self.alive), 2)
        f.node = first
        f.t = self._kill(first)
        self._kill(second)
        f.detail.update(second=second, apart_ms=round((time.time() - f.t) * 1000))

    def _inject_spot_notice_persist_hung(self, f: Fault) -> None:
        proxy = self.s3.proxy
        before = proxy.requests
        proxy.hang()
        held = wait_until(lambda: proxy.requests > before, 30.0)   # a persist is stuck in a request
        f.t = self.c.leave(f.node)
        self.alive.remove(f.node)
        agent = self.c.agents[f.node]
        try:
            rc = agent.wait(timeout=self.leave_timeout + 15)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: reported as missing evidence
            rc = None
        f.detail.update(persist_held=bool(held), agent_exit=rc, agent_exit_s=round(time.time() - f.t, 1))
        proxy.heal()
        f.t_end = time.time()

    # -- the network's faults (--network netns) ------------------------------------------------
    def _cut_for(self, f: Fault, lo: float, hi: float, cut: Callable[[], float]) -> None:
        f.t = cut()
        time.sleep(self.rng.uniform(lo, hi))
        f.t_end = self.net.heal(f.node)

    def _inject_partition(self, f: Fault) -> None:
        self._cut_for(f, 5.0, 12.0, lambda: self.net.partition(f.node))

    def _inject_cut_controller(self, f: Fault) -> None:
        self._cut_for(f, 5.0, 12.0, lambda: self.net.cut(f.node, "controller"))

    def _inject_cut_peers(self, f: Fault) -> None:
        self._cut_for(f, 8.0, 15.0, lambda: self.net.cut(f.node, "peers"))

    def _inject_cut_peers_in(self, f: Fault) -> None:
        self._cut_for(f, 8.0, 15.0, lambda: self.net.cut(f.node, "peers", direction="in"))

    def _inject_cut_peers_out(self, f: Fault) -> None:
        self._cut_for(f, 8.0, 15.0, lambda: self.net.cut(f.node, "peers", direction="out"))

    def _inject_cut_storage(self, f: Fault) -> None:
        self._cut_for(f, 10.0, 20.0, lambda: self.net.cut(f.node, "storage"))

    def _inject_flap(self, f: Fault) -> None:
        changes = self.net.flap(f.node, timedelta(seconds=1), timedelta(seconds=FLAP_S), up_to=timedelta(seconds=5),
                                seed=self.rng.randrange(1 << 30))
        f.t = time.time()
        time.sleep(FLAP_S + 6.0)     # the last state may outlast the 2 minutes by up to 5 s
        f.t_end = self.net.heal(f.node)
        f.t_hit = changes[0][0] if changes else None    # the link first went down
        f.detail["link_changes"] = len(changes)

    def run(self, minutes: float, seed: int, kinds: tuple[str, ...] = KINDS) -> None:
        c = self.c
        c.start_controller()
        for _ in range(4):
            self.new_node()
        c.wait_step(10, timeout=300)
        t0 = time.time()
        for offset, drawn in schedule(seed, minutes, kinds):
            if time.time() - t0 > minutes * 60:
                break
            time.sleep(max(0.0, t0 + offset - time.time()))
            if not self.wait_healthy():
                self.say("the job did not become healthy again within 180 s; stopping the faults")
                break
            left_s = self.seconds_left()
            if left_s < END_MARGIN_S:
                self.say(f"about {left_s:.0f} s of training left; stopping the faults (each needs "
                         f"{END_MARGIN_S:.0f} s to play out and be checked)")
                break
            kind = self.pick_kind(drawn)
            if left_s < _MARGIN.get(kind, END_MARGIN_S):
                self.say(f"about {left_s:.0f} s of training left: too little for {kind} (it needs "
                         f"{_MARGIN[kind]:.0f} s to play out and its node to be back); skipped")
                continue
            self.inject(kind)
        self.say(f"faults over after {time.time() - t0:.0f} s; running to step {self.steps}")


# ----------------------------------------------------------------------------- evidence


def account(f: Fault, events: list[dict[str, Any]], recs: list[dict[str, Any]], job_dir, step_s: float) -> None:
    """Find the proof that the fault was handled (controller events, log lines, metrics).
    Faults that last a while (storage, a full tmpfs) also get the rate of training during
    them, as a fraction of the job's median (``detail["rate"]``)."""
    after = [e for e in events if e.get("t", 0) >= f.t - 0.05]

    def first(pred, t: float = 0.0) -> dict[str, Any] | None:
        return next((e for e in after if e["t"] >= t and pred(e)), None)

    def ev(name: str, node: str | None = None, t: float = 0.0, **match: Any) -> dict[str, Any] | None:
        return first(lambda e: e["event"] == name and (node is None or e.get("node") == node)
                     and all(e.get(k) == v for k, v in match.items()), t)

    def plan_with(key: str, node: str, t: float = 0.0) -> dict[str, Any] | None:
        return first(lambda e: e["event"] == "plan" and node in e.get(key, []), t)

    def pseudo(ok: bool, t: float | None = None) -> dict[str, Any] | None:
        return {"t": f.t if t is None else t} if ok else None

    def advanced(t0: float, t1: float) -> int:
        k = len({m["step"] for m in recs if t0 <= m["t"] <= t1})
        if t1 > t0 and step_s > 0:
            d["rate"] = round(k * step_s / (t1 - t0), 2)
        return k

    found: list[tuple[str, dict[str, Any] | None]] = []
    n, d = f.node, f.detail
    if f.kind == "kill_node":
        found = [("node_failed", ev("node_failed", n)), ("plan lost", plan_with("lost", n))]
    elif f.kind == "kill_worker":
        ex = ev("worker_exit", n, returncode=-9)
        found = [("worker_exit -9", ex), ("node_failed", ev("node_failed", n)),
                 ("rejoin plan", plan_with("joined", n, ex["t"] if ex else 0.0))]
    elif f.kind == "freeze_node":
        failed = ev("node_failed", n)
        found = [("node_failed", failed), ("plan lost", plan_with("lost", n)), ("evicted", ev("evicted", n)),
                 ("rejoin plan", plan_with("joined", n, failed["t"] if failed else 0.0))]
    elif f.kind == "freeze_worker":
        ex = first(lambda e: e["event"] == "worker_exit" and e.get("node") == n and e.get("returncode") == -9
                   and "watchdog (frozen" in str(e.get("error")))
        found = [("worker_exit -9 by the watchdog", ex), ("node_failed", ev("node_failed", n)),
                 ("rejoin plan", plan_with("joined", n, ex["t"] if ex else 0.0))]
    elif f.kind == "spot_notice":
        found = [("leave", ev("leave", n)), ("leave plan", plan_with("leaving", n))]
    elif f.kind == "join":
        found = [("node_registered", ev("node_registered", n)), ("join plan", plan_with("joined", n))]
    elif f.kind == "kill_controller":
        found = [("controller_started resumed", first(lambda e: e["event"] == "controller_started"
                                                      and e.get("resumed"))),
                 ("resumed", ev("resumed"))]
    elif f.kind == "storage_outage":
        k = advanced(f.t, f.t_end or f.t)
        # degraded during the outage: reported after it began, or still so from before (a
        # worker reports the change, not every failure)
        earlier = [e for e in events if e.get("t", 0) < f.t and e["event"] in ("storage_degraded", "storage_recovered")]
        still = earlier[-1] if earlier and earlier[-1]["event"] == "storage_degraded" else None
        found = [("storage_degraded" + (" (since before)" if still and not ev("storage_degraded") else ""),
                  ev("storage_degraded") or still),
                 ("storage_recovered", ev("storage_recovered", t=f.t_end or f.t)),
                 (f"{k} steps trained while down ({d.get('rate')}x the median rate)", pseudo(k > 0, f.t_end))]
    elif f.kind == "slow_storage":
        end = f.t_end or f.t
        k = advanced(f.t, end)
        found = [(f"{d.get('requests', 0)} requests slowed by {d.get('delay_s')} s", pseudo(d.get("requests", 0) > 0)),
                 (f"{k} steps trained while slow ({d.get('rate')}x the median rate)", pseudo(k > 0, end))]
    elif f.kind == "shm_full":
        end = f.t_end or f.t
        skips = [x for x in log_lines(job_dir, "snapshot skipped") if f.t <= x[0] <= end + 1.0]
        k = advanced(f.t, end)
        found = [("node_registered", ev("node_registered", n)), ("join plan", plan_with("joined", n)),
                 (f"{len(skips)} 'snapshot skipped' log lines on {len({x[1] for x in skips})} node(s)",
                  pseudo(bool(skips), skips[0][0] if skips else None)),
                 (f"{k} steps trained while full ({d.get('rate')}x the median rate)", pseudo(k > 0, end))]
    elif f.kind == "kill_during_join":
        v = d.get("victim")
        lost = plan_with("lost", v)
        found = [("join plan issued before the kill", pseudo(bool(d.get("join_plan")))),
                 (f"node_failed {v}", ev("node_failed", v)), (f"plan lost {v}", lost),
                 (f"{n} a member after", first(lambda e: e["event"] == "plan" and n in e.get("members", []),
                                               lost["t"] if lost else float("inf")))]
    elif f.kind == "kill_during_reconfig":
        s = d.get("second")
        lost1 = plan_with("lost", n)
        found = [(f"plan lost {n}", lost1), (f"node_failed {s}", ev("node_failed", s)),
                 (f"plan lost {s} after it", plan_with("lost", s, lost1["t"] if lost1 else float("inf")))]
    elif f.kind == "kill_controller_away":
        found = [("controller_started resumed", first(lambda e: e["event"] == "controller_started"
                                                      and e.get("resumed"))),
                 (f"node_failed {n}", ev("node_failed", n)), (f"plan lost {n}", plan_with("lost", n))]
    elif f.kind == "kill_two_in_grace":
        s = d.get("second")
        both = first(lambda e: e["event"] == "plan" and {n, s} <= set(e.get("lost", [])))
        found = [(f"node_failed {n}", ev("node_failed", n)), (f"node_failed {s}", ev("node_failed", s)),
                 ("one plan lost both", both)]
    elif f.kind == "spot_notice_persist_hung":
        rc = d.get("agent_exit")
        found = [("a persist held by S3", pseudo(bool(d.get("persist_held")))), ("leave", ev("leave", n)),
                 ("leave plan", plan_with("leaving", n)),
                 (f"agent exit {rc} after {d.get('agent_exit_s')} s", pseudo(rc == 0, f.t + (d.get("agent_exit_s")
                                                                                          or 0)))]
    elif f.kind in ("partition", "cut_controller"):
        failed = ev("node_failed", n)
        found = [("node_failed", failed), ("plan lost", plan_with("lost", n)),
                 ("rejoin plan after the heal", plan_with("joined", n, f.t_end or f.t))]
    elif f.kind in ("cut_peers", "cut_peers_in", "cut_peers_out"):
        # the controller must drop the cut node (who reports whom), never the healthy others
        lost = first(lambda e: e["event"] == "plan" and e.get("lost"))
        found = [("collective_error", ev("collective_error")),
                 (f"plan lost {lost['lost'] if lost else '?'} (only the cut node)",
                  lost if lost and lost["lost"] == [n] else None),
                 ("rejoin plan after the heal", plan_with("joined", n, f.t_end or f.t))]
    elif f.kind == "cut_storage":
        end = f.t_end or f.t
        k = advanced(f.t, end)
        dropped = first(lambda e: e["event"] == "plan" and n in e.get("lost", []) and e["t"] <= end)
        found = [(f"{k} steps trained while cut ({d.get('rate')}x the median rate)", pseudo(k > 0, end)),
                 ("not dropped for it", pseudo(dropped is None, end))]
    elif f.kind == "flap":
        end = f.t_end or f.t
        before = [e for e in events if e.get("event") == "plan" and e["t"] <= end]
        back = (first(lambda e: e["event"] == "plan" and n in e.get("members", []), end)
                or pseudo(bool(before) and n in before[-1].get("members", []), end))
        # the flap's plans: from its start until the one that has the node back (other
        # faults may follow while it is held; theirs are not counted)
        plans = [e for e in after if e["event"] == "plan" and e["t"] <= (back["t"] if back else end)]
        bound = 2 * FLAP_LIMIT + 2
        d["plans"] = len(plans)
        found = [(f"{len(plans)} plans for {d.get('link_changes')} link changes (bound {bound})",
                  pseudo(len(plans) <= bound)),
                 ("join_held", ev("join_held", n)), (f"{n} a member again", back)]
    f.evidence = [f"{name} @{e['t'] - f.t:+.1f}s" if e else f"{name} MISSING" for name, e in found]
    f.accounted = bool(found) and all(e is not None for _, e in found)


def measure(f: Fault, recs: list[dict[str, Any]], step_s: float) -> None:
    """Time and steps this fault cost: from the injection (the node kill, for a kill while
    the controller is away) until training first gets past the step it had reached
    before it (a network fault: the step after that one), minus one normal step; steps lost = recorded steps
    run again (a rollback to a checkpoint)."""
    t = f.t_hit or f.t
    before = [m["step"] for m in recs if m["t"] < t]
    after = [m for m in recs if m["t"] >= t]
    if not before or not after:
        return
    hw = max(before)
    f.steps_lost = max(0, hw - after[0]["step"] + 1)
    # A network fault hits the step in flight, which may still be recorded just after it
    # (a kill's step never is): training has got past the fault once the step after it is.
    past = hw + 1 if f.kind in NETNS_KINDS else hw
    regain = next((m for m in after if m["step"] > past), None)
    if regain is not None:
        f.time_lost = max(0.0, regain["t"] - t - step_s)


def target_met(kind: str, time_lost: list[float], steps_lost: int, step_s: float) -> bool | None:
    """Whether a kind met its issue-28 target (None: it has none). A 0 s target is read to
    the resolution of the measurement, two median steps (one step's own time varies)."""
    if kind not in TARGETS or not time_lost:
        return None
    seconds, steps = TARGETS[kind]
    limit = seconds if seconds > 0 else 2 * step_s
    return max(time_lost) <= limit and (steps is None or steps_lost <= steps)
