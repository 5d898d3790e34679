"""Why a transformers MoE model has no block :func:`make_elastic` can take over.

Lazarus's adapter dispatches tokens to fused ``[E, ...]`` expert tensors called as
``experts(hidden_states, top_k_index, top_k_weights)`` after a router with a top-k. Models
built otherwise would compute something else (or need a different state dict) once made
elastic, so they are refused with what is missing; :func:`why_not_elastic` finds it.
"""

from __future__ import annotations

import re

from torch import nn

__all__ = ["why_not_elastic"]


def _count(module: object) -> int | None:
    for attr in ("num_experts", "num_routed_experts", "moe_num_experts", "n_routed_experts"):
        n = getattr(module, attr, None)
        if isinstance(n, int) and not isinstance(n, bool):
            return n
    return None


def _reason(name: str, mod: nn.Module) -> str | None:
    cls = type(mod).__name__
    experts = getattr(mod, "experts", None)
    if isinstance(experts, nn.Module) and name:
        ecls = type(experts).__name__
        kids = [n for n, c in experts.named_children() if any(True for _ in c.parameters())]
        if kids and all(re.fullmatch(r"(?:expert_)?\d+", k) for k in kids):
            return (f"{name} ({cls}): its experts ({ecls}) are one module per expert ({kids[0]}, ...), called with "
                    "a routing mask; Lazarus dispatches to fused [E, ...] expert tensors, and fusing them would "
                    "change the state dict")
        own = dict(experts.named_parameters(recurse=False))
        nested = {n: p for n, p in experts.named_parameters() if "." in n}
        num = _count(experts)
        if not own and nested and num and all(p.shape[0] % num == 0 and p.shape[0] > num for p in nested.values()):
            return (f"{name} ({cls}): its experts ({ecls}) are flattened as [E*F, D] in a child "
                    f"({', '.join(list(nested)[:3])}); the elastic experts hold [E, ...] rows, a different "
                    "state dict")
        rows = {n: p.shape[0] for n, p in own.items() if p.dim() >= 2}
        if len(set(rows.values())) > 1:
            return (f"{name} ({cls}): its experts ({ecls}) hold zero-compute experts (rows {rows}: router ids "
                    f">= {min(rows.values())} are identity experts), which Lazarus's dispatch has no slot for")
        if own and getattr(experts, "forward", None) is not None:
            router = next((getattr(mod, r) for r in ("gate", "router") if isinstance(getattr(mod, r, None), nn.Module)),
                          None)
            if router is not None and not isinstance(getattr(router, "top_k", None), int) and \
                    not isinstance(_config_top_k(router), int):
                return (f"{name} ({cls}): its router ({type(router).__name__}) has no top_k (attribute or "
                        "config field), so Lazarus cannot size its dispatch")
    if {"input_linear", "output_linear"} <= {n for n, _ in mod.named_children()} and _count(mod.input_linear):
        return (f"{name} ({cls}): parallel experts (input_linear / output_linear) called with tokens per expert "
                "after a router returning a slot permutation (JetMoE), not experts(hidden, ids, weights)")
    if {"down_embed", "up_embed"} <= {n for n, _ in mod.named_children()} and _count(mod):
        return (f"{name} ({cls}): product-key retrieval experts (rows of down_embed / up_embed, one neuron each) "
                "computed inline, with no experts module to dispatch to")
    return None


def _config_top_k(router: nn.Module) -> int | None:
    cfg = getattr(router, "config", None)
    for field in ("top_k_experts", "num_experts_per_tok"):
        k = getattr(cfg, field, None)
        if isinstance(k, int):
            return k
    return None


def why_not_elastic(model: nn.Module) -> str | None:
    """What keeps the first MoE-looking module of ``model`` from being made elastic, or
    None when nothing looks like an MoE layer."""
    for name, mod in model.named_modules():
        why = _reason(name, mod)
        if why:
            return why
    return None
