"""Exact mode (``MoCConfig(exact=True)``): sparse checkpoints that lose no tokens.

Every step (``step(t)``, right after ``optimizer.step()``) captures, per the window
schedule (:mod:`moc._exact.schedule`), the full state of the units whose slot is now and
the compute weights of the units whose full capture is later, plus the extra state
(RNG, optimizer hyper-parameters, the user's ``extra_state``). The copies go into one of
the three shared-memory buffers of :mod:`moc._snapshot.buffers` (one buffer holds one window, filled
step by step, reserved and leased by its rules) on a background thread; the optimizer's
step pre-hook waits for it (the stall). On CUDA the copies run on :mod:`moc._cuda`'s side
streams behind an event recorded after ``optimizer.step()``, issued from ``step()`` into a
page-locked buffer, and the next update waits for them on the device, not the host; the
settings bit-exact replay needs there are checked (:mod:`moc._exact.determinism`). A
window's header is published once its last step is copied: an incomplete window is never read.

Several ranks (plain replicas, FSDP2 / DTensor shards, expert parallelism): each rank
captures and replays the pieces it holds (its units, named as everywhere in moc: FQN plus
a piece suffix for a shard). The ranks meet once per window, at its first step, in one
all-reduce (:meth:`ExactCheckpointer._round`): a window is opened only when every rank
has a buffer for it (else every rank skips it and tries again at the next step), the
previous window *counts* only when every rank completed it, a SIGTERM or too many failed
windows on any rank stop every rank, and the persist of a window (the first counted one,
then every ``persist_every``-th) starts on every rank together: each rank writes its part,
rank 0 commits one manifest for the window (:mod:`moc._exact.store`) and tells the others.

Recovery (:meth:`ExactCheckpointer.restore`, collective) loads the newest window complete
on every rank (from memory, else storage) and returns its first step + 1; the user's loop
then *replays* the window:

* at restore, every unit of slot 0 gets its full state, every other unit its compute
  weights of the window's first step; the extra state of that step is restored;
* after each replayed ``optimizer.step()`` (``step(t)``) the units of slot ``t - start``
  are promoted (weights and optimizer state), the others get their compute weights of
  step ``t``, and the RNG is set to what it was after step ``t``;
* every parameter computes its gradient as the first time (global-norm clipping sees the
  same norm); the updates of units not promoted yet are overwritten before they are read.

After the window's last step the model and optimizer equal an uninterrupted run's (bit for
bit on CPU). The gradients of the window's second step are hashed, on every rank, when it
is first trained and again when it is replayed: a loop that feeds other data (or other
code) on replay is stopped there with :class:`moc.CheckpointError`, before its update, on
every rank (the ranks OR their verdicts in one all-reduce, so none is left waiting).

``restore(reshard=True)`` (a window restored by unit name onto other ranks or another
placement) and the hand-over between the managers of an elastic job: :meth:`restore`,
:meth:`detach` and :meth:`adopt` here, over :mod:`moc._exact.elastic`'s typed handover
and resharded read.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import torch
import xxhash

from .._config import MoCConfig
from .._daemon import DaemonExecutor
from .._dist import Comm
from .._errors import CheckpointError
from .._run_state import RunState
from .._snapshot import FREE, PERSIST, READY, BufferPool, SnapshotBuffer
from .._store import CheckpointStore, TreePlan, UnitRecord, plan_tree
from .._together import tick_seconds, wait_together
from .._units import UnitLayout, UnitPlans
from .._units.capture import _clone_all, apply_partial, apply_units, restore_rng
from .copies import CaptureCopies
from .determinism import check_replay_settings, on_cuda
from .elastic import ExactHandover, read_window_resharded
from .loading import WindowLoader
from .schedule import ExactSchedule, plan_schedule
from .state import Replay as _Replay, Round as _Round, Window as _Window, digest_key, grad_digest, grad_digest_later, \
    window_steps
from .store import extra_name, rank_meta, weights_name, window_meta, write_part

__all__ = ["ExactCheckpointer", "grad_digest", "weights_name", "extra_name"]

log = logging.getLogger("moc")

FORMAT = 2

# Slots of the window round's all-reduce (counts over ranks), then each rank's persist candidate.
_NO_BUFFER, _PREV_FAILED, _SIGTERM, _BUSY, _FATAL = range(5)
_FIXED = 5


class ExactCheckpointer:
    """The exact-mode protocol of one :class:`moc.CheckpointManager` (one rank of it).

    Args:
        cfg: the manager's configuration (``exact=True``).
        model, optimizer: what is captured and restored (this rank's part).
        layout: this rank's units.
        plans: the manager's unit plans (full state: weights and optimizer state).
        pool: this rank's shared-memory buffers.
        store: the persistent store.
        run: the shared run bookkeeping (lock, rank, step).
        comm: the manager's collectives (rounds, the persist thread's gathers).
        shared: units that other ranks hold too (stored once per holder).
        extra_tree: the manager's extra unit of a step (RNG, optimizer groups, user state).
        extra_state: the user's objects restored from it.
    """

    def __init__(self, cfg: MoCConfig, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 layout: UnitLayout, plans: UnitPlans, pool: BufferPool, store: CheckpointStore, run: RunState,
                 extra_tree: Callable[[int], dict[str, Any]], extra_state: Mapping[str, Any],
                 comm: Comm | None = None, shared: set[str] | None = None) -> None:
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.layout = layout
        self.plans = plans
        self.wplans = UnitPlans(model, None, layout)   # compute weights only
        self.pool = pool
        self.store = store
        self.run = run
        self.comm = comm if comm is not None else Comm()
        self.shared = set(shared or ())
        self.extra_tree = extra_tree
        self.extra_state = extra_state
        self._load = WindowLoader(layout=layout, pool=pool, store=store, run=run, comm=self.comm,
                                  shared=self.shared)   # the windows a restore can read
        self._capture = ThreadPoolExecutor(1, thread_name_prefix=f"moc-exact-r{run.rank}")
        # Daemon threads: a persist stuck on storage never holds up the process's exit.
        self._persist = DaemonExecutor(f"moc-exact-persist-r{run.rank}")
        self._io = DaemonExecutor(f"moc-exact-io-r{run.rank}")
        self.in_flight: Future | None = None
        self.persist_in_flight: Future | None = None
        self.window: _Window | None = None
        self.replay: _Replay | None = None
        self.expected: int | None = None           # the step the next step() must carry
        self.next_open: int | None = None          # the step of the next round (None: the next step)
        self.opened: int | None = None             # first step of the window opened at the last round
        self.completed: SnapshotBuffer | None = None   # buffer of the newest window completed here
        # newest counted window due for storage and not in it yet: (its buffer, its last step)
        self.due: tuple[SnapshotBuffer, int] | None = None
        self.windows_started = 0
        self.windows_complete = 0                  # completed on this rank
        self.windows_counted = 0                   # completed on every rank (persist_every counts these)
        self.windows_persisted = 0
        self.windows_skipped = 0                   # no buffer (on some rank) at a window's first step
        self.windows_failed = 0
        self.consecutive_failures = 0
        self.last_exception: BaseException | None = None
        self.last_window: dict[str, Any] | None = None    # {"start", "end", "bytes", "step_bytes", "buffer"}
        self.last_persisted_step: int | None = None
        self.persist_failures = 0
        self.stall_last = 0.0
        self.stall_total = 0.0
        self.last_step_bytes = 0
        self.replays = 0
        self.replayed_steps = 0
        self.last_replay: dict[str, Any] | None = None    # {"start", "end", "source": "memory" | "storage"}
        self.rounds = 0
        self.interrupted_replay = False            # the manager this one replaces was replaying (adopt)
        self.copies = CaptureCopies(pool, run.where)     # on the host, or on CUDA side streams
        self._check_device()

    def _check_device(self) -> None:
        """On CUDA, refuse to capture without the settings bit-exact replay needs
        (:mod:`moc._exact.determinism`)."""
        if on_cuda(self.model.parameters()):
            check_replay_settings(self.run.where())

    # -- capture ---------------------------------------------------------------------------
    def step(self, t: int, *, sigterm: bool = False) -> bool:
        """After ``optimizer.step()`` of step ``t``: capture (or, while replaying, promote).
        Returns True when the ranks agreed to flush and exit (a SIGTERM on some rank)."""
        self._settle()
        if not self.comm.distributed:
            self._retry_due()
        if self.replay is not None:
            self._replay_step(t)
            return False
        if self.expected is not None and t != self.expected:
            expected = self.expected
            self._abort_window("a step was left out")
            raise CheckpointError(
                f"{self.run.where()}: exact mode needs step() after every optimizer.step(), steps in order: "
                f"expected step {expected}, got {t}")
        self.expected = t + 1
        if self.next_open is None or t == self.next_open:
            if self._open_window(t, sigterm):
                return True
        if self.window is not None:
            self._capture_step(t)
        return False

    def _sizes(self) -> tuple[dict[str, TreePlan], dict[str, TreePlan]]:
        return self.plans.refresh(), self.wplans.refresh()

    def _k_snapshot(self) -> int | None:
        k = self.cfg.k_snapshot
        assert not isinstance(k, str)       # never "auto" with exact=True (MoCConfig._check_exact)
        return k

    def _candidate(self, reserved: SnapshotBuffer | None, due_new: bool) -> SnapshotBuffer | None:
        """The window this rank would persist now: the one just completed when it is due,
        else the newest counted due one still in memory and not in storage."""
        if due_new:
            buf = self.completed
        else:
            buf = self.due[0] if self.due is not None and self.due[0].step == self.due[1] else None
        with self.run.lock:
            if buf is None or buf is reserved or buf.state != READY or buf.persisted or buf.step is None \
                    or not buf.header.get("exact"):
                return None
            if self.last_persisted_step is not None and buf.step <= self.last_persisted_step:
                return None
        return buf

    def _open_window(self, t: int, sigterm: bool) -> bool:
        """The round at a window's first step (see the module docstring); opens the window
        when every rank has a buffer. Returns True when the ranks agreed to exit."""
        self._reap_persist()
        full, weights = self._sizes()
        self._check_device()
        self.copies.refresh(src for p in full.values() for src in p.sources)
        schedule = plan_schedule(self.layout, self._k_snapshot(), {u: p.nbytes for u, p in full.items()},
                                 {u: p.nbytes for u, p in weights.items()})
        extra = plan_tree(self.extra_tree(t)).nbytes + 64
        need = sum(schedule.step_bytes({u: p.nbytes + 64 for u, p in full.items()},
                                       {u: p.nbytes + 64 for u, p in weights.items()}, extra))
        with self.run.lock:
            buf = self.pool.reserve(need)
        reason = "every snapshot buffer is being persisted, read or holds the newest complete window"
        if buf is not None:
            try:
                # CUDA: a buffer that grows is mapped anew and not page-locked until its window ends
                # (the copies fall back to the capture thread): one that must grow gets 1/8 headroom
                # for the extra state (routing history, the user's) to grow in
                pin = self.copies.pin_device()
                grow = pin is not None and buf.capacity < need
                buf.ensure(need + need // 8 if grow else need, pin=pin, defer_upkeep=True)
            except (OSError, RuntimeError) as exc:
                with self.run.lock:
                    self.pool.unreserve()
                buf, reason = None, f"{type(exc).__name__}: {exc}"
        prev = self.opened
        prev_ok = prev is not None and self.completed is not None and self.last_window is not None \
            and self.last_window["start"] == prev
        due_new = prev_ok and self.windows_counted % self.cfg.persist_every == 0
        cand = self._candidate(buf, due_new)
        agreed = self._round(no_buffer=buf is None, prev_failed=prev is not None and not prev_ok, sigterm=sigterm,
                             fatal=self.consecutive_failures >= self.cfg.max_consecutive_failures,
                             candidate=None if cand is None else cand.step)
        if prev is not None and not agreed.prev_failed:
            self.windows_counted += 1
            if due_new:
                assert self.completed is not None and self.completed.step is not None
                self.due = (self.completed, self.completed.step)
        elif prev is not None:
            log.warning("%s: the exact window from step %d is not complete on every rank; it does not count",
                        self.run.where(), prev)
        self.opened = None
        if agreed.persist is not None and cand is not None and cand.step == agreed.persist:
            if self.due is not None and self.due[1] <= cand.step:
                self.due = None
            self._start_persist(cand)
        if agreed.fatal or agreed.sigterm or agreed.no_buffer:
            if buf is not None:
                with self.run.lock:
                    self.pool.unreserve()
        if agreed.fatal:
            raise CheckpointError(
                f"{self.run.where()}: {self.cfg.max_consecutive_failures} exact windows in a row failed on "
                f"{'this rank' if self.consecutive_failures >= self.cfg.max_consecutive_failures else 'another rank'}"
                f"; the newest complete window ends at step {(self.last_window or {}).get('end')}: "
                f"{self.last_exception}") from self.last_exception
        if agreed.sigterm:
            return True
        if agreed.no_buffer:
            self.next_open = t + 1
            self._skip(t, reason if buf is None else "no snapshot buffer on another rank (see its log)")
            return False
        assert buf is not None
        with self.run.lock:
            self.pool.acquire(buf)      # header withdrawn, state SNAPSHOT, leased until the window ends
        self.windows_started += 1
        self.window = _Window(start=t, schedule=schedule, buf=buf, index=self.windows_started)
        self.opened = t
        self.next_open = t + schedule.window
        return False

    def _round(self, *, no_buffer: bool, prev_failed: bool, sigterm: bool, fatal: bool,
               candidate: int | None) -> _Round:
        """One int64 all-reduce (SUM; per-rank candidates in per-rank slots)."""
        world, rank = self.comm.world, self.comm.rank
        v = torch.zeros(_FIXED + world, dtype=torch.int64)
        v[_NO_BUFFER], v[_PREV_FAILED], v[_SIGTERM], v[_FATAL] = int(no_buffer), int(prev_failed), int(sigterm), \
            int(fatal)
        v[_BUSY] = int((self.persist_in_flight is not None and not self.persist_in_flight.done())
                       or not self._io.idle)
        v[_FIXED + rank] = -1 if candidate is None else candidate
        self.comm.sum_int64(v)
        self.rounds += 1
        cands = set(v[_FIXED:].tolist())
        persist = cands.pop() if len(cands) == 1 and v[_BUSY] == 0 else None
        return _Round(no_buffer=bool(v[_NO_BUFFER]), prev_failed=bool(v[_PREV_FAILED]), sigterm=bool(v[_SIGTERM]),
                      fatal=bool(v[_FATAL]), persist=persist if persist is not None and persist >= 0 else None)

    def _skip(self, t: int, reason: str) -> None:
        self.windows_skipped += 1
        self.run.last_error = f"exact window at step {t} skipped: {reason}"
        log.warning("rank %d step %d: exact window not started (%d so far): %s", self.run.rank, t,
                    self.windows_skipped, reason)

    def _capture_step(self, t: int) -> None:
        w = self.window
        assert w is not None
        i = t - w.start
        full, weights = self._sizes()
        params = set(dict(self.model.named_parameters()))
        items: list[tuple[str, str, TreePlan, Any]] = []
        for u in w.schedule.full_at(i):
            items.append(("full", u, full[u], self.layout.units[u]))
        for u in w.schedule.weights_at(i):
            items.append(("weights", u, weights[u], self.layout.units[u]))
        items.append(("extra", extra_name(t), plan_tree(self.extra_tree(t)), None))
        nbytes = sum(p.nbytes for _, _, p, _ in items)
        if w.offset + nbytes > w.buf.capacity:
            remaining = sum(w.step_bytes[-1:] or [nbytes]) * (w.schedule.window - i - 1)
            try:
                w.buf.ensure(w.offset + nbytes + remaining, pin=self.copies.pin_device(),
                             defer_upkeep=True)   # grows; the file keeps its bytes
            except (OSError, RuntimeError) as exc:
                self._failed(RuntimeError(f"the buffer cannot grow: {type(exc).__name__}: {exc}"))
                return
        placed = []
        for what, name, plan, spec in items:
            placed.append((what, name, plan, spec, w.offset))
            w.offset += plan.nbytes
        w.step_bytes.append(nbytes)
        self.last_step_bytes = nbytes
        # Tensors the next forward may change in place (module buffers, the extra state's
        # live tensors) are copied now; parameters and optimizer state in the background.
        sync = [e for e in placed if e[0] == "extra" or (e[3] is not None and any(k not in params for k in e[3].keys))]
        done_now = {id(e) for e in sync}
        later = [e for e in placed if id(e) not in done_now]
        last = i == w.schedule.window - 1
        # CUDA: on side streams behind this step's update, issued now into a page-locked buffer
        batch, issued, later = self.copies.issue(w.buf, w.offset, sync, later)
        self.in_flight = self._capture.submit(self._fill, w, t, placed, later, last, batch, issued)

    def _fill(self, w: _Window, t: int, placed, later, last: bool, batch=None, issued: bool = False) -> None:
        buf = w.buf
        self.copies.land(buf, batch, issued, later)
        for what, name, plan, spec, off in placed:
            w.pieces.append({
                "what": what, "step": t, "unit": name, "offset": off, "nbytes": plan.nbytes,
                "kind": "extra" if spec is None else spec.kind, "layer": getattr(spec, "layer", None),
                "expert": getattr(spec, "expert", None), "skeleton": plan.skeleton,
                "tensors": [m.to_json() for m in plan.tensors], "itemsize": plan.itemsize,
                "checksum": "xxh3:" + xxhash.xxh3_64_hexdigest(buf.view(off, plan.nbytes))})
        if not last:
            return
        header = {"run": self.run.run_id, "rank": self.run.rank, "world": self.run.world, "step": w.end,
                  "exact": {"format": FORMAT, "start": w.start, "window": w.schedule.window,
                            "slots": w.schedule.slots, "grad": None if w.grad is None else w.grad.result(),
                            "step_bytes": w.step_bytes},
                  "pieces": w.pieces}
        with self.run.lock:
            if self.run.abandoned:
                raise RuntimeError("exact window abandoned: the manager was closed")
            buf.publish(header)
            buf.step, buf.header, buf.state, buf.persisted = w.end, header, READY, False
            buf.start_upkeep()      # page-lock a created or grown buffer (CUDA) now that no copy writes into it
        self.pool.release(buf)

    def _settle(self) -> None:
        """Wait for the capture in flight; book a finished window (local)."""
        fut, self.in_flight = self.in_flight, None
        if fut is not None:
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - counted; raised (on every rank) at the next round
                self._failed(exc)
            else:
                w = self.window
                if w is not None and w.buf.state == READY and w.buf.step == w.end:
                    self._window_done(w)
        self._reap_persist()

    def _window_done(self, w: _Window) -> None:
        self.window = None
        self.windows_complete += 1
        self.consecutive_failures = 0
        self.completed = w.buf
        self.last_window = {"start": w.start, "end": w.end, "window": w.schedule.window, "bytes": w.offset,
                            "step_bytes": list(w.step_bytes), "buffer": w.buf.index}
        log.info("rank %d step %d: exact window %d-%d complete here (%d bytes in buffer %d)", self.run.rank, w.end,
                 w.start, w.end, w.offset, w.buf.index)

    def _failed(self, exc: BaseException) -> None:
        self.windows_failed += 1
        self.consecutive_failures += 1
        self.last_exception = exc
        self.run.last_error = f"exact capture failed: {type(exc).__name__}: {exc}"
        log.error("%s: exact capture failed (%d in a row): %s", self.run.where(), self.consecutive_failures, exc)
        self._abort_window(str(exc))

    def _abort_window(self, reason: str) -> None:
        """Drop the window being captured here (the ranks' schedule of rounds goes on)."""
        w, self.window = self.window, None
        if w is None:
            return
        with self.run.lock:
            w.buf.invalidate()
            w.buf.state = FREE
        self.pool.release(w.buf)
        log.warning("rank %d step %d: exact window from step %d dropped: %s", self.run.rank,
                    self.run.last_step if self.run.last_step is not None else -1, w.start, reason)

    def before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """The optimizer step pre-hook: wait for the capture in flight (the stall); hash the
        gradients of a window's second step (recorded, or checked while replaying: the
        ranks' verdicts are ORed, so a divergence on any rank stops every rank here)."""
        fut = self.in_flight
        if self.copies.order_update():     # on the device: the host does not wait
            self.stall_last = 0.0
        elif fut is not None and not fut.done():
            t0 = time.perf_counter()
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - booked by _settle at the next step()
                pass
            self.stall_last = time.perf_counter() - t0
            self.stall_total += self.stall_last
        else:
            self.stall_last = 0.0
        r = self.replay
        if r is not None:
            if r.next == r.start + 1 and not r.checked:
                r.checked = True
                kind = "xxh3" if r.grad is None else digest_key(r.grad)
                got = grad_digest(self.model, kind) if r.grad is not None else None     # one host read
                mine = got is not None and r.grad is not None and got[kind] != r.grad[kind]
                anywhere = self.comm.any_true(mine)
                if mine:
                    assert got is not None and r.grad is not None     # both digests, or mine is False
                    raise CheckpointError(
                        f"rank {self.run.rank} step {r.next}: replay diverged: the gradients of replayed step "
                        f"{r.next} differ from those recorded when it was trained ({kind} {r.grad[kind]}, global "
                        f"norm {r.grad['norm']:.6g}; now {kind} {got[kind]}, norm {got['norm']:.6g}). Exact replay "
                        "needs the same batch at every step (a function of the step, or a data loader passed in "
                        "extra_state) and the same model code; moc restores the RNG. Nothing was updated.")
                if anywhere:
                    raise CheckpointError(
                        f"rank {self.run.rank} step {r.next}: replay diverged on another rank (see its error): its "
                        "gradients differ from those recorded when the step was trained. Nothing was updated.")
            return
        w = self.window
        if w is not None and w.grad is None and self.expected == w.start + 1 and w.schedule.window > 1:
            w.grad = grad_digest_later(self.model)     # on the device on CUDA; read by the capture thread

    # -- persisting ------------------------------------------------------------------------
    def _reap_persist(self) -> None:
        """Book a finished persist (errors are counted and reported, never raised here)."""
        fut = self.persist_in_flight
        if fut is None or not fut.done():
            return
        self.persist_in_flight = None
        try:
            fut.result()
        except Exception as exc:  # noqa: BLE001 - reported, retried with a later window
            self.persist_failures += 1
            self.run.last_error = f"exact persist failed: {type(exc).__name__}: {exc}"
            log.error("%s: persisting the exact window failed: %s", self.run.where(), exc)

    def _retry_due(self) -> None:
        """One process: a due window that found the persist thread busy at its round is
        written as soon as the thread is free (several ranks retry at the next round)."""
        if self.due is None or self.persist_in_flight is not None:
            return
        buf = self._candidate(None, False)
        self.due = None
        if buf is not None:
            self._start_persist(buf)

    def _start_persist(self, buf: SnapshotBuffer) -> None:
        """Persist the window in ``buf`` (every rank starts the same window: agreed)."""
        with self.run.lock:
            buf.state = PERSIST
            buf.users += 1
        self.persist_in_flight = self._persist.submit(self._write, buf)

    def _write(self, buf: SnapshotBuffer) -> None:
        """This rank's part to storage; the ranks' records to rank 0, which commits and tells
        every rank the outcome (the gathers run whatever failed, so no rank is left waiting).
        The storage I/O runs on the I/O thread while the persist threads meet every tick
        (:func:`moc._together.wait_together`): no collective ever waits on storage."""
        try:
            header = buf.header
            step = int(header["step"])
            tick = tick_seconds(self.cfg.coordination_timeout)
            io = self._io.submit(self._write_part_io, buf, header)
            wait_together(self.comm, io, tick=tick, rank=self.run.rank, step=step, doing="writing its part")
            error, records = io.result()
            mine = {"step": step, "error": error, "meta": rank_meta(header),
                    "records": {r.name: r.to_json() for r in records}}
            parts = self.comm.gather_json(mine, persist=True)
            commit: Future = Future()
            if self.run.rank == 0:
                errors = [p["error"] for p in parts if p["error"]]
                if {p["step"] for p in parts} != {step}:
                    errors.append(f"the ranks wrote different windows: {[p['step'] for p in parts]}")
                if errors:
                    commit.set_result("; ".join(errors))
                else:
                    commit = self._io.submit(self._commit_io, step, header, parts)
            else:
                commit.set_result(None)
            wait_together(self.comm, commit, tick=tick, rank=self.run.rank, step=step, doing="committing")
            outcome = self.comm.broadcast_json(commit.result(), persist=True)
            if outcome:
                raise CheckpointError(f"the exact window ending at step {step} was not committed: {outcome}")
            with self.run.lock:
                buf.persisted = True
                self.last_persisted_step = step
                self.windows_persisted += 1
        finally:
            with self.run.lock:
                if buf.state == PERSIST:
                    buf.state = READY
                buf.users = max(0, buf.users - 1)

    def _write_part_io(self, buf: SnapshotBuffer, header: dict[str, Any]) -> tuple[str | None, list[UnitRecord]]:
        """I/O thread: this rank's part, under its own lease on ``buf``."""
        with self.pool.lease(buf):
            try:
                return None, write_part(self.store, buf, header, self.run.rank, self.shared)
            except Exception as exc:  # noqa: BLE001 - reported to rank 0, which commits nothing
                return f"rank {self.run.rank}: {type(exc).__name__}: {exc}", []

    def _commit_io(self, step: int, header: dict[str, Any], parts: list[dict[str, Any]]) -> str | None:
        """I/O thread, rank 0: one manifest for the window; the error, if any."""
        try:
            recs = [UnitRecord.from_json(n, d) for p in parts for n, d in p["records"].items()]
            self.store.commit(step, recs, meta={"run_id": header["run"], "world": self.comm.world,
                                                "exact": window_meta(header, [p["meta"] for p in parts])})
            return None
        except Exception as exc:  # noqa: BLE001 - told to every rank
            return f"commit: {type(exc).__name__}: {exc}"

    def wait(self, *, flush: bool = True, timeout: float | None = None) -> None:
        """Wait for the capture and persist in flight (local); ``flush``: also write the
        newest window complete on every rank if it is in memory only (collective; raises
        on every rank if that fails)."""
        self._settle()
        fut = self.persist_in_flight
        if fut is not None:
            fut.exception(timeout)
            self._reap_persist()
        if not flush:
            return
        with self.run.lock:
            mine = sorted(b.step for b in self.pool.buffers if b.step is not None and b.state == READY
                          and b.header.get("exact") and b.header.get("run") == self.run.run_id)
        common = set(mine)
        for other in self.comm.gather_json(mine):
            common &= set(other)
        if not common:
            return
        step = max(common)
        if self.last_persisted_step is not None and step <= self.last_persisted_step:
            return
        buf = next(b for b in self.pool.buffers if b.step == step and b.state == READY)
        if self.due is not None and self.due[1] <= step:
            self.due = None
        self._start_persist(buf)
        fut, self.persist_in_flight = self.persist_in_flight, None
        assert fut is not None      # _start_persist just set it
        try:
            fut.result(timeout)
        except Exception as exc:
            self.persist_failures += 1
            raise CheckpointError(f"{self.run.where()}: persisting the exact window failed: {exc}") from exc

    def shutdown(self, *, wait: bool = True) -> None:
        self._capture.shutdown(wait=wait)
        self._persist.shutdown(wait=wait, timeout=30.0)
        self._io.shutdown(wait=wait, timeout=30.0)
        r, self.replay = self.replay, None
        if r is not None and r.lease is not None:
            self.pool.release(r.lease)

    # -- recovery --------------------------------------------------------------------------
    def restore(self, *, reshard: bool = False) -> int:
        """Load the newest window complete on every rank and start its replay; return the
        next step to run (the window's first step + 1), 0 when nothing is stored.
        ``reshard``: the newest window committed to storage, each unit read by name
        whatever ranks wrote it (:mod:`moc._exact.reshard`). Collective: every rank calls it."""
        self._settle()
        self._abort_window("restore")
        if self.persist_in_flight is not None:
            self.persist_in_flight.exception()
            self._reap_persist()
        manifest = self._load.storage_manifest()
        # every rank reads the manifest rank 0 found (a listing is never trusted to agree)
        step = self.comm.broadcast_json(None if manifest is None else manifest.step)
        if step is None:
            manifest = None
        elif manifest is None or manifest.step != step:
            manifest = self.store.read_manifest(step)
        if reshard:
            return 0 if manifest is None else self._restore_resharded(manifest)
        memory = self._load.memory_candidates()
        if manifest is not None:
            memory = [h for h in memory if h.get("run") == manifest.meta.get("run_id")]
        chosen = self._load.agree_memory(memory)
        replay, problem = None, None
        if chosen is not None and (manifest is None or chosen["step"] >= manifest.step):
            try:
                replay = self._load.from_memory(chosen)
            except (OSError, ValueError, KeyError) as exc:
                problem = exc
                log.warning("rank %d: the exact window in memory (step %d) is unusable (%s)", self.run.rank,
                            chosen["step"], exc)
            if self.comm.any_true(replay is None):
                if replay is not None:
                    self._load.drop(replay)
                    replay = None
                log.warning("rank %d: the exact window in memory (step %d) is not usable on every rank%s; "
                            "reading storage", self.run.rank, chosen["step"], f" ({problem})" if problem else "")
        if replay is None and manifest is not None:
            error = None
            try:
                replay = self._load.from_storage(manifest)
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                error = exc
            if self.comm.any_true(error is not None):
                if replay is not None:
                    self._load.drop(replay)
                if error is not None:
                    raise error
                raise CheckpointError(f"{self.run.where()}: another rank could not read its part of the exact "
                                      f"window at step {manifest.step} (see its error)")
        if replay is None:
            return 0
        if replay.source == "memory":
            assert chosen is not None       # a replay from memory is the chosen window's
            run_id = chosen["run"]
        else:
            run_id = manifest.meta.get("run_id")
        self.run.run_id = run_id or self.run.run_id
        return self._start_replay(replay, {"source": replay.source})

    def _restore_resharded(self, manifest) -> int:
        """``restore(reshard=True)`` once every rank has ``manifest``."""
        got = read_window_resharded(manifest, cfg=self.cfg, store=self.store, comm=self.comm, run=self.run,
                                    units=self.layout.units, pool=self.pool, io=self._io)
        r, ex = got.read, got.exact
        replay = _Replay(start=int(ex["start"]), end=manifest.step,
                         steps=window_steps(ex, r.slots, r.trees), grad=r.grad if got.checked else None,
                         source="memory" if r.from_storage == 0 else "storage", lease=r.lease)
        self.run.run_id = manifest.meta.get("run_id") or self.run.run_id
        return self._start_replay(replay, {"source": replay.source, "resharded": True, "checked": got.checked,
                                           "units": {"memory": r.from_memory, "storage": r.from_storage},
                                           "world": int(ex.get("world", 1))})

    # -- hand-over to the manager of a new process group (CheckpointManager.detach) --------
    def detach(self) -> dict[str, Any]:
        """Retire for a manager on another process group: the capture in flight (a local
        copy) is finished, so a window it completes stays usable; the window still being
        captured is dropped; a replay under way is ended (the successor must roll back
        again: ``replaying``); the persist in flight is abandoned. Returns the bookkeeping
        the successor adopts (:meth:`adopt`; an :class:`ExactHandover` on the wire)."""
        self._settle()
        self._abort_window("the process group changed")
        state = ExactHandover(last_persisted_step=self.last_persisted_step, windows_counted=self.windows_counted,
                              windows_persisted=self.windows_persisted, replays=self.replays,
                              replayed_steps=self.replayed_steps, replaying=self.replay is not None)
        self._capture.shutdown(wait=True)
        self._persist.shutdown(wait=False)
        self._io.shutdown(wait=False)
        r, self.replay = self.replay, None
        if r is not None:
            self._load.drop(r)
        return state.to_wire()

    def join(self, timeout: float) -> bool:
        """After :meth:`detach`: wait up to ``timeout`` seconds (in all) for the persist
        threads to end; True once they have."""
        deadline = time.monotonic() + timeout
        return all(ex.join(max(0.0, deadline - time.monotonic())) for ex in (self._persist, self._io))

    def adopt(self, states: Sequence[Mapping[str, Any] | None]) -> None:
        """Continue the bookkeeping of the exact managers this one replaces (every rank's
        :meth:`detach` state, None where a rank had none): a replay interrupted on any rank
        leaves the model half replayed, so :attr:`interrupted_replay` asks for a new restore."""
        h = ExactHandover.merge(states)
        if h is None:
            return
        self.last_persisted_step = h.last_persisted_step
        self.windows_counted, self.windows_persisted = h.windows_counted, h.windows_persisted
        self.replays, self.replayed_steps = h.replays, h.replayed_steps
        self.interrupted_replay = h.replaying

    def _start_replay(self, replay: _Replay, info: dict[str, Any]) -> int:
        self._apply_start(replay)
        self.replays += 1
        self.last_replay = {"start": replay.start, "end": replay.end, **info}
        replay.next = replay.start + 1
        self.expected = replay.start + 1
        self.next_open = replay.end + 1
        self.opened, self.completed, self.due = None, None, None
        if replay.end == replay.start:
            self._end_replay(replay)
        else:
            self.replay = replay
        log.info("rank %d step %d: restored the exact window %d-%d from %s; replaying steps %d-%d", self.run.rank,
                 replay.start, replay.start, replay.end, replay.source, replay.start + 1, replay.end)
        return replay.start + 1

    def _restore_extra(self, tree: Mapping[str, Any], *, user: bool) -> None:
        extra = tree["extra"]
        restore_rng(extra["rng"])
        if user:
            saved = extra.get("user", {})
            for name, obj in self.extra_state.items():
                if name not in saved:
                    raise CheckpointError(f"the exact window has no extra state {name!r} (saved: {sorted(saved)})")
                obj.load_state_dict(_clone_all(saved[name]))

    def _apply_start(self, r: _Replay) -> None:
        first = r.steps[r.start]
        groups = first["extra"]["extra"].get("optimizer_groups")
        missing = apply_units(self.model, self.optimizer, first["full"] + first["weights"], groups)
        if missing:
            raise CheckpointError(f"the exact window from step {r.start} does not cover {missing[:4]} of the model")
        self._restore_extra(first["extra"], user=True)
        self.plans.invalidate()
        self.wplans.invalidate()

    def _replay_step(self, t: int) -> None:
        r = self.replay
        assert r is not None
        if t != r.next:
            raise CheckpointError(
                f"rank {self.run.rank} step {t}: exact replay expects step {r.next} (run the steps from the one "
                f"restore() returned, in order, calling step() after every optimizer.step()), got {t}")
        data = r.steps[t]
        if data["full"]:
            apply_partial(self.model, self.optimizer, data["full"])      # promoted: weights and optimizer state
        if data["weights"]:
            apply_partial(self.model, None, data["weights"])             # compute weights of step t
        self._restore_extra(data["extra"], user=False)
        self.plans.invalidate()
        self.wplans.invalidate()
        self.replayed_steps += 1
        r.next = t + 1
        self.expected = t + 1
        if t == r.end:
            self._end_replay(r)

    def _end_replay(self, r: _Replay) -> None:
        self.replay = None
        self._load.drop(r)
        if (self.last_replay or {}).get("checked", True):
            log.info("rank %d step %d: exact replay done: the state equals the uninterrupted run's", self.run.rank,
                     r.end)
        else:
            log.info("rank %d step %d: exact replay done (another world or placement than the window's: every unit "
                     "has the update of every step once, not bit for bit the uninterrupted run's)", self.run.rank,
                     r.end)

    # -- reporting -------------------------------------------------------------------------
    def schedule(self) -> ExactSchedule:
        """The schedule a window opened now would use."""
        full, weights = self._sizes()
        return plan_schedule(self.layout, self._k_snapshot(), {u: p.nbytes for u, p in full.items()},
                             {u: p.nbytes for u, p in weights.items()})

    def status(self) -> dict[str, Any]:
        w, r = self.window, self.replay
        return {
            "window_open": None if w is None else {"start": w.start, "end": w.end, "steps_captured": len(w.step_bytes)},
            "last_window": self.last_window, "last_step_bytes": self.last_step_bytes,
            "windows_started": self.windows_started, "windows_complete": self.windows_complete,
            "windows_counted": self.windows_counted, "rounds": self.rounds,
            "windows_persisted": self.windows_persisted, "windows_skipped": self.windows_skipped,
            "windows_failed": self.windows_failed, "last_persisted_step": self.last_persisted_step,
            "persist_failures": self.persist_failures,
            "replaying": None if r is None else {"start": r.start, "end": r.end, "next": r.next, "source": r.source},
            "replays": self.replays, "replayed_steps": self.replayed_steps, "last_replay": self.last_replay,
            "stall_seconds_last": self.stall_last, "stall_seconds_total": self.stall_total,
            "device_captures_async": self.copies.device_async,
            "device_captures_fallback": self.copies.device_fallback,
        }
