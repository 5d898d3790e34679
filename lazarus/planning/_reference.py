"""The planner as it was before the speed work: the oracle the fast planner must match.

:func:`allocate_replicas_reference` and :func:`place_mro_reference` are the straightforward
implementations of Eq. 1 (exact ``Fraction`` arithmetic) and of the MRO construction
(Python loops, every ``Placement`` validated element by element, twice per plan) that
:func:`lazarus.planning.allocate_replicas` and :func:`lazarus.planning.place_mro` replaced.
They are kept, unchanged in behaviour, for two uses only:

- tests assert that the fast planner returns exactly the same replica counts and the
  same plans on seeded random inputs (``tests/lazarus/planning/test_reference.py``);
- ``make bench-placement`` times both in the same run.

The local search (:func:`lazarus.planning.improve_placement`) did not change and is shared.
Not exported; nothing in the product calls this module.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from ._allocate import effective_min_replicas
from ._placement import MroLayout
from ._types import Placement
from ._validate import check_int, check_replicas

__all__ = ["allocate_replicas_reference", "place_mro_reference"]


def _validated(
    nodes: list[list[int]], num_experts: int, gpus_per_node: int, strategy: str
) -> Placement:
    """``Placement(...)`` with the element-by-element checks its constructor used to run."""
    table: list[list[int]] = []
    for i, row in enumerate(nodes):
        ids: list[int] = []
        for x in row:
            if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0:
                raise ValueError(f"Placement.nodes[{i}] holds a bad expert id {x!r}")
            ids.append(int(x))
        table.append(ids)
    c = len(table[0])
    if c == 0 or any(len(row) != c for row in table):
        raise ValueError("every node must hold slots_per_node replicas")
    seen_max = max(max(row) for row in table)
    e = num_experts
    if isinstance(e, bool) or not isinstance(e, numbers.Integral) or e < 1 or seen_max >= e:
        raise ValueError(f"bad num_experts {e!r}")
    if len({x for row in table for x in row}) != e:
        raise ValueError("every expert needs at least one replica")
    g = gpus_per_node
    if isinstance(g, bool) or not isinstance(g, numbers.Integral) or not 1 <= g <= c:
        raise ValueError(f"bad gpus_per_node {g!r}")
    return Placement._unchecked(table, int(e), int(g), strategy)


# ----------------------------------------------------------------------------- Eq. 1


def _check_loads(loads: Sequence[float]) -> list[float]:
    out: list[float] = []
    for i, t in enumerate(list(loads)):
        if isinstance(t, bool) or not isinstance(t, numbers.Real):
            raise ValueError(f"loads[{i}] must be a real number, got {t!r}")
        if math.isnan(float(t)) or math.isinf(float(t)) or t < 0:
            raise ValueError(f"loads[{i}] must be finite and >= 0, got {t!r}")
        out.append(t)
    if not out:
        raise ValueError("loads must hold at least one expert, got an empty sequence")
    return out


def _as_fraction(x: float) -> Fraction:
    if isinstance(x, numbers.Integral):
        return Fraction(int(x))
    return Fraction(repr(float(x)))


def allocate_replicas_reference(
    loads: Sequence[float],
    num_nodes: int,
    slots_per_node: int,
    min_replicas: int,
    *,
    max_per_node: int | None = None,
) -> list[int]:
    """Eq. 1 with ``Fraction`` arithmetic (same contract as ``allocate_replicas``)."""
    t = _check_loads(loads)
    n = check_int("num_nodes", num_nodes, lo=1)
    c = check_int("slots_per_node", slots_per_node, lo=1)
    e_count = len(t)
    if n * c < e_count:
        raise ValueError(f"loads has {e_count} experts but only {n * c} slots")
    f = effective_min_replicas(e_count, n, c, min_replicas)
    k_min = -(-c // e_count)
    k = c if max_per_node is None else check_int("max_per_node", max_per_node, lo=k_min, hi=c)
    cap = k * n

    order = sorted(range(e_count), key=lambda i: (t[i], i))
    exact = [_as_fraction(t[i]) for i in order]
    suffix = [Fraction(0)] * (e_count + 1)
    for j in range(e_count - 1, -1, -1):
        suffix[j] = suffix[j + 1] + exact[j]

    out = [0] * e_count
    rest = n * c
    for j, idx in enumerate(order):
        after = e_count - j - 1
        if suffix[j] > 0:
            share = math.floor(exact[j] * rest / suffix[j])
        else:
            share = rest // (after + 1)
        r = max(share, f)
        r = min(max(r, rest - cap * after), cap)
        if j == e_count - 1:
            r = rest
        out[idx] = r
        rest -= r
    return out


# ----------------------------------------------------------------------------- MRO


def _mro_layout(r: list[int], n: int, c: int, partial_first: bool = False) -> MroLayout:
    r, n, c = check_replicas(r, n, c)  # the public mro_layout validated its input
    order = sorted(range(len(r)), key=lambda e: (r[e], e))
    head = len(order) % c if partial_first else 0
    groups = ([order[:head]] if head else []) + [
        order[i : i + c] for i in range(head, len(order), c)
    ]
    sizes: list[int] = []
    used = 0
    for g in groups:
        size = min(r[g[0]], n - used)
        sizes.append(size)
        used += size
    full = all(size == r[g[0]] for g, size in zip(groups, sizes))
    return MroLayout(groups, sizes, full)


def _build_mro(r: list[int], n: int, c: int, layout: MroLayout, label: str) -> Placement:
    nodes: list[list[int]] = [[] for _ in range(n)]
    left = list(r)
    i = 0
    for group, size in zip(layout.groups, layout.sizes):
        for _ in range(size):
            nodes[i] = list(group)
            for e in group:
                left[e] -= 1
            i += 1
    core = [len(row) for row in nodes]
    _fill(nodes, left, r, n, c)
    _repair_duplicates(nodes, core, r, n)
    return _validated([sorted(row) for row in nodes], len(r), 1, label)


def _place_spread(r: list[int], n: int) -> Placement:
    nodes: list[list[int]] = [[] for _ in range(n)]
    p = 0
    for e, count in enumerate(r):
        for _ in range(count):
            nodes[p % n].append(e)
            p += 1
    return _validated([sorted(row) for row in nodes], len(r), 1, "spread")


def _fill(nodes: list[list[int]], left: list[int], r: list[int], n: int, c: int) -> None:
    e_count = len(r)
    vac = np.array([c - len(row) for row in nodes], dtype=np.int64)
    copies = np.zeros((e_count, n), dtype=np.int64)
    for i, row in enumerate(nodes):
        for x in row:
            copies[x, i] += 1
    for e in sorted(range(e_count), key=lambda x: (-left[x], x)):
        need = left[e]
        level = 0
        while need > 0:
            cand = np.flatnonzero((vac > 0) & (copies[e] == level))
            if cand.size:
                cand = cand[np.argsort(-vac[cand], kind="stable")][:need]
                for i in cand.tolist():
                    nodes[i].append(e)
                vac[cand] -= 1
                copies[e, cand] += 1
                need -= int(cand.size)
            level += 1
        left[e] = 0


def _repair_duplicates(nodes: list[list[int]], core: list[int], r: list[int], n: int) -> None:
    flex = [i for i in range(n) if core[i] < len(nodes[i])]
    if len(flex) < 2:
        return
    allowed = np.array([-(-x // n) for x in r], dtype=np.int64)
    copies = np.zeros((len(r), n), dtype=np.int64)
    for i, row in enumerate(nodes):
        for x in row:
            copies[x, i] += 1
    over = copies > allowed[:, None]
    if not over.any():
        return
    flex_arr = np.array(flex)
    for a in flex:
        for j in range(core[a], len(nodes[a])):
            e = nodes[a][j]
            if copies[e, a] <= allowed[e]:
                continue
            room = flex_arr[(copies[e, flex_arr] < allowed[e]) & (flex_arr != a)]
            for b in room.tolist():
                hit = next(
                    (jb for jb in range(core[b], len(nodes[b]))
                     if nodes[b][jb] != e and copies[nodes[b][jb], a] < allowed[nodes[b][jb]]),
                    None,
                )
                if hit is None:
                    continue
                y = nodes[b][hit]
                nodes[a][j], nodes[b][hit] = y, e
                copies[e, a] -= 1
                copies[e, b] += 1
                copies[y, b] -= 1
                copies[y, a] += 1
                break


def place_mro_reference(
    replicas: Sequence[int],
    num_nodes: int,
    slots_per_node: int,
    *,
    improve: bool = True,
    seed: int = 0,
) -> Placement:
    """``place_mro`` as it was: same contract, same result, slower."""
    from ._search import EXACT_SEARCH_MAX_NODES, improve_placement

    r, n, c = check_replicas(replicas, num_nodes, slots_per_node)
    seed = check_int("seed", seed, lo=0)
    r, n, c = check_replicas(r, n, c)  # place_mro_paper validated again
    paper = _build_mro(r, n, c, _mro_layout(r, n, c), "mro-paper")
    if not improve or _mro_layout(r, n, c).full or n < 2:
        return _validated(paper.nodes, paper.num_experts, 1, "mro")
    best, best_score = improve_placement(paper, seed=seed)
    if n <= EXACT_SEARCH_MAX_NODES:
        starts = [_place_spread(r, n)]
        if len(r) % c:
            starts.append(_build_mro(r, n, c, _mro_layout(r, n, c, partial_first=True), "mro"))
        for other in starts:
            cand, score = improve_placement(other, floor=paper, seed=seed)
            if score > best_score + 1e-12:
                best, best_score = cand, score
    return _validated(best.nodes, best.num_experts, 1, "mro")
