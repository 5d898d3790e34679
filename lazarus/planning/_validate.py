"""Argument checks shared by the planning functions.

Every public planning function validates its input up front and raises ``ValueError``
naming the argument and the allowed range. The controller feeds these functions with
values that come over the network or from a user's command line, so a precise message
is worth more than a stack trace from deep inside numpy.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any


def check_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int:
    """Return ``value`` as an ``int`` after checking it is an integer in ``[lo, hi]``.

    ``bool`` is rejected on purpose: ``True`` passing as ``1`` node hides caller bugs.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name} must be in {_range(lo, hi)}, got {v}")
    return v


def _range(lo: int | None, hi: int | None) -> str:
    left = "(-inf" if lo is None else f"[{lo}"
    right = "inf)" if hi is None else f"{hi}]"
    return f"{left}, {right}"


def check_loads(name: str, loads: Any) -> list[float]:
    """Check a per-expert load vector: non-empty, finite, non-negative real numbers."""
    if isinstance(loads, (str, bytes)) or not isinstance(loads, (Sequence,)) and not hasattr(
        loads, "__len__"
    ):
        raise ValueError(f"{name} must be a sequence of non-negative numbers, got {loads!r}")
    out: list[float] = list(loads)
    for i, t in enumerate(out):
        kind = type(t)
        if (kind is float and 0.0 <= t < math.inf) or (kind is int and t >= 0):
            continue  # the common case, checked without the numbers ABCs
        if isinstance(t, bool) or not isinstance(t, numbers.Real):
            raise ValueError(f"{name}[{i}] must be a real number, got {t!r}")
        if math.isnan(float(t)) or math.isinf(float(t)):
            raise ValueError(f"{name}[{i}] must be finite and >= 0, got {t!r}")
        if t < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {t!r}")
    # ints stay ints so that Eq. 1 can be evaluated exactly
    if not out:
        raise ValueError(f"{name} must hold at least one expert, got an empty sequence")
    return out


def check_replicas(
    replicas: Any, num_nodes: Any, slots_per_node: Any, name: str = "replicas"
) -> tuple[list[int], int, int]:
    """Validate a replica vector against the cluster shape used by the placements.

    Placements fill every slot, so the counts must add up to ``num_nodes * slots_per_node``
    and every expert needs at least one replica.
    """
    n = check_int("num_nodes", num_nodes, lo=1)
    c = check_int("slots_per_node", slots_per_node, lo=1)
    if isinstance(replicas, (str, bytes)) or not hasattr(replicas, "__len__"):
        raise ValueError(f"{name} must be a sequence of integers, got {replicas!r}")
    r = list(replicas)
    # Fast path for plain ints in range; anything else gets the per-element message.
    if not (all(type(x) is int for x in r) and (not r or 1 <= min(r) and max(r) <= n * c)):
        r = [check_int(f"{name}[{i}]", x, lo=1, hi=n * c) for i, x in enumerate(r)]
    if not r:
        raise ValueError(f"{name} must hold at least one expert, got an empty sequence")
    if len(r) > n * c:
        raise ValueError(
            f"{name} has {len(r)} experts but num_nodes*slots_per_node = {n * c} slots; "
            "need at most one expert per slot"
        )
    total = sum(r)
    if total != n * c:
        raise ValueError(
            f"sum({name}) must equal num_nodes*slots_per_node = {n * c}, got {total}"
        )
    return r, n, c
