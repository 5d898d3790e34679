"""plan_migration for large clusters (issue 43 item 6: a thousand nodes): the greedy
mapping and the 2-opt pass over classes of identical expert sets are, step by step, the
ones over all N^2 pairs they replaced, and a 4,096-node layer maps in well under a second."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from lazarus.planning import Placement, allocate_replicas, place_mro, plan_migration
from lazarus.planning._migration import _class_costs, _cost_matrix, _greedy_classes, _two_opt_classes


def reference_greedy(cost: np.ndarray) -> np.ndarray:
    """The greedy plan_migration used before (the reference): repeatedly take the cheapest
    pair whose ends are both free."""
    n = cost.shape[0]
    key: np.ndarray = (2 * cost + 1).astype(np.int16 if cost.max(initial=0) < 16000 else np.int64)
    key[np.arange(n), np.arange(n)] -= 1  # ties: keep a node at its old position
    order = np.argsort(key.ravel(), kind="stable")
    assign = np.full(n, -1, dtype=np.int64)
    used_p = np.zeros(n, dtype=bool)
    used_q = np.zeros(n, dtype=bool)
    left = n
    start = 0
    block = max(n, 1024)
    while left and start < order.size:
        chunk = order[start : start + block]
        start += block
        ps, qs = np.divmod(chunk, n)
        keep = ~used_p[ps] & ~used_q[qs]
        for p, q in zip(ps[keep].tolist(), qs[keep].tolist()):
            if not used_p[p] and not used_q[q]:
                used_p[p] = used_q[q] = True
                assign[p] = q
                left -= 1
                if not left:
                    break
    return assign

def reference_two_opt(cost: np.ndarray, assign: np.ndarray, max_passes: int = 4) -> np.ndarray:
    """The 2-opt pass plan_migration used before (the reference): swap the plan nodes of
    two physical nodes while that lowers the total cost."""
    n = cost.shape[0]
    assign = assign.copy()
    m = np.ascontiguousarray(cost[:, assign])  # m[i, j]: node i taking node j's plan node
    diag = m.diagonal().copy()
    for _ in range(max_passes):
        improved = False
        for p in range(n):
            gain = m[p, :] + m[:, p] - diag[p] - diag
            q = int(np.argmin(gain))
            if gain[q] < 0:
                assign[[p, q]] = assign[[q, p]]
                m[:, [p, q]] = m[:, [q, p]]
                diag[p], diag[q] = m[p, p], m[q, q]
                improved = True
        if not improved:
            break
    return assign


def _random_case(seed: int) -> tuple[list[set[int]], Placement] | None:
    rng = random.Random(seed)
    n, e, c = rng.randint(1, 40), rng.randint(1, 10), rng.randint(1, 3)
    rows = [rng.sample(range(e), min(c, e)) for _ in range(n)]
    for x in range(e):
        rows[rng.randrange(n)][0] = x
    try:
        new = Placement(rows, e)
    except ValueError:
        return None
    old = [set(rng.sample(range(e + 2), rng.randint(0, min(c + 1, e + 2)))) for _ in range(n)]
    return old, new


@pytest.mark.parametrize("seed", range(200))
def test_class_greedy_is_the_pairwise_greedy(seed: int) -> None:
    case = _random_case(seed)
    if case is None:
        return
    old, new = case
    cost = _cost_matrix(old, new)
    want = np.zeros((new.num_nodes, new.num_experts))
    have = np.zeros_like(want)
    for i, (h, row) in enumerate(zip(old, new.nodes)):
        have[i, [x for x in h if x < new.num_experts]] = 1
        want[i, sorted(set(row))] = 1
    assert (cost == want.sum(axis=1)[None, :] - have @ want.T).all()
    greedy = _greedy_classes(*_class_costs(old, new))
    assert (greedy == reference_greedy(cost)).all()
    # the 2-opt pass over types: swap for swap the one over all nodes, from the greedy
    # mapping and from a shuffled one
    for start in (greedy, np.random.default_rng(seed).permutation(new.num_nodes)):
        assert (_two_opt_classes(*_class_costs(old, new), start) == reference_two_opt(cost, start)).all()


def test_a_4096_node_layer_maps_fast() -> None:
    """4,096 nodes, 2 slots, 64 experts, 5% lost: the survivors' holdings onto the new MRO
    placement. The cost matrix (N^2 E) and the greedy's sort of its 16.8M pairs took 5 s
    here, and the 2-opt pass after them 1.5 s; over the classes (a few dozen distinct expert
    sets) they take milliseconds."""
    n, e = 4096, 64
    first = place_mro(allocate_replicas([1.0] * e, n, 2, 2), n, 2)
    survivors = [i for i in range(n) if i % 20 != 7]
    new = place_mro(allocate_replicas([1.0] * e, len(survivors), 2, 2), len(survivors), 2)
    old = [set(first.nodes[i]) for i in survivors]
    t0 = time.perf_counter()
    classes = _class_costs(old, new)
    assign = _two_opt_classes(*classes, _greedy_classes(*classes))
    elapsed = time.perf_counter() - t0
    assert sorted(assign.tolist()) == list(range(len(survivors)))
    assert elapsed < 1.0, f"the mapping of a 4,096-node layer took {elapsed:.1f} s"
    mig = plan_migration({f"n{i}": list(first.nodes[i]) for i in survivors}, new)
    assert mig.num_fetches <= mig.identity_fetches
