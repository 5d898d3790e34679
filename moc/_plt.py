"""Proportion of lost tokens (PLT): what partial checkpoints cost on recovery.

``unsaved[layer][e]`` counts tokens routed to expert ``e`` since its last saved version.
When a fault restores expert ``e`` from a version that predates the checkpoint step, the
tokens it saw since that version are lost. Accumulated over faults::

    PLT = (1/L) * sum_l lost_tokens[l] / (total_tokens_processed * top_k)
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

__all__ = ["PLTTracker"]


class PLTTracker:
    """Routing counts since each expert's saved version, and lost tokens over faults."""

    def __init__(self, experts_per_layer: Mapping[str, int], top_k: int = 1) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.top_k = int(top_k)
        self.unsaved: dict[str, list[int]] = {l: [0] * int(n) for l, n in experts_per_layer.items()}
        self.lost: dict[str, int] = {l: 0 for l in experts_per_layer}
        self.total_tokens = 0  # tokens processed (each routed to top_k experts)

    def record(self, layer: str, counts: Sequence[int] | torch.Tensor) -> None:
        """Add the tokens routed to each expert of ``layer`` in one step."""
        if layer not in self.unsaved:
            raise KeyError(f"unknown MoE layer {layer!r}; known: {sorted(self.unsaved)}")
        values = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        row = self.unsaved[layer]
        if len(values) != len(row):
            raise ValueError(f"layer {layer!r} has {len(row)} experts, got {len(values)} counts")
        for e, c in enumerate(values):
            row[e] += int(c)

    def add_tokens(self, n: int) -> None:
        self.total_tokens += int(n)

    def saved(self, layer: str, experts: Iterable[int]) -> None:
        """Experts of ``layer`` were just saved: nothing of theirs is unsaved any more."""
        row = self.unsaved[layer]
        for e in experts:
            row[e] = 0

    def charge(self, unsaved_at_version: Mapping[str, Sequence[int]], stale: Mapping[str, Iterable[int]]) -> int:
        """A fault restored ``stale[layer]`` experts from old versions: count their losses.

        ``unsaved_at_version`` is the manifest's record of tokens each expert had seen
        since its saved version, at the step being restored.
        """
        lost = 0
        for layer, experts in stale.items():
            for e in experts:
                n = int(unsaved_at_version[layer][e])
                self.lost[layer] = self.lost.get(layer, 0) + n
                lost += n
        return lost

    def value(self) -> float:
        if self.total_tokens == 0 or not self.lost:
            return 0.0
        per_layer = [lost / (self.total_tokens * self.top_k) for lost in self.lost.values()]
        return sum(per_layer) / len(per_layer)

    def to_json(self) -> dict[str, Any]:
        return {"top_k": self.top_k, "total_tokens": self.total_tokens, "lost_tokens": dict(self.lost),
                "unsaved": {l: list(v) for l, v in self.unsaved.items()}, "value": self.value()}

    def load_json(self, d: Mapping[str, Any]) -> None:
        """Resume totals from a manifest. After a restore every expert equals a saved
        version, so nothing is unsaved: charge the stale ones first with :meth:`charge`."""
        self.total_tokens = int(d.get("total_tokens", 0))
        for layer, n in (d.get("lost_tokens") or {}).items():
            self.lost[layer] = int(n)
        for row in self.unsaved.values():
            row[:] = [0] * len(row)
