"""Moving expert tensors between ranks with uneven all-to-alls (no subgroups, no pickling).

Replica gradient synchronisation is a reduce-scatter followed by an all-gather, both
built from one ``all_to_all_single`` over the layer's group: the flat gradient of expert e
is cut into one chunk per holder; holder k receives chunk k from every holder, sums them
in rank order, and sends the sum back to all holders. Every holder ends with bit-identical
values (same inputs, same summation order), each moves about ``2 * (h-1)/h`` of an expert's
gradient, and ranks that do not hold e take no part in e. Per-expert process groups would
need a collective ``new_group`` per distinct holder set and re-creation on every new
placement; this needs nothing beyond the layer's group. The experts of several layers on
one group go through the same two all-to-alls (:func:`lazarus.moe.sync_moe_gradients`).

Expert fetching on a new placement is one more all-to-all: every (expert, new holder) pair
is served by an old holder, fetches of one expert spread over all its old holders.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ._comm import exchange

if TYPE_CHECKING:
    from _typeshed import SupportsRichComparison

K = TypeVar("K", bound="SupportsRichComparison")   # unit keys sort the same way on every rank


def _bounds(numel: int, parts: int) -> list[int]:
    return [k * numel // parts for k in range(parts + 1)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``raw`` bytes (a slice of a receive buffer) as ``dtype``, copied (a slice may not be
    aligned to the element size)."""
    return raw.clone().view(dtype)


def reduce_replicas(
    flats: Mapping[K, torch.Tensor], holders: Any, rank: int, world: int, group: Any
) -> dict[K, torch.Tensor]:
    """Sum of each local unit's flat tensor over all ranks holding that unit.

    Args:
        flats: key -> this rank's flat tensor, for the units this rank holds (on one
            device; sizes and dtypes may differ between keys, every holder of a key has
            the same size and dtype). Keys sort the same way on every rank: an expert id of
            one layer, or ``(layer index, expert id)`` for several layers reduced in one
            exchange. The bytes travel as ``uint8``; sums are taken in each key's dtype.
        holders: ``holders[key]``: sorted distinct holder ranks of that unit (the same on
            every rank; needed for this rank's keys).
    """
    keys = sorted(flats)
    if world == 1:
        return {k: flats[k].clone() for k in keys}
    device = flats[keys[0]].device if keys else torch.device("cpu")
    pos = {k: {r: i for i, r in enumerate(holders[k])} for k in keys}
    cuts = {k: _bounds(flats[k].numel(), len(holders[k])) for k in keys}
    size = {k: flats[k].element_size() for k in keys}

    def chunk(k: K, holder: int) -> tuple[int, int]:
        i = pos[k][holder]
        return cuts[k][i], cuts[k][i + 1]

    # Phase 1 (reduce-scatter): my chunk of k goes to its owner; I get my own chunk from all.
    # A sender lists the keys both it and dst hold, in key order; so does the receiver.
    send_parts: list[torch.Tensor] = []
    in_splits = [0] * world
    out_splits = [0] * world
    for dst in range(world):
        for k in keys:
            if dst in pos[k]:
                a, b = chunk(k, dst)
                send_parts.append(_bytes(flats[k][a:b].to(device)))
                in_splits[dst] += (b - a) * size[k]
                a, b = chunk(k, rank)
                out_splits[dst] += (b - a) * size[k]
    send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=torch.uint8, device=device)
    recv = exchange(send, out_splits, in_splits, group)
    sums: dict[K, torch.Tensor] = {}
    offset = 0
    for src in range(world):
        for k in keys:
            if src in pos[k]:
                a, b = chunk(k, rank)
                n = (b - a) * size[k]
                part = _typed(recv[offset : offset + n], flats[k].dtype)
                sums[k] = part if k not in sums else sums[k] + part  # rank order: deterministic
                offset += n
    # Phase 2 (all-gather): my summed chunk of k goes to every holder of k.
    send_parts = []
    for dst in range(world):
        for k in keys:
            if dst in pos[k]:
                send_parts.append(_bytes(sums[k]))
    send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=torch.uint8, device=device)
    recv = exchange(send, in_splits, out_splits, group)
    out = {k: torch.empty(flats[k].numel(), dtype=flats[k].dtype, device=device) for k in keys}
    offset = 0
    for src in range(world):
        for k in keys:
            if src in pos[k]:
                a, b = chunk(k, src)
                n = (b - a) * size[k]
                out[k][a:b] = _typed(recv[offset : offset + n], flats[k].dtype)
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
