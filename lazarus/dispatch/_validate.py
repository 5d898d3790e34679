"""Argument checks for the dispatcher: bad input is a ValueError naming the argument."""

from __future__ import annotations

import numbers

import torch

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _check_matrix(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be an integer torch.Tensor of shape [E, N], got {type(x).__name__}")
    if x.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must have an integer dtype (int64 preferred), got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [E, N] (experts x ranks), got shape {tuple(x.shape)}")
    return x.to(torch.int64)


def check_counts(R: object, T: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated int64 copies of ``R`` (replicas) and ``T`` (routed tokens), both [E, N]."""
    r = _check_matrix("R", R)
    t = _check_matrix("T", T)
    if r.shape != t.shape:
        raise ValueError(f"R has shape {tuple(r.shape)} but T has shape {tuple(t.shape)}; both must be [E, N]")
    if r.device != t.device:
        raise ValueError(f"R is on {r.device} but T is on {t.device}; both must be on one device")
    if r.numel():
        if bool((r < 0).any()):
            raise ValueError("R must be non-negative (replica counts)")
        if bool((t < 0).any()):
            raise ValueError("T must be non-negative (routed token counts)")
        orphan = (r.sum(1) == 0) & (t.sum(1) > 0)
        if bool(orphan.any()):
            ids = orphan.nonzero().flatten()[:10].tolist()
            raise ValueError(f"T routes tokens to experts with zero replicas in R: {ids}")
    return r.contiguous(), t.contiguous()


def check_rank(rank: object, num_ranks: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be an integer in [0, {num_ranks - 1}] (N = R.shape[1]), got {rank!r}")
    return int(rank)


def check_permutation_args(experts: object, send: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated ``experts`` [M] (expert id per token slot) and ``send`` [N, E]."""
    if not isinstance(experts, torch.Tensor) or experts.dtype not in _INT_DTYPES or experts.dim() != 1:
        raise ValueError("experts must be a 1-D integer tensor of expert ids (one per routed token slot)")
    if not isinstance(send, torch.Tensor) or send.dtype not in _INT_DTYPES or send.dim() != 2:
        raise ValueError("send must be a 2-D integer tensor [N_dst, E]")
    ex = experts.to(torch.int64).contiguous()
    sd = send.to(device=ex.device, dtype=torch.int64).contiguous()
    e_count = sd.shape[1]
    if ex.numel() and (int(ex.min()) < 0 or int(ex.max()) >= e_count):
        raise ValueError(f"experts must hold ids in [0, {e_count - 1}] (send has E = {e_count} columns)")
    if sd.numel() and bool((sd < 0).any()):
        raise ValueError("send must be non-negative")
    counts = torch.bincount(ex, minlength=e_count)
    if not torch.equal(counts, sd.sum(0)):
        raise ValueError("send must send exactly the tokens experts routes to each expert (column sums)")
    return ex, sd
