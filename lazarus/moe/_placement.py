"""From a ``lazarus.planning.Placement`` to what the layer needs per rank."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lazarus.planning import Placement

from ._comm import world


def rank_slots(placement: Placement) -> list[list[int]]:
    """Expert ids of every rank. Rank ``node * gpus_per_node + gpu`` takes the slots that
    ``Placement.gpu_slots`` deals to that GPU (one rank per node when ``gpus_per_node == 1``)."""
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be a lazarus.planning.Placement, got {type(placement).__name__}")
    if placement.gpus_per_node == 1:
        return [list(row) for row in placement.nodes]
    return [list(gpu) for node in placement.gpu_slots() for gpu in node]


def replica_matrix(slots: list[list[int]], num_experts: int) -> torch.Tensor:
    """R[E, W]: replicas of expert e on rank j (a rank may hold several)."""
    r = torch.zeros(num_experts, len(slots), dtype=torch.int64)
    for j, row in enumerate(slots):
        for e in row:
            r[e, j] += 1
    return r


def holder_ranks(slots: list[list[int]], num_experts: int) -> list[list[int]]:
    """Sorted distinct ranks holding each expert."""
    out: list[set[int]] = [set() for _ in range(num_experts)]
    for j, row in enumerate(slots):
        for e in row:
            out[e].add(j)
    return [sorted(s) for s in out]


def layer_placements(layers: Mapping[str, int], placements: Mapping[str, Placement] | Placement | None,
                     group: Any = None) -> dict[str, Placement]:
    """One checked :class:`Placement` per MoE layer of a model.

    Args:
        layers: layer name -> number of experts, for every MoE layer of the model.
        placements: one plan for every layer, a dict with exactly the layers' names, or
            ``None`` for all experts on one rank (only in a one-rank group).
        group: the process group the layers run over (``None``: the default group, or no
            group at all when torch.distributed is not initialised).

    Raises:
        ValueError: naming the layer and what does not fit.
    """
    if placements is None:
        _, size = world(group)
        if size != 1:
            raise ValueError(f"placements=None puts every expert on one rank, but the process group has {size} "
                             f"ranks; pass a Placement or a dict over the MoE layers {sorted(layers)}")
        return {n: Placement([list(range(e))], num_experts=e, strategy="single") for n, e in layers.items()}
    if isinstance(placements, Placement):
        plans = {n: placements for n in layers}
    elif isinstance(placements, Mapping):
        missing = [n for n in layers if n not in placements]
        unknown = sorted(set(placements) - set(layers))
        if missing or unknown:
            raise ValueError(f"placements must have exactly the MoE layers {list(layers)}; "
                             f"missing {missing}, unknown {unknown}")
        plans = {n: placements[n] for n in layers}
    else:
        raise ValueError("placements must be None, a lazarus.planning.Placement or a dict layer name -> "
                         f"Placement; got {type(placements).__name__}")
    for n, p in plans.items():
        if not isinstance(p, Placement):
            raise ValueError(f"placements[{n!r}] must be a lazarus.planning.Placement, got {type(p).__name__}")
        if p.num_experts != layers[n]:
            raise ValueError(f"placements[{n!r}] has num_experts = {p.num_experts}, the layer {layers[n]}")
    return plans
