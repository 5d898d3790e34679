"""Routing counts without user calls: forward hooks on the models' own routers.

Per MoE layer ``L`` (the text before ``.experts`` in the parameter names), the router is
the submodule ``L.gate`` (transformers' Mixtral, Qwen-MoE, OLMoE, DeepSeek-V3) or
``L.router`` (GPT-OSS, torchtitan, Megatron-core). Its output holds the chosen experts:

* an integer tensor ``[tokens, top_k]`` of expert ids (transformers, torchtitan), or
* a boolean routing map ``[tokens, E]`` (Megatron-core).

Counts accumulate on the router's device (no host sync per step) and are drained into the
manager when it checkpoints. Only training-mode forwards count, and only the first time:
activation checkpointing (``gradient_checkpointing_enable()``, torchtitan's AC,
``torch.utils.checkpoint`` reentrant or not) runs the router's forward again inside the
backward pass, and that recomputation routes no new tokens.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

__all__ = ["RouterTaps", "find_router"]

log = logging.getLogger("moc")

_ROUTER_NAMES = ("gate", "router")


def find_router(model: torch.nn.Module, layer: str) -> torch.nn.Module | None:
    try:
        block = model.get_submodule(layer)
    except AttributeError:
        return None
    for name in _ROUTER_NAMES:
        mod = getattr(block, name, None)
        if isinstance(mod, torch.nn.Module):
            return mod
    return None


def _recomputing() -> bool:
    """Is this forward running inside a backward pass (activation recomputation)?"""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def _counts(out: Any, num_experts: int) -> torch.Tensor | None:
    items = out if isinstance(out, (tuple, list)) else (out,)
    for t in items:
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            continue
        if t.dtype == torch.bool and t.shape[-1] == num_experts:
            return t.reshape(-1, num_experts).sum(0, dtype=torch.int64)
        if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return torch.bincount(t.reshape(-1).long(), minlength=num_experts)[:num_experts]
    return None


class RouterTaps:
    """Forward hooks on every recognised router; :meth:`drain` hands over the counts."""

    def __init__(self, model: torch.nn.Module, layers: dict[str, int], *, skip: set[str] | None = None) -> None:
        self.layers = dict(layers)
        self._pending: dict[str, torch.Tensor] = {}
        self._handles = []
        self._warned: set[str] = set()
        for layer, num in layers.items():
            if skip and layer in skip:
                continue
            router = find_router(model, layer)
            if router is None:
                continue
            self._handles.append(router.register_forward_hook(self._hook(layer, num)))
        self.tapped = len(self._handles)

    def _hook(self, layer: str, num: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            if not module.training or _recomputing():
                return
            with torch.no_grad():
                counts = _counts(out, num)
            if counts is None:
                if layer not in self._warned:
                    self._warned.add(layer)
                    log.debug("router of %s returned no expert ids; record_routing() feeds it", layer)
                return
            prev = self._pending.get(layer)
            self._pending[layer] = counts if prev is None else prev + counts
        return hook

    def drain(self, record: Callable[[str, torch.Tensor], None]) -> None:
        pending, self._pending = self._pending, {}
        for layer, counts in pending.items():
            record(layer, counts)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
