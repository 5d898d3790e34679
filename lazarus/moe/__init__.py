"""Lazarus MoE layers: experts replicated across ranks by a placement, tokens balanced over
replicas by the flexible dispatcher and exchanged with one uneven all-to-all each way.

:class:`ElasticMoE` is what Lazarus owns (placement, dispatch, all-to-alls, replica
gradient sync, ``set_placement``); the model brings a router returning top-k expert ids
and gates and a :class:`LocalExperts` computation (:class:`MLPExperts`, or fused
:class:`GroupedExperts` run with :func:`grouped_mm`). :class:`MoELayer` is the built-in
instance; ``lazarus.adapters.hf.make_elastic`` adapts transformers models.

Typical use on every rank of a gloo/NCCL process group::

    plan = place_mro(allocate_replicas(loads, world, slots, f), world, slots)
    layer = MoELayer(MoEConfig(d_model=512, d_hidden=2048, num_experts=8, top_k=2), plan)
    record_routing_to(model, ckpt.record_routing)        # moc PLT accounting
    loss = model(x).mean(); loss.backward()
    sync_moe_gradients(model)                            # replicas identical, router averaged
    opt.step()
    layer.set_placement(new_plan)                        # later: re-drive, experts move by all-to-all
"""

from ._comm import all_to_all_uneven
from ._config import MoEConfig
from ._expert import Expert
from ._experts import GroupedExperts, LocalExperts, MLPExperts
from ._grouped import grouped_mm, grouped_mm_available
from ._layer import ElasticMoE, MoELayer
from ._model import moe_layers, record_routing_to, sync_moe_gradients
from ._placement import holder_ranks, layer_placements, rank_slots, replica_matrix
from ._router import SoftmaxRouter

__all__ = [
    "ElasticMoE",
    "Expert",
    "GroupedExperts",
    "LocalExperts",
    "MLPExperts",
    "MoEConfig",
    "MoELayer",
    "SoftmaxRouter",
    "all_to_all_uneven",
    "grouped_mm",
    "grouped_mm_available",
    "holder_ranks",
    "layer_placements",
    "moe_layers",
    "rank_slots",
    "record_routing_to",
    "replica_matrix",
    "sync_moe_gradients",
]
