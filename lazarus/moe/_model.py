"""Model-level helpers: gradient sync of every MoE layer and routing counts for moc."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ._layer import ElasticMoE


def moe_layers(model: nn.Module) -> list[tuple[str, ElasticMoE]]:
    """``(qualified name, layer)`` of every Lazarus MoE layer (:class:`ElasticMoE`: a
    :class:`MoELayer`, or a transformers block made elastic) in ``model``."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ElasticMoE)]


def sync_moe_gradients(model: nn.Module, *, include_router: bool = True) -> None:
    """Call :meth:`ElasticMoE.sync_gradients` on every MoE layer (after ``backward``, before
    ``optimizer.step()``; every rank must call it, in the same module order)."""
    for _, layer in moe_layers(model):
        layer.sync_gradients(include_router=include_router)


def record_routing_to(model: nn.Module, record: Callable[[str, torch.Tensor], None] | None) -> list[str]:
    """Route every MoE layer's per-step expert counts to ``record(layer_name, counts)``.

    The name is the module's qualified name, which is exactly the ``layer`` group moc's
    default expert pattern extracts from ``<name>.experts.<e>.w1.weight``, so
    ``record_routing_to(model, ckpt.record_routing)`` feeds moc's PLT accounting. Counts
    are global (summed over ranks) and identical on every rank. ``None`` detaches.
    Returns the layer names.
    """
    names = []
    for name, layer in moe_layers(model):
        layer.routing_hook = None if record is None else (lambda counts, _n=name: record(_n, counts))
        names.append(name)
    return names
