"""The window schedule of exact mode (``MoCConfig(exact=True)``) and its size formula.

A window is W consecutive steps, W = ceil(E / k_snapshot) (E: the most experts any MoE
layer has; W = 1 when ``k_snapshot`` is None). Every unit (an expert of a layer, a
non-expert module) has one *slot* i in [0, W): at the window's step ``start + i`` its full
state (weights and optimizer state) is captured; at the steps before that, its compute
weights (the tensors the forward reads: its ``state_dict`` entries) are captured.

* Experts: expert e of a layer with E_l experts goes to slot ``e // ceil(E_l / W)`` (the
  sequential order: k_snapshot experts per layer and slot).
* Non-expert modules, largest full state first, each to the slot that keeps the largest
  per-step size smallest (ties: the smaller window total, then the earliest slot).

Bytes captured at slot i (``full(u)``: weights and optimizer state of unit u; ``weights(u)``:
its weights; ``extra``: RNG, optimizer hyper-parameters, the user's extra state)::

    bytes(i) = sum(full(u) for u with slot(u) == i) + sum(weights(u) for u with slot(u) > i) + extra

    window   = sum(full(u) + slot(u) * weights(u) for every u) + W * extra

With E experts of equal size per layer and the modules spread evenly that is, per step on
average, ``full / W + weights * (W - 1) / (2 W)``: 27% of a full checkpoint at W = 8 with
fp32 weights and Adam (full = 3 x weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from .._units import UnitLayout

__all__ = ["ExactSchedule", "plan_schedule", "window_length"]


@dataclass(frozen=True)
class ExactSchedule:
    """W and the slot of every unit (see the module docstring)."""

    window: int
    slots: dict[str, int]

    def full_at(self, i: int) -> list[str]:
        """Units whose full state is captured at slot ``i``."""
        return sorted(u for u, s in self.slots.items() if s == i)

    def weights_at(self, i: int) -> list[str]:
        """Units whose compute weights are captured at slot ``i`` (their full state comes later)."""
        return sorted(u for u, s in self.slots.items() if s > i)

    def step_bytes(self, full: Mapping[str, int], weights: Mapping[str, int], extra: int = 0) -> list[int]:
        """bytes(i) for every slot (the formula of the module docstring)."""
        out = [extra] * self.window
        for u, s in self.slots.items():
            out[s] += full[u]
            for i in range(s):
                out[i] += weights[u]
        return out


def window_length(layout: UnitLayout, k_snapshot: int | None) -> int:
    """W = ceil(E / k_snapshot), E the most experts of any layer (1 without experts or K)."""
    counts = [layout.experts_per_layer.get(layer) or len(ids) for layer, ids in layout.layers.items()]
    if k_snapshot is None or not counts:
        return 1
    return max(1, math.ceil(max(counts) / k_snapshot))


def plan_schedule(layout: UnitLayout, k_snapshot: int | None, full: Mapping[str, int],
                  weights: Mapping[str, int]) -> ExactSchedule:
    """The schedule of one window (``full``/``weights``: bytes per unit, this rank's)."""
    w = window_length(layout, k_snapshot)
    slots: dict[str, int] = {}
    per_step = [0] * w
    for layer, ids in layout.layers.items():
        num = layout.experts_per_layer.get(layer) or (max(ids) + 1 if ids else 0)
        per_slot = max(1, math.ceil(num / w))
        for spec in layout.experts(layer):
            assert spec.expert is not None      # an expert unit's spec names its expert
            s = min(w - 1, int(spec.expert) // per_slot)
            slots[spec.name] = s
            per_step[s] += full[spec.name]
            for i in range(s):
                per_step[i] += weights[spec.name]
    modules = sorted((u for u in layout.units if u not in slots), key=lambda u: (-full[u], u))
    for u in modules:
        best = None
        for s in range(w):
            trial = list(per_step)
            trial[s] += full[u]
            for i in range(s):
                trial[i] += weights[u]
            key = (max(trial), sum(trial), s)
            if best is None or key < best[0]:
                best = (key, s, trial)
        assert best is not None
        slots[u] = best[1]
        per_step = best[2]
    return ExactSchedule(window=w, slots=slots)
