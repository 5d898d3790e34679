"""The controller's membership logic alone (``lazarus.runtime.controller._membership``):
no sockets, no event loop. A fake :class:`Port` records what it sends and the events, and
runs its timers on a fake clock that the tests advance; every test asserts on the plans
that went out (first plan, failures coalesced by ``failure_grace``, joins batched by
``join_window``, a leave, a collective error) and on what they waited for."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest

from lazarus.runtime import ControllerConfig
from lazarus.runtime.controller._membership import Membership
from lazarus.runtime.controller._port import Port
from lazarus.runtime.controller._resume import Resume

pytestmark = pytest.mark.timeout(10)

SECRET = b"s" * 32
LAYERS = {"l0": 4}
OWN_STORE = {"host": "127.0.0.1", "port": 29401, "epoch": 1}


@dataclass(eq=False)
class FakeTimer:
    at: float
    callback: Callable[..., object]
    args: tuple[Any, ...]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

    def when(self) -> float:
        return self.at


@dataclass
class FakeLoop:
    """Timers on a clock that only :meth:`advance` moves."""

    now: float = 0.0
    timers: list[FakeTimer] = field(default_factory=list)

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> FakeTimer:
        t = FakeTimer(self.now + delay, callback, args)
        self.timers.append(t)
        return t

    def call_soon(self, callback: Callable[[], None]) -> FakeTimer:
        return self.call_later(0.0, callback)

    def pending(self) -> list[FakeTimer]:
        return [t for t in self.timers if not t.cancelled]

    def advance(self, seconds: float) -> None:
        """Move the clock, running the timers due on the way, in order."""
        end = self.now + seconds
        while True:
            due = sorted((t for t in self.pending() if t.at <= end), key=lambda t: t.at)
            if not due:
                break
            t = due[0]
            self.timers.remove(t)
            self.now = t.at
            t.callback(*t.args)
        self.now = end


class Cluster:
    """A :class:`Membership` with a fake port; nodes are registered and messaged directly."""

    def __init__(self, **settings: Any) -> None:
        settings.setdefault("slots_per_node", 4)
        self.config = ControllerConfig(secret=SECRET, **settings)
        self.loop = FakeLoop()
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.events: list[dict[str, Any]] = []
        self.saves: list[bool] = []
        self.closed: set[str] = set()
        self.ended = 0
        self.port = Port(send=self._send, event=self._event, save_state=self._save,
                         call_later=self.loop.call_later, call_soon=self.loop.call_soon, time=lambda: self.loop.now,
                         connected=lambda n: n not in self.closed, own_store=lambda: dict(OWN_STORE),
                         end_job=self._end, collective_while_resuming=self._collective_while_resuming)
        self.m = Membership(self.config, self.port)
        self.resume: Resume | None = None

    # the port
    def _send(self, node: str, msg: dict[str, Any]) -> bool:
        if node in self.closed:
            return False
        self.sent.append((node, msg))
        return True

    def _event(self, name: str, level: int = 20, **fields: Any) -> None:
        self.events.append({"event": name, **fields})

    def _save(self, now: bool = False) -> None:
        self.saves.append(now)

    def _end(self) -> None:
        self.ended += 1

    def _collective_while_resuming(self, current: bool) -> None:
        assert self.resume is not None
        self.resume.on_collective(current)

    # driving it
    def register(self, *nodes: str, ready: bool = True, store: dict[str, Any] | None = None) -> None:
        for n in nodes:
            self.m.register(n, f"peer-{n}", slots=None, incarnation=1, pid=100, nproc=1)
            if ready:
                self.ready(n, store=store)

    def ready(self, node: str, store: dict[str, Any] | None = None) -> None:
        msg: dict[str, Any] = {"type": "worker_ready", "node": node, "incarnation": 1, "pid": 200,
                               "model": {"layers": LAYERS, "top_k": 2}}
        if store is not None:
            msg["store"] = store
        self.m.on_message(node, msg)

    def worker(self, node: str, **inner: Any) -> None:
        self.m.on_message(node, {"type": "worker", "node": node, "msg": inner})

    def applied(self, generation: int) -> None:
        """Every member reports ``generation`` applied (the first report counts)."""
        for n in self.m.members:
            self.worker(n, type="reconfigured", generation=generation, t_resumed=self.loop.now)

    # what went out
    def plans(self) -> list[dict[str, Any]]:
        """The plans sent, one per generation, in order."""
        seen: dict[int, dict[str, Any]] = {}
        for _, msg in self.sent:
            if msg["type"] == "plan":
                seen.setdefault(msg["generation"], msg)
        return list(seen.values())

    def receivers(self, generation: int) -> list[str]:
        return [n for n, msg in self.sent if msg["type"] == "plan" and msg["generation"] == generation]

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]


def started(*nodes: str, **settings: Any) -> Cluster:
    """A cluster whose first plan (generation 1, all of ``nodes``) is out and applied."""
    c = Cluster(expected_nodes=len(nodes), **settings)
    c.register(*nodes)
    assert [p["members"] for p in c.plans()] == [sorted(nodes)]
    c.applied(1)
    return c


# ============================================================================ the first plan


def test_registration_of_n_nodes_gives_the_first_plan_once_the_expected_ones_are_ready() -> None:
    c = Cluster(expected_nodes=3)
    c.register("b", "a")
    c.register("c", ready=False)
    assert c.plans() == [] and c.loop.pending() == []     # two of three ready: no plan, no timer
    assert [e["node"] for e in c.named("node_registered")] == ["b", "a", "c"]
    c.ready("c")
    (plan,) = c.plans()
    assert plan["generation"] == 1 and plan["reason"] == "start" and plan["mode"] == "immediate"
    assert plan["members"] == ["a", "b", "c"] and plan["joined"] == ["a", "b", "c"] and plan["lost"] == []
    assert plan["store"] == OWN_STORE and plan["prefix"] == "lazarus/gen1" and plan["world_size"] == 3
    assert sorted(plan["layers"]["l0"][i][j] for i in range(3) for j in range(4)).count(0) >= 2  # f = 2
    assert sorted(c.receivers(1)) == ["a", "b", "c"]
    assert c.m.generation == 1 and c.m.members == ["a", "b", "c"]
    assert c.saves[-1] is True                             # saved before anyone heard of it
    (event,) = c.named("plan")
    assert event["members"] == ["a", "b", "c"] and event["reason"] == "start"


def test_without_expected_nodes_the_first_plan_waits_for_the_join_window() -> None:
    c = Cluster(join_window=timedelta(seconds=2))
    store = {"host": "10.0.0.1", "port": 4000}
    c.register("a", store=store)
    c.loop.advance(1.0)
    c.register("b")
    assert c.plans() == []
    c.loop.advance(1.0)                                   # 2 s after the first ready node
    (plan,) = c.plans()
    assert plan["members"] == ["a", "b"] and plan["reason"] == "start"
    assert plan["store"] == {"host": "10.0.0.1", "port": 4000, "node": "a", "incarnation": 1}  # rank 0 hosts it


def test_a_node_refused_for_its_worker_count() -> None:
    c = Cluster(slots_per_node=2)
    assert c.m.refusal(4, None) == ("2 slots per node < --nproc-per-node 4: every worker needs at least one "
                                    "expert slot; give --slots >= 4 (agent or controller)")
    c.m.gpus_per_node = 2
    assert "differs from this job's 2 workers per node" in (c.m.refusal(1, 4) or "")
    assert c.m.refusal(2, None) is None


# ============================================================================ failures


def test_a_failure_gives_a_plan_without_the_node_after_failure_grace() -> None:
    c = started("a", "b", "c", failure_grace=timedelta(milliseconds=200))
    c.closed.add("b")
    c.m.node_gone("b", "peer-b")                          # its connection broke
    assert len(c.plans()) == 1
    c.loop.advance(0.199)
    assert len(c.plans()) == 1
    c.loop.advance(0.002)
    plan = c.plans()[-1]
    assert plan["generation"] == 2 and plan["reason"] == "failure" and plan["mode"] == "immediate"
    assert plan["members"] == ["a", "c"] and plan["lost"] == ["b"]
    assert sorted(c.receivers(2)) == ["a", "c"]
    assert plan["detected_at"] is not None
    (failed,) = c.named("node_failed")
    assert failed == {"event": "node_failed", "node": "b", "cause": "disconnect", "generation": 1, "peer": "peer-b"}


def test_failure_grace_coalesces_two_failures_into_one_plan() -> None:
    c = started("a", "b", "c", "d", failure_grace=timedelta(milliseconds=200),
                heartbeat_timeout=timedelta(seconds=3))
    c.closed.add("b")
    c.m.node_gone("b", "peer-b")
    c.loop.advance(0.1)
    c.m.on_message("c", {"type": "worker_exit", "node": "c", "returncode": -9, "incarnation": 1})
    c.loop.advance(0.5)
    assert [p["generation"] for p in c.plans()] == [1, 2]  # one plan for both
    plan = c.plans()[-1]
    assert plan["members"] == ["a", "d"] and plan["lost"] == ["b", "c"]
    assert [(e["node"], e["cause"]) for e in c.named("node_failed")] == [("b", "disconnect"), ("c", "worker_exit")]


def test_a_silent_node_fails_on_its_heartbeat_timeout() -> None:
    c = started("a", "b", failure_grace=timedelta(milliseconds=200), heartbeat_timeout=timedelta(seconds=3))
    now = c.m.nodes["b"].last_seen
    c.m.nodes["a"].last_seen = now + 2.0
    c.m.check_heartbeats(now + 2.9, 3.0)
    assert c.named("node_failed") == []
    c.m.check_heartbeats(now + 3.1, 3.0)
    (failed,) = c.named("node_failed")
    assert failed["node"] == "b" and failed["cause"] == "heartbeat_timeout" and failed["silent_s"] == 3.1
    c.loop.advance(0.2)
    assert c.plans()[-1]["members"] == ["a"] and c.plans()[-1]["lost"] == ["b"]
    c.m.on_message("b", {"type": "heartbeat", "node": "b"})   # too late: it is told it was evicted
    assert c.sent[-1] == ("b", {"type": "evicted", "node": "b"})


class _ModuleClock:
    """The membership module's clocks (``time.monotonic`` for heartbeats, ``time.time`` for
    failure stamps) on the test's fake loop."""

    def __init__(self, loop: FakeLoop) -> None:
        self.loop = loop

    def monotonic(self) -> float:
        return 1000.0 + self.loop.now

    def time(self) -> float:
        return 5000.0 + self.loop.now

    def perf_counter(self) -> float:
        return self.loop.now


def _silent_pair(monkeypatch: pytest.MonkeyPatch) -> tuple[Cluster, float]:
    """Four members; c timed out, d silent for 1.8 s of a 2 s timeout: a cut of both."""
    c = started("a", "b", "c", "d", failure_grace=timedelta(milliseconds=200), heartbeat_timeout=timedelta(seconds=2))
    import lazarus.runtime.controller._membership as membership

    monkeypatch.setattr(membership, "time", _ModuleClock(c.loop))
    t = 1000.0 + c.loop.now
    for n in ("a", "b"):
        c.m.nodes[n].last_seen = t
    c.m.nodes["c"].last_seen, c.m.nodes["d"].last_seen = t - 2.1, t - 1.8
    c.m.check_heartbeats(t, 2.0)
    c.loop.advance(0.2)                       # failure_grace over: held for d
    assert [p["generation"] for p in c.plans()] == [1]
    return c, t


def test_members_going_silent_together_are_dropped_by_one_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    c, t = _silent_pair(monkeypatch)
    c.m.check_heartbeats(t + 0.25, 2.0)        # d times out 0.25 s after c
    c.loop.advance(0.2)
    plan = c.plans()[-1]
    assert plan["generation"] == 2 and plan["lost"] == ["c", "d"] and plan["members"] == ["a", "b"]
    assert len(c.plans()) == 2


def test_a_member_that_speaks_again_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    c, t = _silent_pair(monkeypatch)
    c.m.on_message("d", {"type": "heartbeat", "node": "d"})
    c.loop.advance(0.3)
    plan = c.plans()[-1]
    assert plan["generation"] == 2 and plan["lost"] == ["c"] and plan["members"] == ["a", "b", "d"]


def test_the_hold_for_a_silent_member_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # d neither times out (no heartbeat round runs) nor speaks: the plan goes without
    # waiting for it past half the timeout from the first failure
    c, t = _silent_pair(monkeypatch)
    c.loop.advance(0.7)                        # 0.9 s after c failed: still held
    assert [p["generation"] for p in c.plans()] == [1]
    c.loop.advance(0.2)                        # half the 2 s timeout passed: it goes
    plan = c.plans()[-1]
    assert plan["generation"] == 2 and plan["lost"] == ["c"] and plan["members"] == ["a", "b", "d"]


# ============================================================================ joins and leaves


def test_a_join_waits_for_the_join_window_and_batches_the_nodes_warming_up() -> None:
    c = started("a", "b", join_window=timedelta(seconds=2))
    c.register("c", "d", "e", ready=False)
    c.ready("c")
    (join,) = c.named("join")
    assert join == {"event": "join", "node": "c", "generation": 1, "waiting_for": ["d", "e"]}
    c.loop.advance(1.5)
    c.ready("d")
    assert len(c.plans()) == 1                            # the window is still open: e is on its way
    c.loop.advance(0.5)
    plan = c.plans()[-1]
    assert plan["generation"] == 2 and plan["reason"] == "join" and plan["mode"] == "between_steps"
    assert plan["members"] == ["a", "b", "c", "d"] and plan["joined"] == ["c", "d"]
    assert sorted(c.receivers(2)) == ["a", "b", "c", "d"]


def test_the_join_window_closes_once_nobody_else_is_warming_up() -> None:
    c = started("a", "b", join_window=timedelta(seconds=2))
    c.register("c", "d", ready=False)
    c.ready("c")
    assert len(c.plans()) == 1
    c.loop.advance(0.5)
    c.ready("d")                                          # the last one on its way: no need to wait
    plan = c.plans()[-1]
    assert plan["generation"] == 2 and plan["joined"] == ["c", "d"] and c.loop.now == 0.5


def test_a_lone_joiner_is_planned_at_once_but_not_before_the_plan_in_flight_was_applied() -> None:
    c = Cluster(expected_nodes=2)
    c.register("a", "b")
    c.register("c")                                       # nobody else on the way: no window
    assert len(c.plans()) == 1 and c.loop.pending() == []  # plan 1 is not applied yet
    c.applied(1)
    plan = c.plans()[-1]
    assert plan["generation"] == 2 and plan["members"] == ["a", "b", "c"] and plan["joined"] == ["c"]


def test_a_leave_is_a_between_steps_plan_that_hands_over_and_lets_the_node_go() -> None:
    c = started("a", "b", "c", failure_grace=timedelta(milliseconds=200))
    c.m.on_message("b", {"type": "leaving", "node": "b"})
    assert c.named("leave") == [{"event": "leave", "node": "b"}]
    assert len(c.plans()) == 1
    c.loop.advance(0.2)
    plan = c.plans()[-1]
    assert plan["reason"] == "leave" and plan["mode"] == "between_steps"
    assert plan["members"] == ["a", "c"] and plan["leaving"] == ["b"]
    assert sorted(c.receivers(2)) == ["a", "b", "c"]       # the leaving node hands its experts over
    assert "b" in c.m.left


def test_a_non_member_leaving_is_told_to_go_at_once() -> None:
    c = started("a", "b")
    c.register("x", ready=False)
    c.m.on_message("x", {"type": "leaving", "node": "x", "reason": "crash_loop", "error": "boom"})
    assert c.sent[-1] == ("x", {"type": "shutdown", "reason": "leave"})
    assert c.named("leave") == [{"event": "leave", "node": "x", "reason": "crash_loop", "error": "boom"}]


def test_the_last_member_leaving_hands_over_to_a_node_still_starting() -> None:
    # a is the only member; x registered and its worker is starting when a gets its notice:
    # a trains on until x is ready, x joins, then a leaves handing its experts to x
    c = started("a", failure_grace=timedelta(milliseconds=200), handover_wait=timedelta(seconds=30))
    c.register("x", ready=False)
    c.m.on_message("a", {"type": "leaving", "node": "a"})
    c.loop.advance(3.0)
    assert len(c.plans()) == 1 and ("a", {"type": "shutdown", "reason": "leave"}) not in c.sent
    (wait,) = c.named("handover_wait")
    assert wait["leaving"] == ["a"] and wait["waiting_for"] == ["x"] and wait["wait_s"] == 30.0
    c.ready("x")
    join = c.plans()[-1]
    assert join["reason"] == "join" and join["members"] == ["a", "x"] and join["joined"] == ["x"]
    assert join["leaving"] == []
    c.applied(2)
    leave = c.plans()[-1]
    assert leave["reason"] == "leave" and leave["members"] == ["x"] and leave["leaving"] == ["a"]
    assert sorted(c.receivers(3)) == ["a", "x"]             # a hands its experts over
    c.loop.advance(60.0)
    assert c.named("handover_wait_over") == [] and len(c.plans()) == 3
    assert ("a", {"type": "shutdown", "reason": "leave"}) not in c.sent


def test_the_hand_over_wait_runs_out_and_the_last_member_goes() -> None:
    c = started("a", failure_grace=timedelta(milliseconds=200), handover_wait=timedelta(seconds=5))
    c.register("x", ready=False)
    c.m.on_message("a", {"type": "leaving", "node": "a"})
    c.loop.advance(4.0)
    assert ("a", {"type": "shutdown", "reason": "leave"}) not in c.sent
    c.loop.advance(1.5)
    (over,) = c.named("handover_wait_over")
    assert over["leaving"] == ["a"] and over["waited_s"] == 5.0
    assert ("a", {"type": "shutdown", "reason": "leave"}) in c.sent and len(c.plans()) == 1


@pytest.mark.parametrize("settings", [{"handover_wait": timedelta(0)}, {}])
def test_the_last_member_goes_at_once_with_the_wait_off_or_nobody_coming(settings: dict[str, Any]) -> None:
    c = started("a", failure_grace=timedelta(milliseconds=200), **settings)
    if settings:
        c.register("x", ready=False)                      # on its way, but the wait is off
    c.m.on_message("a", {"type": "leaving", "node": "a"})
    c.loop.advance(0.2)
    assert ("a", {"type": "shutdown", "reason": "leave"}) in c.sent and c.named("handover_wait") == []


@pytest.mark.parametrize("value", [timedelta(seconds=-1), timedelta(minutes=11), 30])
def test_handover_wait_is_checked(value: Any) -> None:
    with pytest.raises(ValueError, match="handover_wait must be"):
        ControllerConfig(secret=SECRET, handover_wait=value)


# ============================================================================ collective errors


def test_a_collective_error_replans_the_same_members_after_failure_grace() -> None:
    c = started("a", "b", failure_grace=timedelta(milliseconds=200))
    c.worker("a", type="collective_error", generation=1, error="timeout")
    c.loop.advance(0.1)
    c.worker("b", type="collective_error", generation=1, error="timeout")
    c.worker("b", type="collective_error", generation=0, error="old")   # a stale one changes nothing
    assert len(c.plans()) == 1
    c.loop.advance(0.1)
    plan = c.plans()[-1]
    assert plan["generation"] == 2 and plan["reason"] == "collective_error" and plan["mode"] == "immediate"
    assert plan["members"] == ["a", "b"] and plan["lost"] == []
    c.loop.advance(5.0)
    assert len(c.plans()) == 2                            # one plan for the three reports
    assert len(c.named("collective_error")) == 3


def test_a_failure_during_a_collective_error_makes_one_failure_plan() -> None:
    c = started("a", "b", "c", failure_grace=timedelta(milliseconds=200))
    c.worker("a", type="collective_error", generation=1, error="timeout")
    c.closed.add("c")
    c.m.node_gone("c", "peer-c")
    c.loop.advance(1.0)
    assert [(p["reason"], p["lost"]) for p in c.plans()[1:]] == [("failure", ["c"])]


# ============================================================================ done, resume


def test_the_job_ends_when_every_member_is_done() -> None:
    c = started("a", "b")
    c.worker("a", type="done", step=10)
    assert not c.m.finished and c.ended == 0
    c.worker("b", type="done", step=10)
    assert c.m.finished and c.ended == 1
    assert [m for n, m in c.sent[-2:]] == [{"type": "shutdown", "reason": "done"}] * 2


def test_a_restarted_controller_takes_its_members_back_without_a_plan() -> None:
    first = started("a", "b")
    state = {"epoch": 1, "port": 1, "store_port": 2, **first.m.state(), "saved_at": 0.0}
    c = Cluster()
    c.resume = Resume(c.config, c.m, c.port)
    c.resume.restore(state)
    assert c.m.resuming and c.m.members == ["a", "b"] and c.m.generation == 1
    c.resume.start(epoch=2)
    from lazarus.runtime.controller._resume import ResumeRecord

    for n in ("a", "b"):
        rec = ResumeRecord.from_msg({"incarnation": 1, "worker_alive": True, "worker_ready": True,
                                     "plan_generation": 1, "done": False, "model": {"layers": LAYERS}})
        node, rec = c.resume.admit(n, f"peer-{n}", None, 100, rec)
        c.resume.on_back(node, rec)
    assert c.m.resuming                                    # the queued reports get failure_grace first
    c.loop.advance(0.2)
    assert not c.m.resuming
    (resumed,) = c.named("resumed")
    assert resumed["back"] == ["a", "b"] and resumed["lost"] == [] and not resumed["unapplied_plan"]
    assert c.plans() == []                                 # nothing happened: training goes on


# ============================================================================ a flapping node


def _drop_and_come_back(c: Cluster, node: str, pid: int = 100) -> None:
    """``node``'s connection breaks (a failure plan, applied), then its agent (``pid``)
    registers again and its worker is ready."""
    c.closed.add(node)
    c.m.node_gone(node, f"peer-{node}")
    c.loop.advance(0.3)
    c.applied(c.m.generation)
    c.closed.discard(node)
    c.m.register(node, f"peer-{node}", slots=None, incarnation=1, pid=pid, nproc=1)
    c.ready(node)


def test_a_flapping_node_joins_again_only_after_the_hold_down() -> None:
    c = started("a", "b", "c", failure_grace=timedelta(milliseconds=200), join_window=timedelta(0),
                flap_limit=2, flap_window=timedelta(seconds=60), flap_hold_down=timedelta(seconds=10))
    _drop_and_come_back(c, "b")                 # the first drop: it joins again at once
    assert [p["reason"] for p in c.plans()] == ["start", "failure", "join"]
    c.applied(c.m.generation)
    _drop_and_come_back(c, "b")                 # the second within the window: held
    assert [p["reason"] for p in c.plans()] == ["start", "failure", "join", "failure"]
    (held,) = c.named("join_held")
    assert held["node"] == "b" and held["flaps"] == 2 and held["retry_s"] == 9.7   # 10 s from the drop
    c.loop.advance(5.0)
    c.m.node_gone("b", "peer-b")                # down again while held: the hold-down starts over
    c.m.register("b", "peer-b", slots=None, incarnation=1, pid=100, nproc=1)
    c.ready("b")
    c.loop.advance(9.0)
    assert len(c.plans()) == 4 and "b" not in c.m.members
    c.loop.advance(1.5)                         # stable for 10 s: it joins
    assert c.plans()[-1]["reason"] == "join" and c.plans()[-1]["joined"] == ["b"]
    assert len(c.named("join_held")) == 2


def test_a_node_started_again_is_not_taken_for_flapping() -> None:
    c = started("a", "b", "c", failure_grace=timedelta(milliseconds=200), join_window=timedelta(0),
                flap_limit=1, flap_hold_down=timedelta(seconds=30))
    _drop_and_come_back(c, "b", pid=101)        # a new agent process (a replacement): no hold
    assert c.named("join_held") == [] and c.plans()[-1]["reason"] == "join"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("flap_limit", 0, "flap_limit must be an integer [1, 1000], got 0"),
    ("flap_window", timedelta(milliseconds=10), "flap_window must be >= 1.0s, got 0.01s"),
    ("flap_window", timedelta(days=2), "flap_window must be <= 1 day, got 172800.0s"),
    ("flap_hold_down", timedelta(seconds=-1), "flap_hold_down must be >= 0s, got -1.0s"),
    ("flap_hold_down", timedelta(hours=2), "flap_hold_down must be <= 3600s, got 7200.0s"),
    ("flap_hold_down", 30, "flap_hold_down must be a datetime.timedelta, got int"),
])
def test_flap_settings_are_checked(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ControllerConfig(secret=SECRET, **{field: value})
