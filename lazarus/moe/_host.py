"""Moving the dispatch's small tensors between the host and the device.

A device-to-host read is a host sync on a GPU: the dispatch makes exactly one per call,
through :func:`to_host` (tests count its calls). Host-to-device copies go through
page-locked memory without waiting (:func:`to_device`).
"""

from __future__ import annotations

import torch

__all__ = ["to_device", "to_host"]


def to_host(t: torch.Tensor) -> torch.Tensor:
    """The one device-to-host read of a dispatch (a host sync when ``t`` is on a GPU; the
    tensor itself on the CPU)."""
    return t.cpu()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the host) on ``device`` without a host sync: through page-locked memory
    with a non-blocking copy on a GPU (torch's pinned-memory allocator keeps the block
    until the copy ran); ``t`` itself when it is there already."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
