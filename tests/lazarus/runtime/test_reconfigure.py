"""The reconfigurer's shape (lazarus/runtime/worker/_reconfigure.py, issue 40): it owns its
parts (no mixins), imports no trainer, and applies a plan to a :class:`WorkerState` it is
given, returning the next one: the state it was given stays as it was, and a plan that
fails part way hands back what it wrote so far, which the trainer keeps. No processes."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from lazarus.runtime._plan import Plan, Superseded
from lazarus.runtime.worker._join_gate import JoinGate
from lazarus.runtime.worker._moc_groups import MocGroups
from lazarus.runtime.worker._reconfigure import Reconfigurer
from lazarus.runtime.worker._rendezvous_store import StoreClients
from lazarus.runtime.worker._worker_state import (
    StateDraft,
    WorkerContext,
    WorkerState,
    carry_state,
    state_after,
)

pytestmark = pytest.mark.timeout(120)

WORKER = Path(__file__).resolve().parents[3] / "lazarus" / "runtime" / "worker"


def _reconfigurer(latest: dict | None = None) -> Reconfigurer:
    config = SimpleNamespace(rendezvous_timeout=timedelta(seconds=10), collective_timeout=timedelta(seconds=5),
                             connect_timeout=timedelta(seconds=1), moc=None, lost_experts="restore")
    context = WorkerContext(node="n1", local_rank=0, local_world=1, where="n1",
                            backend=SimpleNamespace(backend="gloo", init_backend="gloo"), layout={"layers": {}},
                            channel=SimpleNamespace(latest_plan=lambda: latest))
    return Reconfigurer(config, context=context, build_model=None, make_optimizer=None)


class _Manager:
    """What retiring reads of a moc manager."""

    def __init__(self) -> None:
        self.detached = self.joined = 0

    def detach(self) -> str:
        self.detached += 1
        return "buffers"

    def join_threads(self) -> None:
        self.joined += 1


def test_no_worker_module_but_the_trainer_imports_the_trainer() -> None:
    # not even behind TYPE_CHECKING (ast.walk sees those blocks too)
    for path in sorted(WORKER.glob("*.py")):
        if path.name == "_trainer.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or "", *(a.name for a in node.names)] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[-1] == "_trainer" for n in names), f"{path.name} imports the trainer"
    code = ("import sys, lazarus.runtime.worker._reconfigure; "
            "print('lazarus.runtime.worker._trainer' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_the_parts_are_owned_not_mixed_in() -> None:
    assert Reconfigurer.__mro__ == (Reconfigurer, object)
    for part in (JoinGate, MocGroups, StoreClients):
        assert part.__mro__ == (part, object)
    r = _reconfigurer()
    assert isinstance(r.gate, JoinGate) and isinstance(r.moc_groups, MocGroups) and isinstance(r.stores, StoreClients)
    assert r.gate.stores is r.stores and r.moc_groups.stores is r.stores   # one set of store clients
    assert r.moc_groups.sockets is r.aborter.sockets


def test_worker_state_is_frozen_and_a_draft_freezes_to_what_was_written() -> None:
    state = WorkerState(step=3, members=["a"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.step = 4  # type: ignore[misc]
    draft = StateDraft(state)
    draft.step, draft.rank = 9, 1
    assert draft.freeze() == dataclasses.replace(state, step=9, rank=1)
    assert state.step == 3 and state.rank == -1
    exc = RuntimeError("x")
    assert state_after(exc, state) is state
    carry_state(exc, draft.freeze())
    assert state_after(exc, state).step == 9


def test_retiring_with_nothing_to_retire_gives_the_same_state() -> None:
    state = WorkerState(step=5, rank=0, world=1, members=["n1"], generation=2)
    assert not dist.is_initialized()
    assert _reconfigurer().retire_group(state) == state


def test_a_superseded_apply_hands_back_what_it_wrote_and_leaves_the_given_state_alone() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    store = {"host": "127.0.0.1", "port": server.port}
    newer = {"generation": 6, "members": ["n1", "n2"], "prefix": "lazarus/gen6", "store": store, "mode": "immediate"}
    r = _reconfigurer(latest=newer)
    manager = _Manager()
    state = WorkerState(ckpt=manager, step=12, rank=1, world=2, members=["n0", "n1"], generation=4)
    plan = Plan.from_wire({"generation": 5, "members": ["n1", "n2"], "prefix": "lazarus/gen5", "store": store,
                           "mode": "immediate"})
    with pytest.raises(Superseded) as err:
        r.apply(plan, state, t_error=None)
    # the failure retired the manager before its rendezvous was superseded: that stays done
    after = state_after(err.value, state)
    assert after == dataclasses.replace(state, ckpt=None)
    assert manager.detached == 1 and r.handover == "buffers"
    # the state it was given is untouched
    assert state.ckpt is manager and state.generation == 4 and state.members == ["n0", "n1"]
    assert not dist.is_initialized()


class _FakeReconfigurer:
    """Plays one outcome per apply: an exception carrying the state it reached, or a state."""

    def __init__(self, outcomes: list) -> None:
        self.outcomes = outcomes
        self.applied: list[WorkerState] = []
        self.retired: list[WorkerState] = []

    def apply(self, plan: Plan, state: WorkerState, t_error: float | None) -> WorkerState:
        self.applied.append(state)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def retire_group(self, state: WorkerState) -> WorkerState:
        self.retired.append(state)
        return dataclasses.replace(state, ckpt=None)


def test_the_trainer_keeps_the_state_a_failed_apply_reached() -> None:
    from lazarus.runtime import ElasticConfig, ElasticTrainer

    sent: list[dict] = []
    channel = SimpleNamespace(node_id="n1", send=sent.append, latest_plan=lambda: None)
    trainer = ElasticTrainer(ElasticConfig(device="cpu"), layout={"layers": {"moe": 2}}, build_model=None,
                             make_optimizer=None, channel=channel)
    assert (trainer.step, trainer.rank, trainer.world, trainer.generation, trainer.members) == (0, -1, 0, -1, [])
    plans = [Plan.from_wire({"generation": g, "members": ["n1"], "prefix": f"lazarus/gen{g}",
                             "store": {"host": "127.0.0.1", "port": 1}}) for g in (5, 6, 7)]
    superseded, broken = Superseded(), RuntimeError("gloo connection reset by peer")
    carry_state(superseded, WorkerState(step=3, generation=-1, ckpt=None))        # retired, then superseded
    carry_state(broken, WorkerState(step=3, rank=0, world=1, members=["n1"], generation=6, ckpt="manager"))
    final = WorkerState(step=3, rank=0, world=1, members=["n1"], generation=7, ckpt="manager 7")
    fake = _FakeReconfigurer([superseded, broken, final])
    trainer.reconf = fake  # type: ignore[assignment]
    waits = iter(plans[1:])
    trainer._wait_plan = lambda newer_than, **kw: next(waits)  # type: ignore[method-assign]
    trainer._reconfigure_loop_inner(plans[0], error=None)
    # each apply started from what the one before it left
    assert fake.applied[1].step == 3 and fake.applied[2].generation == 6 and fake.applied[2].ckpt is None
    # the broken one was retired from the state it reached (its group, its manager)
    assert fake.retired == [WorkerState(step=3, rank=0, world=1, members=["n1"], generation=6, ckpt="manager")]
    assert sent[-1]["type"] == "collective_error" and sent[-1]["generation"] == 6 and sent[-1]["step"] == 3
    assert trainer.state == final and trainer.ckpt == "manager 7" and trainer.generation == 7
    # a public attribute written by user code replaces the state, the old one unchanged
    trainer.step = 11
    assert trainer.step == 11 and final.step == 3


class _Freed(_Manager):
    """A manager that records which thread dropped the last reference to it."""

    freed_in: list[str] = []

    def join_threads(self) -> None:
        import time

        time.sleep(0.3)   # its background threads let go of it (the release thread waits for them)
        super().join_threads()

    def __del__(self) -> None:
        import threading

        _Freed.freed_in.append(threading.current_thread().name)


def _newer_once_released(store: dict) -> dict:
    """The newest plan's message, given once every release thread has ended: asked by
    the rendezvous after the retirement, so whoever still references the retired manager
    then frees it."""
    import threading

    for th in threading.enumerate():
        if th.name.startswith("lazarus-release-"):
            th.join(10)
    return {"generation": 6, "members": ["n1"], "prefix": "lazarus/gen6", "store": store, "mode": "immediate"}


class _Stop(Exception):
    pass


def test_a_manager_retired_mid_apply_is_freed_off_the_training_thread() -> None:
    # the trainer lends its state: neither it nor the reconfigurer keeps the manager that
    # retiring hands to the release thread (its destructors off the training thread, as
    # when it was the trainer's field)
    from lazarus.runtime import ElasticConfig, ElasticTrainer

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    store = {"host": "127.0.0.1", "port": server.port}
    plan = Plan.from_wire({"generation": 5, "members": ["n1", "n2"], "prefix": "lazarus/gen5", "store": store,
                           "mode": "immediate"})
    channel = SimpleNamespace(node_id="n1", send=lambda msg: None, latest_plan=lambda: _newer_once_released(store))
    trainer = ElasticTrainer(ElasticConfig(device="cpu"), layout={"layers": {"moe": 2}}, build_model=None,
                             make_optimizer=None, channel=channel)
    _Freed.freed_in = []
    trainer.ckpt = _Freed()
    seen: list = []

    def wait_plan(newer_than: int, **kw) -> Plan:
        seen.append((newer_than, trainer.ckpt, trainer.step, trainer.generation))
        raise _Stop()

    trainer._wait_plan = wait_plan  # type: ignore[method-assign]
    with pytest.raises(_Stop):
        trainer._reconfigure_loop_inner(plan, error=None)   # superseded during its rendezvous
    assert seen == [(5, None, 0, -1)] and trainer.reconf.handover == "buffers"
    assert _Freed.freed_in and _Freed.freed_in[0].startswith("lazarus-release-"), _Freed.freed_in

    # the reconfigurer alone, given the state
    r = _reconfigurer()
    r.ctx.channel.latest_plan = lambda: _newer_once_released(store)
    _Freed.freed_in = []
    plan = Plan.from_wire({"generation": 5, "members": ["n1", "n2"], "prefix": "lazarus/gen5-alone", "store": store,
                           "mode": "immediate"})   # (a rendezvous of its own: its arrival count starts at 0)
    with pytest.raises(Superseded) as err:
        r.apply(plan, WorkerState(ckpt=_Freed(), step=4, generation=4), t_error=None)
    assert state_after(err.value, WorkerState()) == WorkerState(step=4, generation=4)
    assert _Freed.freed_in and _Freed.freed_in[0].startswith("lazarus-release-"), _Freed.freed_in
    assert not dist.is_initialized()
