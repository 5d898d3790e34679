"""The manager's two modes behind one small protocol: :class:`PlainMode` (partial-expert
checkpoints every ``interval`` steps, the default) and :class:`ExactMode`
(``MoCConfig(exact=True)``: every step, no tokens lost; :mod:`moc._exact`).

:class:`moc.CheckpointManager` owns the training-loop protocol (hooks, SIGTERM, closing,
reporting) and the parts both modes share; it builds one mode and calls it, never asking
which one it has. A mode answers: the optimizer's step pre-hook, ``step``, ``restore``,
``restore_units``, ``wait``, and its share of ``detach``, ``join_threads``, ``close`` and
``status``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Protocol

from ._config import MoCConfig
from ._coordination import Agreement, Ballot, Coordinator
from ._dist import Comm
from ._errors import CheckpointError
from ._exact import ExactCheckpointer
from ._persister import Persister
from ._policy import CheckpointPolicy, Opening, SnapshotDecision
from ._recovery import Recovery
from ._run_state import RunState
from ._snapshot import Inventory, SnapshotEngine, plan_snapshot
from ._store import plan_tree
from ._units import UnitPlans, capture_rng, optimizer_groups

log = logging.getLogger("moc")


class Mode(Protocol):
    """What the manager asks of its mode."""

    #: seconds the newest checkpoint's synchronous part took inside ``step()``, and in all
    step_call_last: float
    step_call_total: float

    def before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None: ...

    def step(self, step: int) -> bool:
        """This step's checkpoint work; True: flush and exit (SIGTERM)."""

    def restore(self, *, reshard: bool) -> int: ...

    def restore_units(self, names: list[str]) -> dict[str, dict[str, Any]]: ...

    def wait(self, *, flush: bool) -> None: ...

    def detach(self) -> dict[str, Any] | None:
        """Retire: this mode's own part of the handover state (None: it has none)."""

    def join(self, timeout: float) -> bool: ...

    def shutdown(self) -> None: ...

    def status(self) -> dict[str, Any] | None:
        """``status()["exact"]``."""

    @property
    def interrupted_replay(self) -> bool: ...

    @property
    def replaying(self) -> bool: ...


def extra_tree(step: int, *, model: Any, optimizer: Any, plans: UnitPlans, extra_state: Mapping[str, Any],
               rank: int, world: int) -> dict[str, Any]:
    """The extra unit of this rank at ``step``: RNG, optimizer hyper-parameters, the user's
    ``extra_state``."""
    extra: dict[str, Any] = {"step": step, "rng": capture_rng(), "rank": rank, "world": world}
    if optimizer is not None:
        extra["optimizer_groups"] = optimizer_groups(model, optimizer, params=plans.params or None)
    if extra_state:
        extra["user"] = {name: obj.state_dict() for name, obj in extra_state.items()}
    return {"extra": extra}


class PlainMode:
    """Partial-expert checkpoints: every ``interval`` steps a snapshot of K experts per
    layer (and every non-expert module) into shared memory, every ``persist_every``-th one
    also to storage; the decision points between checkpoints settle K and the interval.

    It holds the manager's parts, never the manager: a manager dropped is freed at once."""

    def __init__(self, cfg: MoCConfig, *, inventory: Inventory, comm: Comm, run: RunState,
                 policy: CheckpointPolicy, plans: UnitPlans, coordinator: Coordinator, engine: SnapshotEngine,
                 persister: Persister, recovery: Recovery, model: Any, optimizer: Any,
                 extra_state: Mapping[str, Any], drain: Callable[[Any], None]) -> None:
        self.cfg = cfg
        self.inventory = inventory
        self.comm = comm
        self.run = run
        self.rank, self.world = comm.rank, comm.world
        self.policy = policy
        self.plans = plans
        self.coordinator = coordinator
        self.engine = engine
        self.persister = persister
        self.recovery = recovery
        self.model = model
        self.optimizer = optimizer
        self.extra_state = extra_state
        self._drain = drain          # the router taps' counts, into a record function
        self.step_call_last = 0.0    # synchronous part of a checkpoint inside step()
        self.step_call_total = 0.0

    @property
    def interrupted_replay(self) -> bool:
        return False

    @property
    def replaying(self) -> bool:
        return False

    def before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.engine.before_optimizer_step(optimizer, args, kwargs)

    def step(self, step: int) -> bool:
        opening = self.policy.open(step, self._drain)
        if opening is None:
            return False
        # Checkpoints and decision points are the same steps on every rank, so the rounds
        # (one collective each in steady state) line up.
        due = opening.due
        t0 = time.perf_counter()
        has_buffer = True
        if due:
            self.engine.wait()
            has_buffer = self.engine.reserve()   # the buffer to fill, kept from everyone else
        plans, extra, error = self._plan_units(step) if due else (None, None, None)
        agreed = self._agree(opening, plans, extra, error, no_buffer=not has_buffer)
        if due and (agreed.sigterm or agreed.broken or agreed.failed or agreed.no_buffer):
            self.engine.unreserve()
        if agreed.sigterm:
            return True
        self.persister.settle(agreed.finished_seq)
        taken = due and not (agreed.no_buffer or agreed.broken or agreed.failed)
        decision = self.policy.decide(k_snapshot=agreed.k_snapshot, interval=agreed.interval,
                                      routing=agreed.routing if taken else None, first=not self.run.has_base)
        if not due or agreed.no_buffer:
            if due:   # every rank skips it: no buffer on some rank (logged with its reason there)
                why = (self.engine.reserve_error if not has_buffer
                       else "no snapshot buffer on another rank (see its log)")
                assert why is not None      # reserve() said why when it found no buffer
                self.engine.skip(step, why)
            retry = agreed.persist_step(False, step)
            if retry is not None:
                self.persister.start(retry)
            return False
        if agreed.broken:
            if error is not None:
                raise error
            raise CheckpointError(f"{self.run.where()}: another rank could not plan its units (see its log)")
        if agreed.failed:
            raise self.engine.failure_error(self.persister.last_persisted_step)
        assert decision is not None   # a due checkpoint's round carries the routing counts
        self._checkpoint(step, agreed, decision, plans, extra)
        self.step_call_last = time.perf_counter() - t0
        self.step_call_total += self.step_call_last
        self.policy.checkpointed(blocking_seconds=self.step_call_last + self.engine.stall_last,
                                 copy_seconds=self.engine.seconds)
        return False

    def _plan_units(self, step: int) -> tuple[Any, Any, BaseException | None]:
        """Every unit's serialisation plan (cached while its tensors are unchanged) and the
        extra unit's; an error is reported in the round, so all ranks raise together."""
        try:
            plans = self.plans.refresh()
            extra = plan_tree(extra_tree(step, model=self.model, optimizer=self.optimizer, plans=self.plans,
                                         extra_state=self.extra_state, rank=self.rank, world=self.world))
        except Exception as exc:  # noqa: BLE001 - raised after the round, on every rank
            log.error("%s: planning the checkpoint failed: %s", self.run.where(), exc)
            return None, None, exc
        return plans, extra, None

    def _agree(self, opening: Opening, plans: Any, extra: Any, error: BaseException | None, *,
               no_buffer: bool = False) -> Agreement:
        """This step's round: what every rank must decide alike (see :mod:`moc._coordination`)."""
        due = opening.due
        ballot = Ballot(sigterm=self.run.sigterm, persist_busy=self.persister.busy, no_buffer=no_buffer,
                        retry_step=self.persister.retry_candidate(before_snapshot=due),
                        finished_seq=self.persister.finished_seq,
                        k_snapshot=opening.k_snapshot, interval=opening.interval)
        if due:
            ballot.failed = self.engine.failing()
            ballot.broken = error is not None
            ballot.routing = opening.routing
            if error is None:
                ballot.sizes = self.coordinator.changed_sizes({**plans, f"extra/rank{self.rank}": extra})
        return self.coordinator.agree(ballot)

    def _checkpoint(self, step: int, agreed: Agreement, decision: SnapshotDecision, plans: Any,
                    extra: Any) -> None:
        selection, designated = decision.selection, decision.designated
        plan = plan_snapshot(self.cfg, self.inventory, rank=self.rank, world=self.world, step=step,
                             selection=selection, plans=plans, extra=extra, sizes=self.coordinator.sizes)
        meta = {"run_id": self.run.run_id, "layout": self.inventory.info, **decision.meta, "world": self.world}
        header = {"run": self.run.run_id, "rank": self.rank, "world": self.world, "step": step,
                  "plt": decision.plt, "meta": meta, "persist_due": designated,
                  "selection": {l: list(v[1]) for l, v in selection.items()}}
        persist = agreed.persist_step(designated, step)
        snapshot = self.engine.start(plan, header)
        self.run.first_done = True
        if persist is not None:
            self.persister.start(persist, snapshot if designated else None)

    def restore(self, *, reshard: bool) -> int:
        if reshard:
            raise ValueError("restore(reshard=True) needs MoCConfig(exact=True); restore() already restores "
                             "any placement by unit name without exact mode")
        self.engine.wait()
        self.persister.drain(self.cfg.persist_timeout.total_seconds())
        try:
            next_step, manifest = self.recovery.restore()
        finally:
            self.plans.invalidate()   # the model and optimizer state were written into
        if next_step:
            self.persister.base = manifest if self.rank == 0 else None
        return next_step

    def restore_units(self, names: list[str]) -> dict[str, dict[str, Any]]:
        self.engine.wait()
        self.persister.drain(self.cfg.persist_timeout.total_seconds())
        self.policy.sync_routing(self._drain)
        try:
            return self.recovery.restore_units(names)
        finally:
            self.plans.invalidate()

    def wait(self, *, flush: bool) -> None:
        self.engine.wait()
        try:
            if not flush:
                self.persister.wait_in_flight(self.cfg.persist_timeout.total_seconds())
                return
            self.persister.flush(time.monotonic() + self.cfg.persist_timeout.total_seconds())
        finally:
            # Local, and still deterministic: a rank's next round makes every other rank
            # catch up with the jobs it has booked (Persister.settle).
            self.persister.apply_outcomes()

    def detach(self) -> dict[str, Any] | None:
        return None

    def join(self, timeout: float) -> bool:
        return True

    def shutdown(self) -> None:
        pass

    def status(self) -> dict[str, Any] | None:
        return None


class ExactMode:
    """``MoCConfig(exact=True)``: the manager's calls handed to :class:`ExactCheckpointer`
    (:mod:`moc._exact`), which captures every step per the window schedule."""

    step_call_last = 0.0
    step_call_total = 0.0

    def __init__(self, cfg: MoCConfig, *, checkpointer: ExactCheckpointer, comm: Comm, run: RunState) -> None:
        self.cfg = cfg
        self.checkpointer = checkpointer
        self.comm = comm
        self.run = run

    @property
    def interrupted_replay(self) -> bool:
        return self.checkpointer.interrupted_replay

    @property
    def replaying(self) -> bool:
        return self.checkpointer.replay is not None

    def before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.checkpointer.before_optimizer_step(optimizer, args, kwargs)

    def adopt(self, states: list[Mapping[str, Any] | None]) -> None:
        self.checkpointer.adopt(states)

    def step(self, step: int) -> bool:
        # One process flushes at once; several agree on it at the next window's round.
        if self.run.sigterm and not self.comm.distributed:
            return True
        return self.checkpointer.step(step, sigterm=self.run.sigterm)

    def restore(self, *, reshard: bool) -> int:
        return self.checkpointer.restore(reshard=reshard)

    def restore_units(self, names: list[str]) -> dict[str, dict[str, Any]]:
        raise CheckpointError("restore_units() is not available with MoCConfig(exact=True): restore() and "
                              "replay the window instead (no tokens are lost)")

    def wait(self, *, flush: bool) -> None:
        self.checkpointer.wait(flush=flush, timeout=self.cfg.persist_timeout.total_seconds())

    def detach(self) -> dict[str, Any] | None:
        return self.checkpointer.detach()

    def join(self, timeout: float) -> bool:
        return self.checkpointer.join(timeout)

    def shutdown(self) -> None:
        self.checkpointer.shutdown(wait=True)

    def status(self) -> dict[str, Any] | None:
        return self.checkpointer.status()
