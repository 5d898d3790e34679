"""Spreading a node's expert slots over its GPUs, keeping experts where they already are.

A plan decides which experts each *node* hosts (replicas on distinct nodes, since a node
fails as a whole). Which of the node's G GPUs hosts which of those experts is a second,
local choice. The default deal (:meth:`Placement.gpu_slots` without an explicit table)
sorts the node's slots and deals them round-robin. It is balanced and separates copies of
one expert, but it ignores what the GPUs hold now: one added or removed expert shifts
every later one to another GPU, so after a failure nearly every expert of a surviving
node would be fetched again by a sibling GPU.

:func:`deal_gpus` keeps the same two properties (GPU loads of ``c // G`` or
``c // G + 1`` slots; copies of an expert on distinct GPUs whenever the node holds at most
G of them) and keeps every expert it can on the GPU that holds it now:

1. each GPU keeps the experts it holds that the node still hosts (an expert held by more
   GPUs than the node keeps copies of stays on the GPUs holding the fewest experts);
2. the ``c % G`` larger loads go to the GPUs that keep the most; a GPU keeping more than
   its load gives back its highest ids;
3. the rest is placed expert by expert, most copies first, each on a GPU with free slots
   that does not hold it yet (one that held it before, else the one with the most room).
   When only GPUs that hold it have room, one expert moves from a full GPU to a GPU with
   room to make a place (always possible while the copies do not outnumber the GPUs).

The result is compared with the round-robin deal, and the one needing fewer same-node
moves (:func:`same_node_moves`) is returned, so it never does worse than the default.

Pure Python; deterministic for equal inputs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["NodeGpus", "deal_gpus", "round_robin_gpus", "same_node_moves", "split_node"]


def round_robin_gpus(row: Sequence[int], gpus_per_node: int) -> list[list[int]]:
    """The default deal: the node's sorted slots dealt round-robin over its GPUs."""
    s = sorted(int(x) for x in row)
    return [s[j::gpus_per_node] for j in range(gpus_per_node)]


def _loads(c: int, g: int, kept: list[list[int]]) -> list[int]:
    """Slots per GPU: ``c // g`` each; the ``c % g`` extra ones to the GPUs keeping most."""
    base, extra = divmod(c, g)
    order = sorted(range(g), key=lambda j: (-len(kept[j]), j))
    loads = [base] * g
    for j in order[:extra]:
        loads[j] += 1
    return loads


@dataclass(frozen=True)
class NodeGpus:
    """One node's split over its GPUs, with what it costs.

    Attributes:
        split: ``split[j]``: sorted expert ids on GPU ``j``.
        moves: expert copies a GPU must receive although the node holds them on
            another of its GPUs (:func:`same_node_moves` against the holdings).
        round_robin_moves: the same count for the round-robin deal of the same row.
    """

    split: list[list[int]]
    moves: int = 0
    round_robin_moves: int = 0


def deal_gpus(row: Sequence[int], gpus_per_node: int,
              held: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Spread one node's slots ``row`` over ``gpus_per_node`` GPUs (sorted lists, one per GPU).

    Args:
        row: the expert ids the node hosts in the new plan (``c`` slots; repeats are
            copies).
        gpus_per_node: G, between 1 and ``len(row)``.
        held: what each of the node's G GPUs holds now; None, empty or of another length
            (a node that joins, or changed its GPU count) gives the round-robin deal.

    Raises:
        ValueError: G outside ``[1, len(row)]``.
    """
    return split_node(row, gpus_per_node, held).split


def split_node(row: Sequence[int], gpus_per_node: int,
               held: Sequence[Sequence[int]] | None = None) -> NodeGpus:
    """:func:`deal_gpus` with its same-node moves and those of the round-robin deal."""
    g, c = int(gpus_per_node), len(row)
    if not 1 <= g <= max(c, 1):
        raise ValueError(f"gpus_per_node must be in [1, {c}] (the node's slots), got {gpus_per_node!r}")
    if g == 1:
        return NodeGpus([sorted(int(x) for x in row)])
    plain = round_robin_gpus(row, g)
    if held is None or len(held) != g or not any(len(h) for h in held):
        return NodeGpus(plain)
    want = Counter(int(x) for x in row)
    held_counts = [Counter(int(x) for x in h) for h in held]
    node_had = Counter(int(x) for h in held for x in h)
    sizes = [len(h) for h in held]
    if want == node_had and all(c // g <= n <= -(-c // g) for n in sizes):   # the node is unchanged
        return NodeGpus([sorted(int(x) for x in h) for h in held], 0, _moves(plain, held_counts, node_had))

    # 1. every GPU keeps what it holds and the node still hosts. An expert with fewer
    #    copies left than GPUs holding it stays, one copy per GPU per round, on the GPUs
    #    holding the fewest experts (they have the most room to keep it).
    kept: list[list[int]] = [[] for _ in range(g)]
    claims: dict[int, list[int]] = {}
    for j in sorted(range(g), key=lambda j: (sizes[j], j)):
        for e in held_counts[j]:
            if e in want:
                claims.setdefault(e, []).append(j)
    for e, holders in claims.items():
        left, rnd = want[e], 0
        while left and holders:
            holders = [j for j in holders if held_counts[j][e] > rnd]
            for j in holders[:left]:
                kept[j].append(e)
            left -= len(holders[:left])
            rnd += 1

    # 2. loads; a GPU keeping more than its load gives back its highest ids.
    loads = _loads(c, g, kept)
    for j in range(g):
        kept[j].sort()
        del kept[j][loads[j]:]
    to_place = want.copy()
    for k in kept:
        to_place.subtract(k)

    # 3. place the rest, most copies first: on a GPU with room that lacks the expert
    #    (one that held it first, then the most room), else make such a place, else
    #    (more copies than GPUs) on the GPU with room holding the fewest copies of it.
    gpus = [list(k) for k in kept]
    members = [Counter(k) for k in kept]
    pending = sorted((e for e, n in to_place.items() if n > 0), key=lambda e: (-to_place[e], e))
    for e in pending:
        for _ in range(to_place[e]):
            free = [j for j in range(g) if len(gpus[j]) < loads[j]]
            fits = [j for j in free if not members[j][e]]
            if fits:
                j = max(fits, key=lambda j: (held_counts[j][e] > 0, loads[j] - len(gpus[j]), -j))
            else:
                j = _make_room(e, free[0], gpus, members, loads)
                if j < 0:
                    j = min(free, key=lambda j: (members[j][e], j))
            gpus[j].append(e)
            members[j][e] += 1
    out = [sorted(x) for x in gpus]
    # the greedy steps can lose to the plain deal on unlucky inputs: never do worse
    moves = _moves(out, held_counts, node_had)
    plain_moves = _moves(plain, held_counts, node_had)
    if plain_moves < moves:
        return NodeGpus(plain, plain_moves, plain_moves)
    return NodeGpus(out, moves, plain_moves)


def _make_room(e: int, k: int, gpus: list[list[int]], members: list[Counter], loads: list[int]) -> int:
    """GPU ``k`` has room but holds ``e``: move some expert ``x`` from a full GPU ``j``
    without ``e`` to ``k`` (``k`` must not hold ``x``) and return ``j``; -1 if none."""
    for j in range(len(gpus)):
        if j == k or members[j][e] or len(gpus[j]) < loads[j]:
            continue
        for x in sorted((x for x in members[j] if members[j][x] and not members[k][x]), reverse=True):
            gpus[j].remove(x)
            members[j][x] -= 1
            gpus[k].append(x)
            members[k][x] += 1
            return j
    return -1


def same_node_moves(new: Sequence[Sequence[int]], held: Sequence[Sequence[int]]) -> int:
    """Expert copies a node's GPUs must receive although the node already holds them on
    another of its GPUs (``new`` and ``held``: per-GPU lists of one node)."""
    held_counts = [Counter(int(x) for x in h) for h in held]
    return _moves(new, held_counts, Counter(int(x) for h in held for x in h))


def _moves(new: Sequence[Sequence[int]], held_counts: Sequence[Counter], node_had: Counter) -> int:
    moves = 0
    for j, gpu in enumerate(new):
        have = held_counts[j] if j < len(held_counts) else Counter()
        for e, n in Counter(gpu).items():
            short = n - have[e]
            if short > 0:
                moves += min(short, max(node_had[e] - have[e], 0))
    return moves
