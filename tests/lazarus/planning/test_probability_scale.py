"""Recovery probability of large clusters' plans (the controller computes one per layer of
every plan: issue 43 item 6, a thousand nodes)."""

from __future__ import annotations

import math
import random
import time

import pytest

from lazarus.planning import Placement, recovery_estimate
from lazarus.planning._probability import _enumerate, _group_count, _group_counts, minimal_owner_sets


@pytest.mark.parametrize("seed", range(20))
def test_group_count_matches_the_full_product(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.randint(1, 5) for _ in range(rng.randint(1, 8))]
    n = sum(sizes) + rng.randint(0, 6)
    full = _group_counts(sizes, n)
    assert [_group_count(sizes, n, r) for r in range(n + 1)] == full


def test_groups_method_matches_enumeration() -> None:
    # 12 nodes, 2 slots each, 6 experts on disjoint node groups of 4 (compact placement)
    nodes = [[(i // 4) * 2, (i // 4) * 2 + 1] for i in range(12)]
    p = Placement(nodes, 6)
    sets = minimal_owner_sets(p)
    for f in range(1, 12):
        est = recovery_estimate(p, f)
        assert est.method == "groups"
        assert est.probability == _enumerate(sets, 12, f) / math.comb(12, f)


def test_recovery_of_a_4096_node_plan_is_fast() -> None:
    """4,096 nodes, 256 experts each on its own 16 nodes: the product expanded in x took
    O(N^2) big-integer products (5 s here); in 1 + x it is O(G * N) (0.04 s)."""
    n, experts, copies = 4096, 256, 16
    nodes = [[i // copies] for i in range(n)]
    p = Placement(nodes, experts)
    t0 = time.perf_counter()
    est = recovery_estimate(p, 205)
    elapsed = time.perf_counter() - t0
    assert est.method == "groups"
    # independent check: P(no group wiped out) by inclusion-exclusion over the groups wiped out
    exact = sum((-1) ** j * math.comb(experts, j) * math.comb(n - copies * j, 205 - copies * j)
                for j in range(0, 205 // copies + 1)) / math.comb(n, 205)
    assert est.probability == pytest.approx(exact, rel=1e-12)
    assert elapsed < 1.0, f"recovery_estimate of a 4,096-node plan took {elapsed:.1f} s"
