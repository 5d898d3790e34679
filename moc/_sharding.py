"""Who saves what: expert bytes split over the ranks holding the expert, non-expert
modules spread over ranks (equal or adaptive), each rank's extra state its own.

The plan is a pure function of information every rank has (which ranks hold which unit,
unit sizes, the selection), so every rank computes the same plan without talking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["Share", "plan_shares", "split_range"]

ALIGN = 64


@dataclass(frozen=True)
class Share:
    unit: str
    rank: int
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def split_range(nbytes: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``[0, nbytes)``, boundaries 64-byte aligned."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    bounds = [0]
    for i in range(1, parts):
        b = (nbytes * i // parts) // ALIGN * ALIGN
        bounds.append(max(bounds[-1], b))
    bounds.append(nbytes)
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def plan_shares(
    experts: Mapping[str, int],
    modules: Mapping[str, int],
    holders: Mapping[str, Sequence[int]],
    world: int,
    sharding: str,
) -> list[Share]:
    """Shares for one checkpoint.

    ``experts`` / ``modules``: unit name -> bytes for the units saved now; ``holders``:
    unit name -> ranks that hold it. Expert units are split over all their holders
    (unless ``sharding == "none"``: the first holder saves it). Module units go whole to
    one holder: round robin (``equal``), the least-loaded holder counting expert bytes,
    largest module first (``adaptive``), or the first holder (``none``).
    """
    shares: list[Share] = []
    load = [0] * world
    for name in sorted(experts):
        ranks = sorted(holders[name])
        if sharding == "none":
            ranks = ranks[:1]
        for r, (a, b) in zip(ranks, split_range(experts[name], len(ranks))):
            shares.append(Share(name, r, a, b))
            load[r] += b - a
    if sharding == "adaptive":
        order = sorted(modules, key=lambda n: (-modules[n], n))
    else:
        order = sorted(modules)
    for i, name in enumerate(order):
        ranks = sorted(holders[name])
        if sharding == "adaptive":
            r = min(ranks, key=lambda q: (load[q], q))
        elif sharding == "equal":
            r = ranks[i % len(ranks)]
        else:
            r = ranks[0]
        shares.append(Share(name, r, 0, modules[name]))
        load[r] += modules[name]
    return shares
