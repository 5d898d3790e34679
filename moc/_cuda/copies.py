"""Where snapshot bytes come from: host tensors, or CUDA tensors copied on a side stream.

CUDA calls go through :mod:`moc._cuda.calls` (a test installs a stand-in there). Two copiers
share one interface:

* :class:`HostCopier` (CPU tensors): a copy completes inside the call, so the snapshot
  thread makes them while training goes on, and the optimizer pre-hook waits for that
  thread (what moc always did on CPU).
* :class:`CudaCopier` (CUDA tensors): the copies are *issued* from ``step()`` on a side
  stream per device that first waits on an event recorded on the training stream right
  after ``optimizer.step()``; they land in page-locked (``cudaHostRegister``-ed) snapshot
  buffers, so they run asynchronously while the next forward/backward runs. The next
  optimizer step is ordered after them on the device (the training stream waits on the
  copies' completion event), which is the only stall; the snapshot thread waits on that
  event before checksumming and publishing. Persisting and hashing read host memory only.

A copy into pageable memory would be synchronous and, issued from the training stream,
serialise with training: never done here. A buffer not page-locked (yet: buffers are
page-locked in the background after a snapshot that created or grew them, see
:mod:`moc._snapshot.buffers`; or ever: locked-memory limits) makes :class:`SnapshotEngine` copy
from the snapshot thread instead, waited for by the pre-hook like on CPU.

Page-locking (:func:`host_register`) hands out :class:`HostRegistration` objects, kept in a
process-wide registry: each is released once by its owner, and what is left at exit is
released then.

Restores copy host bytes into CUDA parameters and optimizer state with non-blocking
host-to-device copies (:func:`copy_into`) and one :func:`finish_copies` at the end.
"""

from __future__ import annotations

import atexit
import logging
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterable, Iterator, Literal, TypeVar

import torch

from .calls import HOST_REGISTER_PORTABLE, SUCCESS, runtime

__all__ = ["HostCopier", "CudaCopier", "CudaCopyBatch", "HostRegistration", "copier_for", "cuda_devices",
           "host_register", "live_registrations", "copy_into", "finish_copies", "to_host_later", "LateCopies"]

log = logging.getLogger("moc")

M = TypeVar("M")


def cuda_devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The distinct CUDA devices among ``tensors``, in first-seen order."""
    rt = runtime()
    seen: dict[torch.device, None] = {}
    for t in tensors:
        dev = rt.device_of(t)
        if dev is not None:
            seen.setdefault(dev, None)
    return list(seen)


@dataclass(eq=False)
class HostRegistration:
    """One live ``cudaHostRegister`` of ``[ptr, ptr + nbytes)``; :meth:`release` undoes it
    (once). Every live one is in a process-wide registry, released at exit if its owner
    did not."""

    ptr: int
    nbytes: int
    where: str
    released: bool = False

    def covers(self, t: torch.Tensor, nbytes: int) -> bool:
        """Do the first ``nbytes`` of the CPU tensor ``t`` lie in this registration?"""
        start = t.data_ptr()
        return not self.released and self.ptr <= start and start + nbytes <= self.ptr + self.nbytes

    def release(self) -> bool:
        """``cudaHostUnregister``; True when the driver accepted it. The registration is
        gone from the registry either way (a refusal is logged: there is nothing left to
        retry with)."""
        with _LIVE_LOCK:
            if self.released:
                return True
            self.released = True
            _LIVE.pop(self.ptr, None)
        err = runtime().host_unregister(self.ptr)
        if err != SUCCESS:
            log.warning("%s: cudaHostUnregister of %d bytes failed (cudaError %d)", self.where, self.nbytes, err)
            return False
        return True


_LIVE: dict[int, HostRegistration] = {}
_LIVE_LOCK = threading.Lock()


def live_registrations() -> list[HostRegistration]:
    """The page-lockings moc holds in this process."""
    with _LIVE_LOCK:
        return list(_LIVE.values())


@atexit.register
def _release_at_exit() -> None:
    for reg in live_registrations():
        try:
            reg.release()
        except Exception:  # noqa: BLE001 - the runtime may already be torn down at exit
            pass


def host_register(t: torch.Tensor, nbytes: int | None = None, *,
                  where: str = "rank - step -") -> tuple[HostRegistration | None, str | None]:
    """Page-lock the first ``nbytes`` (default: all) of the CPU tensor ``t`` for the CUDA
    driver, so that device-to-host copies into them are asynchronous.

    Returns (the registration, None), or (None, why not): CUDA is not available in this
    process, or the driver refused (locked-memory limits, a mapping it cannot pin). The
    caller reports a refusal; nothing is logged here. The calling thread's current device
    must be set (the call runs in its context)."""
    if t.device.type != "cpu":
        raise ValueError(f"host_register needs a CPU tensor, got one on {t.device}")
    nbytes = t.numel() * t.element_size() if nbytes is None else nbytes
    if nbytes <= 0:
        return None, "nothing to page-lock (0 bytes)"
    rt = runtime()
    if not rt.is_available():
        return None, "CUDA is not available in this process"
    ptr = t.data_ptr()
    err = rt.host_register(ptr, nbytes, HOST_REGISTER_PORTABLE)
    if err != SUCCESS:
        return None, f"cudaHostRegister of {nbytes} bytes failed (cudaError {err})"
    reg = HostRegistration(ptr, nbytes, where)
    with _LIVE_LOCK:
        _LIVE[ptr] = reg
    return reg, None


class HostCopier:
    """Copies that complete in the call (CPU sources, or a buffer that is not page-locked).

    ``device_async`` False: the engine makes these copies on its snapshot thread and the
    optimizer pre-hook waits for that thread."""

    device_async: Literal[False] = False    # Literal: tells the two copiers apart for the type checker
    pins_buffers = False

    def copy(self, plan, start: int, end: int, out: torch.Tensor) -> None:
        plan.copy_range(start, end, out)


class CudaCopyBatch:
    """One snapshot's device-to-host copies: ordered after the work already queued on the
    training stream(s), and ordering the next optimizer step after them.

    Created by :meth:`CudaCopier.begin` on the training thread right after
    ``optimizer.step()``. ``device`` is the device a thread waiting on the copies binds
    (the first one's; events of other devices are waited on from its context)."""

    def __init__(self, streams: dict[torch.device, Any]) -> None:
        # streams and events are the runtime's (torch.cuda's, or a test's stand-in): Any, as in moc._cuda.calls
        rt = runtime()
        self._streams = streams
        self.device = next(iter(streams))
        self._started: dict[torch.device, Any] = {}
        self._done: dict[torch.device, Any] = {}
        self._stall: list[tuple[Any, Any]] = []
        for dev, side in streams.items():
            ready = rt.new_event()
            ready.record(rt.current_stream(dev))   # after optimizer.step()'s kernels
            side.wait_event(ready)
            start = rt.new_event(timing=True)
            start.record(side)
            self._started[dev] = start

    @contextmanager
    def issuing(self) -> Iterator[None]:
        """Copies made inside run on the side streams (``.contiguous()`` temporaries too,
        so the caching allocator frees them on the stream that used them)."""
        rt = runtime()
        with ExitStack() as stack:
            for side in self._streams.values():
                stack.enter_context(rt.use_stream(side))
            yield

    def copy(self, plan, start: int, end: int, out: torch.Tensor, *, non_blocking: bool = True) -> None:
        """Copy stream bytes ``[start, end)`` of ``plan`` into ``out`` on the side streams:
        asynchronously into page-locked ``out``; ``non_blocking=False`` (a pageable buffer)
        returns once the bytes are there."""
        with self.issuing():
            plan.copy_range(start, end, out, non_blocking=non_blocking)

    def fence(self) -> None:
        """Make the training stream(s) wait for the copies issued so far (state the next
        forward changes in place, such as running statistics)."""
        rt = runtime()
        for dev, side in self._streams.items():
            ev = rt.new_event()
            ev.record(side)
            rt.current_stream(dev).wait_event(ev)

    def finish(self) -> None:
        """Record the completion event of every copy issued."""
        rt = runtime()
        for dev, side in self._streams.items():
            ev = rt.new_event(timing=True)
            ev.record(side)
            self._done[dev] = ev

    def order_update(self) -> None:
        """The optimizer pre-hook: the update about to be queued waits, on the device, for
        the copies (the host does not block). Timing events around the wait measure how
        long the training stream actually waited (:meth:`stall_seconds`)."""
        rt = runtime()
        for dev, done in self._done.items():
            stream = rt.current_stream(dev)
            before, after = rt.new_event(timing=True), rt.new_event(timing=True)
            before.record(stream)
            stream.wait_event(done)
            after.record(stream)
            self._stall.append((before, after))

    def query(self) -> bool:
        """Have all copies completed?"""
        return all(ev.query() for ev in self._done.values())

    def synchronize(self) -> None:
        """Block the calling thread until every copy has landed in host memory (the
        thread's current device must be set: see :mod:`moc._cuda.calls`)."""
        for ev in self._done.values():
            ev.synchronize()

    def copy_seconds(self) -> float:
        """Device time of the copies (after :meth:`synchronize`): from the moment the side
        stream could start to the last copy's completion, longest device."""
        return max((self._started[d].elapsed_time(ev) / 1e3 for d, ev in self._done.items()), default=0.0)

    def stall_seconds(self) -> float | None:
        """How long the training stream(s) waited for the copies in :meth:`order_update`
        (longest device); None while that wait has not yet run on the device."""
        if not self._stall or not all(after.query() for _, after in self._stall):
            return None
        return max(before.elapsed_time(after) / 1e3 for before, after in self._stall)


class CudaCopier:
    """Side streams (one per device, created once and reused) for CUDA snapshot copies."""

    device_async: Literal[True] = True
    pins_buffers = True

    def __init__(self, devices: Iterable[torch.device]) -> None:
        self.devices = list(devices)
        if not self.devices:
            raise ValueError("CudaCopier needs at least one CUDA device")
        rt = runtime()
        self._streams = {d: rt.new_stream(d) for d in self.devices}

    @property
    def device(self) -> torch.device:
        """The device threads working for these copies bind (page-locking, waiting)."""
        return self.devices[0]

    def begin(self) -> CudaCopyBatch:
        return CudaCopyBatch(self._streams)


def copier_for(sources: Iterable[torch.Tensor], current: "HostCopier | CudaCopier | None" = None
               ) -> "HostCopier | CudaCopier":
    """The copier for a snapshot of ``sources``: CUDA when any of them lives on a CUDA
    device (``current`` is reused when it covers the same devices), else the host one."""
    devices = cuda_devices(sources)
    if not devices:
        return current if isinstance(current, HostCopier) else HostCopier()
    if isinstance(current, CudaCopier) and current.devices == devices:
        return current
    return CudaCopier(devices)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """``dst.copy_(src)``, non-blocking when it is a host-to-device copy; True when it was
    (the caller then calls :func:`finish_copies` before ``src``'s memory is reused)."""
    h2d = dst.device.type == "cuda" and src.device.type == "cpu"
    dst.copy_(src, non_blocking=h2d)
    return h2d


def finish_copies(devices: Iterable[torch.device]) -> None:
    """Wait for the non-blocking host-to-device copies issued on ``devices``."""
    for dev in dict.fromkeys(devices):
        if dev.type == "cuda":
            runtime().synchronize_stream(dev)


def to_host_later(t: torch.Tensor, out: torch.Tensor | None = None) -> tuple[Any, torch.Tensor]:
    """``(event, host)``: ``t`` copied to the host without waiting when it lives on a GPU
    (into page-locked memory: ``out`` when given, of ``t``'s shape and dtype, else fresh;
    a CUDA event recorded behind the copy: read ``host`` once ``event.query()`` is True or
    after ``event.synchronize()``); a host copy and no event otherwise. Small tensors only
    (routing counts, check flags)."""
    if t.device.type != "cuda":
        return None, t.cpu()
    host = out if out is not None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    with torch.cuda.device(t.device):
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    return event, host


def _device_side(t: torch.Tensor) -> bool:
    """True when :func:`to_host_later` copies ``t`` into page-locked memory (a GPU tensor)."""
    return t.device.type == "cuda"


class LateCopies(Generic[M]):
    """Small device tensors on their way to the host without waiting (routing counts, check
    flags), each with a label: :meth:`send` joins them per device (``join``: ``torch.cat``
    or ``torch.stack``) into one :func:`to_host_later` copy; :meth:`arrived` hands over the
    copies whose bytes have reached the host, with their labels in the order sent, and keeps
    the rest for a later call.

    The page-locked host tensors are reused: one handed over by :meth:`arrived` is valid
    until the next :meth:`send` or :meth:`arrived` call (read it, or copy from it, before),
    then it takes a later copy of the same shape and dtype. A step's copies are the same
    shapes every step, so after the first ones no page-locked memory is allocated."""

    #: Spare host tensors kept per (dtype, shape).
    SPARES = 4

    def __init__(self, join: Callable[[list[torch.Tensor]], torch.Tensor]) -> None:
        self._join = join
        # (event, host, labels, host is page-locked and ours to reuse)
        self._pending: list[tuple[Any, torch.Tensor, list[M], bool]] = []
        self._spare: dict[tuple[torch.dtype, tuple[int, ...]], list[torch.Tensor]] = {}
        self._handed: list[torch.Tensor] = []    # reusable ones handed over by the last arrived()
        self.allocations = 0                     # page-locked host tensors allocated (a test reads it)

    def _recycle(self) -> None:
        for host in self._handed:
            spares = self._spare.setdefault((host.dtype, tuple(host.shape)), [])
            if len(spares) < self.SPARES:
                spares.append(host)
        self._handed = []

    def _host_for(self, t: torch.Tensor) -> torch.Tensor | None:
        """A spare page-locked tensor for ``t``'s copy (None: let the copy allocate one)."""
        if not _device_side(t):
            return None
        spares = self._spare.get((t.dtype, tuple(t.shape)))
        if spares:
            return spares.pop()
        self.allocations += 1
        return None

    def __len__(self) -> int:
        return len(self._pending)

    def send(self, items: Iterable[tuple[torch.Tensor, M]]) -> None:
        by_device: dict[torch.device, list[tuple[torch.Tensor, M]]] = {}
        for t, label in items:
            by_device.setdefault(t.device, []).append((t, label))
        self._recycle()
        for group in by_device.values():
            joined = self._join([t for t, _ in group])
            event, host = to_host_later(joined, self._host_for(joined))
            self._pending.append((event, host, [label for _, label in group], _device_side(joined)))

    def arrived(self, *, wait: bool) -> list[tuple[torch.Tensor, list[M]]]:
        """The copies on the host (``wait``: all of them, waiting for the device); valid
        until the next call of :meth:`send` or :meth:`arrived`."""
        self._recycle()
        done, waiting, handed = [], [], []
        for event, host, labels, reusable in self._pending:
            if event is not None and not wait and not event.query():
                waiting.append((event, host, labels, reusable))
                continue
            if event is not None:
                event.synchronize()
            done.append((host, labels))
            if reusable:
                handed.append(host)
        self._pending = waiting
        self._handed = handed
        return done
