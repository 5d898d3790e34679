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
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import signal
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping

import torch
import xxhash

from storage_backends import open_store

from ._buffers import PERSIST, READY, BufferPool, SnapshotBuffer
from ._ckpt_store import CheckpointStore
from ._codec import TensorMeta, TreePlan, decode_tree, plan_tree
from ._config import MoCConfig
from ._dist import Comm
from ._manager_elastic import ElasticMixin, Handover
from ._manager_restore import RestoreMixin
from ._format import ChunkRecord, Manifest, UnitRecord
from ._plt import PLTTracker
from ._routing import RouterTaps
from ._selection import load_aware_selection
from ._sharding import plan_shares
from ._errors import CheckpointError
from ._units import (UnitLayout, capture_rng, capture_unit, discover_units, expert_unit_name, optimizer_groups,
                     parse_expert, unit_base)

__all__ = ["CheckpointManager", "CheckpointError", "Handover"]

log = logging.getLogger("moc")


def _expert_count(names: list[str], known: Mapping[str, int]) -> dict[str, int]:
    counts: dict[str, int] = dict(known)
    for name in names:
        if name.startswith("expert/"):
            layer, e = parse_expert(name)
            counts[layer] = max(counts.get(layer, 0), e + 1)
    return dict(sorted(counts.items()))


class CheckpointManager(RestoreMixin, ElasticMixin):
    """Wraps a training loop; see the module docstring and ``README.md``.

    Args:
        cfg: the configuration.
        model: the (local part of the) model; expert parameters are found with
            ``cfg.expert_pattern`` (``expert_pattern`` overrides it).
        optimizer: its state is saved with the parameters it belongs to; its step
            pre-hook is where the manager waits for an in-flight snapshot.
        process_group: ranks that checkpoint together (default: the whole world when
            ``torch.distributed`` is initialised, else a single process).
        extra_state: objects with ``state_dict()``/``load_state_dict()`` saved alongside
            (data loaders, schedulers, ...).
        memory_key: name of this process's snapshot folder under the snapshot directory
            (default ``rank<r>``). An elastic runtime whose ranks get renumbered passes a
            name that stays with the node (``worker0``), so snapshots are found again.
        handover: what :meth:`detach` returned on the manager this one replaces (same
            process, new process group after a reconfiguration): its buffers are kept and
            the bookkeeping (run id, counters, PLT, K) continues. Ranks without one (a
            joining process) take the bookkeeping from the lowest rank that has one.
    """

    def __init__(self, cfg: MoCConfig, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 process_group: Any = None, expert_pattern: str | None = None,
                 extra_state: Mapping[str, Any] | None = None, memory_key: str | None = None,
                 handover: "Handover | None" = None) -> None:
        if not isinstance(cfg, MoCConfig):
            raise TypeError(f"cfg must be a MoCConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.extra_state = dict(extra_state or {})
        for name, obj in self.extra_state.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise ValueError(f"extra_state[{name!r}] must have state_dict() and load_state_dict()")
        self.layout: UnitLayout = discover_units(model, expert_pattern or cfg.expert_pattern,
                                                 layout=cfg.expert_layout)
        params = {n for n, _ in model.named_parameters()}
        # Module units holding buffers (running stats...) are copied synchronously in step().
        self._units_with_buffers = {spec.name for spec in self.layout.modules()
                                    if any(k not in params for k in spec.keys)}
        self.comm = Comm.create(process_group, cfg.coordination_timeout)
        self.rank, self.world = self.comm.rank, self.comm.world

        inventory = self.comm.gather_json(sorted(u for u in self.layout.units))
        self.holders: dict[str, list[int]] = {}
        for r, names in enumerate(inventory):
            for name in names:
                self.holders.setdefault(name, []).append(r)
        for r in range(self.world):
            self.holders[f"extra/rank{r}"] = [r]
        known = self.comm.gather_json(self.layout.experts_per_layer)
        self.num_experts = _expert_count(list(self.holders), {l: n for d in known for l, n in d.items()})
        self.layout.experts_per_layer = dict(self.num_experts)
        self.layout_info = self.layout.describe()
        if self.rank == 0:
            log.info("rank %d step -: expert layout %s", self.rank, self.layout_info["description"])
        e_min = min(self.num_experts.values())
        self.k_snapshot = self._initial_k("k_snapshot", cfg.k_snapshot, e_min)
        self.k_persist = self._initial_k("k_persist", cfg.k_persist if cfg.k_persist is not None else self.k_snapshot, e_min)
        if self.k_persist > self.k_snapshot:
            raise ValueError(f"MoCConfig.k_persist ({self.k_persist}) must be <= k_snapshot ({self.k_snapshot})")
        self.interval = 1 if cfg.interval == "auto" else int(cfg.interval)
        self.plt_tracker = PLTTracker(self.num_experts, cfg.top_k)
        self._pending_counts = {layer: torch.zeros(n, dtype=torch.int64) for layer, n in self.num_experts.items()}

        self.store = CheckpointStore(open_store(cfg.storage, **cfg.storage_options),
                                     compression=cfg.compression, keep_last=cfg.keep_last)
        run_key = hashlib.sha1(self.store.store.url.encode()).hexdigest()[:12]
        base_dir = cfg.snapshot_dir or (f"/dev/shm/moc-{run_key}" if os.path.isdir("/dev/shm")
                                        else os.path.join(tempfile.gettempdir(), f"moc-{run_key}"))
        if memory_key is not None and (not memory_key or "/" in memory_key or memory_key.startswith(".")):
            raise ValueError(f"memory_key must be a plain folder name, got {memory_key!r}")
        self.snapshot_dir = os.path.join(base_dir, memory_key or f"rank{self.rank}")
        if handover is not None and handover.pool.directory == self.snapshot_dir:
            self.pool = handover.pool
        else:
            self.pool = BufferPool(self.snapshot_dir)
        self.run_id = self.comm.broadcast_json(uuid.uuid4().hex[:16])  # one id for the whole job

        self._lock = threading.Lock()
        self._snap_exec = ThreadPoolExecutor(1, thread_name_prefix=f"moc-snapshot-r{self.rank}")
        self._persist_exec = ThreadPoolExecutor(1, thread_name_prefix=f"moc-persist-r{self.rank}")
        self._snapshot: Future | None = None
        self._persist: Future | None = None
        self._base: Manifest | None = None           # newest committed manifest (rank 0)
        self._checkpoints = 0
        self._persist_rounds = 0
        self._first_done = False      # a snapshot was taken by this process
        self._has_base = False        # a committed manifest holds every unit
        self._last_step: int | None = None
        self._last_snapshot_step: int | None = None
        self._last_persisted_step: int | None = None
        self._stall_total = 0.0
        self._stall_last = 0.0
        self._step_call_last = 0.0    # synchronous part of a checkpoint inside step()
        self._step_call_total = 0.0
        self._stalls = 0
        self._persist_failures = 0
        self._snapshot_failures = 0
        self._consecutive_failures = 0
        self._last_snapshot_error: BaseException | None = None
        self._last_error: str | None = None
        self._closed = False
        self._abandoned = False   # detached: background jobs must not touch the buffers
        self._sigterm = False
        self._step_times: list[float] = []
        self._last_step_wall: float | None = None
        self._snapshot_seconds: float | None = None
        self._save_overhead: float | None = None
        self._recoveries = 0
        self._started = time.time()
        self._adopt(handover)

        self._attach_lazarus_layers()
        self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step) if optimizer is not None else None
        self._old_sigterm = None
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    # -- configuration helpers -----------------------------------------------------------
    @staticmethod
    def _initial_k(field: str, value: Any, e_min: int) -> int:
        if value is None or value == "auto":
            return e_min if value is None else 1
        if not 1 <= int(value) <= e_min:
            raise ValueError(f"MoCConfig.{field} must be in [1, {e_min}] (experts per MoE layer), got {value}")
        return int(value)

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
        """
        if scope not in ("local", "global"):
            raise ValueError(f"scope must be 'local' or 'global', got {scope!r}")
        if layer not in self._pending_counts:
            raise KeyError(f"unknown MoE layer {layer!r}; known: {sorted(self._pending_counts)}")
        t = torch.as_tensor(counts, dtype=torch.int64).reshape(-1).cpu()
        if t.numel() != self._pending_counts[layer].numel():
            raise ValueError(f"layer {layer!r} has {self._pending_counts[layer].numel()} experts, got {t.numel()} counts")
        if scope == "global":
            # Counted once over the job: only rank 0 contributes it to the sum.
            if self.rank == 0:
                self._pending_counts[layer] += t
        else:
            self._pending_counts[layer] += t

    def _attach_lazarus_layers(self) -> None:
        """Feed routing counts of lazarus MoE layers in the model automatically."""
        try:
            from lazarus.moe import moe_layers
        except ImportError:  # pragma: no cover - lazarus ships with moc
            moe_layers = lambda model: []  # noqa: E731
        lazarus_layers = set()
        for name, layer in moe_layers(self.model):
            if name in self._pending_counts:
                layer.routing_hook = (lambda counts, _n=name: self.record_routing(_n, counts, scope="global"))
                lazarus_layers.add(name)
        self._taps = RouterTaps(self.model, self.num_experts, skip=lazarus_layers)
        if self._taps.tapped and self.rank == 0:
            log.info("rank %d step -: routing counted from %d routers", self.rank, self._taps.tapped)

    def _sync_routing(self) -> None:
        """Fold the pending per-rank routing counts into the global PLT counters."""
        self._taps.drain(self.record_routing)
        layers = list(self._pending_counts)
        flat = torch.cat([self._pending_counts[l] for l in layers])
        self.comm.sum_int64(flat)
        pos = 0
        with self._lock:
            for l in layers:
                n = self._pending_counts[l].numel()
                self.plt_tracker.record(l, flat[pos: pos + n])
                pos += n
            first = flat[: self._pending_counts[layers[0]].numel()]
            self.plt_tracker.add_tokens(int(first.sum()) // self.cfg.top_k)
        for l in layers:
            self._pending_counts[l].zero_()

    def _due(self, step: int) -> bool:
        return not self._first_done or step % self.interval == 0

    def step(self, step: int) -> None:
        """Call after ``optimizer.step()`` of training step ``step``."""
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")
        now = time.perf_counter()
        if self._last_step_wall is not None:
            self._step_times = (self._step_times + [now - self._last_step_wall])[-50:]
        self._last_step_wall = now
        self._last_step = step
        due = self._due(step)
        if due or step % max(1, self.interval // 4) == 0:
            # Decision points are the same steps on every rank, so collectives line up.
            if self.comm.any_true(self._sigterm):
                self._flush_and_exit()
        if due:
            t0 = time.perf_counter()
            self._checkpoint(step)
            self._step_call_last = time.perf_counter() - t0
            self._step_call_total += self._step_call_last
            self._save_overhead = self._step_call_last + self._stall_last
            self._tune()
        elif step % max(1, self.interval // 4) == 0:
            self._maybe_persist("retry")

    def _checkpoint(self, step: int) -> None:
        self._wait_snapshot()
        self._check_failures()
        self._sync_routing()
        # Until one checkpoint holding every unit is committed, save (and persist) every
        # expert; afterwards every persist_every-th snapshot also goes to storage.
        designated = not self._has_base or self._checkpoints % self.cfg.persist_every == 0
        selection = self._select(not self._has_base, designated)
        entries, sync_entries, persist_units, remote, remote_meta = self._plan(step, selection)
        incoming = [r for r in remote if r[4] == self.rank]
        needed = sum(e[3] - e[2] for e in entries) + sum(r[2] - r[1] for r in incoming)
        buf = self.pool.acquire()
        buf.ensure(needed)
        with self._lock:
            plt_state = self.plt_tracker.state()
            for layer, (snap, _) in selection.items():
                self.plt_tracker.mark_saved("snapshot", layer, snap)
        header = {"run": self.run_id, "rank": self.rank, "world": self.world, "step": step,
                  "plt": plt_state, "meta": self._meta(), "persist_due": designated,
                  "selection": {l: list(v[1]) for l, v in selection.items()}}
        offset = 0
        placed = []
        for entry in entries:
            placed.append((entry, offset))
            offset += entry[3] - entry[2]
        landing = []  # where remote copies received from other ranks go in the buffer
        for r in incoming:
            landing.append((r, offset))
            offset += r[2] - r[1]
        # Small, non-parameter state (extra state, module buffers) is copied now: the next
        # forward may change it before the background copy would get to it.
        for entry, off in placed:
            if entry[0] in sync_entries:
                entry[1].copy_range(entry[2], entry[3], buf.data[off: off + entry[3] - entry[2]])
        self._snapshot = self._snap_exec.submit(self._fill, buf, placed, sync_entries, persist_units, header,
                                                remote, landing, remote_meta)
        self._first_done = True
        self._checkpoints += 1
        if designated:
            self._persist_rounds += 1
        self._maybe_persist("new" if designated else "retry")

    def _select(self, first: bool, designated: bool) -> dict[str, tuple[list[int], list[int]]]:
        """Per layer: (experts to snapshot, experts to persist if this snapshot is persisted).

        Sequential: persisted snapshots rotate by ``k_persist`` per persisted checkpoint and
        snapshot the persisted experts plus the next ones; memory-only snapshots rotate by
        ``k_snapshot`` per snapshot. Both are staggered across layers by the layer index.
        A memory-only snapshot that ends up flushed (SIGTERM, close) persists all it holds.
        """
        out = {}
        for li, (layer, num) in enumerate(self.num_experts.items()):
            if first:
                out[layer] = (list(range(num)), list(range(num)))
                continue
            ks, kp = min(self.k_snapshot, num), min(self.k_persist, num)
            if self.cfg.selection == "sequential":
                k, n = (kp, self._persist_rounds) if designated else (ks, self._checkpoints)
                base = (n * k + li * k) % num
                order = [(base + j) % num for j in range(num)]
            else:
                with self._lock:
                    unsaved_p = self.plt_tracker.unsaved("persist", layer)
                    unsaved_s = self.plt_tracker.unsaved("snapshot", layer)
                persist = load_aware_selection(unsaved_p, kp) if designated else []
                rest = [e for e in sorted(range(num), key=lambda e: (-unsaved_s[e], e)) if e not in persist]
                order = persist + rest
            snap = sorted(order[:ks])
            out[layer] = (snap, sorted(order[:kp]) if designated else snap)
        return out

    def _plan(self, step: int, selection: dict[str, tuple[list[int], list[int]]]):
        """This rank's share: entries (unit, TreePlan, start, end, kind, layer, expert)."""
        state = self.model.state_dict(keep_vars=True)
        params = dict(self.model.named_parameters())
        plans: dict[str, tuple[TreePlan, Any]] = {}
        for layer, (snap, _) in selection.items():
            for e in snap:
                spec = self.layout.expert_unit(layer, e)
                if spec is not None:
                    plans[spec.name] = (plan_tree(capture_unit(spec, self.model, self.optimizer, state=state,
                                                               params=params)), spec)
        for spec in self.layout.modules():
            plans[spec.name] = (plan_tree(capture_unit(spec, self.model, self.optimizer, state=state,
                                                       params=params)), spec)
        extra_name = f"extra/rank{self.rank}"
        plans[extra_name] = (plan_tree(self._extra_tree(step)), None)
        sizes = self.comm.gather_json({n: p.nbytes for n, (p, _) in plans.items()})
        size_of: dict[str, int] = {}
        disagree: set[str] = set()
        for d in sizes:
            for n, nb in d.items():
                if n in size_of and size_of[n] != nb:
                    disagree.add(n)
                size_of[n] = nb
        if disagree:
            # Replicas of one unit must serialise identically, or split shares would not
            # tile it; keep such units whole on their first holder.
            log.error("rank %d step %d: holders disagree on the size of %s; not splitting them",
                      self.rank, step, sorted(disagree)[:4])
        experts = {n: s for n, s in size_of.items() if n.startswith("expert/")}
        modules = {n: s for n, s in size_of.items() if not n.startswith("expert/")}
        holders = {n: (sorted(r)[:1] if n in disagree else r) for n, r in self.holders.items()}
        shares = plan_shares(experts, modules, holders, self.world, self.cfg.sharding)
        persist_bases = {expert_unit_name(l, e) for l, (_, p) in selection.items() for e in p}
        persist_units = {n for n in experts if unit_base(n) in persist_bases} | set(modules)
        entries = []
        sync_entries = {extra_name}
        # (unit, start, end, src, dst): share copies sent over the network, in one global order.
        remote: list[tuple[str, int, int, int, int]] = []
        copy_load = [0] * self.world
        for sh in shares:
            holders = sorted(self.holders[sh.unit])
            # The owner snapshots (and persists) the share. The other copies go first to
            # ranks that do NOT hold the unit: a copy on a co-holder dies with the replicas
            # it would replace (an expert is lost only when all its holders are), while a
            # copy elsewhere survives them. Co-holders (copied from their own replica, no
            # network) fill up when there are not enough other ranks.
            extra = self.cfg.snapshot_copies - 1
            others = sorted((r for r in range(self.world) if r not in holders),
                            key=lambda r: (copy_load[r], (r - sh.rank) % self.world))[:extra]
            for r in others:
                copy_load[r] += sh.end - sh.start
                remote.append((sh.unit, sh.start, sh.end, sh.rank, r))
            i = holders.index(sh.rank)
            copies = {holders[(i + j) % len(holders)] for j in range(min(1 + extra - len(others), len(holders)))}
            if self.rank not in copies:
                continue
            plan, spec = plans[sh.unit]
            entries.append((sh.unit, plan, sh.start, sh.end, spec, sh.rank == self.rank))
            if sh.unit in self._units_with_buffers:
                sync_entries.add(sh.unit)
        remote_meta: dict[str, Any] = {}
        if remote:
            # Receivers hold no replica, so the senders describe the units they send.
            mine = {u for (u, _, _, src, _) in remote if src == self.rank}
            described = self.comm.gather_json({u: self._unit_meta(plans[u][0], plans[u][1]) for u in sorted(mine)})
            wanted = {u for (u, _, _, _, dst) in remote if dst == self.rank}
            for d in described:
                remote_meta.update({u: m for u, m in d.items() if u in wanted})
        return entries, sync_entries, persist_units, remote, remote_meta

    @staticmethod
    def _unit_meta(plan: TreePlan, spec: Any) -> dict[str, Any]:
        return {
            "kind": "extra" if spec is None else spec.kind, "layer": getattr(spec, "layer", None),
            "expert": getattr(spec, "expert", None), "unit_nbytes": plan.nbytes, "skeleton": plan.skeleton,
            "tensors": [t.to_json() for t in plan.tensors], "itemsize": plan.itemsize,
        }

    def _extra_tree(self, step: int) -> dict[str, Any]:
        extra: dict[str, Any] = {"step": step, "rng": capture_rng(), "rank": self.rank, "world": self.world}
        if self.optimizer is not None:
            extra["optimizer_groups"] = optimizer_groups(self.model, self.optimizer)
        if self.extra_state:
            extra["user"] = {name: obj.state_dict() for name, obj in self.extra_state.items()}
        return {"extra": extra}

    def _meta(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "layout": self.layout_info, "k_snapshot": self.k_snapshot, "k_persist": self.k_persist,
                "checkpoints": self._checkpoints + 1, "persist_rounds": self._persist_rounds + 1,
                "world": self.world, "interval": self.interval, "recoveries": self._recoveries}

    def _fill(self, buf: SnapshotBuffer, placed, sync_entries, persist_units, header,
              remote=(), landing=(), remote_meta=None) -> SnapshotBuffer:
        """Background: copy this rank's share into the buffer, send/receive the remote
        copies, checksum everything, publish."""
        t0 = time.perf_counter()
        units: dict[str, Any] = {}
        pieces = []
        where: dict[tuple[str, int], int] = {}
        for (name, plan, start, end, spec, owner), off in placed:
            n = end - start
            if name not in sync_entries:
                plan.copy_range(start, end, buf.data[off: off + n])
            units[name] = self._unit_meta(plan, spec)
            where[(name, start)] = off
            pieces.append({"unit": name, "start": start, "end": end, "offset": off,
                           "checksum": "xxh3:" + xxhash.xxh3_64_hexdigest(buf.view(off, n)),
                           "persist": owner and (name in persist_units or units[name]["kind"] == "extra")})
        if remote:
            try:
                pieces += self._exchange_copies(buf, remote, landing, where)
                units.update(remote_meta or {})
            except Exception as exc:  # noqa: BLE001 - the local part of the snapshot stays valid
                self._last_error = f"remote snapshot copies failed: {exc}"
                log.warning("rank %d step %d: remote snapshot copies failed: %s", self.rank, header["step"], exc)
        header = dict(header, units=units, pieces=pieces)
        with self._lock:
            if self._abandoned:
                raise RuntimeError("snapshot abandoned: the manager was detached")
            buf.publish(header)
            buf.step = header["step"]
            buf.header = header
            buf.state = READY
            self._last_snapshot_step = header["step"]
        self._snapshot_seconds = time.perf_counter() - t0
        return buf

    # -- the stall point -----------------------------------------------------------------
    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        t0 = time.perf_counter()
        waited = self._wait_snapshot()
        if waited:
            self._stall_last = time.perf_counter() - t0
            self._stall_total += self._stall_last
            self._stalls += 1

    def _wait_snapshot(self) -> bool:
        fut = self._snapshot
        if fut is None:
            return False
        pending = not fut.done()
        try:
            fut.result()
        except Exception as exc:  # noqa: BLE001 - counted; step() raises after too many in a row
            self._last_error = f"snapshot failed: {type(exc).__name__}: {exc}"
            self._snapshot_failures += 1
            self._consecutive_failures += 1
            self._last_snapshot_error = exc
            log.error("rank %d step %s: snapshot failed (%d in a row): %s", self.rank, self._last_step,
                      self._consecutive_failures, exc)
        else:
            self._consecutive_failures = 0
        self._snapshot = None
        return pending

    def _check_failures(self) -> None:
        """Raise :class:`CheckpointError` on every rank once any rank's snapshots failed
        ``max_consecutive_failures`` times in a row (a collective decision)."""
        limit = self.cfg.max_consecutive_failures
        if self.comm.any_true(self._consecutive_failures >= limit):
            cause = self._last_snapshot_error
            where = f"rank {self.rank}" if cause is not None else "another rank"
            raise CheckpointError(
                f"rank {self.rank} step {self._last_step}: {limit} snapshots in a row failed on {where}; "
                f"nothing newer than step {self._last_persisted_step} is protected. Last error: {self._last_error}"
            ) from cause

    # -- persisting ----------------------------------------------------------------------
    def _maybe_persist(self, mode: str) -> None:
        """Start a persist if every rank is idle; a collective decision, so all ranks
        persist the same steps in the same order.

        ``new``: the snapshot just started (due for storage); ``retry``: the newest
        complete snapshot that was due but is not in storage yet; ``flush``: the newest
        complete snapshot, due or not.
        """
        busy = self._persist is not None and not self._persist.done()
        if self.comm.any_true(busy):
            return
        self._reap_persist()
        if mode == "new":
            candidate: int | None = self._last_step
        else:
            with self._lock:
                done = [b for b in self.pool.buffers if b.step is not None and b.state in (READY, PERSIST)]
                if mode == "retry":
                    done = [b for b in done if b.header.get("persist_due")]
                newest = max(done, key=lambda b: b.step) if done else None
            # Never commit a step older than one already committed: manifests only move forward.
            behind = newest is not None and self._last_persisted_step is not None \
                and newest.step <= self._last_persisted_step
            candidate = None if newest is None or newest.persisted or behind else newest.step
        steps = self.comm.gather_json(candidate)
        if any(s is None for s in steps) or len(set(steps)) != 1:
            return
        snap = self._snapshot if mode == "new" else None
        self._persist = self._persist_exec.submit(self._persist_job, snap, candidate)

    def _reap_persist(self) -> None:
        fut = self._persist
        if fut is not None and fut.done():
            self._persist = None
            exc = fut.exception()
            if exc is not None:
                self._last_error = f"persist failed: {exc}"

    def _persist_job(self, snap: Future | None, step: int) -> bool:
        buf = None
        if snap is not None:
            try:
                buf = snap.result()
            except Exception:  # noqa: BLE001 - reported by _wait_snapshot
                buf = None
        if buf is None:
            with self._lock:
                found = [b for b in self.pool.buffers if b.step == step and b.state == READY]
            buf = found[0] if found else None
        ok, error, units = False, None, {}
        if buf is not None:
            with self._lock:
                buf.state = PERSIST
            try:
                units = self._write_share(buf)
                ok = True
            except Exception as exc:  # noqa: BLE001 - storage trouble never reaches training
                error = f"{type(exc).__name__}: {exc}"
        else:
            error = f"snapshot of step {step} is not available"
        results = self.comm.gather_json({"ok": ok, "error": error, "units": units}, persist=True)
        committed = False
        if self.rank == 0 and not self._abandoned:
            if all(r["ok"] for r in results):
                try:
                    self._commit(step, results, buf.header)  # type: ignore[union-attr]
                    committed = True
                except Exception as exc:  # noqa: BLE001
                    error = f"commit failed: {type(exc).__name__}: {exc}"
            else:
                error = "; ".join(f"rank {i}: {r['error']}" for i, r in enumerate(results) if not r["ok"])
        outcome = self.comm.broadcast_json({"committed": committed, "error": error}, persist=True)
        with self._lock:
            if self._abandoned:
                return bool(outcome["committed"])
            if buf is not None:
                buf.state = READY
            if outcome["committed"]:
                buf.persisted = True
                self._has_base = True
                self._last_persisted_step = step
                for layer, experts in buf.header["selection"].items():
                    self.plt_tracker.mark_saved("persist", layer, experts, cum=buf.header["plt"]["cum"][layer])
            else:
                self._persist_failures += 1
                self._last_error = outcome["error"]
        if outcome["committed"]:
            log.info("rank %d step %d: checkpoint persisted to %s", self.rank, step, self.store.store.url)
        else:
            log.warning("rank %d step %d: persist failed, snapshot kept in memory: %s",
                        self.rank, step, outcome["error"])
        return bool(outcome["committed"])

    def _write_share(self, buf: SnapshotBuffer) -> dict[str, Any]:
        header = buf.header  # type: ignore[attr-defined]
        writer = self.store.writer(header["step"], f"r{self.rank}")
        out = {}
        for piece in header["pieces"]:
            if not piece["persist"]:
                continue
            name = piece["unit"]
            u = header["units"][name]
            view = buf.view(piece["offset"], piece["end"] - piece["start"])
            chunk = writer.add_bytes([view], offset=piece["start"], itemsize=u["itemsize"],
                                     group="experts" if u["kind"] == "expert" else "state")
            out[name] = {"chunk": chunk.to_json(), **{k: u[k] for k in ("kind", "layer", "expert", "unit_nbytes",
                                                                          "skeleton", "tensors")}}
        writer.finish()
        return out

    def _commit(self, step: int, results: list[dict[str, Any]], header: dict[str, Any]) -> None:
        merged: dict[str, dict[str, Any]] = {}
        for r in results:
            for name, u in r["units"].items():
                entry = merged.setdefault(name, dict(u, chunks=[]))
                entry["chunks"].append(ChunkRecord.from_json(u["chunk"]))
        for name, u in merged.items():
            pos = 0
            for c in sorted(u["chunks"], key=lambda c: c.offset):
                if c.offset != pos:
                    break
                pos += c.nbytes
            if pos != int(u["unit_nbytes"]):
                raise RuntimeError(f"step {step}: the ranks' chunks of {name} cover {pos} of its "
                                   f"{u['unit_nbytes']} bytes; not committing an incomplete checkpoint")
        records = [
            UnitRecord(name=name, kind=u["kind"], step=step, nbytes=int(u["unit_nbytes"]), skeleton=u["skeleton"],
                       tensors=u["tensors"], chunks=sorted(u["chunks"], key=lambda c: c.offset),
                       layer=u["layer"], expert=u["expert"])
            for name, u in merged.items()
        ]
        plt = PLTTracker(self.num_experts, self.cfg.top_k)
        plt.load_state(header["plt"])
        for layer, experts in header["selection"].items():
            plt.mark_saved("persist", layer, experts)
        base = self._base
        if base is None:
            base = self.store.latest_manifest()
        self._base = self.store.commit(step, records, base=base, plt=plt.state(), meta=header["meta"])

    # -- adaptive configuration ----------------------------------------------------------
    def _tune(self) -> None:
        step_time = sorted(self._step_times)[len(self._step_times) // 2] if self._step_times else None
        if self.cfg.k_snapshot == "auto" and step_time and self._snapshot_seconds:
            # Largest K whose copy fits in one forward+backward (copy time ~ linear in K).
            per_expert = self._snapshot_seconds / max(1, self._snapshotted_experts())
            e_min = min(self.num_experts.values())
            fit = int(step_time / max(per_expert * len(self.num_experts), 1e-9))
            k = max(self.k_persist, min(e_min, fit))
            k = int(self.comm.broadcast_json(k))
            self.k_snapshot = max(k, 1)
        if self.cfg.interval == "auto" and step_time and self._save_overhead is not None:
            self.interval = int(self.comm.broadcast_json(self.young_daly_interval(step_time)))

    def _snapshotted_experts(self) -> int:
        return sum(min(self.k_snapshot, n) for n in self.num_experts.values()) if self._checkpoints > 1 else \
            sum(self.num_experts.values())

    def young_daly_interval(self, step_time: float) -> int:
        """Steps between checkpoints: I* = sqrt(2 * save_overhead / failure_rate)."""
        elapsed = max(time.time() - self._started, 1.0)
        observed = self._recoveries / elapsed if self._recoveries else 0.0
        rate = max(observed, 1.0 / self.cfg.mtbf.total_seconds())
        seconds = math.sqrt(2.0 * max(self._save_overhead or 0.0, 1e-6) / rate)
        return int(min(max(1, round(seconds / max(step_time, 1e-9))), 100_000))

    # -- waiting, flushing, closing ------------------------------------------------------
    def wait(self, *, flush: bool = True) -> None:
        """Block until the newest snapshot is in storage; raise if it cannot be written.

        ``flush=False`` only waits for work already under way: the snapshot copy in
        flight and the persist in flight (a memory-only snapshot stays memory-only). That
        form is local to this rank; the flushing form is collective under
        torch.distributed (every rank decides the flush together)."""
        self._wait_snapshot()
        if not flush:
            fut = self._persist
            if fut is not None:
                fut.result(timeout=self.cfg.persist_timeout.total_seconds())
                self._reap_persist()
            return
        deadline = time.monotonic() + self.cfg.persist_timeout.total_seconds()
        while True:
            fut = self._persist
            if fut is not None:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
                self._reap_persist()
            newest = self.pool.newest_complete()
            if newest is None or newest.persisted:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"checkpoint of step {newest.step} not persisted within {self.cfg.persist_timeout}: "
                                   f"{self._last_error}")
            before = self._persist_failures
            self._maybe_persist("flush")
            if self._persist is not None:
                self._persist.result(timeout=max(0.0, deadline - time.monotonic()))
                self._reap_persist()
            if self._persist_failures > before and time.monotonic() >= deadline:
                raise OSError(f"checkpoint of step {newest.step} could not be persisted: {self._last_error}")
            if self._persist_failures > before:
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _on_sigterm(self, signum, frame) -> None:
        self._sigterm = True
        log.warning("rank %d: SIGTERM received; flushing the newest snapshot at the next step", self.rank)
        if not self.comm.distributed and self._last_step is not None and not self._closed:
            self._flush_and_exit()

    def _flush_and_exit(self) -> None:
        log.warning("rank %d step %s: flushing the newest snapshot before exit", self.rank, self._last_step)
        try:
            self.wait()
        finally:
            self.close(keep_snapshots=True, raise_errors=False)
            raise SystemExit(128 + signal.SIGTERM)

    def close(self, *, keep_snapshots: bool = False, raise_errors: bool = True, flush: bool = True) -> None:
        """Persist the newest snapshot (``flush``), stop the workers, release the hook and
        the SIGTERM handler; remove the shared-memory buffers unless ``keep_snapshots``."""
        if self._closed:
            return
        try:
            self.wait(flush=flush)
            if flush and self._consecutive_failures:
                raise CheckpointError(
                    f"rank {self.rank} step {self._last_step}: the last {self._consecutive_failures} snapshot(s) "
                    f"failed; the newest persisted state is step {self._last_persisted_step}: {self._last_error}"
                ) from self._last_snapshot_error
        except Exception:
            if raise_errors:
                raise
            log.exception("rank %d: final persist failed", self.rank)
        finally:
            self._closed = True
            if self._hook is not None:
                self._hook.remove()
            self._taps.remove()
            if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._old_sigterm)
            self._snap_exec.shutdown(wait=True)
            self._persist_exec.shutdown(wait=True)
            if not keep_snapshots:
                self.pool.remove_files()

    # -- reporting -----------------------------------------------------------------------
    def snapshot_state(self) -> tuple[int, dict[str, Any]] | None:
        """(step, {unit: tree}) of this rank's newest complete in-memory snapshot; units
        split with other ranks hold only this rank's bytes and are left out."""
        self._wait_snapshot()
        with self._lock:
            buf = self.pool.newest_complete()
        if buf is None:
            return None
        trees = {}
        for piece in buf.header["pieces"]:
            u = buf.header["units"][piece["unit"]]
            if piece["start"] != 0 or piece["end"] != u["unit_nbytes"]:
                continue
            data = bytearray(buf.view(piece["offset"], piece["end"] - piece["start"]))
            trees[piece["unit"]] = decode_tree(u["skeleton"], [TensorMeta.from_json(t) for t in u["tensors"]], data)
        return buf.step, trees


    def plt(self) -> float:
        """Proportion of lost tokens over all recoveries so far."""
        with self._lock:
            return self.plt_tracker.value()

    def status(self) -> dict[str, Any]:
        busy = self._persist is not None and not self._persist.done()
        with self._lock:
            return {
                "rank": self.rank, "world": self.world, "step": self._last_step,
                "last_snapshot_step": self._last_snapshot_step, "last_persisted_step": self._last_persisted_step,
                "persist_in_flight": busy, "persist_failures": self._persist_failures, "last_error": self._last_error,
                "snapshot_failures": self._snapshot_failures, "consecutive_snapshot_failures": self._consecutive_failures,
                "layout": self.layout_info["description"],
                "k_snapshot": self.k_snapshot, "k_persist": self.k_persist, "interval": self.interval,
                "stall_seconds_last": self._stall_last, "stall_seconds_total": self._stall_total, "stalls": self._stalls,
                "step_call_seconds_last": self._step_call_last, "step_call_seconds_total": self._step_call_total,
                "blocked_seconds_total": self._stall_total + self._step_call_total,
                "snapshot_seconds": self._snapshot_seconds, "buffer_bytes": self.pool.allocated_bytes(),
                "plt": self.plt_tracker.value(), "plt_snapshot": self.plt_tracker.value("snapshot"),
                "plt_persist": self.plt_tracker.value("persist"), "recoveries": self._recoveries,
            }

