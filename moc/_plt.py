"""Proportion of lost tokens (PLT): what partial checkpoints cost on recovery.

For every expert the tracker keeps ``cum``, the tokens routed to it that are reflected in
its current state, and per level (snapshot, persist) ``saved``, the value of ``cum`` at
its newest saved version. When a fault restores an expert from a version taken when
``cum`` was ``c_v``, while the rest of the model resumes from a step where it was ``c_S``,
the ``c_S - c_v`` tokens it saw in between are lost. Accumulated over faults::

    PLT = (1/L) * sum_l lost_tokens[l] / (total_tokens_processed * top_k)

Losses are booked to the level the restored version came from, so dynamic-K can raise K
of the level that is too sparse.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

__all__ = ["PLTTracker", "LEVELS"]

LEVELS = ("snapshot", "persist")


class PLTTracker:
    """Routing counts per expert and the tokens lost by recoveries."""

    def __init__(self, experts_per_layer: Mapping[str, int], top_k: int = 1) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.top_k = int(top_k)
        self.cum: dict[str, list[int]] = {l: [0] * int(n) for l, n in experts_per_layer.items()}
        self.saved: dict[str, dict[str, list[int]]] = {lv: {l: [0] * int(n) for l, n in experts_per_layer.items()}
                                                       for lv in LEVELS}
        self.lost: dict[str, dict[str, int]] = {lv: {l: 0 for l in experts_per_layer} for lv in LEVELS}
        self.routed: dict[str, int] = {l: 0 for l in experts_per_layer}   # expert slots per layer
        self.total_tokens = 0  # tokens processed (each routed to top_k experts)

    @property
    def layers(self) -> list[str]:
        return list(self.cum)

    def record(self, layer: str, counts: Sequence[int] | torch.Tensor) -> None:
        """Add the tokens routed to each expert of ``layer`` (global expert ids)."""
        if layer not in self.cum:
            raise KeyError(f"unknown MoE layer {layer!r}; known: {sorted(self.cum)}")
        values = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        row = self.cum[layer]
        if len(values) != len(row):
            raise ValueError(f"layer {layer!r} has {len(row)} experts, got {len(values)} counts")
        for e, c in enumerate(values):
            if c < 0:
                raise ValueError(f"routing counts must be >= 0, got {c} for expert {e} of {layer!r}")
        for e, c in enumerate(values):
            row[e] += int(c)
        self.routed[layer] += int(sum(int(c) for c in values))

    def add_tokens(self, n: int) -> None:
        self.total_tokens += int(n)

    def unsaved(self, level: str, layer: str) -> list[int]:
        """Tokens routed to each expert of ``layer`` since its newest version at ``level``."""
        return [c - s for c, s in zip(self.cum[layer], self.saved[level][layer])]

    def mark_saved(self, level: str, layer: str, experts: Iterable[int], cum: Sequence[int] | None = None) -> None:
        """Experts of ``layer`` were saved at ``level`` when the counters were ``cum``."""
        ref = self.cum[layer] if cum is None else cum
        row = self.saved[level][layer]
        for e in experts:
            row[e] = int(ref[e])

    def book_loss(self, level: str, layer: str, tokens: int) -> None:
        if tokens < 0:
            raise ValueError(f"lost tokens must be >= 0, got {tokens}")
        self.lost[level][layer] = self.lost[level].get(layer, 0) + int(tokens)

    def lost_tokens(self, level: str | None = None) -> int:
        levels = LEVELS if level is None else (level,)
        return sum(sum(self.lost[lv].values()) for lv in levels)

    def per_layer(self, level: str | None = None) -> dict[str, float]:
        """PLT of each MoE layer: its lost slots over the slots it was routed (losses of one
        level, or of both); 0 for a layer that has routed nothing yet."""
        levels = LEVELS if level is None else (level,)
        out = {}
        for l in self.cum:
            denom = self.routed.get(l, 0)
            out[l] = sum(self.lost[lv].get(l, 0) for lv in levels) / denom if denom > 0 else 0.0
        return out

    def value(self, level: str | None = None) -> float:
        """PLT over all recoveries so far (losses of one level, or of both): the mean of
        :meth:`per_layer` over the MoE layers."""
        if not self.cum:
            return 0.0
        per_layer = self.per_layer(level)
        return sum(per_layer.values()) / len(per_layer)

    def state(self) -> dict[str, Any]:
        """JSON-able state, stored in manifests and snapshot headers."""
        return {
            "top_k": self.top_k,
            "total_tokens": self.total_tokens,
            "routed": dict(self.routed),
            "cum": {l: list(v) for l, v in self.cum.items()},
            "saved": {lv: {l: list(v) for l, v in rows.items()} for lv, rows in self.saved.items()},
            "lost": {lv: dict(rows) for lv, rows in self.lost.items()},
            "lost_tokens": {l: sum(self.lost[lv].get(l, 0) for lv in LEVELS) for l in self.cum},
            "unsaved": {l: self.unsaved("persist", l) for l in self.cum},
            "per_layer": self.per_layer(),
            "value": self.value(),
        }

    def load_state(self, d: Mapping[str, Any]) -> None:
        """Restore counters saved by :meth:`state` (layers must match)."""
        self.total_tokens = int(d.get("total_tokens", 0))
        routed = d.get("routed")
        for layer in self.routed:
            if isinstance(routed, Mapping) and layer in routed:
                self.routed[layer] = int(routed[layer])
            else:   # written before per-layer slots were counted: every layer took top_k per token
                self.routed[layer] = self.total_tokens * self.top_k
        for layer, row in (d.get("cum") or {}).items():
            if layer in self.cum and len(row) == len(self.cum[layer]):
                self.cum[layer] = [int(x) for x in row]
        for lv, rows in (d.get("saved") or {}).items():
            for layer, row in rows.items():
                if lv in self.saved and layer in self.saved[lv] and len(row) == len(self.saved[lv][layer]):
                    self.saved[lv][layer] = [int(x) for x in row]
        for lv, rows in (d.get("lost") or {}).items():
            for layer, n in rows.items():
                if lv in self.lost:
                    self.lost[lv][layer] = int(n)
