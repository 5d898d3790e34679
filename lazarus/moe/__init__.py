"""Lazarus MoE layer: experts replicated across ranks by a placement, tokens balanced over
replicas by the flexible dispatcher and exchanged with one uneven all-to-all each way.

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
from ._layer import MoELayer
from ._model import moe_layers, record_routing_to, sync_moe_gradients
from ._placement import holder_ranks, rank_slots, replica_matrix

__all__ = [
    "Expert",
    "MoEConfig",
    "MoELayer",
    "all_to_all_uneven",
    "holder_ranks",
    "moe_layers",
    "rank_slots",
    "record_routing_to",
    "replica_matrix",
    "sync_moe_gradients",
]
