"""The first level: copies of this rank's shares into shared-memory buffers, made while
the next forward/backward runs.

CPU tensors are copied by a background thread; the optimizer's step pre-hook waits for
those copies (the only stall), so no snapshot ever sees the next update, and for nothing
else: checksums (xxh3, over several pieces at once on a small thread pool: the hash releases
the GIL), the remote-copy exchange and the publish run after, while training goes on. CUDA tensors are copied on
a side stream into page-locked buffers (:mod:`moc._cuda.copies`): the copies are issued in
``step()`` after an event recorded behind ``optimizer.step()``, the pre-hook orders the
next update after their completion event on the device, and the background thread only
waits for that event, then checksums and publishes; it binds the device of the tensors
it waits on first (a thread's current device is 0 until set: waiting from there would
create a context on GPU 0 for every rank of a node). A buffer not page-locked yet (created
or grown by this snapshot; page-locked in the background once its copies are done, see
:mod:`moc._snapshot.buffers`) or that cannot be page-locked is filled by the snapshot thread
instead, and the pre-hook waits for it (counted as stall). Before a buffer changes hands
(detach, close) the copies into it are waited for (:meth:`SnapshotEngine.quiesce`).
Failures are counted;
``max_consecutive_failures`` in a row end training with :class:`moc.CheckpointError`
(decided by all ranks together).

Running out of something is not a failure: when no buffer can be had for a due snapshot
(every one is being persisted, read or is the newest complete copy; ``/dev/shm`` full; a
buffer that cannot grow), the snapshot is skipped, counted (``status()["snapshots_skipped"]``)
and logged, and training goes on with the newest complete snapshot still recoverable. The
buffer is reserved before the ranks' round (:meth:`SnapshotEngine.reserve`), so ranks skip
together; a growth that fails only after the round skips this rank's copy alone, and the
rank still takes part in the remote-copy exchange so that no peer waits for it.
"""

from __future__ import annotations

import errno
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import CancelledError as FuturesCancelled
from concurrent.futures import TimeoutError as FuturesTimeout
from datetime import timedelta
from typing import Any

import torch
import xxhash

from .._config import MoCConfig
from .._cuda import CudaCopier, CudaCopyBatch, HostCopier, copier_for, runtime
from .._dist import Comm
from .._errors import CheckpointError
from .._run_state import RunState
from .._store import TensorMeta, decode_tree
from .buffers import FREE, PERSIST, READY, SNAPSHOT, BufferPool, SnapshotBuffer
from .plan import SnapshotPlan, unit_meta

__all__ = ["SnapshotEngine"]


def _set(*events: threading.Event) -> None:
    for e in events:
        e.set()

log = logging.getLogger("moc")

# Checksums of a snapshot smaller than this are computed on the snapshot thread alone.
_PARALLEL_HASH_BYTES = 8 << 20
_HASH_THREADS = 4

# Errors that mean "out of room", not "broken": the snapshot is skipped and counted.
_EXHAUSTED = frozenset({errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EFBIG})


class SnapshotEngine:
    """Triple-buffered background snapshots of one rank.

    Args:
        cfg: the manager's configuration.
        pool: the shared-memory buffers (kept across reconfigurations by a handover).
        comm: the snapshot thread's collectives (remote copies).
        run: the shared run bookkeeping.
    """

    def __init__(self, cfg: MoCConfig, *, pool: BufferPool, comm: Comm, run: RunState) -> None:
        self.cfg = cfg
        self.pool = pool
        self.comm = comm
        self.run = run
        self._exec = ThreadPoolExecutor(1, thread_name_prefix=f"moc-snapshot-r{run.rank}")
        self.in_flight: Future | None = None
        self.last_snapshot_step: int | None = None
        self.seconds: float | None = None     # background copy time of the newest snapshot
        self.failures = 0
        self.consecutive_failures = 0
        self.last_exception: BaseException | None = None
        self.stall_last = 0.0
        self.stall_total = 0.0
        self.stalls = 0
        # the same stalls split by where training waited: the host thread blocked in the
        # pre-hook (CPU tensors, an unpinned buffer), or the device stream ordered after
        # the copies (CUDA, measured by events; the host did not wait)
        self.host_stall_last = 0.0
        self.host_stall_total = 0.0
        self.device_stall_last = 0.0
        self.device_stall_total = 0.0
        self._host = HostCopier()        # copies that complete in the call (CPU, or unpinned)
        self.copier: HostCopier | CudaCopier = self._host
        self.device_copy_seconds: float | None = None  # device time of the newest CUDA snapshot's copies
        self._batch: CudaCopyBatch | None = None        # CUDA copies the next update must wait for
        self._stall_batch: CudaCopyBatch | None = None  # whose device-side wait is not measured yet
        self._reserved: SnapshotBuffer | None = None    # the buffer the due snapshot will fill
        self.reserve_error: str | None = None           # why none could be reserved
        self._last_nbytes = 0                           # this rank's share of the newest snapshot
        self.skipped = 0                                # due snapshots skipped for lack of a buffer
        self.skipped_local = 0                          # ... of which on this rank only (growth failed)
        self.last_skip: dict[str, Any] | None = None    # {"step", "reason"} of the newest skip
        self._in_flight_step = -1
        self._pin_error_logged = False
        self.device_snapshots_async = 0     # CUDA snapshots copied asynchronously into page-locked memory
        self.device_snapshots_fallback = 0  # ... copied by the snapshot thread (buffer not page-locked)
        self._last_batch: CudaCopyBatch | None = None    # the newest issued copies (quiesce waits for them)
        self._local_done = threading.Event()              # the newest snapshot's local copies are done
        self._local_done.set()
        # the newest snapshot's copies from the model are done (what the next update waits for)
        self._copied = threading.Event()
        self._copied.set()
        self._hashers = ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix=f"moc-xxh3-r{run.rank}")

    # -- taking a snapshot -----------------------------------------------------------------
    def reserve(self) -> bool:
        """Before the round of a due snapshot: reserve the buffer it will fill (False, with
        :attr:`reserve_error`, when every buffer is busy: the ranks then skip the snapshot
        together) and try to grow it to the size this rank's newest snapshot needed, so
        that steady-state snapshots never resize inside :meth:`start`. A growth that fails
        here is tried again there with the snapshot's real size."""
        with self.run.lock:
            buf = self.pool.reserve(self._last_nbytes)
            self._reserved = buf
        if buf is None:
            self.reserve_error = "every snapshot buffer is being filled, persisted or read, or is the newest " \
                                 "complete snapshot"
            return False
        self.reserve_error = None
        try:
            buf.ensure(max(self._last_nbytes, buf.capacity), pin=self._pin_device(), defer_upkeep=True)
        except (OSError, RuntimeError):
            pass
        return True

    def unreserve(self) -> None:
        with self.run.lock:
            self.pool.unreserve()
            self._reserved = None

    def skip(self, step: int, reason: str, *, local: bool = False, unreserve: bool = True) -> None:
        """Count a due snapshot that was not taken (never an error: the newest complete
        snapshot stays the recovery copy) and say so in the log."""
        if unreserve:
            self.unreserve()
        self.skipped += 1
        self.skipped_local += int(local)
        self.last_skip = {"step": step, "reason": reason}
        self.run.last_error = f"snapshot of step {step} skipped: {reason}"
        log.warning("rank %d step %d: snapshot skipped (%d so far)%s: %s", self.run.rank, step, self.skipped,
                    " on this rank" if local else "", reason)

    def start(self, plan: SnapshotPlan, header: dict[str, Any]) -> Future:
        """Fill the reserved buffer: copy the state the next forward may change now, and
        leave the rest (parameters, optimizer state, remote copies, checksums) to the
        background. A buffer that cannot grow to the plan's size skips this rank's copy
        (the returned future then gives None)."""
        self.collect_device_stall()
        self.copier = copier_for((src for e in plan.entries for src in e[1].sources), self.copier)
        nbytes = plan.nbytes(self.run.rank)
        self._in_flight_step = header["step"]
        # Page-locking happens later, off this thread (see moc._snapshot.buffers): never here.
        buf, exc = self._take_buffer(nbytes)
        if buf is None:
            assert exc is not None      # _take_buffer gives the reason when it gives no buffer
            return self._skip_here(plan, header, nbytes, exc)
        self._last_nbytes = nbytes
        offset = 0
        placed = []
        for entry in plan.entries:
            placed.append((entry, offset))
            offset += entry[3] - entry[2]
        landing = []  # where remote copies received from other ranks go in the buffer
        for r in plan.incoming(self.run.rank):
            landing.append((r, offset))
            offset += r[2] - r[1]
        # CUDA: the side stream(s) wait on an event recorded behind this step's update.
        batch = self.copier.begin() if self.copier.device_async else None
        issued = batch is not None and buf.pinned_for(nbytes)
        done = self._local_done = threading.Event()   # one per snapshot: set once nothing local writes
        copied = self._copied = threading.Event()     # ... and once the model's tensors are read
        if batch is not None and issued:
            # Issue every device-to-host copy now, asynchronously into the page-locked
            # buffer; state the next forward changes in place is fenced off at once.
            for first in (True, False):
                for (name, tplan, start, end, _, _), off in placed:
                    if (name in plan.sync_entries) == first:
                        batch.copy(tplan, start, end, buf.data[off: off + end - start])
                if first:
                    batch.fence()
            batch.finish()
            self._batch = self._last_batch = batch
            self.device_snapshots_async += 1
            copied.set()    # the pre-hook orders the update after the copies on the device
        else:
            if batch is not None:
                self.device_snapshots_fallback += 1
                error = self.pool.pin_error()
                if error is not None and not self._pin_error_logged:
                    self._pin_error_logged = True
                    log.warning("%s: a snapshot buffer in %s cannot be page-locked (%s); CUDA tensors are copied "
                                "by the snapshot thread and the optimizer step waits for it", self.run.where(),
                                self.pool.directory, error)
            try:
                for (name, tplan, start, end, _, _), off in placed:
                    if name in plan.sync_entries:
                        self._copy_now(batch, tplan, start, end, buf.data[off: off + end - start])
            except BaseException:
                done.set()
                copied.set()
                with self.run.lock:
                    buf.invalidate()
                    buf.state = FREE
                self.pool.release(buf)
                raise
        self.in_flight = self._exec.submit(self._fill_job, buf, placed, plan, header, landing, batch, issued, done,
                                           copied)
        self.in_flight.add_done_callback(lambda _: _set(copied, done))
        return self.in_flight

    def _pin_device(self) -> torch.device | None:
        return self.copier.device if isinstance(self.copier, CudaCopier) else None

    def _take_buffer(self, nbytes: int) -> tuple[SnapshotBuffer | None, BaseException | None]:
        """The reserved buffer, grown to ``nbytes`` and leased; when it cannot grow, another
        idle one that is big enough already (an older complete snapshot). (None, why)
        when there is none."""
        with self.run.lock:
            buf, self._reserved = self._reserved, None
            if buf is None:
                buf = self.pool.victim(nbytes)
            if buf is None:
                return None, RuntimeError("every snapshot buffer is busy")
            self.pool.acquire(buf)
        tried: set[int] = set()
        while True:
            try:
                buf.ensure(nbytes, pin=self._pin_device(), defer_upkeep=True)
                return buf, None
            except (OSError, RuntimeError) as exc:
                tried.add(buf.index)
                with self.run.lock:
                    buf.state = FREE
                    buf.users = max(0, buf.users - 1)
                    other = self.pool.victim(nbytes, exclude=buf)
                    if other is None or other.index in tried or other.capacity < nbytes:
                        other = None
                    else:
                        self.pool.acquire(other)
                if other is None:
                    return None, exc
                buf = other

    def _skip_here(self, plan: SnapshotPlan, header: dict[str, Any], nbytes: int, exc: BaseException) -> Future:
        """No buffer could grow to this rank's share after the round: skip this rank's copy
        (counted), and still take part in the remote-copy exchange the peers run."""
        self.skip(header["step"], f"{type(exc).__name__}: {exc}", local=True)
        self._last_nbytes = nbytes
        if plan.remote:
            self.in_flight = self._exec.submit(self._exchange_without_buffer, plan.remote)
        else:
            self.in_flight = Future()
            self.in_flight.set_result(None)
        return self.in_flight

    def _copy_now(self, batch: CudaCopyBatch | None, tplan, start: int, end: int, out) -> None:
        """A copy complete on return: on the host, or (unpinned buffer) on the side stream
        behind the step's update event."""
        if batch is None:
            self._host.copy(tplan, start, end, out)
        else:
            batch.copy(tplan, start, end, out, non_blocking=False)

    def _fill(self, buf: SnapshotBuffer, placed, plan: SnapshotPlan, header: dict[str, Any],
              landing, batch: CudaCopyBatch | None = None, issued: bool = False,
              done: threading.Event | None = None, copied: threading.Event | None = None) -> SnapshotBuffer:
        """Background: copy this rank's share into the buffer (or wait for the device to
        have copied it), send/receive the remote copies, checksum everything, publish;
        then start the buffer's upkeep (a shrink's truncate, page-locking a created or
        grown buffer; deferred so far, see :meth:`SnapshotBuffer.ensure`: it would slow
        these copies and step()'s)."""
        if batch is not None:
            runtime().set_device(batch.device)    # before any CUDA call of this thread
        try:
            return self._fill_now(buf, placed, plan, header, landing, batch, issued, done, copied)
        finally:
            if copied is not None:
                copied.set()
            if done is not None:
                done.set()
            with self.run.lock:
                if not self.run.abandoned:   # after a detach the buffers are no longer ours to pin
                    buf.start_upkeep()

    def _fill_job(self, buf: SnapshotBuffer, *args) -> SnapshotBuffer:
        """The background job of a snapshot: :meth:`_fill` under the buffer's lease, which
        ends however the job does; a job that fails gives its buffer back (free), unless its
        manager was detached meanwhile (the buffers are the successor's then)."""
        try:
            return self._fill(buf, *args)
        except BaseException:
            with self.run.lock:
                if not self.run.abandoned and buf.state == SNAPSHOT:
                    buf.invalidate()
                    buf.state = FREE
            raise
        finally:
            self.pool.release(buf)

    def _exchange_without_buffer(self, remote) -> None:
        """This rank's part of the remote-copy exchange when it has no buffer: zeros
        instead of its shares and no descriptions (the receivers drop what arrives without
        one, keeping their local snapshots), and nothing kept of what it receives."""
        rank, world = self.run.rank, self.comm.world
        send_splits, recv_splits = [0] * world, [0] * world
        for _, start, end, src, dst in remote:
            if src == rank:
                send_splits[dst] += end - start
            if dst == rank:
                recv_splits[src] += end - start
        lengths = torch.zeros(world, dtype=torch.int64)
        meta = self.comm.exchange(lengths.view(torch.uint8), [8] * world, [8] * world, snapshot=True)
        for src, n in enumerate(meta.view(torch.int64).tolist()):
            recv_splits[src] += n
        self.comm.exchange(torch.zeros(sum(send_splits), dtype=torch.uint8), send_splits, recv_splits,
                           snapshot=True)
        return None

    def _fill_now(self, buf: SnapshotBuffer, placed, plan: SnapshotPlan, header: dict[str, Any],
                  landing, batch: CudaCopyBatch | None, issued: bool,
                  done: threading.Event | None, copied: threading.Event | None = None) -> SnapshotBuffer:
        t0 = time.perf_counter()
        if issued:
            assert batch is not None    # copies are issued only with a batch
            batch.synchronize()
            self.device_copy_seconds = batch.copy_seconds()
        else:
            for (name, tplan, start, end, _, _), off in placed:
                if name not in plan.sync_entries:
                    self._copy_now(batch, tplan, start, end, buf.data[off: off + end - start])
        if copied is not None:
            copied.set()    # the next update may run: the rest reads the buffer, not the model
        units: dict[str, Any] = {}
        pieces = []
        where: dict[tuple[str, int], int] = {}
        sums = self._checksums([(off, end - start) for (_, _, start, end, _, _), off in placed], buf)
        for ((name, tplan, start, end, spec, owner), off), checksum in zip(placed, sums):
            units[name] = unit_meta(tplan, spec)
            where[(name, start)] = off
            pieces.append({"unit": name, "start": start, "end": end, "offset": off, "checksum": checksum,
                           "persist": owner and (name in plan.persist_units or units[name]["kind"] == "extra")})
        if done is not None:
            done.set()   # nothing but remote copies (checked against a detach) writes from here on
        if plan.remote:
            try:
                received, meta = self._exchange_copies(buf, plan.remote, landing, where, units)
                pieces += received
                units.update(meta)
            except Exception as exc:  # noqa: BLE001 - the local part of the snapshot stays valid
                self.run.last_error = f"remote snapshot copies failed: {exc}"
                log.warning("rank %d step %d: remote snapshot copies failed: %s", self.run.rank, header["step"], exc)
        header = dict(header, units=units, pieces=pieces)
        with self.run.lock:
            if self.run.abandoned:
                raise RuntimeError("snapshot abandoned: the manager was detached")
            buf.publish(header)
            buf.step = header["step"]
            buf.header = header
            buf.state = READY
            self.last_snapshot_step = header["step"]
        self.seconds = time.perf_counter() - t0
        return buf

    def _checksums(self, spans: list[tuple[int, int]], buf: SnapshotBuffer) -> list[str]:
        """``xxh3:<hex>`` of each ``(offset, nbytes)`` span of ``buf``, several at once when
        there is enough to hash (xxh3 releases the GIL; one core hashes ~10 GB/s at best,
        a K=all snapshot of a large model is several GB)."""
        if sum(n for _, n in spans) < _PARALLEL_HASH_BYTES or len(spans) < 2:
            return ["xxh3:" + xxhash.xxh3_64_hexdigest(buf.view(off, n)) for off, n in spans]
        return list(self._hashers.map(lambda s: "xxh3:" + xxhash.xxh3_64_hexdigest(buf.view(*s)), spans))

    def _exchange_copies(self, buf: SnapshotBuffer, remote, landing, where,
                         described: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Send the shares this rank owns to their remote copy holders and land the
        copies it holds for others, on the snapshot thread's group: one all-to-all of the
        lengths of the unit descriptions each rank sends each other rank (receivers hold
        no replica, so the senders describe what they send), then one of the bytes, each
        destination's shares followed by their descriptions (JSON)."""
        rank, world = self.run.rank, self.comm.world
        send_parts, send_splits, recv_splits = [], [0] * world, [0] * world
        to_describe: list[dict[str, Any]] = [{} for _ in range(world)]
        for unit, start, end, src, dst in remote:   # one global order on every rank
            if src == rank:
                off = where[(unit, start)]
                send_parts.append((dst, buf.data[off: off + end - start]))
                send_splits[dst] += end - start
                to_describe[dst][unit] = described[unit]
            if dst == rank:
                recv_splits[src] += end - start
        blobs = [json.dumps(d, separators=(",", ":")).encode() if d else b"" for d in to_describe]
        lengths = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
        got = self.comm.exchange(lengths.view(torch.uint8), [8] * world, [8] * world, snapshot=True)
        meta_lengths = got.view(torch.int64).tolist()
        for dst, b in enumerate(blobs):
            if b:
                send_parts.append((dst, torch.frombuffer(bytearray(b), dtype=torch.uint8)))
                send_splits[dst] += len(b)
        for src in range(world):
            recv_splits[src] += meta_lengths[src]
        # all_to_all_single wants the send buffer grouped by destination rank; a stable
        # sort keeps the global order within each destination (shares, then the
        # description), which is how it lands.
        send_parts.sort(key=lambda x: x[0])
        send = torch.cat([t for _, t in send_parts]) if send_parts else torch.empty(0, dtype=torch.uint8)
        received = self.comm.exchange(send, send_splits, recv_splits, snapshot=True)
        starts, pos = {}, 0
        for q in range(world):
            starts[q] = pos
            pos += recv_splits[q]
        pieces = []
        with self.run.lock:
            if self.run.abandoned:  # the buffer may belong to the successor now
                raise RuntimeError("snapshot abandoned: the manager was detached")
            for (unit, start, end, src, _), off in landing:
                n = end - start
                buf.data[off: off + n].copy_(received[starts[src]: starts[src] + n])
                starts[src] += n
                pieces.append({"unit": unit, "start": start, "end": end, "offset": off,
                               "checksum": "xxh3:" + xxhash.xxh3_64_hexdigest(buf.view(off, n)), "persist": False})
        meta: dict[str, Any] = {}
        for src in range(world):
            n = meta_lengths[src]
            if n:
                meta.update(json.loads(bytes(received[starts[src]: starts[src] + n].cpu().numpy()).decode()))
        wanted = {r[0] for r, _ in landing}
        missing = sorted(wanted - set(meta))
        if missing:
            raise RuntimeError(f"remote copies of {missing[:4]} arrived without their descriptions")
        return pieces, {u: m for u, m in meta.items() if u in wanted}

    # -- waiting ---------------------------------------------------------------------------
    def wait(self) -> bool:
        """Wait for the snapshot in flight; True if it was still running. A failure is
        counted, never raised here (see :meth:`check_failures`)."""
        self.collect_device_stall()
        fut = self.in_flight
        if fut is None:
            return False
        pending = not fut.done()
        try:
            fut.result()
        except OSError as exc:
            if exc.errno not in _EXHAUSTED:
                self._count_failure(exc)
            else:   # out of room (a full /dev/shm while publishing): skipped, not failed
                self.skip(self._in_flight_step, f"{type(exc).__name__}: {exc}", local=True, unreserve=False)
        except Exception as exc:  # noqa: BLE001 - counted; step() raises after too many in a row
            self._count_failure(exc)
        else:
            self.consecutive_failures = 0
        self.in_flight = None
        return pending

    def _count_failure(self, exc: BaseException) -> None:
        self.run.last_error = f"snapshot failed: {type(exc).__name__}: {exc}"
        self.failures += 1
        self.consecutive_failures += 1
        self.last_exception = exc
        log.error("%s: snapshot failed (%d in a row): %s", self.run.where(), self.consecutive_failures, exc)

    def before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """The optimizer step pre-hook: the one place training waits for a snapshot, and
        only for its copies from the model (checksums, remote copies and the publish go on
        in the background; a failure there is counted by :meth:`wait`).

        CUDA snapshots: the update is ordered after the copies on the device, the host
        does not block; the device-side wait is measured by timing events and booked by
        :meth:`collect_device_stall` once it has run."""
        batch = self._batch
        if batch is not None:
            self._batch = None
            pending = not batch.query()      # still copying: the update will wait for it
            batch.order_update()             # always: the query may race with the completion
            if pending:
                self._stall_batch = batch
            else:
                self.stall_last = 0.0
            return
        t0 = time.perf_counter()
        if self.wait_copies():
            self._book_stall(time.perf_counter() - t0, device=False)

    def wait_copies(self) -> bool:
        """Wait until the newest snapshot's copies from the model are done (not its
        checksums, remote copies or publish); True if they were still running."""
        copied = self._copied
        if copied.is_set():
            return False
        copied.wait()
        return True

    def _book_stall(self, seconds: float, *, device: bool) -> None:
        self.stall_last = seconds
        self.stall_total += seconds
        self.stalls += 1
        if device:
            self.device_stall_last = seconds
            self.device_stall_total += seconds
        else:
            self.host_stall_last = seconds
            self.host_stall_total += seconds

    def collect_device_stall(self) -> None:
        """Book how long the training stream waited for the last CUDA snapshot's copies,
        once that wait has run on the device (a no-op otherwise)."""
        batch = self._stall_batch
        if batch is None:
            return
        seconds = batch.stall_seconds()
        if seconds is None:
            return
        self._stall_batch = None
        self._book_stall(seconds, device=True)

    def failing(self) -> bool:
        """``max_consecutive_failures`` snapshots in a row failed on this rank."""
        return self.consecutive_failures >= self.cfg.max_consecutive_failures

    def failure_error(self, last_persisted_step: int | None) -> CheckpointError:
        """What every rank raises once any rank is :meth:`failing` (a decision the ranks
        take together, see :mod:`moc._coordination`)."""
        limit = self.cfg.max_consecutive_failures
        cause = self.last_exception if self.failing() else None
        where = f"rank {self.run.rank}" if cause is not None else "another rank"
        err = CheckpointError(
            f"{self.run.where()}: {limit} snapshots in a row failed on {where}; nothing newer than step "
            f"{last_persisted_step} is protected. Last error: {self.run.last_error}")
        err.__cause__ = cause
        return err

    # -- reading back ----------------------------------------------------------------------
    def newest_state(self) -> tuple[int, dict[str, Any]] | None:
        """(step, {unit: tree}) of the newest complete snapshot; units split with other
        ranks hold only this rank's bytes and are left out."""
        self.wait()
        with self.run.lock:
            buf = self.pool.newest_complete()
            if buf is None:
                return None
            buf.users += 1     # a lease: not refilled while it is read
        try:
            trees = {}
            for piece in buf.header["pieces"]:
                u = buf.header["units"][piece["unit"]]
                if piece["start"] != 0 or piece["end"] != u["unit_nbytes"]:
                    continue
                data = bytearray(buf.view(piece["offset"], piece["end"] - piece["start"]))
                trees[piece["unit"]] = decode_tree(u["skeleton"], [TensorMeta.from_json(t) for t in u["tensors"]],
                                                   data)
            assert buf.step is not None     # newest_complete picks only buffers holding a step
            return buf.step, trees
        finally:
            self.pool.release(buf)

    # -- ending ----------------------------------------------------------------------------
    def abandon(self, grace: timedelta) -> None:
        """Detach: give the copy in flight ``grace`` to finish; one still blocked in a
        collective is left behind (``run.abandoned`` stops it from publishing), once the
        copies into its buffer are done (:meth:`quiesce`)."""
        fut = self.in_flight
        if fut is not None:
            # exception(), not result(): a re-raised exception would carry this frame (and
            # its callers', the manager's) in the traceback the future keeps for its other
            # readers (the persist thread), keeping the detached manager alive with it.
            try:
                exc = fut.exception(timeout=grace.total_seconds())
            except FuturesTimeout:
                log.warning("rank %d: background snapshot still blocked at reconfiguration; abandoned",
                            self.run.rank)
            except FuturesCancelled:
                pass
            else:
                if exc is not None:   # the group is gone; the snapshot stays in memory
                    log.warning("rank %d: in-flight snapshot abandoned at reconfiguration: %s", self.run.rank, exc)
            self.in_flight = None
        self.quiesce()

    def quiesce(self) -> None:
        """Wait until nothing writes into a buffer any more: the newest device copies'
        completion events, and the snapshot thread's own copies (never blocked by peers:
        only remote copies wait on them, and those check ``run.abandoned``). Called
        before the buffers change hands or are released."""
        batch, self._last_batch = self._last_batch, None
        if batch is not None:
            try:
                with runtime().device_guard(batch.device):   # the calling thread keeps its device
                    batch.synchronize()
            except Exception as exc:  # noqa: BLE001 - a failed device writes no more; close/detach go on
                log.error("%s: waiting for the snapshot copies failed: %s", self.run.where(), exc)
        if not self._local_done.wait(self.cfg.coordination_timeout.total_seconds()):
            log.error("%s: the snapshot thread's copies did not finish within %s", self.run.where(),
                      self.cfg.coordination_timeout)

    def retire_buffers(self) -> None:
        """Keep every complete buffer as a memory-only recovery source (its shares were
        planned for this group: a successor on another group must not persist them, the
        pieces of lost ranks would be missing) and drop the incomplete one."""
        with self.run.lock:
            self.pool.unreserve()
            self._reserved = None
            for b in self.pool.buffers:
                b.persisted = True
                if b.state == PERSIST:
                    b.state = READY
                elif b.state == SNAPSHOT:
                    b.invalidate()
                    b.state = FREE

    def shutdown(self, *, wait: bool = True) -> None:
        self._exec.shutdown(wait=wait)
        self._hashers.shutdown(wait=wait)
