"""Exact mode (``MoCConfig(exact=True)``): sparse checkpoints that lose no tokens.

Every step (``step(t)``, right after ``optimizer.step()``) captures, per the window
schedule (:mod:`moc._exact_schedule`), the full state of the units whose slot is now and
the compute weights of the units whose full capture is later, plus the extra state
(RNG, optimizer hyper-parameters, the user's ``extra_state``). The copies go into one of
the three shared-memory buffers of :mod:`moc._buffers` (one buffer holds one window, filled
step by step, reserved and leased by its rules) on a background thread; the optimizer's
step pre-hook waits for it (the stall). A window's header is published once its last step
is copied: an incomplete window is never read. The first complete window and then every
``persist_every``-th one is written to storage and committed (one manifest per window, at
its last step).

Recovery (:meth:`ExactCheckpointer.restore`) loads the newest complete window (memory,
else storage) and returns its first step + 1; the user's loop then *replays* the window:

* at restore, every unit of slot 0 gets its full state, every other unit its compute
  weights of the window's first step; the extra state of that step is restored;
* after each replayed ``optimizer.step()`` (``step(t)``) the units of slot ``t - start``
  are promoted (weights and optimizer state), the others get their compute weights of
  step ``t``, and the RNG is set to what it was after step ``t``;
* every parameter computes its gradient as the first time (global-norm clipping sees the
  same norm); the updates of units not promoted yet are overwritten before they are read.

After the window's last step the model and optimizer equal an uninterrupted run's (bit for
bit on CPU). The gradients of the window's second step are hashed when it is first trained
and again when it is replayed: a loop that feeds other data (or other code) on replay is
stopped there with :class:`moc.CheckpointError`, before its update.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import xxhash

from ._buffers import FREE, PERSIST, READY, BufferPool, SnapshotBuffer, read_headers
from ._ckpt_store import CheckpointStore
from ._codec import TensorMeta, TreePlan, decode_tree, plan_tree
from ._config import MoCConfig
from ._errors import CheckpointError
from ._exact_schedule import ExactSchedule, plan_schedule
from ._format import UnitRecord
from ._layouts import UnitLayout, local_tensor
from ._plan_cache import UnitPlans
from ._run_state import RunState
from ._units import _clone_all, apply_partial, apply_units, restore_rng

__all__ = ["ExactCheckpointer", "grad_digest", "weights_name", "extra_name"]

log = logging.getLogger("moc")

FORMAT = 1


def weights_name(step: int, unit: str) -> str:
    """Storage name of a unit's compute weights captured at ``step``."""
    return f"exact/weights/{step}/{unit}"


def extra_name(step: int) -> str:
    """Storage name of the extra state captured at ``step``."""
    return f"exact/extra/{step}"


def grad_digest(model: torch.nn.Module) -> dict[str, Any]:
    """xxh3 of every gradient's bytes (parameter order, names included) and the global norm
    (float32 dot products: a hint for the error message, only the hash is compared)."""
    h = xxhash.xxh3_64()
    sq = 0.0
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = local_tensor(p.grad).detach()
        if g.device.type != "cpu":
            g = g.cpu()
        g = g.contiguous()
        h.update(name.encode())
        if g.numel():
            h.update(memoryview(g.reshape(-1).view(torch.uint8).numpy()))
            # not g.double().pow(2).sum(): that copies every gradient twice (~1.7 s per window
            # on benchmarks/exact's 1.3 GB model, all of it in the optimizer step's pre-hook)
            flat = g.reshape(-1)
            flat = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
            sq += float(torch.dot(flat, flat))
    return {"xxh3": h.hexdigest(), "norm": sq ** 0.5}


@dataclass
class _Window:
    start: int
    schedule: ExactSchedule
    buf: SnapshotBuffer
    index: int                                  # windows started by this process
    offset: int = 0
    pieces: list[dict[str, Any]] = field(default_factory=list)
    step_bytes: list[int] = field(default_factory=list)
    grad: dict[str, Any] | None = None

    @property
    def end(self) -> int:
        return self.start + self.schedule.window - 1


@dataclass
class _Replay:
    start: int
    end: int
    steps: dict[int, dict[str, Any]]            # step -> {"full": [...], "weights": [...], "extra": tree}
    grad: dict[str, Any] | None
    source: str
    lease: SnapshotBuffer | None = None
    next: int = 0
    checked: bool = False


class ExactCheckpointer:
    """The exact-mode protocol of one (single-process) :class:`moc.CheckpointManager`.

    Args:
        cfg: the manager's configuration (``exact=True``).
        model, optimizer: what is captured and restored.
        layout: the model's units.
        plans: the manager's unit plans (full state: weights and optimizer state).
        pool: the shared-memory buffers.
        store: the persistent store.
        run: the shared run bookkeeping (lock, rank, step).
        extra_tree: the manager's extra unit of a step (RNG, optimizer groups, user state).
        extra_state: the user's objects restored from it.
    """

    def __init__(self, cfg: MoCConfig, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 layout: UnitLayout, plans: UnitPlans, pool: BufferPool, store: CheckpointStore, run: RunState,
                 extra_tree: Callable[[int], dict[str, Any]], extra_state: Mapping[str, Any]) -> None:
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.layout = layout
        self.plans = plans
        self.wplans = UnitPlans(model, None, layout)   # compute weights only
        self.pool = pool
        self.store = store
        self.run = run
        self.extra_tree = extra_tree
        self.extra_state = extra_state
        self._capture = ThreadPoolExecutor(1, thread_name_prefix=f"moc-exact-r{run.rank}")
        self._persist = ThreadPoolExecutor(1, thread_name_prefix=f"moc-exact-persist-r{run.rank}")
        self.in_flight: Future | None = None
        self.persist_in_flight: Future | None = None
        self.window: _Window | None = None
        self.replay: _Replay | None = None
        self.expected: int | None = None           # the step the next step() must carry
        self.windows_started = 0
        self.windows_complete = 0
        self.windows_persisted = 0
        self.windows_skipped = 0                   # no buffer at a window's first step
        self.windows_failed = 0
        self.consecutive_failures = 0
        self.last_exception: BaseException | None = None
        self.last_window: dict[str, Any] | None = None    # {"start", "end", "bytes", "step_bytes", "buffer"}
        self._persist_pending: SnapshotBuffer | None = None
        self.last_persisted_step: int | None = None
        self.persist_failures = 0
        self.stall_last = 0.0
        self.stall_total = 0.0
        self.last_step_bytes = 0
        self.replays = 0
        self.replayed_steps = 0

    # -- capture ---------------------------------------------------------------------------
    def step(self, t: int) -> None:
        """After ``optimizer.step()`` of step ``t``: capture (or, while replaying, promote)."""
        self._settle()
        if self.replay is not None:
            self._replay_step(t)
            return
        if self.expected is not None and t != self.expected:
            expected = self.expected
            self._abort_window("a step was left out")
            raise CheckpointError(
                f"{self.run.where()}: exact mode needs step() after every optimizer.step(), steps in order: "
                f"expected step {expected}, got {t}")
        self.expected = t + 1
        if self.window is None and not self._open_window(t):
            return
        self._capture_step(t)

    def _sizes(self) -> tuple[dict[str, TreePlan], dict[str, TreePlan]]:
        return self.plans.refresh(), self.wplans.refresh()

    def _open_window(self, t: int) -> bool:
        full, weights = self._sizes()
        schedule = plan_schedule(self.layout, self.cfg.k_snapshot, {u: p.nbytes for u, p in full.items()},
                                 {u: p.nbytes for u, p in weights.items()})
        extra = plan_tree(self.extra_tree(t)).nbytes + 64
        need = sum(schedule.step_bytes({u: p.nbytes + 64 for u, p in full.items()},
                                       {u: p.nbytes + 64 for u, p in weights.items()}, extra))
        with self.run.lock:
            buf = self.pool.reserve(need)
        if buf is None:
            self._skip(t, "every snapshot buffer is being persisted, read or holds the newest complete window")
            return False
        try:
            buf.ensure(need, defer_upkeep=True)
        except (OSError, RuntimeError) as exc:
            with self.run.lock:
                self.pool.unreserve()
            self._skip(t, f"{type(exc).__name__}: {exc}")
            return False
        with self.run.lock:
            self.pool.acquire(buf)      # header withdrawn, state SNAPSHOT, leased until the window ends
        self.windows_started += 1
        self.window = _Window(start=t, schedule=schedule, buf=buf, index=self.windows_started)
        return True

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
                w.buf.ensure(w.offset + nbytes + remaining, defer_upkeep=True)   # grows; the file keeps its bytes
            except (OSError, RuntimeError) as exc:
                self._abort_window(f"the buffer cannot grow: {exc}")
                self._skip(t, f"{type(exc).__name__}: {exc}")
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
        for what, name, plan, spec, off in sync:
            plan.copy_range(0, plan.nbytes, w.buf.data[off: off + plan.nbytes])
        done_now = {id(e) for e in sync}
        later = [e for e in placed if id(e) not in done_now]
        last = i == w.schedule.window - 1
        self.in_flight = self._capture.submit(self._fill, w, t, placed, later, last)

    def _fill(self, w: _Window, t: int, placed, later, last: bool) -> None:
        buf = w.buf
        for what, name, plan, spec, off in later:
            plan.copy_range(0, plan.nbytes, buf.data[off: off + plan.nbytes])
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
                            "slots": w.schedule.slots, "grad": w.grad, "step_bytes": w.step_bytes},
                  "pieces": w.pieces}
        with self.run.lock:
            if self.run.abandoned:
                raise RuntimeError("exact window abandoned: the manager was closed")
            buf.publish(header)
            buf.step, buf.header, buf.state, buf.persisted = w.end, header, READY, False
        self.pool.release(buf)

    def _settle(self) -> None:
        """Wait for the capture in flight; book a finished window; start a due persist."""
        fut, self.in_flight = self.in_flight, None
        if fut is not None:
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - counted; raised after too many in a row
                self._failed(exc)
            else:
                w = self.window
                if w is not None and w.buf.state == READY and w.buf.step == w.end:
                    self._window_done(w)
        self._start_persist()

    def _window_done(self, w: _Window) -> None:
        self.window = None
        self.windows_complete += 1
        self.consecutive_failures = 0
        self.last_window = {"start": w.start, "end": w.end, "window": w.schedule.window, "bytes": w.offset,
                            "step_bytes": list(w.step_bytes), "buffer": w.buf.index}
        log.info("rank %d step %d: exact window %d-%d complete (%d bytes in buffer %d)", self.run.rank, w.end,
                 w.start, w.end, w.offset, w.buf.index)
        if (self.windows_complete - 1) % self.cfg.persist_every == 0:
            self._persist_pending = w.buf

    def _failed(self, exc: BaseException) -> None:
        self.windows_failed += 1
        self.consecutive_failures += 1
        self.last_exception = exc
        self.run.last_error = f"exact capture failed: {type(exc).__name__}: {exc}"
        log.error("%s: exact capture failed (%d in a row): %s", self.run.where(), self.consecutive_failures, exc)
        self._abort_window(str(exc))
        if self.consecutive_failures >= self.cfg.max_consecutive_failures:
            raise CheckpointError(f"{self.run.where()}: {self.consecutive_failures} exact windows in a row failed; "
                                  f"the newest complete window ends at step "
                                  f"{(self.last_window or {}).get('end')}: {exc}") from exc

    def _abort_window(self, reason: str) -> None:
        w, self.window = self.window, None
        if w is None:
            return
        self.expected = None
        with self.run.lock:
            w.buf.invalidate()
            w.buf.state = FREE
        self.pool.release(w.buf)
        log.warning("rank %d step %d: exact window from step %d dropped: %s", self.run.rank,
                    self.run.last_step if self.run.last_step is not None else -1, w.start, reason)

    def before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """The optimizer step pre-hook: wait for the capture in flight (the stall); hash the
        gradients of a window's second step (recorded, or checked while replaying)."""
        fut = self.in_flight
        if fut is not None and not fut.done():
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
            if r.next == r.start + 1 and not r.checked and r.grad is not None:
                got = grad_digest(self.model)
                if got["xxh3"] != r.grad["xxh3"]:
                    raise CheckpointError(
                        f"rank {self.run.rank} step {r.next}: replay diverged: the gradients of replayed step "
                        f"{r.next} differ from those recorded when it was trained (xxh3 {r.grad['xxh3']}, global "
                        f"norm {r.grad['norm']:.6g}; now xxh3 {got['xxh3']}, norm {got['norm']:.6g}). Exact replay "
                        "needs the same batch at every step (a function of the step, or a data loader passed in "
                        "extra_state) and the same model code; moc restores the RNG. Nothing was updated.")
                r.checked = True
            return
        w = self.window
        if w is not None and w.grad is None and self.expected == w.start + 1 and w.schedule.window > 1:
            w.grad = grad_digest(self.model)

    # -- persisting ------------------------------------------------------------------------
    def _start_persist(self) -> None:
        fut = self.persist_in_flight
        if fut is not None:
            if not fut.done():
                return
            self.persist_in_flight = None
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - reported, retried with the next window
                self.persist_failures += 1
                self.run.last_error = f"exact persist failed: {type(exc).__name__}: {exc}"
                log.error("%s: persisting the exact window failed: %s", self.run.where(), exc)
        buf, self._persist_pending = self._persist_pending, None
        if buf is None:
            return
        with self.run.lock:
            if buf.state != READY or buf.persisted or buf.step is None:
                return
            buf.state = PERSIST
            buf.users += 1
        self.persist_in_flight = self._persist.submit(self._write, buf)

    def _write(self, buf: SnapshotBuffer) -> None:
        try:
            header = buf.header
            ex = header["exact"]
            writer = self.store.writer(header["step"], f"r{self.run.rank}")
            records = []
            for piece in header["pieces"]:
                what, unit, t = piece["what"], piece["unit"], int(piece["step"])
                chunk = writer.add_bytes([buf.view(piece["offset"], piece["nbytes"])], offset=0,
                                         itemsize=piece["itemsize"], group="experts" if piece["kind"] == "expert"
                                         else "state")
                name = unit if what in ("full", "extra") else weights_name(t, unit)
                kind = piece["kind"] if what == "full" else "extra"
                records.append(UnitRecord(name=name, kind=kind, step=t, nbytes=piece["nbytes"],
                                          skeleton=piece["skeleton"], tensors=piece["tensors"], chunks=[chunk],
                                          layer=piece["layer"] if kind == "expert" else None,
                                          expert=piece["expert"] if kind == "expert" else None))
            writer.finish()
            self.store.commit(header["step"], records, meta={"run_id": header["run"], "exact": ex,
                                                             "world": header["world"]})
            with self.run.lock:
                buf.persisted = True
                self.last_persisted_step = header["step"]
                self.windows_persisted += 1
        finally:
            with self.run.lock:
                if buf.state == PERSIST:
                    buf.state = READY
                buf.users = max(0, buf.users - 1)

    def wait(self, *, flush: bool = True, timeout: float | None = None) -> None:
        """Wait for the capture and persist in flight; ``flush``: also write the newest
        complete window if it is in memory only (raises if that fails)."""
        self._settle()
        if self.persist_in_flight is not None:
            self.persist_in_flight.exception(timeout)
        if not flush:
            return
        self._start_persist()   # books the finished persist
        with self.run.lock:
            newest = self.pool.newest_complete()
            todo = newest if newest is not None and newest.header.get("exact") and not newest.persisted else None
        if todo is not None:
            self._persist_pending = todo
            self._start_persist()
        fut = self.persist_in_flight
        if fut is not None:
            self.persist_in_flight = None
            try:
                fut.result(timeout)
            except Exception as exc:
                self.persist_failures += 1
                raise CheckpointError(f"{self.run.where()}: persisting the exact window failed: {exc}") from exc

    def shutdown(self, *, wait: bool = True) -> None:
        self._capture.shutdown(wait=wait)
        self._persist.shutdown(wait=wait)
        r, self.replay = self.replay, None
        if r is not None and r.lease is not None:
            self.pool.release(r.lease)

    # -- recovery --------------------------------------------------------------------------
    def _memory_candidates(self) -> list[dict[str, Any]]:
        units = set(self.layout.units)
        out = [h for h in read_headers(self.pool.directory)
               if isinstance(h.get("exact"), dict) and set(h["exact"].get("slots", {})) == units]
        return sorted(out, key=lambda h: h["step"])

    def _storage_manifest(self):
        for step in reversed(self.store.steps()):
            try:
                m = self.store.read_manifest(step)
            except Exception as exc:  # noqa: BLE001 - a corrupt manifest: an older one may do
                log.warning("rank %d: skipping manifest of step %d: %s", self.run.rank, step, exc)
                continue
            if not m.meta.get("exact"):
                raise CheckpointError(
                    f"{self.store.store.url}: the newest checkpoint (step {step}) was not written in exact mode "
                    "(MoCConfig(exact=True)); it has no window to replay. Open it with exact=False, or use new storage")
            return m
        return None

    def restore(self) -> int:
        """Load the newest complete window and start its replay; return the next step to
        run (the window's first step + 1), 0 when nothing is stored."""
        self._settle()
        self._abort_window("restore")
        if self.persist_in_flight is not None:
            self.persist_in_flight.exception()
        manifest = self._storage_manifest()
        memory = self._memory_candidates()
        if manifest is not None:
            memory = [h for h in memory if h.get("run") == manifest.meta.get("run_id")]
        replay = None
        if memory and (manifest is None or memory[-1]["step"] >= manifest.step):
            try:
                replay = self._from_memory(memory[-1])
            except (OSError, ValueError, KeyError) as exc:
                log.warning("rank %d: the exact window in memory (step %d) is unusable (%s); reading storage",
                            self.run.rank, memory[-1]["step"], exc)
        if replay is None and manifest is not None:
            replay = self._from_storage(manifest)
        if replay is None:
            return 0
        self.run.run_id = (memory[-1]["run"] if replay.source == "memory" else manifest.meta.get("run_id")) \
            or self.run.run_id
        self._apply_start(replay)
        self.replays += 1
        replay.next = replay.start + 1
        self.expected = replay.start + 1
        if replay.end == replay.start:
            self._end_replay(replay)
        else:
            self.replay = replay
        log.info("rank %d step %d: restored the exact window %d-%d from %s; replaying steps %d-%d", self.run.rank,
                 replay.start, replay.start, replay.end, replay.source, replay.start + 1, replay.end)
        return replay.start + 1

    def _window_steps(self, ex: Mapping[str, Any], trees: Mapping[tuple[str, int, str], Any]) -> dict[int, Any]:
        start, w, slots = int(ex["start"]), int(ex["window"]), ex["slots"]
        steps: dict[int, dict[str, Any]] = {}
        for i in range(w):
            t = start + i
            full = [trees[("full", t, u)] for u, s in sorted(slots.items()) if s == i]
            weights = [trees[("weights", t, u)] for u, s in sorted(slots.items()) if s > i]
            steps[t] = {"full": full, "weights": weights, "extra": trees[("extra", t, extra_name(t))]}
        return steps

    def _from_memory(self, header: dict[str, Any]) -> _Replay:
        buf = self.pool.buffers[int(header["buffer"])]
        size = os.path.getsize(buf.path)
        with self.run.lock:
            if buf.users:
                raise ValueError(f"buffer {buf.index} is in use")
            buf.ensure(max(size, buf.capacity))
            buf.users += 1
        try:
            trees = {}
            for p in header["pieces"]:
                view = buf.view(p["offset"], p["nbytes"])
                if "xxh3:" + xxhash.xxh3_64_hexdigest(view) != p["checksum"]:
                    raise ValueError(f"piece {p['unit']} of step {p['step']} failed its checksum")
                data = buf.data[p["offset"]: p["offset"] + p["nbytes"]]
                trees[(p["what"], int(p["step"]), p["unit"])] = decode_tree(
                    p["skeleton"], [TensorMeta.from_json(m) for m in p["tensors"]], data)
            ex = header["exact"]
            steps = self._window_steps(ex, trees)
        except BaseException:
            self.pool.release(buf)
            raise
        with self.run.lock:
            buf.step, buf.header, buf.state, buf.persisted = header["step"], header, READY, False
        return _Replay(start=int(ex["start"]), end=int(header["step"]), steps=steps, grad=ex.get("grad"),
                       source="memory", lease=buf)

    def _from_storage(self, manifest) -> _Replay:
        ex = manifest.meta["exact"]
        loaded = self.store.load(manifest.step)
        trees: dict[tuple[str, int, str], Any] = {}
        prefix_w, prefix_x = "exact/weights/", "exact/extra/"
        for name, tree in loaded.units.items():
            rec = manifest.units[name]
            if name.startswith(prefix_w):
                t, unit = name[len(prefix_w):].split("/", 1)
                trees[("weights", int(t), unit)] = tree
            elif name.startswith(prefix_x):
                trees[("extra", rec.step, name)] = tree
            else:
                trees[("full", rec.step, name)] = tree
        missing = set(self.layout.units) - set(ex["slots"])
        if missing:
            raise CheckpointError(f"the exact window at step {manifest.step} lacks units {sorted(missing)[:4]} "
                                  "of this model")
        return _Replay(start=int(ex["start"]), end=manifest.step, steps=self._window_steps(ex, trees),
                       grad=ex.get("grad"), source="storage")

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
        r.steps.clear()
        if r.lease is not None:
            self.pool.release(r.lease)
        log.info("rank %d step %d: exact replay done: the state equals the uninterrupted run's", self.run.rank, r.end)

    # -- reporting -------------------------------------------------------------------------
    def schedule(self) -> ExactSchedule:
        """The schedule a window opened now would use."""
        full, weights = self._sizes()
        return plan_schedule(self.layout, self.cfg.k_snapshot, {u: p.nbytes for u, p in full.items()},
                             {u: p.nbytes for u, p in weights.items()})

    def status(self) -> dict[str, Any]:
        w, r = self.window, self.replay
        return {
            "window_open": None if w is None else {"start": w.start, "end": w.end, "steps_captured": len(w.step_bytes)},
            "last_window": self.last_window, "last_step_bytes": self.last_step_bytes,
            "windows_started": self.windows_started, "windows_complete": self.windows_complete,
            "windows_persisted": self.windows_persisted, "windows_skipped": self.windows_skipped,
            "windows_failed": self.windows_failed, "last_persisted_step": self.last_persisted_step,
            "persist_failures": self.persist_failures,
            "replaying": None if r is None else {"start": r.start, "end": r.end, "next": r.next, "source": r.source},
            "replays": self.replays, "replayed_steps": self.replayed_steps,
            "stall_seconds_last": self.stall_last, "stall_seconds_total": self.stall_total,
        }
