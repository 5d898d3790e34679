"""Where snapshot bytes come from: host tensors, or CUDA tensors copied on a side stream.

This is the only moc module that touches ``torch.cuda``. Two copiers share one interface:

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
serialise with training: never done here. When page-locking a buffer fails (locked-memory
limits), :class:`SnapshotEngine` falls back to copying from the snapshot thread, waited
for by the pre-hook like on CPU.

Restores copy host bytes into CUDA parameters and optimizer state with non-blocking
host-to-device copies (:func:`copy_into`) and one :func:`finish_copies` at the end.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack, contextmanager
from typing import Iterable, Iterator

import torch

__all__ = ["HostCopier", "CudaCopier", "CudaCopyBatch", "copier_for", "cuda_devices", "host_register",
           "host_unregister", "copy_into", "finish_copies"]

log = logging.getLogger("moc")

_CUDA_HOST_REGISTER_PORTABLE = 1   # cudaHostRegisterPortable: pinned for every CUDA context


def cuda_devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The distinct CUDA devices among ``tensors``, in first-seen order."""
    seen: dict[torch.device, None] = {}
    for t in tensors:
        if t.device.type == "cuda":
            seen.setdefault(t.device, None)
    return list(seen)


def host_register(t: torch.Tensor, *, where: str = "rank - step -") -> bool:
    """Page-lock the host memory of the CPU tensor ``t`` for the CUDA driver, so that
    device-to-host copies into it are asynchronous. False (nothing done) when CUDA is not
    available in this process or the driver refuses (locked-memory limits)."""
    if t.device.type != "cpu":
        raise ValueError(f"host_register needs a CPU tensor, got one on {t.device}")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0 or not torch.cuda.is_available():
        return False
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    if err != 0:
        log.warning("%s: cudaHostRegister of %d bytes failed (cudaError %d); snapshots of CUDA tensors fall "
                    "back to copies from the snapshot thread", where, nbytes, err)
        return False
    return True


def host_unregister(t: torch.Tensor, *, where: str = "rank - step -") -> None:
    """Undo :func:`host_register` (the memory stays mapped)."""
    if t.numel() == 0 or not torch.cuda.is_available():
        return
    err = int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))
    if err != 0:
        log.warning("%s: cudaHostUnregister failed (cudaError %d)", where, err)


class HostCopier:
    """Copies that complete in the call (CPU sources, or a buffer that is not page-locked).

    ``device_async`` False: the engine makes these copies on its snapshot thread and the
    optimizer pre-hook waits for that thread."""

    device_async = False
    pins_buffers = False

    def copy(self, plan, start: int, end: int, out: torch.Tensor) -> None:
        plan.copy_range(start, end, out)


class CudaCopyBatch:
    """One snapshot's device-to-host copies: ordered after the work already queued on the
    training stream(s), and ordering the next optimizer step after them.

    Created by :meth:`CudaCopier.begin` on the training thread right after
    ``optimizer.step()``."""

    def __init__(self, streams: dict[torch.device, torch.cuda.Stream]) -> None:
        self._streams = streams
        self._started: dict[torch.device, torch.cuda.Event] = {}
        self._done: dict[torch.device, torch.cuda.Event] = {}
        self._stall: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        for dev, side in streams.items():
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(dev))   # after optimizer.step()'s kernels
            side.wait_event(ready)
            start = torch.cuda.Event(enable_timing=True)
            start.record(side)
            self._started[dev] = start

    @contextmanager
    def issuing(self) -> Iterator[None]:
        """Copies made inside run on the side streams (``.contiguous()`` temporaries too,
        so the caching allocator frees them on the stream that used them)."""
        with ExitStack() as stack:
            for side in self._streams.values():
                stack.enter_context(torch.cuda.stream(side))
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
        for dev, side in self._streams.items():
            ev = torch.cuda.Event()
            ev.record(side)
            torch.cuda.current_stream(dev).wait_event(ev)

    def finish(self) -> None:
        """Record the completion event of every copy issued."""
        for dev, side in self._streams.items():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(side)
            self._done[dev] = ev

    def order_update(self) -> None:
        """The optimizer pre-hook: the update about to be queued waits, on the device, for
        the copies (the host does not block). Timing events around the wait measure how
        long the training stream actually waited (:meth:`stall_seconds`)."""
        for dev, done in self._done.items():
            stream = torch.cuda.current_stream(dev)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(stream)
            stream.wait_event(done)
            after.record(stream)
            self._stall.append((before, after))

    def query(self) -> bool:
        """Have all copies completed?"""
        return all(ev.query() for ev in self._done.values())

    def synchronize(self) -> None:
        """Block the calling (snapshot) thread until every copy has landed in host memory."""
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

    device_async = True
    pins_buffers = True

    def __init__(self, devices: Iterable[torch.device]) -> None:
        self.devices = list(devices)
        if not self.devices:
            raise ValueError("CudaCopier needs at least one CUDA device")
        self._streams = {d: torch.cuda.Stream(device=d) for d in self.devices}

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
            torch.cuda.current_stream(dev).synchronize()
