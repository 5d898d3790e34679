"""``make soak``: a chaos soak of a real Lazarus job on this machine.

A controller and 4 agents (the example MoE GPT worker, gloo, moc checkpoints on an S3 API
served by moto on 127.0.0.1) train while a seeded random schedule injects, for
``--minutes``:

* ``kill_node``       SIGKILL of a node's agent and worker (a replacement joins later),
* ``kill_worker``     SIGKILL of a training process only (its agent restarts it),
* ``kill_controller`` SIGKILL of the controller, restarted 2-6 s later with the same
                      command line,
* ``freeze_node``     SIGSTOP of a node for 3-6 s (past the heartbeat timeout), then SIGCONT,
* ``spot_notice``     SIGTERM to an agent (graceful leave),
* ``join``            a new node (the world stays between 3 and 5 nodes),
* ``storage_outage``  the S3 endpoint down for 10-20 s.

Before each fault the job must be healthy again (every live node a member of the newest
plan, training past its earlier high-water mark). Then the job runs to its last step and
the soak checks: the job finished, ``moc verify`` passes on every committed step, every
replica of every expert is identical, the dense state is identical, the loss went down,
and every fault is accounted for in the controller's event log. It prints a table (faults
by kind, survived, time lost per fault median / max, steps lost) and writes it to
``benchmarks/soak/results.md``.

Time lost per fault = from the injection until training first gets past the step it had
reached before it, minus one normal step. Steps lost = recorded steps run again (a
rollback to a checkpoint); the step in flight when a peer dies is discarded before it is
recorded, so it shows up as time lost, not here.

Rerun: ``make soak`` (10 minutes), or ``python benchmarks/soak/main.py --minutes 3 --seed 7``.
Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lazarus._local_cluster import LocalCluster  # noqa: E402

KINDS = ("kill_node", "kill_worker", "kill_controller", "freeze_node", "spot_notice", "join", "storage_outage")
WEIGHTS = (2, 2, 2, 2, 2, 2, 1)
REMOVALS = ("kill_node", "spot_notice")
LAYERS, EXPERTS = 2, 4
BUCKET = "soak"
MIN_NODES, MAX_NODES = 3, 5


# ----------------------------------------------------------------------------- storage


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Endpoint:
    """moto's S3 server on 127.0.0.1 that can be taken down and brought back (its data stays)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = _free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "soak", "AWS_SECRET_ACCESS_KEY": "soak",
                    "AWS_REGION": "us-east-1"}
        self.up = False

    def start(self) -> None:
        self.server.start()
        self.up = True

    def stop(self) -> None:
        self.server.stop()
        inner = getattr(self.server, "_server", None)
        if inner is not None:
            inner.server_close()   # refuse connections like an endpoint that is down
        self.up = False

    def make_bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.url, aws_access_key_id="soak", aws_secret_access_key="soak",
                     region_name="us-east-1").create_bucket(Bucket=name)


# ----------------------------------------------------------------------------- the job


def _job(workdir: Path, s3: S3Endpoint, steps: int, run: str) -> LocalCluster:
    worker = ["--steps", str(steps), "--storage", f"s3://{BUCKET}/{run}", "--layers", str(LAYERS),
              "--experts", str(EXPERTS), "--d-model", "32", "--d-hidden", "64", "--batch-size", "8",
              "--seq-len", "32", "--corpus-bytes", str(1 << 20), "--interval", "5", "--k-snapshot", "2",
              "--k-persist", "1", "--persist-every", "2", "--snapshot-copies", "2",
              "--collective-timeout", "5s", "--rendezvous-timeout", "30s", "--plan-timeout", "150s",
              "--report-every", "5", "--digests", str(workdir / "digest-{node}.json")]
    controller = ["--slots", "2", "--min-replicas", "2", "--expected-nodes", "4", "--heartbeat-timeout", "2s",
                  "--join-window", "1s", "--resume-grace", "6s"]
    agent = ["--heartbeat-interval", "250ms", "--respawn-delay", "500ms", "--max-restarts", "20",
             "--reconnect-timeout", "2m"]
    return LocalCluster(workdir / "job", worker_args=worker, controller_args=controller, agent_args=agent,
                        env=s3.env)


def _median_step_seconds(c: LocalCluster) -> float:
    recs = sorted(c.steps(), key=lambda m: m["t"])
    gaps = [b["t"] - a["t"] for a, b in zip(recs, recs[1:]) if b["step"] == a["step"] + 1 and b["t"] > a["t"]]
    return statistics.median(gaps) if gaps else 0.5


def calibrate(workdir: Path, s3: S3Endpoint, steps: int = 40) -> float:
    """Seconds per step of a fault-free job of the same shape (median)."""
    with _job(workdir, s3, steps, "calibration") as c:
        c.start([f"n{i}" for i in range(4)])
        rc = c.wait(timeout=600)
        if rc != 0:
            raise RuntimeError(f"calibration job failed ({rc}); see {c.dir}")
        return _median_step_seconds(c)


# ----------------------------------------------------------------------------- faults


@dataclass
class Fault:
    kind: str
    t: float                       # injected (wall clock)
    node: str | None = None
    t_end: float | None = None     # thawed / restarted / endpoint back
    step_before: int = -1          # high-water mark of recorded steps at injection
    detail: dict[str, Any] = field(default_factory=dict)
    accounted: bool = False
    evidence: list[str] = field(default_factory=list)
    time_lost: float | None = None
    steps_lost: int | None = None


def schedule(seed: int, minutes: float, kinds: tuple[str, ...] = KINDS,
             spacing: tuple[float, float] = (12.0, 24.0)) -> list[tuple[float, str]]:
    """Offsets (seconds after the warm-up) and kinds, from the seed alone."""
    rng = random.Random(seed)
    weights = [w for k, w in zip(KINDS, WEIGHTS) if k in kinds]
    kinds = tuple(k for k in KINDS if k in kinds)
    out, t = [], 0.0
    while True:
        t += rng.uniform(*spacing)
        if t > minutes * 60:
            return out
        out.append((t, rng.choices(kinds, weights)[0]))


class Soak:
    def __init__(self, c: LocalCluster, s3: S3Endpoint, steps: int, seed: int) -> None:
        self.c, self.s3, self.steps = c, s3, steps
        self.rng = random.Random(seed + 1)
        self.alive: list[str] = []
        self.next_id = 0
        self.faults: list[Fault] = []
        self.log = open(c.dir / "soak.log", "a")

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
        return sorted(self.members()) == sorted(self.alive) and self.c.current_step() > since_step + 2

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

    def pick_kind(self, kind: str) -> str:
        if kind in REMOVALS and len(self.alive) <= MIN_NODES:
            return "join"
        if kind == "join" and len(self.alive) >= MAX_NODES:
            return "kill_node"
        return kind

    def inject(self, kind: str) -> Fault:
        c, rng = self.c, self.rng
        f = Fault(kind, time.time(), step_before=c.current_step())
        if kind in ("kill_node", "kill_worker", "freeze_node", "spot_notice"):
            f.node = rng.choice(sorted(self.alive))
        if kind == "kill_node":
            f.t = c.kill_node(f.node)
            self.alive.remove(f.node)
        elif kind == "kill_worker":
            f.t = c.kill_worker(f.node)
        elif kind == "spot_notice":
            f.t = c.leave(f.node)
            self.alive.remove(f.node)
        elif kind == "freeze_node":
            f.t = c.freeze_node(f.node)
            time.sleep(rng.uniform(3.0, 6.0))
            c.thaw_node(f.node)
            f.t_end = time.time()
        elif kind == "kill_controller":
            f.t = c.kill_controller()
            time.sleep(rng.uniform(2.0, 6.0))
            c.restart_controller()
            f.t_end = time.time()
        elif kind == "join":
            f.node = self.new_node()
        elif kind == "storage_outage":
            self.s3.stop()
            time.sleep(rng.uniform(10.0, 20.0))
            self.s3.start()
            f.t_end = time.time()
        self.faults.append(f)
        self.say(f"{kind} {f.node or ''}".rstrip() + (f" ({f.t_end - f.t:.1f} s)" if f.t_end else ""))
        return f

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
            if c.current_step() > 0.93 * self.steps:
                self.say("close to the last step; stopping the faults")
                break
            self.inject(self.pick_kind(drawn))
        self.say(f"faults over after {time.time() - t0:.0f} s; running to step {self.steps}")


# ----------------------------------------------------------------------------- checks


def account(f: Fault, events: list[dict[str, Any]]) -> None:
    """Find the fault in the controller's event log."""
    after = [e for e in events if e.get("t", 0) >= f.t - 0.05]

    def first(pred) -> dict[str, Any] | None:
        return next((e for e in after if pred(e)), None)

    def plan_with(key: str, node: str, t: float = 0.0) -> dict[str, Any] | None:
        return first(lambda e: e["event"] == "plan" and node in e.get(key, []) and e["t"] >= t)

    found: list[tuple[str, dict[str, Any] | None]] = []
    n = f.node
    if f.kind == "kill_node":
        found = [("node_failed", first(lambda e: e["event"] == "node_failed" and e.get("node") == n)),
                 ("plan lost", plan_with("lost", n))]
    elif f.kind == "kill_worker":
        ex = first(lambda e: e["event"] == "worker_exit" and e.get("node") == n and e.get("returncode") == -9)
        found = [("worker_exit -9", ex), ("node_failed", first(lambda e: e["event"] == "node_failed"
                                                               and e.get("node") == n)),
                 ("rejoin plan", plan_with("joined", n, ex["t"] if ex else 0.0))]
    elif f.kind == "freeze_node":
        failed = first(lambda e: e["event"] == "node_failed" and e.get("node") == n)
        found = [("node_failed", failed), ("plan lost", plan_with("lost", n)),
                 ("evicted", first(lambda e: e["event"] == "evicted" and e.get("node") == n)),
                 ("rejoin plan", plan_with("joined", n, failed["t"] if failed else 0.0))]
    elif f.kind == "spot_notice":
        found = [("leave", first(lambda e: e["event"] == "leave" and e.get("node") == n)),
                 ("leave plan", plan_with("leaving", n))]
    elif f.kind == "join":
        found = [("node_registered", first(lambda e: e["event"] == "node_registered" and e.get("node") == n)),
                 ("join plan", plan_with("joined", n))]
    elif f.kind == "kill_controller":
        found = [("controller_started resumed", first(lambda e: e["event"] == "controller_started"
                                                      and e.get("resumed"))),
                 ("resumed", first(lambda e: e["event"] == "resumed"))]
    elif f.kind == "storage_outage":
        bad = first(lambda e: e["event"] == "storage_degraded")
        found = [("storage_degraded", bad),
                 ("storage_recovered", first(lambda e: e["event"] == "storage_recovered"
                                             and e["t"] >= (f.t_end or f.t)))]
    f.evidence = [f"{name} @{e['t'] - f.t:+.1f}s" if e else f"{name} MISSING" for name, e in found]
    f.accounted = all(e is not None for _, e in found)


def measure(f: Fault, recs: list[dict[str, Any]], step_s: float) -> None:
    """Time and steps this fault cost (see the module docstring)."""
    before = [m["step"] for m in recs if m["t"] < f.t]
    after = [m for m in recs if m["t"] >= f.t]
    if not before or not after:
        return
    hw = max(before)
    f.steps_lost = max(0, hw - after[0]["step"] + 1)
    regain = next((m for m in after if m["step"] > hw), None)
    if regain is not None:
        f.time_lost = max(0.0, regain["t"] - f.t - step_s)


def moc_verify(s3: S3Endpoint, run: str) -> tuple[bool, str]:
    env = dict(os.environ, **s3.env, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "moc.cli", "verify", f"s3://{BUCKET}/{run}"], capture_output=True,
                       text=True, env=env, timeout=600)
    out = (r.stdout.strip().splitlines() or [""])[-1] or r.stderr.strip()[-300:]
    return r.returncode == 0, out


def table(faults: list[Fault]) -> list[str]:
    rows = ["| fault | injected | survived (accounted for) | time lost median / max (s) | steps lost |",
            "|---|---|---|---|---|"]
    for kind in KINDS + ("all",):
        fs = [f for f in faults if kind in ("all", f.kind)]
        if not fs:
            continue
        lost = [f.time_lost for f in fs if f.time_lost is not None]
        tl = f"{statistics.median(lost):.2f} / {max(lost):.2f}" if lost else "-"
        steps = sum(f.steps_lost or 0 for f in fs)
        name = f"**{kind}**" if kind == "all" else f"`{kind}`"
        rows.append(f"| {name} | {len(fs)} | {sum(f.accounted for f in fs)} | {tl} | {steps} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long faults are injected (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the fault schedule (default 0)")
    ap.add_argument("--dir", default=str(ROOT / "runs" / "soak"), help="work directory (wiped)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps of the job (default: calibrated so that it lasts about --minutes)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "soak" / "results.md"),
                    help="where to write the table ('' = nowhere)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"faults to draw from (default all: {','.join(KINDS)})")
    args = ap.parse_args(argv)
    if args.minutes <= 0:
        ap.error(f"--minutes must be > 0, got {args.minutes}")
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds must be a comma list of {', '.join(KINDS)}; got {args.kinds!r}")
    workdir = Path(args.dir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)   # moto's request log
    # The dispatcher's C++ op, built once into a cache of this checkout's own: in a cache
    # shared with other checkouts each one rewrites the build and every fresh worker waits
    # (tens of seconds) on torch's build lock, which would be measured as time lost.
    os.environ.setdefault("LAZARUS_EXT_DIR", str(ROOT / "runs" / "soak-ext"))
    from lazarus.dispatch._build import load_ops

    ops = load_ops()
    print(f"soak: dispatcher op {'C++' if ops.cpp else 'torch fallback: ' + ops.reason}", flush=True)
    s3 = S3Endpoint()
    s3.start()
    s3.make_bucket(BUCKET)
    t_start = time.time()
    try:
        if args.steps is None:
            step_s = calibrate(workdir / "calibration", s3)
            # faults, recoveries and joins cost time: 10 minutes of faults ran at ~60% of
            # the fault-free rate here, so the job ends soon after the faults do
            steps = max(200, int(args.minutes * 60 / step_s * 0.6))
            print(f"soak: calibration {step_s * 1000:.0f} ms/step -> {steps} steps", flush=True)
        else:
            steps = args.steps
        run = "job"
        with _job(workdir, s3, steps, run) as c:
            soak = Soak(c, s3, steps, args.seed)
            soak.run(args.minutes, args.seed, kinds)
            if not s3.up:
                s3.start()
            rc = c.wait(timeout=steps * 2.0 + 600)
            for node in soak.alive:
                try:
                    c.agents[node].wait(timeout=120)
                except subprocess.TimeoutExpired:
                    pass
            events = c.events()
            recs = sorted(c.steps(), key=lambda m: m["t"])
            step_s = _median_step_seconds(c)
            for f in soak.faults:
                account(f, events)
                measure(f, recs, step_s)
            final = [e for e in events if e.get("event") == "plan"][-1]["members"]
            digests = c.read_digests(str(workdir / "digest-{node}.json"), final)
            problems = c.final_state_problems(digests, final, steps, expert_units=LAYERS * EXPERTS)
            first, last = c.loss_drop(20)
            verified, verify_out = moc_verify(s3, run)
            job_wall = (recs[-1]["t"] - recs[0]["t"]) if recs else 0.0
    finally:
        if s3.up:
            s3.stop()
    checks = [
        ("job finished (controller exit 0, every step)", rc == 0 and any(e.get("event") == "done" for e in events)),
        (f"moc verify: {verify_out}", verified),
        ("replicas identical, dense state identical, final world = live nodes"
         + ("" if not problems else f": {'; '.join(problems)}"), not problems),
        (f"loss down: {first:.3f} -> {last:.3f} (mean of the first / last 20 steps)", last < first - 0.5),
        (f"every fault accounted for in the event log ({sum(f.accounted for f in soak.faults)} of "
         f"{len(soak.faults)})", all(f.accounted for f in soak.faults)),
        (f"sane state sizes: final world {len(final)} in [{MIN_NODES}, {MAX_NODES}]",
         MIN_NODES <= len(final) <= MAX_NODES),
    ]
    ok = all(passed for _, passed in checks)
    lines = [
        f"Soak: seed {args.seed}, faults for {args.minutes:g} min, {steps} steps in {job_wall / 60:.1f} min "
        f"({step_s * 1000:.0f} ms/step median), {len(soak.faults)} faults, {LAYERS} layers x {EXPERTS} experts, "
        f"{MIN_NODES}-{MAX_NODES} nodes; total {(time.time() - t_start) / 60:.1f} min.",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, torch {_torch_version()}.",
        "",
        *table(soak.faults),
        "",
        *[f"- [{'x' if passed else ' '}] {name}" for name, passed in checks],
        "",
        "Faults in order (evidence: seconds after the injection):",
        "",
        *[f"{i + 1}. `{f.kind}` {f.node or ''} at step {f.step_before}: "
          f"{'ok' if f.accounted else 'NOT ACCOUNTED'}; {', '.join(f.evidence)}; "
          f"time lost {f.time_lost if f.time_lost is None else round(f.time_lost, 2)} s, "
          f"steps lost {f.steps_lost}" for i, f in enumerate(soak.faults)],
        "",
        f"Rerun: `make soak` or `python benchmarks/soak/main.py --minutes {args.minutes:g} --seed {args.seed}`; "
        f"logs, events and metrics in `{workdir}/job`.",
    ]
    print("\n".join(lines))
    if args.results:
        Path(args.results).write_text("# make soak\n\n" + "\n".join(lines) + "\n")
    return 0 if ok else 1


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
