"""Lazarus planning: replica allocation, fault-tolerant placement, recovery odds, migration.

Pure Python + numpy, no torch: the controller calls these on every failure, join and
rebalance, so they must be fast and importable anywhere.

Typical use::

    r = allocate_replicas(loads, num_nodes=10, slots_per_node=6, min_replicas=2)
    plan = place_mro(r, 10, 6)
    recovery_probability(plan, num_failed=4)
    plan_migration({"host-a": [0, 3], ...}, new_plan).transfers
"""

from ._allocate import allocate_replicas, effective_min_replicas
from ._bruteforce import best_survivor_counts, survivor_counts
from ._gpus import NodeGpus, deal_gpus, round_robin_gpus, same_node_moves, split_node
from ._layers import LayerPlan, plan_layers
from ._migration import Migration, plan_migration
from ._placement import MroLayout, mro_layout, place_compact, place_mro_paper, place_spread
from ._probability import (
    RecoveryEstimate,
    minimal_owner_sets,
    recovery_curve,
    recovery_estimate,
    recovery_probability,
)
from ._search import improve_placement, place_mro
from ._types import Placement

__all__ = [
    "LayerPlan",
    "Migration",
    "MroLayout",
    "NodeGpus",
    "Placement",
    "RecoveryEstimate",
    "allocate_replicas",
    "best_survivor_counts",
    "deal_gpus",
    "effective_min_replicas",
    "improve_placement",
    "minimal_owner_sets",
    "mro_layout",
    "place_compact",
    "place_mro",
    "place_mro_paper",
    "place_spread",
    "plan_layers",
    "plan_migration",
    "recovery_curve",
    "recovery_estimate",
    "recovery_probability",
    "round_robin_gpus",
    "same_node_moves",
    "split_node",
    "survivor_counts",
]
