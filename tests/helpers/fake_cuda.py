"""A stand-in for the CUDA runtime moc calls (:mod:`moc._cuda.calls`), for machines without a GPU.

It keeps CUDA's rules instead of waving calls through:

* ``host_register`` of a range overlapping a live registration returns 712
  (``cudaErrorHostMemoryAlreadyRegistered``); of memory that is not mapped, 1
  (``cudaErrorInvalidValue``); ``host_unregister`` of an address that does not start a
  live registration returns 713 (``cudaErrorHostMemoryNotRegistered``). Every non-zero
  return is kept in :attr:`FakeCuda.errors`.
* Truncating a file (``os.truncate`` / ``os.ftruncate``, patched while installed) so that
  it cuts into a registered range is a violation, and so is a registered range found no
  longer mapped to the file it was registered over (checked at every call and by
  :meth:`FakeCuda.check`, with ``/proc/self/maps``). Violations raise
  :class:`CudaRuleViolation` where they happen and are kept in :attr:`FakeCuda.violations`
  (a background thread's exception would otherwise be lost).
* A thread's current device is 0 until it sets one, and calls without a device argument
  (``host_register``, ``host_unregister``, ``Event.query`` / ``Event.synchronize``) run in
  that device's context: :attr:`FakeCuda.contexts` records every device a context was
  created on, and by which thread.
* Streams and events keep device time: work issued inside ``use_stream(side)`` on a
  created (side) stream takes ``copy_seconds``; an event completes when the work queued
  before it on its stream has; ``wait_event`` orders a stream after an event;
  ``synchronize`` sleeps until completion; ``elapsed_time`` is the device time between two
  events. So an event of copies still "in flight" really is incomplete
  (:meth:`FakeCuda.incomplete_events`). Every host wait on the device (an event's or a
  stream's ``synchronize``) is kept in :attr:`FakeCuda.host_syncs` with its thread.

Which tensors are "on a device" is set with :meth:`FakeCuda.place` (their storage); the
copies themselves are ordinary host copies.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch

from moc import _cuda

SUCCESS, INVALID_VALUE = 0, 1
ALREADY_REGISTERED, NOT_REGISTERED = 712, 713


class CudaRuleViolation(AssertionError):
    """Something real CUDA would corrupt memory or fail over."""


@dataclass
class _Mapping:
    start: int
    end: int
    offset: int
    dev: int
    inode: int
    path: str


def _maps() -> list[_Mapping]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            out.append(_Mapping(lo, hi, int(parts[2], 16), os.makedev(major, minor), int(parts[4]),
                                parts[5].strip() if len(parts) > 5 else ""))
    return out


@dataclass
class Registration:
    ptr: int
    nbytes: int
    thread: str
    device: int
    file: tuple[int, int] | None      # (st_dev, st_ino) of the mapped file
    file_offset: int                  # where the range starts in that file

    @property
    def end(self) -> int:
        return self.ptr + self.nbytes


@dataclass
class FakeStream:
    cuda: "FakeCuda"
    device: torch.device
    side: bool
    tail: float = 0.0     # monotonic time its queued work is done

    def queue(self, seconds: float) -> None:
        self.tail = max(self.tail, time.monotonic()) + seconds

    def wait_event(self, event: "FakeEvent") -> None:
        if event.at is None:
            return                                   # CUDA: waiting on an unrecorded event is a no-op
        self.tail = max(self.tail, event.at)

    def synchronize(self) -> None:
        self.cuda._host_sync("stream.synchronize")
        delay = self.tail - time.monotonic()
        if delay > 0:
            time.sleep(delay)


@dataclass
class FakeEvent:
    cuda: "FakeCuda"
    timing: bool
    at: float | None = None
    device: torch.device | None = None

    def record(self, stream: FakeStream) -> None:
        self.cuda._context(stream.device.index)      # torch guards to the stream's device
        self.at = max(stream.tail, time.monotonic())
        self.device = stream.device
        with self.cuda._lock:
            self.cuda.events.append(self)

    def query(self) -> bool:
        self.cuda._context(None)
        return self.at is None or time.monotonic() >= self.at

    def synchronize(self) -> None:
        self.cuda._context(None)
        self.cuda._host_sync("event.synchronize")
        if self.at is not None:
            delay = self.at - time.monotonic()
            if delay > 0:
                time.sleep(delay)

    def elapsed_time(self, end: "FakeEvent") -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("elapsed_time needs two events created with enable_timing=True")
        if self.at is None or end.at is None or not end.query():
            raise RuntimeError("elapsed_time of an event not recorded or not completed")
        return (end.at - self.at) * 1e3


@dataclass
class FakeCuda:
    """See the module docstring. ``device_count`` devices; side-stream work takes
    ``copy_seconds`` of device time per ``use_stream`` block."""

    device_count: int = 2
    copy_seconds: float = 0.0
    fail_register: int = SUCCESS          # a non-zero cudaError every host_register returns
    live: dict[int, Registration] = field(default_factory=dict)
    registered: list[Registration] = field(default_factory=list)   # every successful registration
    errors: list[tuple[str, int, str]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    contexts: dict[int, set[str]] = field(default_factory=dict)     # device -> threads that used it
    events: list[FakeEvent] = field(default_factory=list)
    host_syncs: list[tuple[str, str]] = field(default_factory=list)   # (thread, call) of every host wait

    def __post_init__(self) -> None:
        self._lock = threading.RLock()
        self._local = threading.local()
        self._placed: dict[int, int] = {}          # storage data_ptr -> device index
        self._default = {i: FakeStream(self, torch.device("cuda", i), side=False) for i in range(self.device_count)}
        self._rng = [torch.tensor([i, 0, 0, 0], dtype=torch.uint8) for i in range(self.device_count)]

    # -- installing ------------------------------------------------------------------------
    @contextmanager
    def installed(self) -> Iterator["FakeCuda"]:
        """moc calls this runtime inside the block; ``os.truncate`` / ``os.ftruncate`` are
        checked against live registrations."""
        real_truncate, real_ftruncate = os.truncate, os.ftruncate

        def truncate(path, length):
            self._check_truncate(os.stat(path), length, f"truncate({path!r}, {length})")
            return real_truncate(path, length)

        def ftruncate(fd, length):
            self._check_truncate(os.fstat(fd), length, f"ftruncate({fd}, {length})")
            return real_ftruncate(fd, length)

        os.truncate, os.ftruncate = truncate, ftruncate
        try:
            with _cuda.use_runtime(self):
                yield self
        finally:
            os.truncate, os.ftruncate = real_truncate, real_ftruncate

    def place(self, tensors: Iterable[torch.Tensor], device: int) -> None:
        """Treat these (CPU) tensors as living on fake ``cuda:<device>``."""
        for t in tensors:
            self._placed[t.untyped_storage().data_ptr()] = device

    # -- rules -----------------------------------------------------------------------------
    def _violate(self, what: str) -> None:
        with self._lock:
            self.violations.append(what)
        raise CudaRuleViolation(what)

    def _error(self, call: str, code: int, detail: str) -> int:
        with self._lock:
            self.errors.append((call, code, detail))
        return code

    def _context(self, device: int | None) -> int:
        index = self.current_device() if device is None else device
        with self._lock:
            self.contexts.setdefault(index, set()).add(threading.current_thread().name)
        return index

    def _check_truncate(self, st: os.stat_result, length: int, call: str) -> None:
        with self._lock:
            cut = [r for r in self.live.values()
                   if r.file == (st.st_dev, st.st_ino) and r.file_offset + r.nbytes > length]
        if cut:
            self._violate(f"{call} cuts into {len(cut)} registered range(s) "
                          f"(first: {cut[0].nbytes} bytes at file offset {cut[0].file_offset})")

    def check(self) -> None:
        """Every live registration is still mapped to the file range it was made over."""
        with self._lock:
            regs = list(self.live.values())
        if not regs:
            return
        maps = _maps()
        for r in regs:
            pos = r.ptr
            while pos < r.end:
                m = next((m for m in maps if m.start <= pos < m.end), None)
                if m is None:
                    self._violate(f"registered range at {r.ptr:#x} ({r.nbytes} bytes) was unmapped")
                if r.file is not None and ((m.dev, m.inode) != r.file
                                           or m.offset + (pos - m.start) != r.file_offset + (pos - r.ptr)):
                    self._violate(f"registered range at {r.ptr:#x} now maps another file range")
                pos = m.end

    # -- the runtime moc calls ------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_of(self, t: torch.Tensor) -> torch.device | None:
        if t.device.type != "cpu":
            return None
        index = self._placed.get(t.untyped_storage().data_ptr())
        return None if index is None else torch.device("cuda", index)

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, device: torch.device | int) -> None:
        index = device if isinstance(device, int) else device.index
        if not 0 <= index < self.device_count:
            raise RuntimeError(f"invalid device ordinal {index}")
        self._local.device = index
        self._context(index)          # CUDA 12: cudaSetDevice initialises the primary context

    @contextmanager
    def device_guard(self, device: torch.device):
        previous = self.current_device()
        self.set_device(device)
        try:
            yield
        finally:
            self._local.device = previous

    def host_register(self, ptr: int, nbytes: int, flags: int = 1) -> int:
        device = self._context(None)
        self.check()
        if self.fail_register:
            return self._error("cudaHostRegister", self.fail_register, "refused (fail_register)")
        if nbytes <= 0:
            return self._error("cudaHostRegister", INVALID_VALUE, "0 bytes")
        with self._lock:
            overlap = [r for r in self.live.values() if r.ptr < ptr + nbytes and ptr < r.end]
            if overlap:
                return self._error("cudaHostRegister", ALREADY_REGISTERED,
                                   f"[{ptr:#x}, +{nbytes}) overlaps a registration at {overlap[0].ptr:#x}")
        maps = _maps()
        first = next((m for m in maps if m.start <= ptr < m.end), None)
        pos = ptr
        while pos < ptr + nbytes:
            m = next((m for m in maps if m.start <= pos < m.end), None)
            if m is None:
                return self._error("cudaHostRegister", INVALID_VALUE, f"{pos:#x} is not mapped")
            pos = m.end
        file = (first.dev, first.inode) if first.inode else None
        reg = Registration(ptr, nbytes, threading.current_thread().name, device, file,
                           first.offset + (ptr - first.start))
        with self._lock:
            self.live[ptr] = reg
            self.registered.append(reg)
        return SUCCESS

    def host_unregister(self, ptr: int) -> int:
        self._context(None)
        self.check()
        with self._lock:
            if self.live.pop(ptr, None) is None:
                return self._error("cudaHostUnregister", NOT_REGISTERED, f"{ptr:#x} starts no registration")
        return SUCCESS

    def new_stream(self, device: torch.device) -> FakeStream:
        self._context(device.index)
        return FakeStream(self, device, side=True)

    def current_stream(self, device: torch.device) -> FakeStream:
        current = getattr(self._local, "stream", None)
        if current is not None and current.device == device:
            return current
        return self._default[device.index]

    @contextmanager
    def use_stream(self, stream: FakeStream):
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous
            if stream.side:
                stream.queue(self.copy_seconds)    # the copies issued inside

    def new_event(self, *, timing: bool = False) -> FakeEvent:
        return FakeEvent(self, timing)

    def synchronize_stream(self, device: torch.device) -> None:
        self._context(device.index)
        self._default[device.index].synchronize()

    def _host_sync(self, call: str) -> None:
        with self._lock:
            self.host_syncs.append((threading.current_thread().name, call))

    def rng_states(self) -> list[torch.Tensor]:
        return [s.clone() for s in self._rng]

    def set_rng_states(self, states: Sequence[torch.Tensor]) -> int:
        n = min(len(states), self.device_count)
        for i in range(n):
            self._rng[i] = states[i].clone()
        return n

    # -- for tests -------------------------------------------------------------------------
    def reseed(self, device: int, value: int) -> None:
        """Change a device's RNG state (what generating random numbers on it would do)."""
        self._rng[device] = torch.tensor([device, value % 256, value // 256 % 256, 7], dtype=torch.uint8)

    def incomplete_events(self) -> list[FakeEvent]:
        with self._lock:
            return [e for e in self.events if e.at is not None and time.monotonic() < e.at]

    def registrations_by(self, thread_name: str) -> list[Registration]:
        with self._lock:
            return [r for r in self.registered if r.thread == thread_name]
