"""Placement constructions: the paper's MRO plan and the two baselines.

All three take the replica counts produced by allocation (input order = expert id) and
fill every one of the ``N * c`` slots. Within a node the expert list is sorted, which
makes plans easy to read and lets :meth:`Placement.gpu_slots` separate same-node copies.

MRO (maximum rank overlap) in short: sort experts by replica count, cut them into groups
of ``c`` consecutive experts, and give group ``i`` its own block of nodes, as many as the
group's smallest count (its *representative*). Every node of the block holds the whole
group, so the group survives as long as one node of its block survives, and the
representative, whose replicas all sit in the block, cannot survive otherwise. Left-over
replicas of the larger experts go to the free slots. When the blocks do not fit in ``N``
nodes the later blocks are cut short ("truncated"); the paper's optimality proof does not
cover that case and :func:`lazarus.planning.place_mro` improves on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._types import Placement
from ._validate import check_replicas


@dataclass(frozen=True)
class MroLayout:
    """How the paper's construction split experts and nodes (for tests and the search).

    Attributes:
        groups: expert ids of each group, least replicated first.
        sizes: nodes given to each group (its representative's count, or fewer).
        full: True when every group got its representative's full count: the domain of
            the paper's Theorem 1, where the plan is optimal.
    """

    groups: list[list[int]]
    sizes: list[int]
    full: bool


def mro_layout(
    replicas: Sequence[int], num_nodes: int, slots_per_node: int, *, partial_first: bool = False
) -> MroLayout:
    """Groups and node blocks of the MRO construction (validates like the placements).

    ``partial_first`` puts the short group (``E mod c`` least replicated experts) first
    instead of last; not the paper's layout, but a useful start for the local search.
    """
    r, n, c = check_replicas(replicas, num_nodes, slots_per_node)
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


def place_mro_paper(replicas: Sequence[int], num_nodes: int, slots_per_node: int) -> Placement:
    """The paper's MRO construction, without the improvement for truncated plans.

    Optimal (Theorem 1) when :func:`mro_layout` reports ``full``; kept public so that tests
    and benchmarks can measure what :func:`place_mro` adds.
    """
    r, n, c = check_replicas(replicas, num_nodes, slots_per_node)
    return _build_mro(r, n, c, mro_layout(r, n, c), "mro-paper")


def _build_mro(r: list[int], n: int, c: int, layout: MroLayout, label: str) -> Placement:
    """Blocks of whole groups first, then the left-over replicas in the free slots."""
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
    return Placement([sorted(row) for row in nodes], len(r), strategy=label)


def place_spread(replicas: Sequence[int], num_nodes: int, slots_per_node: int) -> Placement:
    """Baseline: deal each expert's replicas round-robin over consecutive nodes.

    Replicas are listed expert by expert and slot ``p`` of that list goes to node
    ``p mod N``; every node gets exactly ``c`` slots and an expert with ``r <= N`` replicas
    lands on ``r`` distinct nodes. This ignores how experts overlap, which is what MRO
    exploits.
    """
    r, n, c = check_replicas(replicas, num_nodes, slots_per_node)
    nodes: list[list[int]] = [[] for _ in range(n)]
    p = 0
    for e, count in enumerate(r):
        for _ in range(count):
            nodes[p % n].append(e)
            p += 1
    return Placement([sorted(row) for row in nodes], len(r), strategy="spread")


def place_compact(replicas: Sequence[int], num_nodes: int, slots_per_node: int) -> Placement:
    """Baseline: pack each expert's replicas on as few nodes as possible.

    Experts, most replicated first, fill the slots node after node, so an expert with
    ``r`` replicas occupies ``ceil(r / c)`` nodes (one more when it straddles a boundary)
    and holds several copies per node. Good for locality, poor for fault tolerance.
    """
    r, n, c = check_replicas(replicas, num_nodes, slots_per_node)
    nodes: list[list[int]] = [[] for _ in range(n)]
    p = 0
    for e in sorted(range(len(r)), key=lambda x: (-r[x], x)):
        for _ in range(r[e]):
            nodes[p // c].append(e)
            p += 1
    return Placement([sorted(row) for row in nodes], len(r), strategy="compact")


def _fill(nodes: list[list[int]], left: list[int], r: list[int], n: int, c: int) -> None:
    """Place the left-over replicas into the free slots, in place.

    Experts with the most left-over replicas go first (they are the hardest to spread);
    each takes the free nodes that hold the fewest copies of it, preferring nodes with the
    most free slots so that vacancies stay balanced for the experts that follow. This is
    the Gale-Ryser style greedy; the rare dead ends it leaves are fixed by
    :func:`_repair_duplicates`.
    """
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
    """Swap filler replicas between nodes to remove avoidable same-node copies, in place.

    ``core[i]`` is how many leading entries of ``nodes[i]`` belong to the MRO block and
    must stay put. A copy of ``e`` beyond ``ceil(r_e / N)`` on node ``a`` is exchanged with
    a filler ``y`` of a node ``b`` that may take another ``e`` while ``a`` may take ``y``;
    neither expert loses a node. Copies that cannot move (all candidate nodes are full
    MRO blocks, which happens for very popular experts) stay: they still add compute and
    go to different GPUs of the node.
    """
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
