"""Collectives of the MoE layer: the differentiable uneven all-to-all and the count gather.

Only tensor collectives are used (no ``*_object`` calls, which pickle). The all-to-all is
``all_to_all_single`` with explicit split sizes along dim 0, so nothing is padded; its
backward is the same exchange with the split sizes swapped.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch
import torch.distributed as dist

#: (rank, size) a model is being built for before its process group exists (see building_for)
_BUILDING_FOR: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("lazarus_building_for",
                                                                                      default=None)


@contextlib.contextmanager
def building_for(rank: int, size: int) -> Iterator[None]:
    """Build MoE layers for ``rank`` of ``size`` ranks before torch.distributed is
    initialised: inside the block :func:`world` answers ``(rank, size)`` where it would
    answer ``(0, 1)``, so a layer built here holds that rank's experts. Lazarus's joiner
    builds its model this way while the members still train; the layers are used only
    once the real group (of that size) exists. Bad input raises ``ValueError`` naming it."""
    for name, v in (("rank", rank), ("size", size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an integer, got {v!r}")
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, size) and size >= 1, got rank={rank}, size={size}")
    token = _BUILDING_FOR.set((rank, size))
    try:
        yield
    finally:
        _BUILDING_FOR.reset(token)


def world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) in ``group``; when torch.distributed is not initialised, (0, 1), or
    what :func:`building_for` says inside its block."""
    if not (dist.is_available() and dist.is_initialized()):
        return _BUILDING_FOR.get() or (0, 1)
    return dist.get_rank(group), dist.get_world_size(group)


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """Non-differentiable uneven all-to-all of the rows of ``x``."""
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    if len(in_splits) == 1:  # single rank: nothing leaves the process
        out.copy_(x)
        return out
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        if len(in_splits) == 1:  # single rank: the rows stay, no copy
            return x.view_as(x)
        return exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        if len(in_splits) == 1:
            return grad, None, None, None
        return exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all_uneven(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any = None) -> torch.Tensor:
    """Send ``in_splits[j]`` consecutive rows of ``x`` to rank j and receive ``out_splits[j]``
    rows from rank j; differentiable (gradients travel back along the reverse exchange)."""
    return _AllToAll.apply(x, list(map(int, out_splits)), list(map(int, in_splits)), group)


def all_gather_rows(local: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[size, *local.shape]: every rank's ``local`` (same shape on all ranks)."""
    if size == 1:
        return local.unsqueeze(0).clone()
    flat = local.contiguous().reshape(-1)
    out = flat.new_empty(size * flat.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, flat, group=group)
    return out.view((size,) + tuple(local.shape))
