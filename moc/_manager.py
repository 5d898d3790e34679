"""``CheckpointManager``: two-level, triple-buffered, partial-expert checkpointing.

Per checkpoint (every ``interval`` steps, called right after ``optimizer.step()``):

1. selection: ``k_snapshot`` experts per MoE layer (all at a run's first checkpoint), of
   which ``k_persist`` also go to storage;
2. sharding: expert bytes split over the ranks holding the expert, non-expert modules
   spread over ranks, each rank's extra state its own;
3. snapshot: a background thread copies this rank's share into a shared-memory buffer
   while the next forward/backward runs; the optimizer step pre-hook waits for it (the
   only stall) so no snapshot ever sees the next update;
4. persist: another background thread writes the buffer to storage, the ranks exchange
   chunk records, rank 0 commits the manifest. Storage errors are retried, reported in
   :meth:`status` and never raised into training.

What the ranks must decide alike at a checkpoint (SIGTERM, failures, routing counts, K,
which snapshot to persist, unit sizes) is settled in one round, one collective in steady
state (:mod:`moc._coordination`); unit serialisation plans are cached across checkpoints
(:mod:`moc._units.plans`), so the rest of ``step()`` is local and short.

Exact mode (``MoCConfig(exact=True)``) replaces this per-checkpoint protocol: the manager
calls one mode object (:mod:`moc._modes`: plain or exact) for ``step``, ``restore``,
``wait`` and the rest, never asking which one it has.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import signal
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping
from urllib.parse import urlsplit

import torch

from storage_backends import LocalStore, PermanentStorageError, open_store, permanent_fault

from ._announce import announce
from ._config import MoCConfig
from ._coordination import Coordinator
from ._dist import Comm
from ._errors import CheckpointError
from ._exact import ExactCheckpointer
from ._modes import ExactMode, Mode, PlainMode, extra_tree
from ._persister import Persister
from ._plt import PLTTracker
from ._policy import CheckpointPolicy
from ._recovery import Recovery
from ._restore import RestorePlan, RestoreReport, report_restore
from ._run_state import RunState
from ._snapshot import BufferPool, Inventory, SnapshotEngine
from ._store import CheckpointStore
from ._topology import check_node, default_node
from ._units import RouterTaps, UnitLayout, UnitPlans, discover_units, resolve_top_k, routing_reporters

__all__ = ["CheckpointManager", "CheckpointError", "Handover"]

log = logging.getLogger("moc")


@dataclass
class Handover:
    """What a retired manager passes to its successor: the buffers and its bookkeeping."""

    pool: BufferPool
    state: dict[str, Any]
    store: CheckpointStore | None = None   # reused: a reconfiguration opens no connection to storage
    storage: str | None = None             # the MoCConfig.storage it was opened from


def _open(cfg: MoCConfig):
    """The configured store; an S3 endpoint that is unreachable right now (a transient
    error) is not a configuration error: training starts, persists retry, status() says so.
    A local root must be writable (a probe file, removed): one that is not (read-only
    mount, immutable, another user's) is an error here, not a warning per checkpoint."""
    try:
        store = open_store(cfg.storage, **cfg.storage_options)
    except (ConnectionError, TimeoutError) as exc:
        if urlsplit(str(cfg.storage)).scheme.lower() not in ("s3", "s3a"):
            raise
        log.warning("rank - step -: storage %s unreachable now (%s); starting anyway, persists will retry",
                    cfg.storage, exc)
        return open_store(cfg.storage, **{**cfg.storage_options, "check": False})
    if isinstance(store, LocalStore):
        try:
            store.check_writable()
        except OSError as exc:
            fault = permanent_fault(exc)
            fix = f" Fix: {fault.fix}." if fault is not None else ""
            message = f"MoCConfig.storage {store.root!r} is not writable: {exc}.{fix}"
            if fault is not None:
                raise PermanentStorageError(message, fault) from exc
            raise OSError(message) from exc
    return store


class CheckpointManager:
    """Wraps a training loop; see the module docstring and ``README.md``.

    The manager owns the training-loop protocol (``step``, ``wait``, ``close``, SIGTERM)
    and composes small parts: the :class:`~moc._snapshot.plan.Inventory` (layout: which
    units exist, who holds them), the :class:`~moc._policy.CheckpointPolicy` (selection,
    K, interval, PLT), the :class:`~moc._snapshot.engine.SnapshotEngine` (first level),
    the :class:`~moc._persister.Persister` (second level) and
    :class:`~moc._recovery.Recovery`; the training-loop calls go to its :attr:`mode`
    (:class:`~moc._modes.PlainMode`, or :class:`~moc._modes.ExactMode` with ``cfg.exact``).

    Args:
        cfg: the configuration.
        model: the (local part of the) model; its experts are found by
            ``cfg.expert_layout`` (``expert_pattern`` overrides the per-expert regex).
        optimizer: its state is saved with the parameters it belongs to; its step
            pre-hook is where the manager waits for an in-flight snapshot.
        process_group: ranks that checkpoint together (default: the whole world when
            ``torch.distributed`` is initialised, else a single process).
        extra_state: objects with ``state_dict()``/``load_state_dict()`` saved alongside
            (data loaders, schedulers, ...).
        memory_key: name of this process's snapshot folder under the snapshot directory
            (default ``rank<r>``). An elastic runtime whose ranks get renumbered passes a
            name that stays with the node (``worker0``), so snapshots are found again.
        node: the node (machine, failure domain) this process runs on; remote snapshot
            copies of a unit go to ranks on nodes where none of its holders runs, so one
            node failure never takes a replica and its copy together. Default: derived
            from the launcher (:func:`moc._topology.default_node`: the host when
            ``LOCAL_WORLD_SIZE`` > 1, as under torchrun; else every rank its own node).
        handover: what :meth:`detach` returned on the manager this one replaces (same
            process, new process group after a reconfiguration): its buffers are kept and
            the bookkeeping (run id, counters, PLT, K) continues. Ranks without one (a
            joining process) take the bookkeeping from the lowest rank that has one.
        generation: the fencing generation this manager writes as (an elastic runtime's
            membership generation; default 0, or the replaced manager's): data keys and
            manifests carry it, and once a newer generation's fence marker is in the store
            (:meth:`fence`) no write of an older one is committed. A job whose first
            :meth:`restore` finds fences of an earlier job at or above it adds the newest
            of them to every generation it is given. See ``docs/operations.md``.
        comm: the manager's process groups, made beforehand with
            :meth:`moc._dist.Comm.create` on ``process_group`` (an elastic runtime forms
            them while it moves state after a reconfiguration); default: made here.
    """

    def __init__(self, cfg: MoCConfig, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 process_group: Any = None, expert_pattern: str | None = None,
                 extra_state: Mapping[str, Any] | None = None, memory_key: str | None = None,
                 handover: "Handover | None" = None, node: str | None = None, comm: Comm | None = None,
                 generation: int | None = None) -> None:
        if not isinstance(cfg, MoCConfig):
            raise TypeError(f"cfg must be a MoCConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.extra_state = dict(extra_state or {})
        for name, obj in self.extra_state.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise ValueError(f"extra_state[{name!r}] must have state_dict() and load_state_dict()")
        if memory_key is not None and (not memory_key or "/" in memory_key or memory_key.startswith(".")):
            raise ValueError(f"memory_key must be a plain folder name, got {memory_key!r}")
        if node is not None:
            check_node(node)
        if generation is not None and (not isinstance(generation, int) or isinstance(generation, bool)
                                       or generation < 0):
            raise ValueError(f"generation must be a non-negative int or None, got {generation!r}")
        layout = discover_units(model, expert_pattern or cfg.expert_pattern, layout=cfg.expert_layout)
        if comm is not None and not isinstance(comm, Comm):
            raise TypeError(f"comm must be a moc._dist.Comm, got {type(comm).__name__}")
        self.comm = comm if comm is not None else Comm.create(process_group, cfg.coordination_timeout)
        self.rank, self.world = self.comm.rank, self.comm.world
        self.node = node if node is not None else default_node(self.rank)
        # One collective for everything the ranks tell each other at start: their units and
        # nodes (the inventory), a run id (rank 0's wins) and the replaced manager's
        # bookkeeping (each collective round costs every rank a wait for the slowest).
        told = self.comm.gather_json({**Inventory.describe_rank(layout, self.comm, self.node),
                                      "run_id": uuid.uuid4().hex[:16],
                                      "handover": handover.state if handover is not None else None})
        self.inventory = Inventory.from_gathered(model, layout, told)
        top_k = resolve_top_k(cfg.top_k, model, self.inventory.num_experts)   # None: the model's
        if top_k != cfg.top_k:
            self.cfg = cfg = dataclasses.replace(cfg, top_k=top_k)
        if self.rank == 0:   # once a run: a manager replacing another (handover) has the same layout
            log.log(logging.DEBUG if handover is not None else logging.INFO, "rank %d step -: expert layout %s",
                    self.rank, self.inventory.info["description"])
        if handover is not None and handover.store is not None and handover.storage == str(cfg.storage):
            store = handover.store
        else:
            store = CheckpointStore(_open(cfg), compression=cfg.compression, keep_last=cfg.keep_last)
        run_key = hashlib.sha1(store.store.url.encode()).hexdigest()[:12]
        base_dir = cfg.snapshot_dir or (f"/dev/shm/moc-{run_key}" if os.path.isdir("/dev/shm")
                                        else os.path.join(tempfile.gettempdir(), f"moc-{run_key}"))
        self.snapshot_dir = os.path.join(base_dir, memory_key or f"rank{self.rank}")
        if handover is not None and handover.pool.directory == self.snapshot_dir:
            pool = handover.pool
        else:
            pool = BufferPool(self.snapshot_dir)
        # One lock for the buffers' states, shared with the background jobs of a manager this
        # one replaces (they may still run; see moc._snapshot.buffers).
        self.run = RunState(rank=self.rank, world=self.world, lock=pool.lock)
        self.policy = CheckpointPolicy(cfg, num_experts=self.inventory.num_experts, run=self.run, comm=self.comm)
        self.plans = UnitPlans(model, optimizer, layout)
        self.coordinator = Coordinator(self.comm, self.policy.routing_len)
        self.run.run_id = told[0]["run_id"]  # one id for the whole job
        self.engine = SnapshotEngine(cfg, pool=pool, comm=self.comm, run=self.run)
        self.persister = Persister(cfg, store=store, pool=pool, comm=self.comm, run=self.run, policy=self.policy)
        self.recovery = Recovery(cfg, model=model, optimizer=optimizer, inventory=self.inventory, comm=self.comm,
                                 run=self.run, store=store, snapshot_dir=self.snapshot_dir, policy=self.policy,
                                 extra_state=self.extra_state)
        self._closed = False
        self._restore_report: RestoreReport | None = None
        self._flushing = False          # close() or a SIGTERM's flush is under way
        self._exit_after_close = False  # a SIGTERM came during that flush
        #: the generation base is known (adopted from a handover, or a restore read the store)
        self._base_known = any(t["handover"] is not None for t in told)
        #: a job with no runtime counting generations for it (no generation given, no
        #: handover): its first restore that finds a checkpoint starts a new generation
        self._auto_fence = generation is None and not self._base_known
        self._adopt([t["handover"] for t in told])
        if generation is not None:
            self._set_generation(generation)
        #: exact mode's checkpointer (None: plain mode); the manager calls only :attr:`mode`
        self.exact = self._exact_checkpointer(store, pool) if cfg.exact else None
        self.mode: Mode
        if self.exact is not None:
            self.mode = ExactMode(cfg, checkpointer=self.exact, comm=self.comm, run=self.run)
            self.mode.adopt([(t["handover"] or {}).get("exact") for t in told])

        self._attach_routing()
        if self.exact is None:
            self.mode = PlainMode(cfg, inventory=self.inventory, comm=self.comm, run=self.run, policy=self.policy,
                                  plans=self.plans, coordinator=self.coordinator, engine=self.engine,
                                  persister=self.persister, recovery=self.recovery, model=model, optimizer=optimizer,
                                  extra_state=self.extra_state,
                                  drain=functools.partial(self._taps.drain, fed=self._fed.__contains__))
        self._hook = (optimizer.register_step_pre_hook(self.mode.before_optimizer_step)
                      if optimizer is not None else None)
        self._old_sigterm = None
        # A process started with SIGTERM ignored (a supervisor that signals every process
        # of a job, SLURM's steps, and leaves the decision to a parent, the Lazarus agent)
        # keeps ignoring it: flushing and exiting here would take every rank down.
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _exact_checkpointer(self, store: CheckpointStore, pool: BufferPool) -> ExactCheckpointer:
        """``cfg.exact``: the exact-mode protocol; every rank captures and replays its own
        pieces (DTensor shards included); units several ranks hold are stored per holder."""
        shared = {u for u in self.inventory.layout.units if len(self.inventory.holders.get(u, ())) > 1}
        return ExactCheckpointer(self.cfg, model=self.model, optimizer=self.optimizer, layout=self.inventory.layout,
                                 plans=self.plans, pool=pool, store=store, run=self.run, comm=self.comm,
                                 shared=shared, extra_tree=self._extra_tree, extra_state=self.extra_state)

    # -- the parts' public faces -----------------------------------------------------------
    @property
    def layout(self) -> UnitLayout:
        return self.inventory.layout

    @property
    def layout_info(self) -> dict[str, Any]:
        return self.inventory.info

    @property
    def holders(self) -> dict[str, list[int]]:
        return self.inventory.holders

    @property
    def num_experts(self) -> dict[str, int]:
        return self.inventory.num_experts

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @property
    def store(self) -> CheckpointStore:
        return self.persister.store

    @property
    def pool(self) -> BufferPool:
        return self.engine.pool

    @property
    def plt_tracker(self) -> PLTTracker:
        return self.policy.tracker

    @property
    def k_snapshot(self) -> int:
        return self.policy.k_snapshot

    @property
    def k_persist(self) -> int:
        return self.policy.k_persist

    @property
    def interval(self) -> int:
        return self.policy.interval

    @property
    def interrupted_replay(self) -> bool:
        """Exact mode: the manager this one took over from (``handover=``, on any rank) was
        replaying a window, so the model is half replayed: call ``restore(reshard=True)``
        before training on."""
        return self.mode.interrupted_replay

    @property
    def replaying(self) -> bool:
        """Exact mode: a restored window is being replayed (the steps up to its last one)."""
        return self.mode.replaying

    @property
    def last_restore(self) -> RestorePlan | None:
        """The plan of the newest :meth:`restore` (sources per unit), None before one."""
        return self.recovery.last_restore

    @property
    def last_restore_report(self) -> RestoreReport | None:
        """What the newest :meth:`restore` did (step, source, units from memory and
        storage, expert versions, PLT, seconds), None before one; its ``str()`` is the line
        rank 0 logged."""
        return self._restore_report

    # -- context manager -----------------------------------------------------------------
    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            # Crashing out: keep the in-memory snapshots for recovery, let an in-flight
            # persist finish, start nothing new, and never mask the exception.
            self.close(keep_snapshots=True, raise_errors=False, flush=False)

    # -- training-loop API ---------------------------------------------------------------
    def record_routing(self, layer: str, counts: Any, *, scope: str = "local") -> None:
        """Tokens routed to each expert of ``layer`` (global expert ids) in one step.

        ``scope="local"``: this rank's tokens (the manager sums over ranks);
        ``"global"``: counts already summed over ranks and identical on every rank (what
        lazarus MoE layers report; they are wired up automatically).

        ``counts`` on a GPU are summed there; at the next checkpoint or decision step they
        are copied to the host without waiting and counted once the copy is done, so
        calling this every step never waits for the device.
        """
        self._fed.add(layer)
        self.policy.record_routing(layer, counts, scope=scope)

    def _drain(self, record: Any) -> None:
        """Router taps' counts; a router moc cannot read is an error unless its layer is fed."""
        self._taps.drain(record, fed=lambda layer: layer in self._fed)

    def _attach_routing(self) -> None:
        """Count routing without user calls: layers that report their own counts (Lazarus's,
        through :data:`moc._units.routing.GLOBAL_ROUTING_ATTR`) are wired up, other routers
        (transformers, Megatron) are tapped with forward hooks."""
        lazarus_layers = set()
        self._fed: set[str] = set()
        self._reporters: list[tuple[torch.nn.Module, Any]] = []   # (layer, the hook set on it here)
        for name, reporter in routing_reporters(self.model):
            if name in self.num_experts:
                # ignore: torch's stub of Module.__setattr__ takes only Tensor | Module (any value works)
                reporter.routing_hook = (lambda counts, _n=name:  # type: ignore[assignment]
                                         self.policy.record_routing(_n, counts, scope="global"))
                self._reporters.append((reporter, reporter.routing_hook))
                lazarus_layers.add(name)
        owners: dict[str, str] = {}
        for layer in self.layout.layers:
            units = self.layout.experts(layer)
            if units and units[0].refs:
                key = units[0].refs[0].key
                owners[layer] = key.rsplit(".", 1)[0] if "." in key else ""
        self._taps = RouterTaps(self.model, self.num_experts, skip=lazarus_layers, top_k=self.policy.tracker.top_k,
                                widths=self.layout.routed_ids, owners=owners)
        if self._taps.tapped and self.rank == 0:
            log.info("rank %d step -: routing counted from %d routers", self.rank, self._taps.tapped)

    def _sync_routing(self) -> None:
        self.policy.sync_routing(self._drain)

    def step(self, step: int) -> None:
        """Call after ``optimizer.step()`` of training step ``step``."""
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")
        if self.run.fatal is not None:
            raise self.run.fatal
        self.run.last_step = step
        if self.mode.step(step):
            self._flush_and_exit()

    def _extra_tree(self, step: int) -> dict[str, Any]:
        return extra_tree(step, model=self.model, optimizer=self.optimizer, plans=self.plans,
                          extra_state=self.extra_state, rank=self.rank, world=self.world)

    def young_daly_interval(self, step_time: float) -> int:
        """Steps between checkpoints: I* = sqrt(2 * save_overhead / failure_rate)."""
        return self.policy.young_daly_interval(step_time)

    # -- recovery --------------------------------------------------------------------------
    def snapshot_headers(self) -> list[dict[str, Any]]:
        """Published snapshots in this rank's shared-memory directory (newest last)."""
        return self.recovery.snapshot_headers()

    def restore(self, *, reshard: bool = False) -> int:
        """Load the newest consistent state; return the next step to run (0 if none).

        Collective: every rank of the process group must call it.

        Exact mode: the next step is the newest complete window's first step + 1; the loop
        then replays the window's steps (see ``docs/exact.md``). ``reshard=True`` (exact
        mode only): restore from the newest window committed to storage even when other
        ranks, or ranks holding other units, wrote it: every unit this rank holds now is
        read by its name (from this rank's memory where it holds the same record), and the
        replay-divergence check is off unless the world and every rank's units are the
        window's (``status()["exact"]["last_replay"]`` says which).

        Rank 0 logs what it did in one line at INFO, shown under Python's default logging
        set-up too (:mod:`moc._announce`); :attr:`last_restore_report` holds it.
        """
        started = time.monotonic()
        self._learn_generation_base()
        next_step = self.mode.restore(reshard=reshard)
        if self._auto_fence and next_step:
            self._fence_restart()
        replay = self.exact.last_replay if self.exact is not None and next_step else None
        self._restore_report = report_restore(
            self.recovery.last_restore, next_step=next_step, storage=str(self.cfg.storage), plt=self.plt(),
            seconds=time.monotonic() - started,
            exact_window=None if replay is None else (replay["start"], replay["end"], str(replay["source"])))
        if self.rank == 0:
            announce(log, "%s", self._restore_report)
        return next_step

    def restore_units(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """Replace the named units (typically experts that lost every replica) with their
        newest saved version, from any rank's memory first, else storage; the rest of the
        live state is untouched and the step does not move back.

        Collective: every rank calls it with the same ``names``. Tokens routed to each
        restored expert since its version are booked as lost (PLT, by level). Returns
        ``unit -> {"level": "snapshot" | "persist" | None, "version": step | None,
        "lost_tokens": int}``; level None means no saved version exists anywhere (the unit
        keeps its current values).
        """
        return self.mode.restore_units(names)

    # -- fencing ---------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        """The fencing generation this manager's writes carry."""
        return self.store.generation

    def _set_generation(self, generation: int) -> None:
        effective = self.store.generation_base + generation
        if effective < self.store.generation:
            raise ValueError(f"generation only grows: this manager writes as generation {self.store.generation}, "
                             f"got {generation}" + (f" (+ base {self.store.generation_base})"
                                                    if self.store.generation_base else ""))
        self.store.generation = effective

    def _learn_generation_base(self) -> None:
        """A job's first restore: when an earlier job on this storage path fenced generations
        at or above the ones this job counts from (a new controller counts from 1 again),
        add the newest one to this job's generations, so its writes are not fenced and still
        fence everything older. Collective (rank 0 reads, every rank learns)."""
        if self._base_known:
            return
        newest = None
        if self.rank == 0:
            fence = self.store.newest_fence()
            newest = None if fence is None else fence.generation
        newest = self.comm.broadcast_json(newest)
        self._base_known = True
        if newest is not None and newest >= self.store.generation:
            self.store.generation_base = int(newest)
            self.store.generation += int(newest)
            if self.rank == 0:
                log.info("rank 0 step -: %s holds fences up to generation %d: this job writes as generation %d",
                         self.store.store.url, newest, self.store.generation)

    def _fence_restart(self) -> None:
        """A restarted job (no runtime gives it generations) writes as a new generation
        from its restore on and fences the old one: a process of the earlier incarnation
        still running (a preempted node that did not die) can no longer commit, and what
        the restart writes again (exact mode replays a committed window and commits it
        anew) goes under keys of its own, never over the committed ones. The manifests
        committed before the restore stay visible: the fence hides only older
        generations' manifests of later steps. Collective, like :meth:`restore`."""
        self._auto_fence = False
        latest = self.store.latest_step() if self.rank == 0 else None
        latest = self.comm.broadcast_json(latest)
        resume = 0 if latest is None else int(latest) + 1
        self.fence(self.store.generation - self.store.generation_base + 1, resume_step=resume)
        if self.rank == 0:
            log.info("rank 0 step %d: restarted job writes as generation %d (older generations fenced from step %d)",
                     resume, self.store.generation, resume)

    def fence(self, generation: int, *, resume_step: int, wait: bool = True) -> None:
        """Write as fencing generation ``generation`` from now on and fence every older one:
        rank 0 publishes the marker ``fence/g<generation>.json`` (conditionally; one already
        there stays), after which no writer of an older generation commits anything, and
        readers ignore older generations' manifests of steps >= ``resume_step`` (the first
        step this generation trains). Local: each rank calls it (an elastic runtime, when it
        adopts a plan of a new generation). ``wait=False``: the marker is written in the
        background, and before this process's next commit at the latest (for a caller that
        must not wait on storage). Raises :class:`moc.FencedError` when a newer
        generation already fenced this one, ``ValueError`` when ``generation`` is below
        the current one or not >= 1."""
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 1:
            raise ValueError(f"generation must be an integer >= 1, got {generation!r}")
        if not isinstance(resume_step, int) or isinstance(resume_step, bool) or resume_step < 0:
            raise ValueError(f"resume_step must be a non-negative int, got {resume_step!r}")
        self._set_generation(generation)
        gen = self.store.generation
        if self.rank == 0 and wait:
            self.store.write_fence(gen, resume_step, run_id=self.run.run_id)
        elif self.rank == 0:
            self.store.defer_fence(gen, resume_step, run_id=self.run.run_id)
        elif wait:
            self.store.check_fence(resume_step, gen)

    # -- reconfiguration -----------------------------------------------------------------
    def _export_state(self) -> dict[str, Any]:
        with self.run.lock:
            return {"run_id": self.run.run_id, **self.policy.state(), "pending": self.policy.pending_state(),
                    "has_base": self.run.has_base,
                    "first_done": self.run.first_done, "last_persisted_step": self.persister.last_persisted_step,
                    "last_snapshot_step": self.engine.last_snapshot_step,
                    "persist_failures": self.persister.failures, "generation": self.store.generation,
                    "generation_base": self.store.generation_base}

    def _adopt(self, states: list[dict[str, Any] | None]) -> None:
        """Continue the bookkeeping of the manager(s) this one replaces: ``states`` holds
        every rank's handover state (None: a rank without one), in rank order."""
        state = next((s for s in states if s is not None), None)
        if state is None:
            return
        self.run.run_id = state["run_id"]
        self.policy.load_state(state)
        # routing since the last checkpoint: booked when a lost expert is restored
        self.policy.adopt_pending([s.get("pending") if s is not None else None for s in states])
        self.run.has_base, self.run.first_done = bool(state["has_base"]), bool(state["first_done"])
        self.persister.last_persisted_step = state["last_persisted_step"]
        self.engine.last_snapshot_step = state["last_snapshot_step"]
        self.persister.failures = int(state["persist_failures"])
        self.store.generation_base = max(self.store.generation_base,
                                         *(int((s or {}).get("generation_base", 0)) for s in states))
        self.store.generation = max(self.store.generation, *(int((s or {}).get("generation", 0)) for s in states))

    def detach(self, grace: timedelta = timedelta(milliseconds=500)) -> Handover:
        """Retire this manager because its process group is broken or being replaced,
        keeping the snapshot buffers (node memory) and the bookkeeping for the manager
        built on the next process group (pass the result as ``handover=``).

        Local only, commits nothing new. Background snapshot/persist jobs get ``grace`` to
        finish; one still blocked in a collective (gloo peers that are alive but have left
        the group only time out) is abandoned: it can no longer publish a snapshot or
        write into a buffer, and its persist is never committed by anyone. The device
        copies into the buffers are waited for, and the buffers' page-locking released,
        before they are handed over (the successor page-locks them again, off its
        training thread).
        """
        exact = self.mode.detach()
        with self.run.lock:
            self.run.abandoned = True
        self.engine.abandon(grace)        # waits for the copies into the buffers too
        self.persister.abandon(grace)
        self.persister.apply_outcomes()   # the successor continues from every commit seen here
        self.engine.retire_buffers()
        self.engine.pool.unpin()
        state = self._export_state()
        if exact is not None:
            state["exact"] = exact
        self._closed = True
        self._release_hooks()
        self.engine.shutdown(wait=False)
        self.persister.shutdown(wait=False)
        return Handover(pool=self.engine.pool, state=state, store=self.persister.store, storage=str(self.cfg.storage))

    def join_threads(self, timeout: timedelta = timedelta(seconds=5)) -> bool:
        """After :meth:`detach` or :meth:`close`: wait up to ``timeout`` (in all) for the
        background threads to end (a job left behind on storage that hangs keeps its thread);
        True once they have. A process about to exit calls it (off its training thread, as
        :func:`lazarus.runtime.worker._abort.release_in_background` does): daemon threads still at
        work while the interpreter finalises abort it as soon as they leave a C++ call."""
        deadline = time.monotonic() + timeout.total_seconds()
        left = lambda: max(0.0, deadline - time.monotonic())   # noqa: E731
        done = self.persister.join(left())
        return self.mode.join(left()) and done

    # -- waiting, flushing, closing ------------------------------------------------------
    def wait(self, *, flush: bool = True) -> None:
        """Block until the newest snapshot is in storage; raise if it cannot be written.

        ``flush=False`` only waits for work already under way: the snapshot copy in
        flight and the persist in flight (a memory-only snapshot stays memory-only). That
        form is local to this rank; the flushing form is collective under
        torch.distributed (every rank decides the flush together)."""
        self.mode.wait(flush=flush)

    @property
    def _sigterm(self) -> bool:
        return self.run.sigterm

    def _on_sigterm(self, signum, frame) -> None:
        self.run.sigterm = True
        if self.run.stop_deadline is None:
            self.run.stop_deadline = time.monotonic() + self.cfg.stop_timeout.total_seconds()
        if self._flushing:
            # the flush under way (close(), or the flush of a first SIGTERM) gives up at the
            # stop deadline; close() then exits
            self._exit_after_close = True
            log.warning("%s: SIGTERM received while flushing; giving the flush at most %s (MoCConfig.stop_timeout), "
                        "then exiting", self.run.where(), self.cfg.stop_timeout)
            return
        log.warning("rank %d: SIGTERM received; flushing the newest snapshot at the next step", self.rank)
        if not self.comm.distributed and self.run.last_step is not None and not self._closed:
            self._flush_and_exit()

    def _flush_and_exit(self) -> None:
        log.warning("%s: flushing the newest snapshot before exit", self.run.where())
        self._flushing = True
        try:
            self.wait()
        finally:
            self.close(keep_snapshots=True, raise_errors=False)
            raise SystemExit(128 + signal.SIGTERM)

    def _release_hooks(self) -> None:
        """Leave the model and optimizer as found: nothing of theirs refers to this manager
        once it is closed or detached (its successor hooks in afresh)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for layer, hook in self._reporters:
            if layer.routing_hook is hook:
                layer.routing_hook = None  # type: ignore[assignment]  # torch's Module.__setattr__ stub: Tensor | Module
        self._reporters = []
        self._taps.remove()
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)

    def close(self, *, keep_snapshots: bool = False, raise_errors: bool = True, flush: bool = True) -> None:
        """Persist the newest snapshot (``flush``), stop the workers, release the hook and
        the SIGTERM handler; remove the shared-memory buffers unless ``keep_snapshots`` or
        the final flush failed (they then hold the only copy of the newest state). A
        permanent storage error is raised at once (:class:`storage_backends.PermanentStorageError`);
        a SIGTERM meanwhile bounds the flush by ``MoCConfig.stop_timeout`` and ends in
        ``SystemExit(143)``."""
        if self._closed:
            return
        self._flushing = True
        failed_flush = False
        try:
            self.wait(flush=flush)
            failed = self.engine.consecutive_failures
            if flush and failed:
                raise CheckpointError(
                    f"{self.run.where()}: the last {failed} snapshot(s) failed; the newest persisted state is "
                    f"step {self.persister.last_persisted_step}: {self.run.last_error}"
                ) from self.engine.last_exception
        except Exception:
            # the newest state is in no store: its snapshot files stay for a restart
            failed_flush = flush
            if raise_errors and not self._exit_after_close:
                raise
            log.exception("rank %d: final persist failed", self.rank)
        finally:
            self._closed = True
            self._release_hooks()
            self.engine.shutdown(wait=True)
            stop = self.run.stop_deadline
            # after SIGTERM, a persist job stuck on storage is waited for only until the stop deadline
            self.persister.shutdown(wait=True, timeout=30.0 if stop is None else
                                    max(0.0, min(30.0, stop - time.monotonic())) / 2)
            self.mode.shutdown()
            self.engine.quiesce()
            if not (keep_snapshots or failed_flush):
                self.engine.pool.remove_files()
            else:
                self.engine.pool.unpin()   # the files stay for a restart; the driver's pins go
        if self._exit_after_close:
            raise SystemExit(128 + signal.SIGTERM)

    # -- reporting -----------------------------------------------------------------------
    def snapshot_state(self) -> tuple[int, dict[str, Any]] | None:
        """(step, {unit: tree}) of this rank's newest complete in-memory snapshot; units
        split with other ranks hold only this rank's bytes and are left out."""
        return self.engine.newest_state()

    def plt(self) -> float:
        """Proportion of lost tokens over all recoveries so far."""
        with self.run.lock:
            return self.policy.tracker.value()

    def status(self) -> dict[str, Any]:
        busy = self.persister.busy
        e, p, pol = self.engine, self.persister, self.policy
        exact = self.mode.status()
        with self.run.lock:
            return {
                "exact": exact,
                "rank": self.rank, "world": self.world, "step": self.run.last_step,
                "last_snapshot_step": e.last_snapshot_step, "last_persisted_step": p.last_persisted_step,
                "persist_in_flight": busy, "persist_failures": p.failures, "persists_skipped": p.skipped,
                "persist_error_permanent": p.permanent.kind if p.permanent is not None else None,
                "last_error": self.run.last_error,
                "snapshot_failures": e.failures, "consecutive_snapshot_failures": e.consecutive_failures,
                "snapshots_skipped": e.skipped, "snapshots_skipped_here": e.skipped_local,
                "last_skip": dict(e.last_skip) if e.last_skip else None,
                "layout": self.inventory.info["description"],
                "k_snapshot": pol.k_snapshot, "k_persist": pol.k_persist, "interval": pol.interval,
                "stall_seconds_last": e.stall_last, "stall_seconds_total": e.stall_total, "stalls": e.stalls,
                "host_stall_seconds_last": e.host_stall_last, "host_stall_seconds_total": e.host_stall_total,
                "device_stall_seconds_last": e.device_stall_last,
                "device_stall_seconds_total": e.device_stall_total,
                "step_call_seconds_last": self.mode.step_call_last,
                "step_call_seconds_total": self.mode.step_call_total,
                "blocked_seconds_total": e.stall_total + self.mode.step_call_total,
                "snapshot_seconds": e.seconds, "buffer_bytes": e.pool.allocated_bytes(),
                "device_snapshots_async": e.device_snapshots_async,
                "device_snapshots_fallback": e.device_snapshots_fallback,
                "buffers_page_locked": e.pool.pinned_count(), "page_lock_error": e.pool.pin_error(),
                "plt": pol.tracker.value(), "plt_snapshot": pol.tracker.value("snapshot"),
                "plt_persist": pol.tracker.value("persist"), "recoveries": pol.recoveries,
                "generation": self.store.generation, "writes_refused": self.store.refusals,
                "last_refusal": self.store.last_refusal,
                "fatal": None if self.run.fatal is None else str(self.run.fatal),
            }
