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


def _cost_matrix(old: list[set[int]], new: Placement) -> np.ndarray:
    """``cost[p, q]``: experts of plan node ``q`` that physical node ``p`` lacks."""
    n, e_count = new.num_nodes, new.num_experts
    have = np.zeros((n, e_count), dtype=np.float32)
    for p, s in enumerate(old):
        ids = [x for x in s if x < e_count]
        have[p, ids] = 1
    want = np.zeros((n, e_count), dtype=np.float32)
    for q, row in enumerate(new.nodes):
        want[q, sorted(set(row))] = 1
    # float32 matmul goes through BLAS; the entries are small integers, so exact.
    overlap = np.rint(have @ want.T).astype(np.int64)
    return want.sum(axis=1).astype(np.int64)[None, :] - overlap


def _greedy(cost: np.ndarray) -> np.ndarray:
    """Greedy assignment: repeatedly take the cheapest pair whose ends are both free."""
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


def _two_opt(cost: np.ndarray, assign: np.ndarray, max_passes: int = 4) -> np.ndarray:
    """Swap the plan nodes of two physical nodes while that lowers the total cost."""
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
    cost = _cost_matrix(old, new)
    assign = _greedy(cost)
    identity = int(np.trace(cost))
    if improve:
        assign = _two_opt(cost, assign)
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
