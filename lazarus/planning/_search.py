"""``place_mro``: the paper's MRO plan, improved by local search where it is not optimal.

Theorem 1 of the paper proves MRO optimal for every failure count when every node block
gets its representative's full replica count. When the blocks do not fit (this happens
when the last group has fewer than ``c`` experts) the construction is cut short, and
better plans exist: for ``N=3, c=2, r=[2,2,2]`` MRO survives one failure with
probability 2/3, while ``[[0,1],[1,2],[0,2]]`` always survives.

For such truncated plans we run a deterministic local search. A move swaps two replicas
between two nodes (node ``a`` gives expert ``x`` to node ``b`` and takes ``y`` back), so
every node keeps ``c`` replicas and every expert keeps its count. A move is accepted only
if it *dominates*: at least as many surviving alive sets for every failure count and more
for one. Starting from the paper's plan this guarantees the result is never worse than the
paper's for any number of failed nodes. Among dominating moves the one with the largest
sum of recovery probabilities wins (ties: first in scan order).

Scoring uses a fixed table of alive sets: all ``2^N`` subsets for small ``N`` (exact), or
for larger ``N`` a seeded sample with the same rows reused for every candidate (common
random numbers, so comparisons are consistent). Each expert keeps a boolean "has an alive
owner" column over the table, so a move re-scores only the two experts it touches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ._placement import _build_mro, _mro_layout, place_spread
from ._types import Placement
from ._validate import check_int, check_replicas

#: Up to this many nodes the search scores moves on all 2^N alive sets (exact).
EXACT_SEARCH_MAX_NODES = 12
#: Rows per failure count of the sampled table used above that size.
SAMPLED_ROWS_PER_COUNT = 128
#: Distinct failure counts sampled when scoring is sampled.
SAMPLED_COUNTS = 32
#: On large clusters only this many partner nodes are tried per node.
PARTNERS_LARGE = 24
#: Scored moves allowed when scoring is sampled (keeps large plans fast).
SAMPLED_MAX_EVALS = 3000


class _AliveTable:
    """Alive sets (rows) used to score plans, with the failure count of each row."""

    def __init__(self, n: int, seed: int, min_failed: int = 1) -> None:
        self.n = n
        if n <= EXACT_SEARCH_MAX_NODES:
            masks = np.arange(1 << n, dtype=np.int64)
            self.alive = ((masks[:, None] >> np.arange(n)) & 1).astype(bool)
            self.weights = np.array(
                [1.0 / math.comb(n, k) for k in range(n + 1)], dtype=np.float64
            )
            self.exact = True
        else:
            rng = np.random.default_rng(seed)
            rows = []
            # Fewer failures than the smallest owner set always recover: no rows needed.
            lo = max(1, min(min_failed, n - 1))
            counts = sorted(set(np.linspace(lo, n - 1, num=min(SAMPLED_COUNTS, n - lo)).round().astype(int).tolist()))
            for f in counts:
                keys = rng.random((SAMPLED_ROWS_PER_COUNT, n))
                idx = np.argpartition(keys, f - 1, axis=1)[:, :f]
                alive = np.ones((SAMPLED_ROWS_PER_COUNT, n), dtype=bool)
                np.put_along_axis(alive, idx, False, axis=1)
                rows.append(alive)
            self.alive = np.concatenate(rows)
            self.weights = np.zeros(n + 1)  # indexed by alive count R
            self.weights[[n - f for f in counts]] = 1.0 / SAMPLED_ROWS_PER_COUNT
            self.exact = False
        self.alive_count = self.alive.sum(axis=1)
        self.cols = [np.ascontiguousarray(self.alive[:, i]).astype(np.int16) for i in range(n)]

    def alive_owners(self, owners: set[int]) -> np.ndarray:
        """Per row, how many of ``owners`` are alive (an expert survives iff > 0)."""
        if not owners:
            return np.zeros(self.alive.shape[0], dtype=np.int16)
        return self.alive[:, sorted(owners)].sum(axis=1, dtype=np.int16)

    def counts(self, uncovered: np.ndarray) -> np.ndarray:
        """Covering rows per alive count ``R`` (index 0..N)."""
        return np.bincount(self.alive_count[uncovered == 0], minlength=self.n + 1)


def _owner_sets(nodes: list[list[int]], e_count: int) -> list[set[int]]:
    out: list[set[int]] = [set() for _ in range(e_count)]
    for i, row in enumerate(nodes):
        for x in row:
            out[x].add(i)
    return out


def _risky_experts(alive_cnt: list[np.ndarray], k: int) -> set[int]:
    """The ``k`` experts lost in the most scoring rows (moves must involve one of them)."""
    lost = np.array([int((h == 0).sum()) for h in alive_cnt])
    order = np.argsort(-lost, kind="stable")[:k]
    return {int(e) for e in order if lost[e] > 0}


def improve_placement(
    start: Placement,
    *,
    floor: Placement | None = None,
    max_rounds: int = 200,
    max_evals: int | None = None,
    seed: int = 0,
) -> tuple[Placement, float]:
    """Local search from ``start``; returns the plan and its score.

    Every accepted move raises the score (sum over failure counts of the recovery
    probability on the scoring table) and keeps the plan at or above ``floor`` (default:
    ``start``) for every failure count. The returned plan dominates ``floor`` if ``start``
    did. Exact when ``N <= EXACT_SEARCH_MAX_NODES``; above that, judged on a seeded sample
    of alive sets. ``max_evals`` bounds the number of scored moves (default: unbounded for
    exact scoring, ``SAMPLED_MAX_EVALS`` for sampled scoring). Deterministic for a seed.
    """
    n, e_count = start.num_nodes, start.num_experts
    rounds = check_int("max_rounds", max_rounds, lo=0)
    evals_left = None if max_evals is None else check_int("max_evals", max_evals, lo=0)
    nodes = [list(row) for row in start.nodes]
    owners = _owner_sets(nodes, e_count)
    table = _AliveTable(n, seed, min_failed=min(len(o) for o in owners))
    if evals_left is None and not table.exact:
        evals_left = SAMPLED_MAX_EVALS
    base = floor if floor is not None else start
    if base.num_nodes != n:
        raise ValueError("floor must have as many nodes as start")
    base_unc = np.zeros(table.alive.shape[0], dtype=np.int32)
    for s in _owner_sets(base.nodes, base.num_experts):
        base_unc += table.alive_owners(s) == 0
    low = table.counts(base_unc)
    alive_cnt = [table.alive_owners(s) for s in owners]
    uncovered = np.zeros(table.alive.shape[0], dtype=np.int32)
    for k in alive_cnt:
        uncovered += k == 0
    cur = table.counts(uncovered)
    # Upper bound: the expert spanning the fewest nodes must survive. Reaching it for
    # every R means nothing can be gained.
    span = min(len(s) for s in owners)
    # Only used with exact scoring (N <= EXACT_SEARCH_MAX_NODES): C(N, k) overflows int64
    # from N = 67 on.
    bound = (
        np.array([math.comb(n, k) - math.comb(n - span, k) for k in range(n + 1)], dtype=np.int64)
        if table.exact
        else None
    )
    rng = np.random.default_rng(seed + 1)
    small = n <= EXACT_SEARCH_MAX_NODES
    done_rounds = 0
    while done_rounds < rounds and (evals_left is None or evals_left > 0):
        done_rounds += 1
        if bound is not None and np.array_equal(cur[1:n], bound[1:n]):
            break
        risk = None if small else _risky_experts(alive_cnt, 2 * start.slots_per_node)
        best = None
        best_score = float(np.dot(cur, table.weights))
        above = not np.any(cur[1:n] < low[1:n])
        for a in range(n):
            if evals_left is not None and evals_left <= 0:
                break
            if small:
                partners: list[int] = list(range(a + 1, n))
            else:
                pick = rng.choice(n, size=min(PARTNERS_LARGE, n), replace=False).tolist()
                partners = sorted(set(pick) - {a})
            for b in partners:
                # Moves may create a same-node copy: freeing a slot for a scarce expert
                # can be worth a duplicate of a plentiful one.
                set_a, set_b = set(nodes[a]), set(nodes[b])
                xs, ys = sorted(set_a), sorted(set_b)
                col_a, col_b = table.cols[a], table.cols[b]
                for x in xs:
                    kx = alive_cnt[x]
                    if nodes[a].count(x) == 1:
                        kx = kx - col_a
                    if x not in set_b:
                        kx = kx + col_b
                    for y in ys:
                        if y == x or (y in set_a and x in set_b):
                            continue  # no-op, or both experts lose a node
                        if risk is not None and x not in risk and y not in risk:
                            continue
                        ky = alive_cnt[y]
                        if nodes[b].count(y) == 1:
                            ky = ky - col_b
                        if y not in set_a:
                            ky = ky + col_a
                        unc = (
                            uncovered
                            - (alive_cnt[x] == 0) - (alive_cnt[y] == 0) + (kx == 0) + (ky == 0)
                        )
                        cnt = table.counts(unc)
                        if evals_left is not None:
                            evals_left -= 1
                        if above and np.any(cnt[1:n] < low[1:n]):
                            continue
                        score = float(np.dot(cnt, table.weights))
                        if score > best_score + 1e-12:
                            best, best_score = (a, b, x, y, kx, ky, unc, cnt), score
        if best is None:
            break
        a, b, x, y, kx, ky, unc, cnt = best
        nodes[a][nodes[a].index(x)] = y
        nodes[b][nodes[b].index(y)] = x
        for e, node_from, node_to in ((x, a, b), (y, b, a)):
            if e not in nodes[node_from]:
                owners[e].discard(node_from)
            owners[e].add(node_to)
        alive_cnt[x], alive_cnt[y] = kx, ky
        uncovered, cur = unc, cnt
    plan = Placement._unchecked(
        [sorted(r) for r in nodes], e_count, start.gpus_per_node, start.strategy
    )
    return plan, float(np.dot(cur, table.weights)) if not np.any(cur[1:n] < low[1:n]) else -1.0


def place_mro(
    replicas: Sequence[int],
    num_nodes: int,
    slots_per_node: int,
    *,
    improve: bool = True,
    seed: int = 0,
) -> Placement:
    """MRO placement: optimal where the paper's theorem applies, improved elsewhere.

    Args:
        replicas: replica count per expert (e.g. from :func:`allocate_replicas`); must sum
            to ``num_nodes * slots_per_node`` with every count >= 1.
        num_nodes: N (>= 1).
        slots_per_node: c (>= 1).
        improve: run the local search on truncated plans (default). ``False`` returns the
            paper's plan, same as :func:`place_mro_paper`.
        seed: seed of the sampled scoring table used for large truncated plans.

    The result never does worse than :func:`place_mro_paper` for any failure count when
    ``N <= EXACT_SEARCH_MAX_NODES`` (exact scoring); above that the guarantee holds on the
    seeded sample used for scoring.
    """
    r, n, c = check_replicas(replicas, num_nodes, slots_per_node)
    seed = check_int("seed", seed, lo=0)
    layout = _mro_layout(r, n, c)
    paper = _build_mro(r, n, c, layout, "mro-paper")
    if not improve or layout.full or n < 2:
        return Placement._unchecked(paper.nodes, paper.num_experts, 1, "mro")
    best, best_score = improve_placement(paper, seed=seed)
    if n <= EXACT_SEARCH_MAX_NODES:
        # A second start escapes local optima of the paper's plan; its result only counts
        # if it ends at or above the paper's plan for every failure count.
        starts = [place_spread(r, n, c)]
        if len(r) % c:
            starts.append(_build_mro(r, n, c, _mro_layout(r, n, c, partial_first=True), "mro"))
        for other in starts:
            cand, score = improve_placement(other, floor=paper, seed=seed)
            if score > best_score + 1e-12:
                best, best_score = cand, score
    return Placement._unchecked(best.nodes, best.num_experts, 1, "mro")
