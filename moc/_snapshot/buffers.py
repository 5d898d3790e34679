"""The snapshot level: three preallocated CPU buffers in shared memory.

Each buffer is a file mapped into the process (``/dev/shm`` by default), so a snapshot
outlives a killed training process on the same node and the restarted process recovers
from memory. A buffer's contents count only once its header (``buf<i>.json``) is
published, atomically, after the copy is complete; before a buffer is refilled its
header is removed first. A torn snapshot is therefore never read.

States cycle SNAPSHOT (being filled) -> PERSIST (being written to storage) -> RECOVERY
(the newest complete copy, kept for fast restore); a buffer not needed by either of those
roles is FREE. A buffer grows when a snapshot outgrows it and shrinks when it is more than
twice the size its next snapshot needs (the first, full checkpoint's buffer, typically).

Who may touch a buffer (the rules that keep a snapshot from ever raising into training
for lack of one, and a stale thread from ever writing into a buffer someone else fills):

* One lock per pool (:attr:`BufferPool.lock`), shared by every manager that uses the pool
  (a handover passes the pool, and with it the lock), guards states, reservations and leases.
* A thread that reads or writes a buffer's bytes holds a lease on it (:meth:`BufferPool.lease`)
  until it is done, whatever way it ends; a leased buffer is never handed out to be filled,
  even when the manager that started the thread was detached meanwhile.
* The buffer for the next snapshot is reserved (:meth:`BufferPool.reserve`) before the ranks
  decide on that snapshot, and grown there to the size the last snapshot needed, so a rank
  that has no buffer (every one busy, or ``/dev/shm`` full) says so in the round and every
  rank skips that snapshot together, rather than one raising.
* Growth reserves the file's pages (``posix_fallocate``) so a full ``/dev/shm`` is an
  ``OSError`` (ENOSPC) at that point, never a SIGBUS while copying.

For snapshots of CUDA tensors a buffer is page-locked (``cudaHostRegister`` of its
mapping, :func:`moc._cuda.copies.host_register`) so device-to-host copies into it are
asynchronous. The page-locking lifecycle, by CUDA's rules (see :mod:`moc._cuda.calls`):

* a registration is released before any truncate that cuts into it and before its
  mapping is dropped, and a range is never registered twice;
* registering costs ~0.2-0.5 s per GB, so it never runs in ``step()``: a buffer created or
  grown by a snapshot is page-locked by an *upkeep* thread (bound to the snapshot's
  device) once that snapshot's copies are done, together with the truncate of a shrink;
  the snapshot that grew it is copied by the snapshot thread instead (the slow path, its
  wait counted as stall). A shrink keeps the old registration for its copies (they fall
  inside it) and swaps it for the smaller one afterwards. Resizing a buffer whose upkeep
  still runs waits for it (warm-up only: a buffer is reused two snapshots later at the
  earliest);
* every registration is released by :meth:`BufferPool.unpin` / :meth:`BufferPool.remove_files`
  (close, detach), else at process exit (:mod:`moc._cuda.copies`'s registry).

A buffer that cannot be page-locked keeps the reason (``pin_error``) and is not retried
until it is mapped anew.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, cast

import torch
import xxhash

from .._cuda import HostRegistration, host_register, runtime

__all__ = ["SnapshotBuffer", "BufferPool", "FREE", "SNAPSHOT", "READY", "PERSIST"]

FREE, SNAPSHOT, READY, PERSIST = "free", "snapshot", "ready", "persist"
HEADER_VERSION = 1
SHRINK_MIN = 1 << 20  # buffers below this are never shrunk (resizing costs more)


def _pages(n: int) -> int:
    return -(-max(n, 4096) // 4096) * 4096


def _checksum_header(body: dict[str, Any]) -> str:
    return "xxh3:" + xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


@dataclass
class SnapshotBuffer:
    index: int
    directory: str
    capacity: int = 0
    data: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    state: str = FREE
    step: int | None = None
    persisted: bool = False
    header: dict[str, Any] = field(default_factory=dict)
    pin_error: str | None = None   # why page-locking this mapping failed (not retried until remapped)
    _map: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8), repr=False)
    _mapped: int = 0
    _upkeep: threading.Thread | None = field(default=None, repr=False)
    _shrink_to: int | None = field(default=None, repr=False)   # a truncate waiting for start_upkeep()
    _reg: HostRegistration | None = field(default=None, repr=False)
    _pin_device: torch.device | None = field(default=None, repr=False)   # page-lock for this device's copies
    _reg_device: torch.device | None = field(default=None, repr=False)   # whose context registered it
    users: int = 0                # threads reading or writing its bytes (BufferPool.lease)
    reserved: bool = False        # picked for the next snapshot (BufferPool.reserve)
    _allocated: int = field(default=0, repr=False)   # bytes of the file whose pages are reserved

    @property
    def path(self) -> str:
        return os.path.join(self.directory, f"buf{self.index}.bin")

    @property
    def header_path(self) -> str:
        return os.path.join(self.directory, f"buf{self.index}.json")

    @property
    def pinned(self) -> bool:
        """Page-locked over its whole capacity."""
        return self.capacity > 0 and self.pinned_for(self.capacity)

    def pinned_for(self, nbytes: int) -> bool:
        """Are the first ``nbytes`` page-locked (copies into them asynchronous)? False
        while the upkeep thread may be changing the registration."""
        upkeep = self._upkeep
        return (upkeep is None or not upkeep.is_alive()) and self._locked(nbytes)

    def _locked(self, nbytes: int) -> bool:
        reg = self._reg
        return reg is not None and reg.covers(self.data, nbytes)

    def ensure(self, nbytes: int, *, pin: torch.device | None = None, defer_upkeep: bool = False) -> None:
        """Make the buffer at least ``nbytes`` long; ``pin``: page-locked for copies from
        that CUDA device (by the upkeep thread, see the module docstring).

        It grows when it must, and shrinks when it is more than twice what is needed: the
        first checkpoint holds every unit, later partial ones a fraction of that, and
        without shrinking all three buffers would stay the size of the full state. A
        shrunk buffer keeps 25% headroom so that snapshots of slightly different sizes do
        not resize it again. Shrinking truncates the file in the upkeep thread (freeing
        a GB of tmpfs pages takes ~0.1-0.2 s) and keeps the mapping, so growing back up to
        the mapped size is another truncate, not a new map. While that truncate runs,
        writes into the buffer's remaining pages are slow too (0.2 s for a few KB, measured
        on a 1.3 GB buffer): ``defer_upkeep`` leaves it, and the page-locking, to
        :meth:`start_upkeep`, called once the copies into the buffer are done.

        Never registers memory itself: on the calling thread it at most releases a
        registration that a truncate or a new mapping would cut into.
        """
        if pin is not None:
            self._pin_device = pin
        self.settle()
        if nbytes <= self.capacity <= max(2 * nbytes, SHRINK_MIN):
            self._reserve_pages(self.capacity)   # a no-op unless an earlier growth failed
            if not defer_upkeep:
                self.start_upkeep()
            return
        if nbytes > self.capacity:
            capacity = _pages(nbytes)
            if capacity <= self._mapped:
                self._truncate(capacity)     # a grow (a pending shrink's truncate never ran)
                self._reserve_pages(capacity)
            else:
                self._release_pin()          # before its mapping goes
                self.data = self._map = torch.empty(0, dtype=torch.uint8)
                self.pin_error = None        # a new mapping may page-lock where the old did not
                if not os.path.exists(self.path):
                    open(self.path, "wb").close()
                    self._allocated = 0
                self._truncate(capacity)
                try:
                    self._reserve_pages(capacity)
                except OSError:              # the old mapping is gone: the buffer is empty now
                    self.capacity = self._mapped = self._allocated = 0
                    os.truncate(self.path, 0)
                    raise
                self._map = torch.from_file(self.path, shared=True, size=capacity, dtype=torch.uint8)
                self._mapped = capacity
            self._shrink_to = None
        else:
            # The registration (if any) covers the old, larger size: copies into the first
            # ``capacity`` bytes stay asynchronous; the upkeep thread swaps it for a
            # smaller one around the truncate.
            capacity = _pages(nbytes + nbytes // 4)
            self._shrink_to = capacity
            self._allocated = min(self._allocated, capacity)
        self.capacity = capacity
        self.data = self._map[:capacity]
        if not defer_upkeep:
            self.start_upkeep()

    def _reserve_pages(self, capacity: int) -> None:
        """Back the file's pages up to ``capacity`` now (tmpfs allocates them lazily, and a
        write into a page it cannot allocate kills the process with SIGBUS). On failure the
        file goes back to the size it had and ``OSError`` says why."""
        if capacity <= self._allocated:
            return
        if hasattr(os, "posix_fallocate"):
            fd = os.open(self.path, os.O_RDWR)
            try:
                os.posix_fallocate(fd, self._allocated, capacity - self._allocated)
            except OSError as exc:
                if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):   # a file system without it
                    self._allocated = capacity
                    return
                reg = self._reg        # never cut into a registration (a shrunk buffer keeps its larger one)
                os.ftruncate(fd, max(self.capacity, reg.nbytes if reg is not None else 0))
                free = ""
                with contextlib.suppress(OSError):
                    st = os.statvfs(self.directory)
                    free = f", {st.f_bavail * st.f_frsize / 2**20:.1f} MiB free there"
                raise OSError(exc.errno, f"snapshot buffer {self.path} cannot grow from {self.capacity} to "
                                         f"{capacity} bytes ({os.strerror(exc.errno or 0)}{free})") from exc
            finally:
                os.close(fd)
        self._allocated = capacity

    def start_upkeep(self) -> None:
        """Bring the file to the buffer's size (a shrink's truncate) and the page-locking to
        its capacity, in a background thread; a no-op when nothing is to do. Called once
        the copies into the buffer are done (a registration changes under none)."""
        if self._upkeep is not None:
            return
        shrink_to, self._shrink_to = self._shrink_to, None
        pin = self._pin_device is not None and self.pin_error is None and self.capacity > 0
        if shrink_to is None and not (pin and not self._locked(self.capacity)):
            return
        device = self._pin_device if self._pin_device is not None else self._reg_device
        self._upkeep = threading.Thread(target=self._upkeep_run, args=(shrink_to, device, pin),
                                        name=f"moc-buffer{self.index}-upkeep", daemon=True)
        self._upkeep.start()

    def _upkeep_run(self, shrink_to: int | None, device: torch.device | None, pin: bool) -> None:
        if device is not None and runtime().is_available():
            runtime().set_device(device)     # our thread: its CUDA calls run in this device's context
        if shrink_to is not None:
            self._truncate(shrink_to)        # releases a registration it would cut into first
        if pin and not self._locked(self.capacity):
            self._release_pin()              # the smaller registration of a grown buffer
            self._reg, self.pin_error = host_register(self.data, where=f"snapshot buffer {self.path}")
            self._reg_device = device

    def _truncate(self, size: int) -> None:
        """Set the file's size, releasing first a registration the truncate would cut into."""
        if self._reg is not None and self._reg.nbytes > size:
            self._release_pin()
        os.truncate(self.path, size)

    def _release_pin(self) -> None:
        reg, self._reg = self._reg, None
        if reg is None:
            return
        device = self._reg_device
        if device is None or threading.current_thread() is self._upkeep:
            reg.release()
            return
        with runtime().device_guard(device):  # the caller's thread keeps its own device
            reg.release()

    def settle(self) -> None:
        """Wait for the upkeep thread (truncate, page-locking) to finish."""
        if self._upkeep is not None:
            self._upkeep.join()
            self._upkeep = None

    def unpin(self) -> None:
        """Release the page-locking (after any upkeep); the mapping and contents stay."""
        self.settle()
        self._release_pin()

    def invalidate(self) -> None:
        """Withdraw the published snapshot before the bytes get overwritten."""
        try:
            os.remove(self.header_path)
        except FileNotFoundError:
            pass
        self.step = None
        self.persisted = False

    def publish(self, header: dict[str, Any]) -> None:
        body = dict(header, version=HEADER_VERSION, buffer=self.index)
        body["checksum"] = _checksum_header(body)
        tmp = f"{self.header_path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "w") as f:
                json.dump(body, f)
            os.replace(tmp, self.header_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise

    def view(self, offset: int, nbytes: int) -> memoryview:
        # ignore: numpy's stubs give ndarray __buffer__ only on Python >= 3.12
        return memoryview(self.data[offset: offset + nbytes].numpy()).cast("B")  # type: ignore[arg-type, unused-ignore]


def read_headers(directory: str) -> list[dict[str, Any]]:
    """Published, intact snapshot headers found in ``directory`` (any process's)."""
    out: list[dict[str, Any]] = []
    if not os.path.isdir(directory):
        return out
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("buf") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                body = json.load(f)
            stored = body.pop("checksum", None)
            if stored != _checksum_header(body) or body.get("version") != HEADER_VERSION:
                continue
            out.append(body)
        except (OSError, ValueError):
            continue
    return out


class BufferPool:
    """Three buffers and the rules for picking one to fill (see the module docstring)."""

    def __init__(self, directory: str, count: int = 3) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.buffers = [SnapshotBuffer(i, directory) for i in range(count)]
        self.lock = threading.RLock()   # shared by every manager using the pool (RunState.lock)

    def newest_complete(self) -> SnapshotBuffer | None:
        done = [b for b in self.buffers if b.step is not None and b.state in (READY, PERSIST)]
        return max(done, key=lambda b: cast(int, b.step)) if done else None     # done: buffers with a step

    def victim(self, nbytes: int = 0, *, exclude: SnapshotBuffer | None = None) -> SnapshotBuffer | None:
        """The buffer the next snapshot (``nbytes`` long, if known) would fill: the reserved
        one, else one that is free or complete but neither being persisted nor the newest
        complete copy (that one is the RECOVERY copy), and never one a thread still reads
        or writes (leased). Among those: a free one first (an older complete snapshot is
        kept as long as possible), one big enough (no growth) before one that must grow, then
        the oldest. None when there is none."""
        for b in self.buffers:
            if b.reserved and b is not exclude:
                return b
        newest = self.newest_complete()
        candidates = [b for b in self.buffers if b.users == 0 and b is not exclude
                      and (b.state == FREE or (b.state == READY and b is not newest))]
        if not candidates:
            return None
        return min(candidates, key=lambda b: (b.state != FREE, b.capacity < nbytes,
                                              -1 if b.step is None else b.step, b.index))

    def reserve(self, nbytes: int = 0) -> SnapshotBuffer | None:
        """Pick the buffer for the next snapshot (:meth:`victim`) and keep it from
        everyone else (a persist looking for its step, the next pick) until
        :meth:`acquire` or :meth:`unreserve`; its published snapshot stays valid until
        then. None when every buffer is busy. Call with :attr:`lock` held."""
        self.unreserve()
        b = self.victim(nbytes)
        if b is not None:
            b.reserved = True
        return b

    def unreserve(self) -> None:
        """Give the reservation back (the snapshot was skipped). Call with :attr:`lock` held."""
        for b in self.buffers:
            b.reserved = False

    def acquire(self, buf: SnapshotBuffer | None = None) -> SnapshotBuffer:
        """The buffer to fill: ``buf`` (reserved), else :meth:`victim`; its published
        snapshot withdrawn, state SNAPSHOT, leased to the caller (who must
        :meth:`release` it once the copies into it are done)."""
        b = buf if buf is not None else self.victim()
        if b is None:
            raise RuntimeError("no snapshot buffer available: every buffer is being filled, persisted or is the "
                               "newest complete snapshot (reserve() first and skip the snapshot when it is None)")
        if b.users:
            raise RuntimeError(f"snapshot buffer {b.index} is still in use by {b.users} thread(s)")
        self.unreserve()
        b.invalidate()
        b.state = SNAPSHOT
        b.users += 1
        return b

    def release(self, buf: SnapshotBuffer) -> None:
        """End a lease taken by :meth:`acquire` or :meth:`lease`."""
        with self.lock:
            buf.users = max(0, buf.users - 1)

    @contextlib.contextmanager
    def lease(self, buf: SnapshotBuffer) -> Iterator[SnapshotBuffer]:
        """Hold ``buf`` while reading it: it is not refilled until the block ends."""
        with self.lock:
            buf.users += 1
        try:
            yield buf
        finally:
            self.release(buf)

    def unpin(self) -> None:
        """Release the page-locking of every buffer (the files and their contents stay),
        once any upkeep is done. Called when the buffers change hands (detach) or stop
        being used (close): the caller has waited for every copy into them."""
        for b in self.buffers:
            b.unpin()

    def pin_error(self) -> str | None:
        """Why a buffer could not be page-locked (the first such buffer's reason), else None."""
        return next((f"buffer {b.index}: {b.pin_error}" for b in self.buffers if b.pin_error is not None), None)

    def pinned_count(self) -> int:
        """Buffers in use that are page-locked over their whole capacity."""
        return sum(1 for b in self.buffers if b.pinned)

    def allocated_bytes(self) -> int:
        return sum(b.capacity for b in self.buffers)

    def remove_files(self) -> None:
        for b in self.buffers:
            b.invalidate()
            b.unpin()
            b.data = b._map = torch.empty(0, dtype=torch.uint8)
            b.capacity = b._mapped = 0
            try:
                os.remove(b.path)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self.directory)
        except OSError:
            pass
