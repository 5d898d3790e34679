"""Tokens per expert over training: a seeded Zipf generator or a recorded routing trace."""

from __future__ import annotations

from abc import ABC, abstractmethod

import json
import math
import random
from bisect import bisect_right
from pathlib import Path

from ._config import SkewSpec


class Routing(ABC):
    """``loads(step)[l][e]``: relative tokens routed to expert ``e`` of simulated layer ``l``."""

    def __init__(self, num_experts: int, layers: int, epoch_steps: int) -> None:
        self.num_experts = num_experts
        self.layers = layers
        self.epoch_steps = epoch_steps
        self._cache: dict[int, list[list[float]]] = {}

    def loads(self, step: int) -> list[list[float]]:
        k = self.epoch_of(step)
        if k not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[k] = self._make(k)
        return self._cache[k]

    def epoch_of(self, step: int) -> int:
        return max(0, step) // self.epoch_steps

    @abstractmethod
    def _make(self, epoch: int) -> list[list[float]]:
        ...


class ZipfRouting(Routing):
    """Expert of rank ``i`` (a seeded per-layer permutation) gets ``1/(i+1)^s`` of the
    tokens, times a seeded log-normal factor ``exp(drift * N(0, 1))`` re-drawn every
    epoch, so the hot experts slowly change."""

    def __init__(self, num_experts: int, layers: int, epoch_steps: int, skew: SkewSpec,
                 seed: int) -> None:
        super().__init__(num_experts, layers, epoch_steps)
        self.skew = skew
        self.seed = seed
        self._perm = []
        for layer in range(layers):
            perm = list(range(num_experts))
            random.Random(f"perm-{seed}-{layer}").shuffle(perm)
            self._perm.append(perm)

    def _make(self, epoch: int) -> list[list[float]]:
        out = []
        for layer in range(self.layers):
            rng = random.Random(f"drift-{self.seed}-{layer}-{epoch}")
            row = [0.0] * self.num_experts
            for rank, e in enumerate(self._perm[layer]):
                noise = math.exp(self.skew.drift * rng.gauss(0.0, 1.0)) if self.skew.drift else 1.0
                row[e] = noise / (rank + 1) ** self.skew.zipf_s
            out.append(row)
        return out


class TraceRouting(Routing):
    """Replays a recorded routing trace (JSON lines ``{"step", "layer", "counts"}``).

    The loads at step ``s`` are those of the newest recorded step ``<= s`` (cycling
    through the trace when training runs longer than it); simulated layer ``l`` uses
    recorded layer ``l mod (recorded layers)``.
    """

    def __init__(self, path: str | Path, num_experts: int, layers: int, epoch_steps: int) -> None:
        super().__init__(num_experts, layers, epoch_steps)
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ValueError(f"--routing-trace: cannot read {p}: {exc.strerror}") from None
        table: dict[int, dict[int, list[float]]] = {}
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                step, layer, counts = int(rec["step"]), int(rec["layer"]), rec["counts"]
                if not isinstance(counts, list) or not all(
                    isinstance(c, (int, float)) and not isinstance(c, bool) and c >= 0 for c in counts
                ):
                    raise TypeError
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise ValueError(
                    f"{p}:{i}: expected {{\"step\": int, \"layer\": int, \"counts\": [int, ...]}}, "
                    f"got {line.strip()[:80]!r}"
                ) from None
            if len(counts) != num_experts:
                raise ValueError(f"{p}:{i}: counts has {len(counts)} experts, the model has {num_experts}")
            table.setdefault(step, {})[layer] = [float(c) for c in counts]
        if not table:
            raise ValueError(f"{p}: routing trace holds no records")
        self._steps = sorted(table)
        self._layers = sorted({lay for rows in table.values() for lay in rows})
        self._table = table
        self._period = self._steps[-1] + 1

    def epoch_of(self, step: int) -> int:
        s = max(0, step) % self._period
        return bisect_right(self._steps, s) - 1 if s >= self._steps[0] else 0

    def _make(self, epoch: int) -> list[list[float]]:
        out = []
        for layer in range(self.layers):
            want = self._layers[layer % len(self._layers)]
            row = None
            for j in range(epoch, -1, -1):  # newest record of this layer at or before
                row = self._table[self._steps[j]].get(want)
                if row is not None:
                    break
            if row is None:
                row = next(self._table[s][want] for s in self._steps if want in self._table[s])
            out.append(row if sum(row) > 0 else [1.0] * self.num_experts)
        return out
