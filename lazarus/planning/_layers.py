"""Per-layer planning: every MoE layer gets its own allocation and placement.

Expert popularity differs from layer to layer (the paper's Fig. 2), so a single plan for
the whole model would over-replicate some experts and starve others. The cluster shape is
shared; only the loads differ.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ._allocate import allocate_replicas, effective_min_replicas
from ._placement import place_compact, place_mro_paper, place_spread
from ._search import place_mro
from ._types import Placement
from ._validate import check_int, check_loads

_Layer = TypeVar("_Layer", bound=Hashable)   # a Mapping is invariant in its key type

STRATEGIES = {
    "mro": place_mro,
    "mro-paper": place_mro_paper,
    "spread": place_spread,
    "compact": place_compact,
}


@dataclass(frozen=True)
class LayerPlan:
    """Allocation and placement of one MoE layer.

    ``min_replicas`` is the threshold actually used (lowered when slots are short).
    """

    layer: Hashable
    loads: list[float]
    replicas: list[int]
    min_replicas: int
    placement: Placement


def plan_layers(
    loads_per_layer: Sequence[Sequence[float]] | Mapping[_Layer, Sequence[float]],
    num_nodes: int,
    slots_per_node: int,
    min_replicas: int,
    gpus_per_node: int = 1,
    *,
    strategy: str = "mro",
) -> list[LayerPlan]:
    """Plan every layer independently.

    Args:
        loads_per_layer: a list (layer index = position) or a mapping layer -> loads.
        num_nodes, slots_per_node, min_replicas: as for :func:`allocate_replicas`.
        gpus_per_node: GPUs per node, in ``[1, slots_per_node]``; a node's slots are
            dealt round-robin over its GPUs (it need not divide the slot count).
        strategy: ``"mro"`` (default), ``"mro-paper"``, ``"spread"`` or ``"compact"``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    items: list[tuple[Hashable, Any]]
    if isinstance(loads_per_layer, Mapping):
        items = list(loads_per_layer.items())
    elif isinstance(loads_per_layer, (str, bytes)) or not hasattr(loads_per_layer, "__iter__"):
        raise ValueError("loads_per_layer must be a list of per-layer load lists or a dict layer -> loads")
    else:
        items = list(enumerate(loads_per_layer))
    if not items:
        raise ValueError("loads_per_layer must hold at least one layer")
    n = check_int("num_nodes", num_nodes, lo=1)
    c = check_int("slots_per_node", slots_per_node, lo=1)
    g = check_int("gpus_per_node", gpus_per_node, lo=1, hi=c)
    place = STRATEGIES[strategy]
    out = []
    for layer, loads in items:
        t = check_loads(f"loads_per_layer[{layer!r}]", loads)
        r = allocate_replicas(t, n, c, min_replicas)
        f = effective_min_replicas(len(t), n, c, min_replicas)
        plan = place(r, n, c).with_gpus(g)
        out.append(LayerPlan(layer, list(t), r, f, plan))
    return out
