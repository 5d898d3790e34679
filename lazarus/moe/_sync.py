"""Moving expert tensors between ranks with uneven all-to-alls (no subgroups, no pickling).

Replica gradient synchronisation is a reduce-scatter followed by an all-gather, both
built from one ``all_to_all_single`` over the layer's group: the flat gradient of expert e
is cut into one chunk per holder; holder k receives chunk k from every holder, sums them
in rank order, and sends the sum back to all holders. Every holder ends with bit-identical
values (same inputs, same summation order), each moves about ``2 * (h-1)/h`` of an expert's
gradient, and ranks that do not hold e take no part in e. Per-expert process groups would
need a collective ``new_group`` per distinct holder set and re-creation on every new
placement; this needs nothing beyond the layer's group.

Expert fetching on a new placement is one more all-to-all: every (expert, new holder) pair
is served by an old holder, fetches of one expert spread over all its old holders.
"""

from __future__ import annotations

from typing import Any

import torch

from ._comm import exchange


def _bounds(numel: int, parts: int) -> list[int]:
    return [k * numel // parts for k in range(parts + 1)]


def reduce_replicas(
    flats: dict[int, torch.Tensor], holders: list[list[int]], rank: int, world: int, group: Any
) -> dict[int, torch.Tensor]:
    """Sum of each local expert's flat tensor over all ranks holding that expert.

    Args:
        flats: expert id -> this rank's flat tensor (all experts have the same numel).
        holders: sorted distinct holder ranks of every expert (same on all ranks).
    """
    experts = sorted(flats)
    if not experts:
        ref = None
    else:
        ref = flats[experts[0]]
    numel = ref.numel() if ref is not None else 0
    dtype = ref.dtype if ref is not None else torch.float32
    device = ref.device if ref is not None else torch.device("cpu")
    if world == 1:
        return {e: flats[e].clone() for e in experts}
    pos = {e: {r: k for k, r in enumerate(holders[e])} for e in experts}
    cuts = {e: _bounds(numel, len(holders[e])) for e in experts}

    def chunk_len(e: int, holder: int) -> int:
        k = pos[e][holder]
        return cuts[e][k + 1] - cuts[e][k]

    # Phase 1 (reduce-scatter): my chunk of e goes to its owner; I get my own chunk from all.
    send_parts: list[torch.Tensor] = []
    in_splits = [0] * world
    out_splits = [0] * world
    for dst in range(world):
        for e in experts:
            if dst in pos[e]:
                k = pos[e][dst]
                send_parts.append(flats[e][cuts[e][k] : cuts[e][k + 1]])
                in_splits[dst] += cuts[e][k + 1] - cuts[e][k]
                out_splits[dst] += chunk_len(e, rank)
    send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=dtype, device=device)
    recv = exchange(send, out_splits, in_splits, group)
    sums: dict[int, torch.Tensor] = {}
    offset = 0
    for src in range(world):
        for e in experts:
            if src in pos[e]:
                n = chunk_len(e, rank)
                part = recv[offset : offset + n]
                sums[e] = part.clone() if e not in sums else sums[e] + part  # rank order: deterministic
                offset += n
    # Phase 2 (all-gather): my summed chunk of e goes to every holder of e.
    send_parts = []
    for dst in range(world):
        for e in experts:
            if dst in pos[e]:
                send_parts.append(sums[e])
    send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=dtype, device=device)
    recv = exchange(send, in_splits, out_splits, group)
    out = {e: torch.empty(numel, dtype=dtype, device=device) for e in experts}
    offset = 0
    for src in range(world):
        for e in experts:
            if src in pos[e]:
                k = pos[e][src]
                n = cuts[e][k + 1] - cuts[e][k]
                out[e][cuts[e][k] : cuts[e][k + 1]] = recv[offset : offset + n]
                offset += n
    return out


def fetch_plan(old: list[list[int]], new: list[list[int]], num_experts: int) -> list[tuple[int, int, int]]:
    """Sorted (expert, destination, source) transfers: every rank that newly holds an
    expert gets it from an old holder, round-robin over old holders per expert."""
    old_holders: list[list[int]] = [sorted({j for j, row in enumerate(old) if e in row}) for e in range(num_experts)]
    used = [0] * num_experts
    plan = []
    for e in range(num_experts):
        for dst, row in enumerate(new):
            if e in row and e not in old[dst]:
                owners = old_holders[e]
                if not owners:
                    raise ValueError(f"expert {e} has no holder in the old placement to fetch it from")
                plan.append((e, dst, owners[used[e] % len(owners)]))
                used[e] += 1
    return plan


def fetch_experts(
    plan: list[tuple[int, int, int]], flats: dict[int, torch.Tensor], numel: int, rank: int, world: int,
    group: Any, dtype: torch.dtype, device: torch.device,
) -> dict[int, torch.Tensor]:
    """Run ``plan`` with one all-to-all; returns expert id -> flat tensor received here."""
    in_splits = [0] * world
    out_splits = [0] * world
    parts = []
    for e, dst, src in sorted(plan, key=lambda t: (t[1], t[0])):
        if src == rank:
            parts.append(flats[e])
            in_splits[dst] += numel
    incoming = sorted((src, e) for e, dst, src in plan if dst == rank)
    for src, _ in incoming:
        out_splits[src] += numel
    send = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
    recv = exchange(send, out_splits, in_splits, group)
    return {e: recv[k * numel : (k + 1) * numel].clone() for k, (_, e) in enumerate(incoming)}
