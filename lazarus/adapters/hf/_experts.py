"""A transformers 5.x experts module cut down to this rank's experts, same math.

transformers 5.x stores a layer's experts fused (``experts.gate_up_proj`` [E, 2F, D] and
``experts.down_proj`` [E, D, F]; GPT-OSS transposed, interleaved gate/up, with biases and
its own clamped SwiGLU) and describes the layout with flags that
``transformers.integrations.moe.use_experts_implementation`` sets on the module:
``has_gate``, ``has_bias``, ``is_transposed``, ``has_post_expert_norm``, and the gating
function ``_apply_gate``. :class:`HFExperts` keeps the rows of the experts this rank holds
and applies exactly that math with one grouped matmul per projection (a loop where torch
has no kernel for the operands).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from lazarus.moe import GroupedExperts, grouped_mm

from ._layouts import ExpertsSpec

if TYPE_CHECKING:
    from lazarus.moe import ElasticMoE

__all__ = ["HFExperts", "is_hf_experts"]

_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


def is_hf_experts(module: nn.Module) -> bool:
    """A transformers fused-experts module: ``num_experts`` and a ``down_proj`` plus a
    ``gate_up_proj`` (or ``up_proj``) parameter with ``num_experts`` rows."""
    num = getattr(module, "num_experts", None)
    params = dict(module.named_parameters(recurse=False))
    if not isinstance(num, int) or "down_proj" not in params:
        return False
    if "gate_up_proj" not in params and "up_proj" not in params:
        return False
    return all(p.dim() >= 2 and p.shape[0] == num for p in params.values())


def _unbound() -> None:
    return None


def _default_gate(self: Any, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate) * up


class HFExperts(GroupedExperts):
    """The rows ``ids`` of a transformers experts module, computing what it computes.

    Parameters keep the original names (``gate_up_proj``, ``gate_up_proj_bias``,
    ``down_proj``, ...) in the original order, with ``len(ids)`` rows. Plain attributes
    (``alpha``, ``limit``, ``config``, the layout flags) and parameter-free submodules
    (``act_fn``) are carried over, so the model's own ``_apply_gate`` runs unchanged.

    ``forward(hidden_states, top_k_index, top_k_weights)`` -- the signature the model's MoE
    block calls -- hands the tokens to the owning Lazarus layer's dispatch, which sends
    them to the ranks holding their experts and calls :meth:`run` there.
    """

    act_fn: Callable[[torch.Tensor], torch.Tensor]   # the original's activation child (taken over)

    def __init__(self, original: nn.Module, ids: Sequence[int], spec: ExpertsSpec | None = None,
                 call: str = "ids") -> None:
        if spec is None and not is_hf_experts(original):
            raise ValueError(f"{type(original).__name__} is not a transformers fused-experts module "
                             "(num_experts, gate_up_proj or up_proj, down_proj with num_experts rows)")
        if getattr(original, "has_post_expert_norm", False):
            raise ValueError(f"{type(original).__name__}: experts with a post-expert norm are not supported")
        if call not in ("ids", "ids_identity", "dense"):
            raise ValueError(f"call must be 'ids', 'ids_identity' or 'dense', got {call!r}")
        ids = sorted(set(int(e) for e in ids))
        index = torch.tensor(ids, dtype=torch.long)
        fields: Any = original   # the model's own module: transformers declares no attribute types
        source = original if spec is None else spec.source
        full = dict(original.named_parameters(recurse=False)) if spec is None else spec.tensors
        tensors = {name: p.detach().index_select(0, index.to(p.device)) for name, p in full.items()}
        super().__init__(int(fields.num_experts) if spec is None else spec.num_experts, ids, tensors)
        self.original_class = type(original)
        self.call = call
        for name, b in (spec.buffers if spec is not None else {}).items():
            self.register_buffer(name, b.detach().clone())
        for key, value in (vars(source) if source is not None else {}).items():
            if key.startswith("_") or key in ("training", "num_experts") or key in self.__dict__:
                continue
            self.__dict__[key] = value
        for name, child in (source.named_children() if source is not None else ()):
            if any(True for _ in child.parameters()):
                raise ValueError(f"{type(original).__name__}.{name} has parameters: not supported")
            self.add_module(name, child)
        if spec is not None and spec.act_fn is not None:
            self.act_fn = spec.act_fn
        self.has_gate = bool(getattr(source, "has_gate", "gate_up_proj" in tensors))
        self.has_bias = bool(getattr(source, "has_bias", any(n.endswith("_bias") for n in tensors)))
        self.is_transposed = bool(getattr(source, "is_transposed", spec is not None and spec.is_transposed))
        gate = getattr(type(source), "_apply_gate", None) if source is not None else None
        self._gate_fn: Callable[[Any, torch.Tensor], torch.Tensor] = gate if gate is not None else _default_gate
        if call == "dense":
            zero = self.act_fn(torch.zeros(1))
            if bool(zero.abs().max() != 0):
                raise ValueError(f"{type(original).__name__}: its experts take a dense input with zero rows for "
                                 f"tokens not routed, and its activation ({self.act_fn}) is not 0 at 0, so those "
                                 "rows are not zero-output: Lazarus cannot dispatch only the routed ones")
        self._owner: Callable[[], "ElasticMoE | None"] = _unbound
        self.train(original.training)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_owner"] = _unbound      # a weak reference does not pickle; the block rebinds on forward
        return state

    def bind(self, owner: "ElasticMoE") -> None:
        """The Lazarus layer whose dispatch :meth:`forward` uses (held weakly: the layer owns us)."""
        self._owner = weakref.ref(owner)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        owner: Any = self._owner()
        if owner is None:
            raise RuntimeError("HFExperts is not bound to a Lazarus layer (use lazarus.adapters.hf.make_elastic)")
        if self.call == "dense":
            return owner.dispatch_dense(hidden_states)
        if top_k_index is None or top_k_weights is None:
            raise TypeError("HFExperts(hidden_states, top_k_index, top_k_weights): the ids and weights are missing")
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])   # DBRX passes [batch, seq, d]
        ids, weights = top_k_index.reshape(flat.shape[0], -1), top_k_weights.reshape(flat.shape[0], -1)
        out = owner.dispatch_identity(flat, ids, weights) if self.call == "ids_identity" else \
            owner.dispatch(flat, ids, weights)
        return out.view(hidden_states.shape)

    # -- the expert math, over this rank's rows -------------------------------------------------
    def _linear(self, x: torch.Tensor, name: str, counts: list[int], rows: torch.Tensor | None) -> torch.Tensor:
        w = getattr(self, name)
        out = grouped_mm(x.to(w.dtype), w if self.is_transposed else w.transpose(-2, -1), counts)
        bias = getattr(self, name + "_bias", None) if self.has_bias else None
        if bias is not None:
            out = out + bias.index_select(0, rows)
        return out

    def run(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        counts = [int(c) for c in counts]
        rows = None
        if self.has_bias:
            rows = torch.repeat_interleave(torch.arange(len(counts), device=x.device),
                                           torch.tensor(counts, device=x.device), output_size=x.shape[0])
        if self.has_gate:
            h = self._gate_fn(self, self._linear(x, "gate_up_proj", counts, rows))
        else:
            h = self.act_fn(self._linear(x, "up_proj", counts, rows))
        return self._linear(h, "down_proj", counts, rows)

    def extra_repr(self) -> str:
        return f"{self.original_class.__name__}, num_experts={self.num_experts}, expert_ids={self.expert_ids}"
