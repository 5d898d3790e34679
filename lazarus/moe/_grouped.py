"""Grouped matrix multiplication: rows of ``x`` grouped by expert, one weight per group.

``grouped_mm(x, w, counts)`` computes ``cat([x[rows of g] @ w[g] for g])``. It runs as ONE
``torch.nn.functional.grouped_mm`` call where torch has a kernel for the operands (CPU with
16-byte aligned strides, torch >= 2.10, CUDA bf16 on compute capability >= 8.0) and as a
loop of matmuls otherwise; both give the same values (fp32 reordering aside) and the same
gradients.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ._host import to_device

__all__ = ["grouped_mm", "grouped_mm_available"]

_KERNEL = getattr(F, "grouped_mm", None)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: the grouped-mm
    backward kernel rejects expanded gradients (zero strides, e.g. from ``.sum()``)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(
        (s * size) % 16 == 0 for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1)


def grouped_mm_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Would :func:`grouped_mm` use torch's one-call kernel for these operands?"""
    if _KERNEL is None or x.dim() != 2 or w.dim() != 3 or x.dtype != w.dtype or x.device != w.device:
        return False
    if x.shape[0] == 0 or w.shape[0] == 0:
        return False
    if x.device.type == "cpu":
        # torch.nn.functional.grouped_mm (torch >= 2.10) has a CPU kernel for these dtypes
        return _aligned(x) and _aligned(w) and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0) \
            and _aligned(x) and _aligned(w)
    return False


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int], *, force_loop: bool = False) -> torch.Tensor:
    """``[S, K] x [G, K, N] -> [S, N]``: the first ``counts[0]`` rows of ``x`` times ``w[0]``,
    the next ``counts[1]`` rows times ``w[1]``, ... (``sum(counts) == S``, ``len(counts) == G``).

    ``w`` may be a transposed view (``W.transpose(-2, -1)`` of a ``[G, N, K]`` tensor).
    ``force_loop`` skips the kernel (benchmarks, tests).
    """
    counts = [int(c) for c in counts]
    if len(counts) != w.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_mm: counts {counts} must have one entry per group ({w.shape[0]}) "
                         f"and sum to the rows of x ({x.shape[0]})")
    kernel = _KERNEL
    if not force_loop and kernel is not None and grouped_mm_available(x, w):
        # offsets known on the host: copied to the device without a host sync
        offs = to_device(torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32), x.device)
        return _ContiguousGrad.apply(kernel(x, w, offs=offs))
    outs = []
    start = 0
    for g, n in enumerate(counts):
        if n:
            outs.append(x[start:start + n] @ w[g])
        start += n
    if not outs:
        return x.new_zeros((0, w.shape[-1])) + 0 * (x.sum() + w.sum())
    return torch.cat(outs) if len(outs) > 1 else outs[0]
