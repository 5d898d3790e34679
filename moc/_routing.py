"""Routing counts without user calls: forward hooks on the models' own routers.

Per MoE layer ``L`` (the text before ``.experts`` in the parameter names), the router is
the submodule ``L.gate`` (transformers' Mixtral, Qwen-MoE, OLMoE, DeepSeek-V3) or
``L.router`` (GPT-OSS, torchtitan, Megatron-core). Its output holds the chosen experts:

* an integer tensor ``[tokens, top_k]`` of expert ids (transformers, torchtitan),
* a boolean routing map ``[tokens, E]`` (Megatron-core) or an integer 0/1 one (Switch
  Transformers), or
* dense weights ``[tokens, E]``, 0 where an expert is not selected (Llama 4).

Every call of a router counts (a layer run twice per forward routes twice the slots). A
router whose output holds none of these is an error at the next checkpoint, naming it,
unless its layer is fed with ``record_routing``: PLT is never silently 0.

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

__all__ = ["RouterTaps", "find_router", "GLOBAL_ROUTING_ATTR", "routing_reporters"]

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


def _counts(out: Any, num_experts: int, top_k: int) -> tuple[torch.Tensor, int] | None:
    """Expert slots in a router's output, read for what they are: ``(counts, rows)``.

    * a boolean routing map ``[..., E]`` (Megatron-core);
    * an integer tensor ``[..., E]`` of 0/1 (a one-hot dispatch mask: Switch Transformers),
      when E differs from ``top_k`` (then ids and a mask cannot be told apart by shape,
      and both count the same: every expert once per token);
    * an integer tensor ``[..., k]`` of expert ids (transformers, torchtitan);
    * failing those, a float tensor ``[..., E]`` whose unselected entries are exactly 0
      (Llama 4's dense scores): ``rows`` lets :meth:`RouterTaps.drain` check that it holds
      at most ``top_k`` slots per token (logits do not), else the router is unreadable.

    ``rows`` is 0 when the reading needs no check. None: nothing readable."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    tensors = [t for t in items if isinstance(t, torch.Tensor) and t.dim() >= 1]
    for t in tensors:
        if t.dtype == torch.bool and t.shape[-1] == num_experts:
            return t.reshape(-1, num_experts).sum(0, dtype=torch.int64), 0
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            continue
        if t.dim() >= 2 and t.shape[-1] == num_experts and num_experts != top_k:
            return t.reshape(-1, num_experts).sum(0, dtype=torch.int64), 0
        return torch.bincount(t.reshape(-1).long(), minlength=num_experts)[:num_experts], 0
    for t in tensors:
        if t.is_floating_point() and t.dim() >= 2 and t.shape[-1] == num_experts:
            flat = t.detach().reshape(-1, num_experts)
            return (flat != 0).sum(0, dtype=torch.int64), flat.shape[0]
    return None


class RouterTaps:
    """Forward hooks on every recognised router; :meth:`drain` hands over the counts."""

    def __init__(self, model: torch.nn.Module, layers: dict[str, int], *, skip: set[str] | None = None,
                 top_k: int = 1) -> None:
        self.layers = dict(layers)
        self.top_k = int(top_k)
        self._pending: dict[str, torch.Tensor] = {}
        self._rows: dict[str, int] = {}
        self._handles = []
        self._names: dict[str, str] = {}
        self.unreadable: dict[str, str] = {}    # layer -> why its router's output was not read
        paths = {id(m): n for n, m in model.named_modules()}
        for layer, num in layers.items():
            if skip and layer in skip:
                continue
            router = find_router(model, layer)
            if router is None:
                continue
            self._names[layer] = f"{paths.get(id(router), layer)} ({type(router).__name__})"
            self._handles.append(router.register_forward_hook(self._hook(layer, num)))
        self.tapped = len(self._handles)

    def _hook(self, layer: str, num: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            if not module.training or _recomputing():
                return
            with torch.no_grad():
                found = _counts(out, num, self.top_k)
            if found is None:
                kinds = [f"{t.dtype} {tuple(t.shape)}" for t in (out if isinstance(out, (tuple, list)) else (out,))
                         if isinstance(t, torch.Tensor)]
                self.unreadable.setdefault(layer, f"it returned {kinds or type(out).__name__}")
                return
            counts, rows = found
            prev = self._pending.get(layer)
            self._pending[layer] = counts if prev is None else prev + counts
            if rows:
                self._rows[layer] = self._rows.get(layer, 0) + rows
        return hook

    def drain(self, record: Callable[[str, torch.Tensor], None],
              fed: Callable[[str], bool] = lambda layer: False) -> None:
        """Hand the counts to ``record``. Raises ``ValueError`` naming the router of every
        layer whose output held no readable expert slots (``fed(layer)``: the user feeds
        that layer with ``record_routing``, so its router needs no reading)."""
        pending, self._pending = self._pending, {}
        rows, self._rows = self._rows, {}
        for layer, n in rows.items():
            if layer in pending and int(pending[layer].sum()) > n * self.top_k:
                self.unreadable.setdefault(layer, "its float output [tokens, E] selects more than top_k = "
                                                  f"{self.top_k} experts per token (logits, not routing)")
                pending.pop(layer)
        bad = {l: why for l, why in self.unreadable.items() if not fed(l)}
        if bad:
            layer, why = next(iter(bad.items()))
            raise ValueError(f"MoE layer {layer!r}: moc cannot read the expert slots its router "
                             f"{self._names.get(layer, layer)} selects ({why}); expected expert ids [tokens, k], "
                             "a boolean or 0/1 mask [tokens, E], or dense weights [tokens, E] that are 0 where "
                             f"an expert is not selected. Call ckpt.record_routing({layer!r}, tokens_per_expert) "
                             "each step instead" + (f" (also {sorted(bad)[1:4]})" if len(bad) > 1 else ""))
        for layer, counts in pending.items():
            record(layer, counts)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


#: The protocol by which an MoE layer reports its own routing to moc, without moc knowing
#: its class: a module with ``reports_global_routing = True`` and a settable ``routing_hook``
#: attribute calls ``routing_hook(counts)`` after each forward with the global (all-rank)
#: tokens per expert. Lazarus's MoE layers declare it; moc never imports them.
GLOBAL_ROUTING_ATTR = "reports_global_routing"


def routing_reporters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every module of ``model`` that reports its own routing."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, GLOBAL_ROUTING_ATTR, False) is True]
