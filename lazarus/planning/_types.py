"""The ``Placement`` value type: which expert replicas each node hosts.

A placement is deliberately a plain table (``nodes[i]`` lists the expert ids on node ``i``)
so that it serialises to JSON as is, travels from the controller to the agents, and can be
written by hand in tests. Everything else (replica counts, owners of an expert, the
per-GPU split) is derived from that table.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Placement:
    """Expert replicas per node.

    Attributes:
        nodes: ``nodes[i]`` is the list of expert ids held by plan node ``i``; every node
            has the same number of slots. An id may repeat on a node only when there are
            fewer experts than slots (copies then go to different GPUs).
        num_experts: E; inferred as ``max id + 1`` when omitted. Every expert in
            ``range(E)`` must have at least one replica.
        gpus_per_node: GPUs a node's slots are spread over (failures are still per node).
        strategy: free-form label of the algorithm that produced the plan (not compared).
        gpus: optional explicit per-GPU split, ``gpus[i][j]`` = expert ids on GPU ``j`` of
            node ``i`` (each node's GPU lists together hold exactly its row, ``c // G`` or
            ``c // G + 1`` slots per GPU; :func:`lazarus.planning.deal_gpus` makes one that
            keeps experts on the GPUs holding them). None: the round-robin default.
    """

    nodes: list[list[int]]
    num_experts: int = -1
    gpus_per_node: int = 1
    strategy: str = field(default="", compare=False)
    gpus: list[list[list[int]]] | None = None

    def __post_init__(self) -> None:
        nodes = self.nodes
        if isinstance(nodes, (str, bytes)) or not hasattr(nodes, "__len__") or len(nodes) == 0:
            raise ValueError("Placement.nodes must be a non-empty list of per-node expert lists")
        table: list[list[int]] = []
        for i, row in enumerate(nodes):
            if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
                raise ValueError(f"Placement.nodes[{i}] must be a list of expert ids, got {row!r}")
            ids = list(row)
            # Fast path for rows of plain ints (the common case, JSON included); anything
            # else gets the element-by-element check with its precise message.
            if not all(type(x) is int for x in ids) or (ids and min(ids) < 0):
                ids = [_expert_id(i, x) for x in ids]
            table.append(ids)
        c = len(table[0])
        if c == 0:
            raise ValueError("Placement.nodes rows must hold at least one slot (slots_per_node >= 1)")
        for i, row in enumerate(table):
            if len(row) != c:
                raise ValueError(
                    f"every node must hold slots_per_node = {c} replicas; node {i} holds {len(row)}"
                )
        seen_max = max(max(row) for row in table)
        e = self.num_experts
        if e == -1:
            e = seen_max + 1
        if isinstance(e, bool) or not isinstance(e, numbers.Integral) or e < 1:
            raise ValueError(f"Placement.num_experts must be an integer >= 1, got {e!r}")
        if seen_max >= e:
            raise ValueError(f"expert ids must be in [0, {e - 1}] (num_experts={e}), got {seen_max}")
        present = set().union(*table)
        if len(present) != e:
            absent = sorted(set(range(e)) - present)
            raise ValueError(f"every expert needs at least one replica; missing {absent[:10]}")
        g = _check_gpus(self.gpus_per_node, c)
        object.__setattr__(self, "nodes", table)
        object.__setattr__(self, "num_experts", int(e))
        object.__setattr__(self, "gpus_per_node", g)
        if self.gpus is not None:
            object.__setattr__(self, "gpus", _check_split(self.gpus, table, g))

    @classmethod
    def _unchecked(
        cls, nodes: list[list[int]], num_experts: int, gpus_per_node: int = 1, strategy: str = ""
    ) -> Placement:
        """Build without validation: only for tables the planner itself constructed.

        The caller guarantees what ``__post_init__`` would check: a non-empty list of
        equally long, non-empty lists of ``int`` ids in ``[0, num_experts)``, every id
        present, and ``1 <= gpus_per_node <= len(nodes[0])``. Input from users, files or
        the network must go through the public constructor.
        """
        plan = object.__new__(cls)
        object.__setattr__(plan, "nodes", nodes)
        object.__setattr__(plan, "num_experts", num_experts)
        object.__setattr__(plan, "gpus_per_node", gpus_per_node)
        object.__setattr__(plan, "strategy", strategy)
        object.__setattr__(plan, "gpus", None)
        return plan

    # ----- shape -----------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def slots_per_node(self) -> int:
        return len(self.nodes[0])

    # ----- derived views -----------------------------------------------------------
    def replica_counts(self) -> list[int]:
        """Replicas of each expert (all copies, including same-node ones)."""
        counts = [0] * self.num_experts
        for row in self.nodes:
            for x in row:
                counts[x] += 1
        return counts

    def owners(self) -> list[list[int]]:
        """``owners()[e]``: sorted distinct nodes holding expert ``e``."""
        out: list[set[int]] = [set() for _ in range(self.num_experts)]
        for i, row in enumerate(self.nodes):
            for x in row:
                out[x].add(i)
        return [sorted(s) for s in out]

    def max_copies_per_node(self) -> int:
        """Largest number of copies of one expert on one node (1 = no duplicates)."""
        return max(max(row.count(x) for x in set(row)) for row in self.nodes)

    def gpu_slots(self) -> list[list[list[int]]]:
        """``gpu_slots()[node][gpu]``: expert ids on each GPU of each node.

        The explicit split (``gpus``) when the placement has one; otherwise a node's
        (sorted) slots dealt round-robin over its GPUs, so copies of the same expert on one
        node land on different GPUs and each GPU gets ``c // g`` or ``c // g + 1`` slots.
        """
        if self.gpus is not None:
            return [[list(gpu) for gpu in node] for node in self.gpus]
        g = self.gpus_per_node
        return [[sorted(row)[j::g] for j in range(g)] for row in self.nodes]

    def with_gpus(self, gpus_per_node: int) -> Placement:
        """The same plan with its slots spread over ``gpus_per_node`` GPUs per node (the
        round-robin split; an explicit ``gpus`` split is dropped)."""
        g = _check_gpus(gpus_per_node, self.slots_per_node)
        table = [list(row) for row in self.nodes]
        return Placement._unchecked(table, self.num_experts, g, self.strategy)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (used by the CLI and by the controller's plan messages)."""
        d: dict[str, Any] = {
            "strategy": self.strategy,
            "num_nodes": self.num_nodes,
            "slots_per_node": self.slots_per_node,
            "num_experts": self.num_experts,
            "gpus_per_node": self.gpus_per_node,
            "nodes": [list(r) for r in self.nodes],
            "replicas": self.replica_counts(),
        }
        if self.gpus_per_node > 1:
            d["gpus"] = self.gpu_slots()
        return d


def _expert_id(node: int, x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0:
        raise ValueError(
            f"Placement.nodes[{node}] must hold non-negative integer expert ids, got {x!r}"
        )
    return int(x)


def _check_split(gpus: Any, table: list[list[int]], g: int) -> list[list[list[int]]]:
    """Validate an explicit per-GPU split against the node rows (see ``Placement.gpus``)."""
    if isinstance(gpus, (str, bytes)) or not hasattr(gpus, "__len__") or len(gpus) != len(table):
        raise ValueError(f"Placement.gpus must hold one list of per-GPU lists for each of the {len(table)} nodes")
    c = len(table[0])
    lo, hi = c // g, -(-c // g)
    out: list[list[list[int]]] = []
    for i, (node, row) in enumerate(zip(gpus, table)):
        if isinstance(node, (str, bytes)) or not hasattr(node, "__len__") or len(node) != g:
            raise ValueError(f"Placement.gpus[{i}] must hold gpus_per_node = {g} lists of expert ids")
        split: list[list[int]] = []
        for j, gpu in enumerate(node):
            if isinstance(gpu, (str, bytes)) or not hasattr(gpu, "__iter__"):
                raise ValueError(f"Placement.gpus[{i}][{j}] must be a list of expert ids, got {gpu!r}")
            ids = [_expert_id(i, x) for x in gpu]
            if not lo <= len(ids) <= hi:
                raise ValueError(f"Placement.gpus[{i}][{j}] holds {len(ids)} slots; every GPU holds "
                                 f"{lo}" + ("" if lo == hi else f" or {hi}") + f" of the node's {c}")
            split.append(ids)
        if sorted(x for gpu in split for x in gpu) != sorted(row):
            raise ValueError(f"Placement.gpus[{i}] must split exactly node {i}'s slots {sorted(row)}")
        out.append(split)
    return out


def _check_gpus(g: Any, c: int) -> int:
    if isinstance(g, bool) or not isinstance(g, numbers.Integral) or not 1 <= int(g) <= c:
        raise ValueError(
            f"gpus_per_node must be an integer in [1, {c}] (slots_per_node), got {g!r}"
        )
    return int(g)
