"""From a ``lazarus.planning.Placement`` to what the layer needs per rank."""

from __future__ import annotations

import torch

from lazarus.planning import Placement


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
