"""Plan computation for the controller: allocation, MRO placement, node mapping.

Pure functions over plain data so that they can be tested and timed on their own. For
every MoE layer, independently:

1. loads = the routing history (uniform before any report);
2. ``allocate_replicas(loads, N, c, f)`` (``f`` capped at ``N``; the allocator lowers it
   further when slots are short);
3. ``place_mro``;
4. ``plan_migration`` from what each member holds now (joiners hold nothing) to map plan
   nodes onto physical nodes with the fewest fetches;
5. the per-node expert lists, in member order.

Several workers (GPUs) per node: ``c`` is the node's slot count, spread over its
``gpus_per_node`` ranks by :func:`lazarus.planning.split_node` (balanced, copies of one
expert on different GPUs, and every expert a GPU holds now stays there when the node keeps
it; a joining node gets the round-robin deal). The split travels in the plan (``gpus``), so
a failure elsewhere does not reshuffle the experts among a surviving node's GPUs. Failures
stay per node, so replicas of an expert go to distinct *nodes* (MRO works on nodes);
ranks are contiguous per node: rank = node index * gpus_per_node + local rank
(:func:`lazarus.runtime._plan.rank_layout`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from lazarus.planning import (
    allocate_replicas,
    place_mro,
    plan_migration,
    recovery_probability,
    split_node,
)

__all__ = ["InsufficientSlots", "LayerSpec", "PlanResult", "applied_holdings", "compute_plan", "max_replica_load"]


class InsufficientSlots(ValueError):
    """Fewer replica slots than experts in some layer: training cannot run."""


@dataclass(frozen=True)
class LayerSpec:
    name: str
    num_experts: int


@dataclass
class PlanResult:
    """Everything the controller puts into a plan message (besides membership)."""

    layers: dict[str, list[list[int]]]
    replicas: dict[str, list[int]]
    fetches_greedy: int = 0
    fetches_identity: int = 0
    missing: dict[str, list[int]] = field(default_factory=dict)
    transfers: dict[str, list[list]] = field(default_factory=dict)
    recovery: dict[str, float] = field(default_factory=dict)
    max_load: float = 0.0
    # several GPUs per node: layer -> node (member order) -> GPU -> expert ids
    gpus: dict[str, list[list[list[int]]]] = field(default_factory=dict)
    # copies a GPU must fetch although its node holds them on another GPU: with the
    # stable deal, and what the round-robin deal would have needed (for reporting)
    gpu_moves: int = 0
    gpu_moves_round_robin: int = 0


def _loads_for(name: str, e: int, loads: Mapping[str, Sequence[float]] | None) -> list[float]:
    v = (loads or {}).get(name)
    if v is None or len(v) != e or not any(x > 0 for x in v):
        return [1.0] * e
    return [float(x) for x in v]


def max_replica_load(assignment: Sequence[Sequence[int]], loads: Sequence[float]) -> float:
    """Predicted largest per-replica load ``max_e t_e / r_e`` of a layer's assignment.

    The dispatcher gives every replica of ``e`` the share ``t_e / r_e`` (Algorithm 1), so
    this is the work of the busiest slot. Experts without replicas count as infinite.
    """
    counts = [0] * len(loads)
    for row in assignment:
        for x in row:
            if 0 <= x < len(counts):
                counts[x] += 1
    worst = 0.0
    for t, r in zip(loads, counts):
        if r == 0:
            if t > 0:
                return float("inf")
            continue
        worst = max(worst, t / r)
    return worst


def applied_holdings(members: Sequence[str], layers: Mapping[str, Sequence[Sequence[int]]],
                     gpus: Mapping[str, Sequence[Sequence[Sequence[int]]]] | None = None
                     ) -> tuple[dict[str, dict[str, list[int]]], dict[str, dict[str, list[list[int]]]]]:
    """What each member holds once a plan is applied, as :func:`compute_plan` takes it:
    ``(node -> layer -> experts, node -> layer -> per-GPU experts)`` from the plan's
    ``layers`` rows and ``gpus`` split (member order)."""
    held = {m: {layer: list(rows[i]) for layer, rows in layers.items()} for i, m in enumerate(members)}
    split = {m: {layer: [list(gpu) for gpu in s[i]] for layer, s in (gpus or {}).items()}
             for i, m in enumerate(members)}
    return held, split


def compute_plan(
    members: Sequence[str],
    holdings: Mapping[str, Mapping[str, Sequence[int]]],
    layers: Sequence[LayerSpec],
    loads: Mapping[str, Sequence[float]] | None,
    slots: int,
    min_replicas: int,
    gpus_per_node: int = 1,
    gpu_holdings: Mapping[str, Mapping[str, Sequence[Sequence[int]]]] | None = None,
) -> PlanResult:
    """Compute per-layer assignments for ``members`` (node order).

    Args:
        members: physical node ids, rank order of the nodes.
        holdings: node -> layer -> experts it holds now (on any of its ranks; absent: nothing).
        layers: the model's MoE layers.
        loads: layer -> tokens per expert (history); missing or all-zero -> uniform.
        slots: c, slots per node (all its GPUs together).
        min_replicas: f (capped at the number of members): replicas on distinct nodes.
        gpus_per_node: G ranks per node; each gets ``c // G`` or ``c // G + 1`` slots.
        gpu_holdings: node -> layer -> per-GPU expert lists now (the last plan's
            ``gpus``); absent for a node: it gets the round-robin deal.

    Raises:
        InsufficientSlots: ``len(members) * slots`` is below some layer's expert count,
            or ``slots < gpus_per_node`` (a rank without a slot).
    """
    n = len(members)
    if n == 0:
        raise InsufficientSlots("no members to place experts on")
    if slots < gpus_per_node:
        raise InsufficientSlots(f"{slots} slots per node < {gpus_per_node} workers per node: every worker "
                                f"(GPU) needs at least one expert slot; raise --slots to >= {gpus_per_node}")
    out = PlanResult(layers={}, replicas={})
    total_load = 0.0
    for spec in layers:
        e = spec.num_experts
        if n * slots < e:
            raise InsufficientSlots(
                f"layer {spec.name}: {n} node(s) x {slots} slots = {n * slots} < {e} experts"
            )
        t = _loads_for(spec.name, e, loads)
        r = allocate_replicas(t, n, slots, min(min_replicas, n))
        placement = place_mro(r, n, slots)
        old: dict[Hashable, list[int]] = {m: [int(x) for x in holdings.get(m, {}).get(spec.name, [])]
                                          for m in members}
        mig = plan_migration(old, placement)
        assign = [list(placement.nodes[mig.mapping[m]]) for m in members]
        out.layers[spec.name] = assign
        if gpus_per_node > 1:
            split = []
            for m, row in zip(members, assign):
                node = split_node(row, gpus_per_node, (gpu_holdings or {}).get(m, {}).get(spec.name))
                split.append(node.split)
                out.gpu_moves += node.moves
                out.gpu_moves_round_robin += node.round_robin_moves
            out.gpus[spec.name] = split
        out.replicas[spec.name] = r
        out.fetches_greedy += mig.num_fetches
        out.fetches_identity += mig.identity_fetches
        if mig.missing:
            out.missing[spec.name] = mig.restore_experts
        out.transfers[spec.name] = [[int(x), s, d] for x, s, d in mig.transfers]
        out.recovery[spec.name] = float(recovery_probability(placement, 1)) if n > 1 else 0.0
        total_load += max_replica_load(assign, t)
    out.max_load = total_load
    return out
