"""Exhaustive references for small clusters: the best any placement can do.

Used to check :func:`place_mro` against the true optimum and to report how far heuristics
are from it. Exponential in the number of nodes, so limited to ``num_nodes <= 10``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

from ._validate import check_int

__all__ = ["survivor_counts", "best_survivor_counts"]

MAX_NODES = 10


def survivor_counts(nodes: Sequence[Sequence[int]], num_nodes: int) -> tuple[int, ...]:
    """For R = 0..N: how many alive sets of R nodes keep every expert with a replica.

    Dividing entry R by C(N, R) gives the recovery probability with N - R nodes failed.
    """
    n = check_int("num_nodes", num_nodes, lo=1, hi=MAX_NODES)
    owners: dict[int, int] = {}
    for i, row in enumerate(nodes):
        for x in row:
            owners[x] = owners.get(x, 0) | (1 << i)
    masks = list(owners.values())
    out = [0] * (n + 1)
    for alive in range(1 << n):
        if all(alive & m for m in masks):
            out[bin(alive).count("1")] += 1
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _best(replicas: tuple[int, ...], n: int, c: int) -> tuple[int, ...]:
    contents = list(itertools.combinations_with_replacement(range(len(replicas)), c))
    best = [0] * (n + 1)
    left = list(replicas)

    # Nodes are interchangeable: enumerate node contents as a non-decreasing sequence.
    def rec(i: int, prev: tuple[int, ...], acc: list[tuple[int, ...]]) -> None:
        if i == n:
            for k, v in enumerate(survivor_counts(acc, n)):
                best[k] = max(best[k], v)
            return
        for node in contents:
            if node < prev:
                continue
            for x in node:
                left[x] -= 1
            if min(left) >= 0 and sum(left) == (n - i - 1) * c:
                acc.append(node)
                rec(i + 1, node, acc)
                acc.pop()
            for x in node:
                left[x] += 1

    rec(0, (), [])
    return tuple(best)


def best_survivor_counts(replicas: Sequence[int], num_nodes: int, slots_per_node: int) -> tuple[int, ...]:
    """Pointwise maximum of :func:`survivor_counts` over every placement of ``replicas``."""
    n = check_int("num_nodes", num_nodes, lo=1, hi=MAX_NODES)
    c = check_int("slots_per_node", slots_per_node, lo=1)
    r = tuple(check_int(f"replicas[{i}]", x, lo=1) for i, x in enumerate(replicas))
    if sum(r) != n * c:
        raise ValueError(f"replicas must sum to num_nodes*slots_per_node = {n * c}, got {sum(r)}")
    return _best(r, n, c)
