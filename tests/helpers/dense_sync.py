"""What DDP does for the dense part of an expert-parallel model, for the rank programs of
the adapter tests: average over the ranks the gradients of everything outside the MoE
layers (the experts' gradients are :func:`lazarus.moe.sync_moe_gradients`')."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lazarus.moe import moe_layers


def sync_dense(model: torch.nn.Module, world: int) -> None:
    """Average the gradients of everything outside the MoE layers (what DDP does)."""
    moe = {id(p) for _, layer in moe_layers(model) for p in layer.parameters()}
    params = [p for p in model.parameters() if id(p) not in moe]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p in params:
        p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
        offset += p.numel()
