"""moc's one door to the CUDA runtime: page-locking, devices, streams, events, RNG.

Every CUDA call moc makes goes through :func:`runtime`, an object with the few methods
below (:class:`CudaRuntime` forwards them to ``torch.cuda``). Tests install a stand-in
(``tests/helpers/fake_cuda.py``) with :func:`use_runtime`; it enforces the CUDA rules these calls
are subject to (one registration per host range, unregister only what was registered, no
truncating or unmapping a registered range, contexts created on the calling thread's
current device), so the snapshot path's lifecycle is checked on machines without a GPU.

CUDA rules the callers keep:

* A thread's current device is 0 until it sets one, and calls without a device argument
  (``cudaHostRegister``, ``cudaEventSynchronize``, ``cudaEventQuery``) run in that
  device's context, creating it (~0.5 GB of device memory) if needed. A background thread
  that waits on events or page-locks memory calls :meth:`CudaRuntime.set_device` first.
* ``cudaHostRegister`` of a range overlapping a registered one fails (712,
  ``cudaErrorHostMemoryAlreadyRegistered``); ``cudaHostUnregister`` takes the start
  address of a registration (713 otherwise). A registered range must be unregistered
  before its pages are truncated or unmapped.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

__all__ = ["CudaRuntime", "runtime", "use_runtime", "SUCCESS", "HOST_REGISTER_PORTABLE"]

SUCCESS = 0
HOST_REGISTER_PORTABLE = 1   # cudaHostRegisterPortable: page-locked for every CUDA context


class CudaRuntime:
    """The real runtime: ``torch.cuda`` and ``torch.cuda.cudart()``."""

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def is_initialized(self) -> bool:
        return torch.cuda.is_initialized()

    def device_of(self, t: torch.Tensor) -> torch.device | None:
        """The CUDA device ``t`` lives on, None for any other device."""
        return t.device if t.device.type == "cuda" else None

    def set_device(self, device: torch.device) -> None:
        """Bind the calling thread (one moc owns) to ``device``."""
        torch.cuda.set_device(device)

    def device_guard(self, device: torch.device):
        """Context manager: ``device`` is current inside, the caller's afterwards (for calls
        moc makes on a thread it does not own)."""
        return torch.cuda.device(device)

    def host_register(self, ptr: int, nbytes: int, flags: int = HOST_REGISTER_PORTABLE) -> int:
        """``cudaHostRegister``; the cudaError code (0: success)."""
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags))

    def host_unregister(self, ptr: int) -> int:
        """``cudaHostUnregister``; the cudaError code (0: success)."""
        return int(torch.cuda.cudart().cudaHostUnregister(ptr))

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def use_stream(self, stream: Any):
        """Context manager: work queued inside runs on ``stream`` (and its device)."""
        return torch.cuda.stream(stream)

    def new_event(self, *, timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def synchronize_stream(self, device: torch.device) -> None:
        torch.cuda.current_stream(device).synchronize()

    def rng_states(self) -> list[torch.Tensor]:
        """The RNG state of every device, [] when CUDA is not initialised in this process
        (asking must not initialise it)."""
        if not torch.cuda.is_initialized():
            return []
        return [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]

    def set_rng_states(self, states: Sequence[torch.Tensor]) -> int:
        """Restore the first ``device_count()`` of ``states``; how many were restored."""
        if not torch.cuda.is_available():
            return 0
        n = min(len(states), torch.cuda.device_count())
        for i in range(n):
            torch.cuda.set_rng_state(states[i].clone(), i)
        return n


_RUNTIME: Any = CudaRuntime()


def runtime() -> Any:
    """The CUDA runtime moc calls (the real one unless a test installed a stand-in)."""
    return _RUNTIME


@contextmanager
def use_runtime(rt: Any) -> Iterator[Any]:
    """Install ``rt`` as :func:`runtime` inside the block (tests)."""
    global _RUNTIME
    previous, _RUNTIME = _RUNTIME, rt
    try:
        yield rt
    finally:
        _RUNTIME = previous
