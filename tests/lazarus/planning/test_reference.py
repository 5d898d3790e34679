"""The fast planner returns exactly what the previous planner returned.

``lazarus.planning._reference`` keeps the planner as it was before the speed work
(``Fraction`` arithmetic, dense copy tables, every plan validated twice). These tests run
both on seeded random inputs, heavy-tailed loads included, and require identical replica
counts and identical plans (node by node, slot by slot). The helpers that were rewritten
(``_fill``, ``_repair_duplicates``) are also compared directly on random tables built to
need many repairs, so that their scan order is exercised, not just their usual no-op.
"""

from __future__ import annotations

import enum
import random

import numpy as np
import pytest

from lazarus.planning import Placement, allocate_replicas, mro_layout, place_mro, place_mro_paper
from lazarus.planning import _placement, _reference
from lazarus.planning._reference import allocate_replicas_reference, place_mro_reference

KINDS = ("pareto1.2", "pareto0.8", "zipf", "uniform", "ints", "zeros", "extreme", "numpy")


def _loads(rnd: random.Random, e: int, kind: str) -> list:
    if kind == "pareto1.2":
        return [rnd.paretovariate(1.2) for _ in range(e)]
    if kind == "pareto0.8":
        return [rnd.paretovariate(0.8) for _ in range(e)]
    if kind == "zipf":
        s = rnd.uniform(0.5, 2.0)
        return [1.0 / (k + 1) ** s for k in range(e)]
    if kind == "uniform":
        return [rnd.random() for _ in range(e)]
    if kind == "ints":
        return [rnd.randint(0, 50) for _ in range(e)]
    if kind == "zeros":
        return [0 if rnd.random() < 0.6 else rnd.random() for _ in range(e)]
    if kind == "extreme":  # decimal forms with very different exponents, ties, ints mixed in
        pool = [0.1, 0.3, 0.7, 1e-300, 5e-324, 1e300, 2.5e-7, 3, 0, 123456789.125]
        return [rnd.choice(pool) for _ in range(e)]
    g = np.random.default_rng(rnd.randrange(1 << 30))
    return list(g.pareto(1.2, e) + 1) if rnd.random() < 0.5 else list(g.integers(0, 9, e))


def _case(rnd: random.Random, max_nodes: int) -> tuple[list, int, int, int, int | None]:
    n = rnd.randint(1, max_nodes)
    c = rnd.randint(1, 9)
    e = rnd.randint(1, min(n * c, 300))
    f = rnd.randint(1, min(n, 4))
    cap = None if rnd.random() < 0.7 else rnd.randint(-(-c // e), c)
    return _loads(rnd, e, rnd.choice(KINDS)), n, c, f, cap


@pytest.mark.timeout(120)
def test_allocation_matches_reference() -> None:
    rnd = random.Random(15)
    for _ in range(600):
        loads, n, c, f, cap = _case(rnd, 400)
        assert allocate_replicas(loads, n, c, f, max_per_node=cap) == allocate_replicas_reference(
            loads, n, c, f, max_per_node=cap
        ), (loads, n, c, f, cap)


@pytest.mark.timeout(300)
def test_place_mro_matches_reference() -> None:
    rnd = random.Random(5)
    truncated = 0
    for i in range(400):
        loads, n, c, f, cap = _case(rnd, 12 if i % 2 else 200)
        r = allocate_replicas(loads, n, c, f, max_per_node=cap)
        improve = n <= 12 or i % 25 == 0  # the sampled search on big plans is slow-ish
        truncated += not mro_layout(r, n, c).full
        got = place_mro(r, n, c, improve=improve, seed=i % 3)
        want = place_mro_reference(r, n, c, improve=improve, seed=i % 3)
        assert got == want and got.strategy == want.strategy == "mro", (r, n, c)
        assert all(type(x) is int for row in got.nodes for x in row)
        paper = place_mro_paper(r, n, c)
        assert paper == place_mro_reference(r, n, c, improve=False)
        assert paper.strategy == "mro-paper"
    assert truncated > 50  # the local search path was compared too


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", range(4))
def test_pareto_1024_nodes_matches_reference(seed: int) -> None:
    # The benchmark's size: 1,024 nodes x 8 slots x 256 experts, Pareto(1.2) loads.
    n, c, e = 1024, 8, 256
    loads = (np.random.default_rng(seed).pareto(1.2, e) + 1).tolist()
    r = allocate_replicas(loads, n, c, 2)
    assert r == allocate_replicas_reference(loads, n, c, 2)
    assert mro_layout(r, n, c).full
    plan = place_mro(r, n, c)
    assert plan == place_mro_reference(r, n, c)
    assert plan.replica_counts() == r


def _random_table(rnd: random.Random) -> tuple[list[list[int]], list[int], list[int], int]:
    """A filled table with skewed experts and random MRO-block prefixes (``core``)."""
    n, c = rnd.randint(1, 60), rnd.randint(1, 8)
    e = rnd.randint(1, min(n * c, 40))
    weights = [rnd.paretovariate(1.0) for _ in range(e)]
    slots = list(range(e)) + rnd.choices(range(e), weights=weights, k=n * c - e)
    if rnd.random() < 0.5:
        slots.sort()
    else:
        rnd.shuffle(slots)
    nodes = [slots[i * c : (i + 1) * c] for i in range(n)]
    core = [rnd.choice([0, 0, c, rnd.randint(0, c)]) for _ in range(n)]
    r = [0] * e
    for x in slots:
        r[x] += 1
    return nodes, core, r, n


@pytest.mark.timeout(120)
def test_repair_matches_reference_when_it_swaps() -> None:
    rnd = random.Random(7)
    swapped = 0
    for _ in range(1500):
        nodes, core, r, n = _random_table(rnd)
        got, want = [list(x) for x in nodes], [list(x) for x in nodes]
        _placement._repair_duplicates(got, core, r, n)
        _reference._repair_duplicates(want, core, r, n)
        assert got == want, (nodes, core, r)
        swapped += got != nodes
    assert swapped > 700  # most tables needed repairs: the scan order was compared


@pytest.mark.timeout(120)
def test_fill_matches_reference() -> None:
    rnd = random.Random(11)
    dealt = general = 0  # full blocks (round-robin deal) / partial blocks (greedy)
    for _ in range(800):
        n, c = rnd.randint(1, 40), rnd.randint(1, 8)
        e = rnd.randint(1, min(n * c, 60))
        r = [1] * e
        for x in rnd.choices(range(e), weights=[rnd.paretovariate(1.2) for _ in range(e)],
                             k=n * c - e):
            r[x] += 1
        layout = mro_layout(r, n, c, partial_first=rnd.random() < 0.5)
        nodes: list[list[int]] = []
        left = list(r)
        for group, size in zip(layout.groups, layout.sizes):
            nodes.extend(list(group) for _ in range(size))
            for x in group:
                left[x] -= size
        nodes.extend([] for _ in range(n - len(nodes)))
        if sum(left):
            if all(not row for row in nodes if len(row) < c):
                dealt += 1
            else:
                general += 1
        got, want = [list(x) for x in nodes], [list(x) for x in nodes]
        left_got, left_want = list(left), list(left)
        _placement._fill(got, left_got, r, n, c)
        _reference._fill(want, left_want, r, n, c)
        assert got == want and left_got == left_want == [0] * e, (r, n, c)
    assert dealt > 100 and general > 100


# ----------------------------------------------------------------------------- Placement


class _Id(enum.IntEnum):
    ZERO = 0
    ONE = 1


def test_placement_still_validates_public_input() -> None:
    ok = Placement([[np.int64(0), _Id.ONE], [1, 0]])
    assert ok.nodes == [[0, 1], [1, 0]]
    assert all(type(x) is int for row in ok.nodes for x in row)
    for bad, word in (
        ([[0, -1], [1, 0]], "non-negative integer expert ids, got -1"),
        ([[0, True], [1, 0]], "non-negative integer expert ids, got True"),
        ([[0, 1.0], [1, 0]], "non-negative integer expert ids, got 1.0"),
        ([[0, "1"], [1, 0]], "non-negative integer expert ids"),
        ([[0, 1], [1]], "slots_per_node = 2"),
        ([[0, 2], [2, 0]], "missing \\[1\\]"),
    ):
        with pytest.raises(ValueError, match=word):
            Placement(bad)
    with pytest.raises(ValueError, match="num_experts"):
        Placement([[0, 1]], num_experts=True)


def test_planner_plans_equal_validated_ones() -> None:
    r = allocate_replicas([1 / (k + 1) for k in range(12)], 10, 6, 2)
    for plan in (place_mro(r, 10, 6), place_mro_paper(r, 10, 6)):
        again = Placement([list(row) for row in plan.nodes], plan.num_experts, plan.gpus_per_node)
        assert again == plan and again.nodes == plan.nodes


def test_with_gpus_checks_and_copies() -> None:
    plan = Placement([[0, 0, 1, 1], [0, 1, 1, 0]])
    two = plan.with_gpus(2)
    assert two.gpus_per_node == 2 and two.nodes == plan.nodes
    assert two.nodes is not plan.nodes and two.nodes[0] is not plan.nodes[0]
    for g in (0, 5, True, 1.5):
        with pytest.raises(ValueError, match="gpus_per_node"):
            plan.with_gpus(g)
