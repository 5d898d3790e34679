"""Model-level helpers: gradient sync of every MoE layer and routing counts for moc."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ._layer import ElasticMoE
from ._sync import reduce_replicas


def moe_layers(model: nn.Module) -> list[tuple[str, ElasticMoE]]:
    """``(qualified name, layer)`` of every Lazarus MoE layer (:class:`ElasticMoE`: a
    :class:`MoELayer`, or a transformers block made elastic) in ``model``."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ElasticMoE)]


def sync_moe_gradients(model: nn.Module, *, include_router: bool = True) -> None:
    """What :meth:`ElasticMoE.sync_gradients` does for one layer, for every MoE layer of
    ``model`` at once (after ``backward``, before ``optimizer.step()``; every rank calls it
    with the same layers in the same module order): expert replicas summed over their
    holders, and with ``include_router`` the replicated parameters (routers, shared
    experts) summed over the group, both scaled by each layer's ``grad_reduction``.

    The layers on one process group share the collectives: one reduce-scatter and one
    all-gather (two all-to-alls) for all their experts and one flat all-reduce for all their
    replicated parameters, three collectives for the model instead of three per layer.
    Each expert's sum is taken in rank order, as a layer's own sync takes it, so the
    values are the same and replicas stay bit-identical."""
    batches: dict[int, list[tuple[int, ElasticMoE]]] = {}
    for i, (_, layer) in enumerate(moe_layers(model)):
        batches.setdefault(id(layer.group), []).append((i, layer))
    for batch in batches.values():
        _sync_batch(batch, include_router)


def _sync_batch(batch: list[tuple[int, ElasticMoE]], include_router: bool) -> None:
    """Sync the layers of one process group together (see :func:`sync_moe_gradients`)."""
    first = batch[0][1]
    rank, size, group = first.rank, first.world_size, first.group
    flats, holders, scales = {}, {}, {}
    for i, layer in batch:
        scales[i] = 1.0 / size if layer.grad_reduction == "mean" else 1.0
        for e in layer.local_experts:
            flats[(i, e)] = layer.experts.flat_grad(e)
            holders[(i, e)] = layer._holders[e]
    summed = reduce_replicas(flats, holders, rank, size, group)
    layers = dict(batch)
    for (i, e), flat in summed.items():
        layers[i].experts.set_flat_grad(e, flat * scales[i])
    if not include_router:
        return
    params = [(i, p) for i, layer in batch for p in layer.replicated_parameters()]
    if not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for _, p in params])
    if size > 1:
        dist.all_reduce(flat, group=group)
    offset = 0
    for i, p in params:
        p.grad = (flat[offset: offset + p.numel()] * scales[i]).view_as(p).clone()
        offset += p.numel()


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
