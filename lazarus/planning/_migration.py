"""Migration from the replicas nodes hold now to a new placement.

A placement names plan nodes ``0..N-1``; which physical node plays which plan node is
free, and that choice decides how many expert states must move: a physical node only
fetches the experts of its plan node that it does not already hold. We pick the mapping
greedily, as the paper does: among all unmapped (physical, plan) pairs take the one that
needs the fewest fetches, repeat. Costs of a pair never change as others are mapped, so
this is one scan over the pairs sorted by cost (ties prefer keeping a node at its old
position, then the lower indices).

Greedy assignment can lose to a simple alternative on unlucky cost matrices, so two cheap
safeguards follow: pairwise exchanges of plan nodes while they reduce the total (2-opt),
and a final comparison with the identity mapping (``i``-th physical node in ``old_nodes``
order keeps plan index ``i``). The result therefore never needs more fetches than the
identity mapping.

Each fetch is then assigned a source among the surviving owners of the expert: the owner
that has sent this expert the fewest times so far, ties broken by fewest sends overall.
One expert's fetches thus rotate over all its owners, and no node becomes a hot spot.
Experts with no surviving owner are listed in ``missing``: they must come from the
checkpoint (moc), not from a peer.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from ._types import Placement
from ._validate import check_int

NodeId = Hashable
# the node ids of one call (a Mapping is invariant in its key type: dict[str, ...] is no
# Mapping[Hashable, ...], but it is a Mapping[_Node, ...])
_Node = TypeVar("_Node", bound=Hashable)


@dataclass(frozen=True)
class Migration:
    """A node mapping plus the expert transfers it implies.

    Attributes:
        mapping: physical node id -> plan node index in the new placement.
        transfers: ``(expert, src_node, dst_node)`` peer-to-peer fetches (physical ids).
        missing: ``(expert, dst_node)`` fetches with no surviving owner; restore these
            from the checkpoint store.
        identity_fetches: fetches the identity mapping would have needed (for reporting).
    """

    mapping: dict[NodeId, int]
    transfers: list[tuple[int, NodeId, NodeId]]
    missing: list[tuple[int, NodeId]] = field(default_factory=list)
    identity_fetches: int = 0

    @property
    def num_fetches(self) -> int:
        """Expert states a node must receive: peer transfers plus checkpoint restores."""
        return len(self.transfers) + len(self.missing)

    @property
    def inverse(self) -> dict[int, NodeId]:
        """Plan node index -> physical node id."""
        return {q: p for p, q in self.mapping.items()}

    @property
    def restore_experts(self) -> list[int]:
        """Experts that no survivor holds (sorted, unique)."""
        return sorted({e for e, _ in self.missing})

    def sends_per_node(self) -> dict[NodeId, int]:
        """Number of transfers each source sends (to check the spreading)."""
        out: dict[NodeId, int] = {}
        for _, src, _ in self.transfers:
            out[src] = out.get(src, 0) + 1
        return out


def _check_old(old_nodes: Mapping[_Node, Sequence[int]], n: int) -> list[_Node]:
    if not isinstance(old_nodes, Mapping):
        raise ValueError(f"old_nodes must be a dict node_id -> list of expert ids, got {type(old_nodes).__name__}")
    if len(old_nodes) != n:
        raise ValueError(
            f"old_nodes must list exactly the new placement's num_nodes = {n} physical nodes, "
            f"got {len(old_nodes)}"
        )
    for node, experts in old_nodes.items():
        if isinstance(experts, (str, bytes)) or not hasattr(experts, "__iter__"):
            raise ValueError(f"old_nodes[{node!r}] must be a list of expert ids, got {experts!r}")
        for x in experts:
            check_int(f"old_nodes[{node!r}] expert id", x, lo=0)
    return list(old_nodes.keys())


def _classes(rows: Sequence[frozenset[int]]) -> tuple[list[frozenset[int]], np.ndarray]:
    """The distinct sets of ``rows`` and each row's index among them (a large cluster's
    nodes hold a few dozen distinct expert sets)."""
    index: dict[frozenset[int], int] = {}
    of = np.fromiter((index.setdefault(r, len(index)) for r in rows), dtype=np.int64, count=len(rows))
    return list(index), of


def _class_costs(old: list[set[int]], new: Placement) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(small, old_of, new_of)``: ``small[a, b]``, experts of the ``b``-th distinct new
    row that the ``a``-th distinct old set lacks; ``old_of[p]`` / ``new_of[q]``: the
    classes of physical node ``p`` and plan node ``q``."""
    e_count = new.num_experts
    old_sets, old_of = _classes([frozenset(x for x in s if x < e_count) for s in old])
    new_sets, new_of = _classes([frozenset(row) for row in new.nodes])
    small = np.array([[len(w - h) for w in new_sets] for h in old_sets], dtype=np.int64)
    return small, old_of, new_of


def _cost_matrix(old: list[set[int]], new: Placement) -> np.ndarray:
    """``cost[p, q]``: experts of plan node ``q`` that physical node ``p`` lacks.

    Computed between the distinct old and new expert sets, then spread over the nodes
    (the same values as node by node, in O(N^2) array work instead of O(N^2 E))."""
    small, old_of, new_of = _class_costs(old, new)
    return small[old_of[:, None], new_of[None, :]]


def _greedy_classes(small: np.ndarray, old_of: np.ndarray, new_of: np.ndarray) -> np.ndarray:
    """Greedy assignment of ``cost = small[old_of][:, new_of]``: repeatedly take the
    cheapest pair whose ends are both free (ties: a node keeps its old position, then the
    lowest ``p``, then the lowest ``q``), without sorting the N^2 pairs (it did, and took
    most of a 1,024-node plan's time): O(N * classes) per cost value.

    The pairs go by key ``2 * cost + 1`` (minus 1 on the diagonal), then by ``p``, then by
    ``q``. So for each cost value ``c``: first every free ``p`` whose
    own plan node ``q = p`` costs ``c`` and is free keeps it; then, ``p`` ascending, each
    free ``p`` takes the lowest free ``q`` that costs it ``c`` (the lowest free plan node
    of each class, kept with a pointer: plan nodes are only ever taken)."""
    n = old_of.size
    assign = np.full(n, -1, dtype=np.int64)
    used_q = np.zeros(n, dtype=bool)
    members = [np.flatnonzero(new_of == b) for b in range(small.shape[1])]
    ptr = [0] * len(members)
    diag_cost = small[old_of, new_of]
    for c in np.unique(small).tolist():
        keep = (diag_cost == c) & (assign < 0) & ~used_q
        idx = np.flatnonzero(keep)
        assign[idx] = idx
        used_q[idx] = True
        targets = [np.flatnonzero(small[a] == c).tolist() for a in range(small.shape[0])]
        used = used_q.tolist()
        for p in np.flatnonzero(assign < 0).tolist():
            best = -1
            for b in targets[int(old_of[p])]:
                arr, i = members[b], ptr[b]
                while i < arr.size and used[arr[i]]:
                    i += 1
                ptr[b] = i
                if i < arr.size and (best < 0 or arr[i] < best):
                    best = int(arr[i])
            if best >= 0:
                assign[p] = best
                used[best] = True
        used_q[:] = used
    return assign


def _two_opt_classes(small: np.ndarray, old_of: np.ndarray, new_of: np.ndarray, assign: np.ndarray,
                     max_passes: int = 4) -> np.ndarray:
    """Swap the plan nodes of two physical nodes while that lowers the total cost.

    For each ``p`` in turn, the swap with the lowest gain (the lowest ``q`` among equal
    ones) is made when it lowers the cost; up to ``max_passes`` passes while one does.
    A swap's gain depends only on the *types* of ``p`` and ``q`` (the class of the set a
    node holds, the class of the plan node it has now), of which a large cluster has a
    few dozen: each step looks at the types, and at the lowest node of each, instead of
    at all N nodes (O(N^2) per pass before: most of a 1,024-node plan's time)."""
    n = old_of.size
    assign = assign.copy()
    ko, ka = small.shape
    types = ko * ka
    t_old = np.repeat(np.arange(ko), ka)
    t_new = np.tile(np.arange(ka), ko)
    diag_t = small[t_old, t_new]
    cur = new_of[assign]                   # class of the plan node each physical node has now
    of_type = (old_of * ka + cur).tolist()
    members: list[list[int]] = [[] for _ in range(types)]
    for i, t in enumerate(of_type):
        members[t].append(i)               # ascending: i goes up
    none = n + 1
    first = np.array([m[0] if m else none for m in members], dtype=np.int64)
    old_list = old_of.tolist()
    cur_list = cur.tolist()
    # whether a type has an improving swap depends only on which types are present:
    # a type found without one is skipped until that set changes (its version)
    version = 0
    no_gain: dict[int, int] = {}

    def move(i: int, src: int, dst: int) -> None:
        nonlocal version
        lst = members[src]
        del lst[bisect.bisect_left(lst, i)]
        first[src] = lst[0] if lst else none
        if not lst:
            version += 1
        lst = members[dst]
        if not lst:
            version += 1
        bisect.insort(lst, i)
        first[dst] = lst[0]
        of_type[i] = dst

    for _ in range(max_passes):
        improved = False
        for p in range(n):
            if no_gain.get(of_type[p]) == version:
                continue
            op, ap = old_list[p], cur_list[p]
            gain = small[op, t_new] + small[t_old, ap] - small[op, ap] - diag_t
            gain[first == none] = 0
            g = int(gain.min())
            if g >= 0:
                no_gain[of_type[p]] = version
                continue
            q = int(first[gain == g].min())
            tp, tq = of_type[p], of_type[q]
            oq, aq = old_list[q], cur_list[q]
            assign[[p, q]] = assign[[q, p]]
            cur_list[p], cur_list[q] = aq, ap
            move(p, tp, op * ka + aq)
            move(q, tq, oq * ka + ap)
            improved = True
        if not improved:
            break
    return assign


def plan_migration(
    old_nodes: Mapping[_Node, Sequence[int]], new: Placement, *, improve: bool = True
) -> Migration:
    """Map physical nodes onto ``new``'s plan nodes and schedule the expert fetches.

    Args:
        old_nodes: for each physical node of the new cluster (survivors, and joiners with
            an empty list), the expert ids it holds now. Order defines the identity mapping.
        new: the placement to migrate to; ``new.num_nodes`` must equal ``len(old_nodes)``.
        improve: apply the 2-opt pass and identity fallback after the greedy mapping
            (default). ``False`` returns the plain greedy mapping.
    """
    if not isinstance(new, Placement):
        raise ValueError(f"new must be a Placement, got {type(new).__name__}")
    n = new.num_nodes
    phys = _check_old(old_nodes, n)
    old = [set(int(x) for x in old_nodes[p]) for p in phys]
    small, old_of, new_of = _class_costs(old, new)
    cost = small[old_of[:, None], new_of[None, :]]
    assign = _greedy_classes(small, old_of, new_of)
    identity = int(np.trace(cost))
    if improve:
        assign = _two_opt_classes(small, old_of, new_of, assign)
        if int(cost[np.arange(n), assign].sum()) > identity:
            assign = np.arange(n)
    mapping: dict[NodeId, int] = {p: int(assign[i]) for i, p in enumerate(phys)}

    holders: dict[int, list[int]] = {}
    for i, s in enumerate(old):
        for x in s:
            holders.setdefault(x, []).append(i)
    owner_arr = {x: np.asarray(v, dtype=np.int64) for x, v in holders.items()}
    sends = np.zeros(n, dtype=np.int64)
    per_expert: dict[int, np.ndarray] = {}
    transfers: list[tuple[int, NodeId, NodeId]] = []
    missing: list[tuple[int, NodeId]] = []
    inv = np.empty(n, dtype=np.int64)
    inv[assign] = np.arange(n)
    for q in range(n):
        dst = int(inv[q])
        for e in sorted(set(new.nodes[q]) - old[dst]):
            owners = owner_arr.get(e)
            if owners is None:
                missing.append((e, phys[dst]))
                continue
            used = per_expert.get(e)
            if used is None:
                used = per_expert[e] = np.zeros(owners.size, dtype=np.int64)
            # least used for this expert, then fewest sends overall, then lowest index
            cand = np.flatnonzero(used == used.min())
            pick = int(cand[np.argmin(sends[owners[cand]])])
            src = int(owners[pick])
            used[pick] += 1
            sends[src] += 1
            transfers.append((e, phys[src], phys[dst]))
    return Migration(mapping, transfers, missing, identity)
