"""Pure-torch dispatcher: the reference and fallback, equal to the C++/CUDA op bit for bit.

All quantities are int64 and vectorised over [E, N]; the rule is the one documented in
``csrc/dispatch_core.h`` (largest-remainder capacities, local tokens first, excesses
matched to residual capacities by filling in rank order).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Plan(NamedTuple):
    """Per expert and rank: tokens kept locally, excess sent out, residual received, and the
    exclusive prefix sums of excess (``a``) and residual (``b``) over ranks."""

    capacity: torch.Tensor
    local: torch.Tensor
    excess: torch.Tensor
    residual: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor


def plan(R: torch.Tensor, T: torch.Tensor) -> Plan:
    e_count, n = R.shape
    r = R.sum(1, keepdim=True)
    t = T.sum(1, keepdim=True)
    num = t * R
    safe_r = r.clamp(min=1)
    q = torch.div(num, safe_r, rounding_mode="floor")
    rem = num - q * safe_r
    leftover = t - q.sum(1, keepdim=True)
    # Leftover tokens go to the largest remainders; ties to ranks with local tokens beyond
    # their floor share, then to the lower rank (stable sort keeps rank order).
    key = rem * 2 + (T > q).to(torch.int64)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    position = torch.empty_like(order)
    position.scatter_(1, order, torch.arange(n, device=R.device).expand(e_count, n).contiguous())
    cap = q + ((position < leftover) & (rem > 0)).to(torch.int64)
    local = torch.minimum(cap, T)
    x = T - local
    y = cap - local
    return Plan(cap, local, x, y, x.cumsum(1) - x, y.cumsum(1) - y)


def _overlap(a: torch.Tensor, x: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    lo = torch.maximum(a, b)
    hi = torch.minimum(a + x, b + y)
    return (hi - lo).clamp(min=0)


def dispatch_table(R: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
    """[N_src, N_dst, E] tokens of each expert sent from each rank to each rank."""
    p = plan(R, T)
    n = R.shape[1]
    d = _overlap(p.a[:, :, None], p.excess[:, :, None], p.b[:, None, :], p.residual[:, None, :])
    d = d + torch.diag_embed(p.local)
    return d.permute(1, 2, 0).contiguous() if n else d.permute(1, 2, 0)


def dispatch_rank(R: torch.Tensor, T: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(send[N_dst, E], recv[N_src, E]) of one rank, in O(N*E)."""
    p = plan(R, T)
    i = rank
    send = _overlap(p.a[:, i : i + 1], p.excess[:, i : i + 1], p.b, p.residual)
    recv = _overlap(p.a, p.excess, p.b[:, i : i + 1], p.residual[:, i : i + 1])
    send[:, i] += p.local[:, i]
    recv[:, i] += p.local[:, i]
    return send.t().contiguous(), recv.t().contiguous()


def dispatch_permutation(experts: torch.Tensor, send: torch.Tensor) -> torch.Tensor:
    """Gather order of token slots into send order: destination-major, then expert; within
    an expert, tokens keep their original order and the first ``send[0, e]`` go to rank 0."""
    m = experts.numel()
    # Tokens per expert: send's column sums (equal to the experts' counts for a valid
    # send); unlike bincount, no host sync on a GPU.
    counts = send.sum(0)
    grouped = torch.sort(experts, stable=True).indices
    group_start = counts.cumsum(0) - counts
    within = send.cumsum(0) - send
    sizes = send.flatten()
    starts = (group_start[None, :] + within).flatten()
    offsets = sizes.cumsum(0) - sizes
    pos = torch.arange(m, device=experts.device) - torch.repeat_interleave(offsets, sizes, output_size=m)
    return grouped[torch.repeat_interleave(starts, sizes, output_size=m) + pos]
