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

import itertools
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
    return _mro_layout(r, n, c, partial_first)


def _mro_layout(r: list[int], n: int, c: int, partial_first: bool = False) -> MroLayout:
    """:func:`mro_layout` on arguments already checked by :func:`check_replicas`."""
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
    return _build_mro(r, n, c, _mro_layout(r, n, c), "mro-paper")


def _build_mro(r: list[int], n: int, c: int, layout: MroLayout, label: str) -> Placement:
    """Blocks of whole groups first, then the left-over replicas in the free slots.

    ``r``, ``n``, ``c`` must have passed :func:`check_replicas`; the plan is built
    without re-validation (every slot is filled and every expert placed by construction).
    """
    nodes: list[list[int]] = []
    left = list(r)
    for group, size in zip(layout.groups, layout.sizes):
        nodes.extend(list(group) for _ in range(size))
        for e in group:
            left[e] -= size
    nodes.extend([] for _ in range(n - len(nodes)))
    core = [len(row) for row in nodes]
    _fill(nodes, left, r, n, c)
    _repair_duplicates(nodes, core, r, n)
    for row in nodes:
        row.sort()
    return Placement._unchecked(nodes, len(r), 1, label)


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
    return Placement._unchecked([sorted(row) for row in nodes], len(r), 1, "spread")


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
    return Placement._unchecked([sorted(row) for row in nodes], len(r), 1, "compact")


def _fill(nodes: list[list[int]], left: list[int], r: list[int], n: int, c: int) -> None:
    """Place the left-over replicas into the free slots, in place.

    Experts with the most left-over replicas go first (they are the hardest to spread);
    each takes the free nodes that hold the fewest copies of it, preferring nodes with the
    most free slots so that vacancies stay balanced for the experts that follow. This is
    the Gale-Ryser style greedy; the rare dead ends it leaves are fixed by
    :func:`_repair_duplicates`.

    When every node with a free slot is empty (all MRO groups have ``c`` experts, so the
    blocks are full) this greedy is a plain round-robin deal: all free nodes start with
    ``c`` vacancies and no copies, each expert takes the next nodes in cyclic order (the
    most vacant, lowest index first), and wraps around when it needs more nodes than
    there are. That case is dealt directly; partial blocks take the general path.
    """
    e_count = len(r)
    todo = sorted((x for x in range(e_count) if left[x] > 0), key=lambda x: (-left[x], x))
    free = [i for i, row in enumerate(nodes) if len(row) < c]
    if free and all(not nodes[i] for i in free):
        deck: list[int] = []
        for e in todo:
            deck.extend([e] * left[e])
        for k, i in enumerate(free):
            nodes[i].extend(deck[k :: len(free)])
        for e in range(e_count):
            left[e] = 0
        return
    lens = [len(row) for row in nodes]
    vac = c - np.array(lens, dtype=np.int64)
    # Which nodes already hold each expert (the MRO blocks), grouped by expert. An
    # expert's copies only change while that expert is placed, so its row of the
    # copies table is built when its turn comes.
    owner = np.repeat(np.arange(n, dtype=np.int64), lens)
    flat = np.fromiter(itertools.chain.from_iterable(nodes), dtype=np.int64, count=len(owner))
    by_expert = np.argsort(flat, kind="stable")
    holders = owner[by_expert]
    bounds = np.searchsorted(flat[by_expert], np.arange(e_count + 1)).tolist()
    for e in todo:
        need = left[e]
        copies = np.bincount(holders[bounds[e] : bounds[e + 1]], minlength=n)
        level = 0
        while need > 0:
            cand = np.flatnonzero((vac > 0) & (copies == level))
            if cand.size:
                cand = cand[np.argsort(-vac[cand], kind="stable")][:need]
                for i in cand.tolist():
                    nodes[i].append(e)
                vac[cand] -= 1
                copies[cand] += 1
                need -= int(cand.size)
            level += 1
    for e in range(e_count):
        left[e] = 0


def _repair_duplicates(nodes: list[list[int]], core: list[int], r: list[int], n: int) -> None:
    """Swap filler replicas between nodes to remove avoidable same-node copies, in place.

    ``core[i]`` is how many leading entries of ``nodes[i]`` belong to the MRO block and
    must stay put. A copy of ``e`` beyond ``ceil(r_e / N)`` on node ``a`` is exchanged with
    a filler ``y`` of a node ``b`` that may take another ``e`` while ``a`` may take ``y``;
    neither expert loses a node. Copies that cannot move (all candidate nodes are full
    MRO blocks, which happens for very popular experts) stay: they still add compute and
    go to different GPUs of the node.

    Scan order (the result depends on it): nodes ``a`` ascending, their filler slots in
    order; an excess copy goes to the lowest node ``b`` that can take it and has a
    suitable filler, in exchange for the first such filler. What keeps this fast without
    changing the result:

    - a swap never creates an excess copy (``e`` only moves to a node below its allowance,
      ``y`` likewise), so only the nodes and experts in excess at the start are visited;
    - a filler of ``b`` is unsuitable exactly when it is an expert already at its
      allowance on ``a``. So the search for ``e`` succeeds iff the fillers of the nodes
      that can take ``e`` (``room(e)``) are not all at their allowance on ``a``; that set
      of fillers only changes on a swap and is computed once per expert between swaps.
      Under heavy skew it is usually empty (the hot expert is everywhere) and nothing is
      scanned at all.
    """
    e_count = len(r)
    lens = np.array([len(row) for row in nodes], dtype=np.int64)
    core_arr = np.array(core, dtype=np.int64)
    fill_len = lens - core_arr
    if int(np.count_nonzero(fill_len)) < 2:
        return
    allowed = [-(-x // n) for x in r]
    total = int(lens.sum())
    owner = np.repeat(np.arange(n, dtype=np.int64), lens)
    flat = np.fromiter(itertools.chain.from_iterable(nodes), dtype=np.int64, count=total)
    # Copies per (node, expert), sparse: a dense E x N table costs more than the search.
    pairs, counts = np.unique(owner * e_count + flat, return_counts=True)
    pair_expert = pairs % e_count
    excess = counts > np.array(allowed, dtype=np.int64)[pair_expert]
    excess &= fill_len[pairs // e_count] > 0  # only fillers move
    excess_nodes = pairs[excess] // e_count
    excess_experts = pair_expert[excess]
    if excess_nodes.size == 0:
        return
    over_at: dict[int, list[int]] = {}
    for a, e in zip(excess_nodes.tolist(), excess_experts.tolist()):
        over_at.setdefault(a, []).append(e)
    # Per-node copies of the experts in excess somewhere (the only rows ever needed).
    over_experts = sorted(set(excess_experts.tolist()))
    row_of = {e: k for k, e in enumerate(over_experts)}
    rows = np.zeros((len(over_experts), n), dtype=np.int64)
    sel = np.isin(pair_expert, over_experts)
    rows[
        np.array([row_of[e] for e in pair_expert[sel].tolist()], dtype=np.int64),
        pairs[sel] // e_count,
    ] = counts[sel]
    # Filler slots, node by node: owner, position within the node, expert.
    pos = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    is_filler = pos >= np.repeat(core_arr, lens)
    slot_node, slot_pos, slot_expert = owner[is_filler], pos[is_filler], flat[is_filler]
    slot_start = np.cumsum(fill_len) - fill_len  # first filler slot of each node
    has_fill = fill_len > 0
    room_fillers: dict[int, set[int]] = {}  # cache between swaps

    def fillers_in_room(e: int) -> set[int]:
        got = room_fillers.get(e)
        if got is None:
            room = has_fill & (rows[row_of[e]] < allowed[e])
            got = set(np.unique(slot_expert[room[slot_node]]).tolist())
            room_fillers[e] = got
        return got

    if not any(fillers_in_room(e) for e in over_experts):
        return  # no excess copy can move, and nothing changes without a move
    for a in sorted(over_at):
        if not any(fillers_in_room(e) for e in over_at[a]):
            continue  # nothing can take any excess copy of this node
        row_a = nodes[a]
        held: dict[int, int] = {}
        for x in row_a:
            held[x] = held.get(x, 0) + 1
        at_cap = {y for y, k in held.items() if k >= allowed[y]}
        for j in range(core[a], len(row_a)):
            e = row_a[j]
            if held[e] <= allowed[e] or fillers_in_room(e) <= at_cap:
                continue
            bad = np.zeros(e_count, dtype=bool)
            bad[list(at_cap)] = True
            room = has_fill & (rows[row_of[e]] < allowed[e])
            room[a] = False
            suitable = room[slot_node] & ~bad[slot_expert]
            k = int(np.argmax(suitable))  # first suitable filler of the lowest such node
            assert suitable[k], "fillers_in_room promised a partner"
            b, hit = int(slot_node[k]), int(slot_pos[k])
            y = nodes[b][hit]
            row_a[j], nodes[b][hit] = y, e
            slot_expert[k] = e
            slot_expert[slot_start[a] + j - core[a]] = y
            for x, src, dst in ((e, a, b), (y, b, a)):
                if x in row_of:
                    rows[row_of[x], src] -= 1
                    rows[row_of[x], dst] += 1
            held[e] -= 1
            held[y] = held.get(y, 0) + 1
            if held[y] >= allowed[y]:
                at_cap.add(y)
            room_fillers.clear()
