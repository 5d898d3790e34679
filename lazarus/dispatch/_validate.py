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
        orphan = (r.sum(1) == 0) & (t.sum(1) > 0)
        # Every condition on the tensors' device, read back with one host sync.
        negative_r, negative_t, any_orphan = torch.stack([(r < 0).any(), (t < 0).any(), orphan.any()]).tolist()
        if negative_r:
            raise ValueError("R must be non-negative (replica counts)")
        if negative_t:
            raise ValueError("T must be non-negative (routed token counts)")
        if any_orphan:
            ids = orphan.nonzero().flatten()[:10].tolist()
            raise ValueError(f"T routes tokens to experts with zero replicas in R: {ids}")
    return r.contiguous(), t.contiguous()


def check_rank(rank: object, num_ranks: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= int(rank) < num_ranks:
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
    # Every condition on the device, read back with one host sync: counts by a scatter into
    # E + 1 bins (the last for ids out of range) instead of bincount, which syncs for its size.
    in_range = (ex >= 0) & (ex < e_count)
    bins = torch.where(in_range, ex, torch.full_like(ex, e_count))
    routed = torch.zeros(e_count + 1, dtype=torch.int64, device=ex.device).scatter_add_(0, bins,
                                                                                      torch.ones_like(ex))
    bad_id, negative, mismatch = torch.stack([
        ~in_range.all(), (sd < 0).any(), (routed[:e_count] != sd.sum(0)).any()]).tolist()
    if bad_id:
        raise ValueError(f"experts must hold ids in [0, {e_count - 1}] (send has E = {e_count} columns)")
    if negative:
        raise ValueError("send must be non-negative")
    if mismatch:
        raise ValueError("send must send exactly the tokens experts routes to each expert (column sums)")
    return ex, sd
