"""Partial experts checkpointing: which K experts of each MoE layer to save."""

from __future__ import annotations

from typing import Sequence

__all__ = ["sequential_selection", "load_aware_selection", "SELECTIONS"]

SELECTIONS = ("sequential", "load_aware")


def _check(k: int, num_experts: int) -> None:
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an integer >= 1, got {num_experts!r}")
    if not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"k must be an integer in [1, {num_experts}], got {k!r}")


def sequential_selection(checkpoint: int, layer_index: int, k: int, num_experts: int) -> list[int]:
    """Experts ``{(n*K + l*K + j) mod E : j < K}`` for checkpoint ``n`` and MoE layer ``l``.

    The layer offset staggers the choice across layers so that the experts saved at one
    checkpoint sit on different expert-parallel ranks; every expert is saved at least
    once every ``ceil(E / K)`` checkpoints.
    """
    _check(k, num_experts)
    if checkpoint < 0 or layer_index < 0:
        raise ValueError("checkpoint and layer_index must be >= 0")
    base = (checkpoint * k + layer_index * k) % num_experts
    return sorted({(base + j) % num_experts for j in range(k)})


def load_aware_selection(unsaved_tokens: Sequence[int], k: int) -> list[int]:
    """The ``k`` experts with the most tokens routed to them since their last save.

    Ties go to the lower expert id, so the choice is deterministic on every rank.
    """
    _check(k, len(unsaved_tokens))
    order = sorted(range(len(unsaved_tokens)), key=lambda e: (-int(unsaved_tokens[e]), e))
    return sorted(order[:k])
