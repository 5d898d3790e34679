"""Per-architecture layouts: the transformers MoE blocks that are not built like Mixtral.

Most transformers 5.x MoE blocks need no entry: fused ``experts.gate_up_proj`` /
``down_proj`` ``[E, ...]`` tensors called as ``experts(hidden, top_k_index, top_k_weights)``
after a ``gate``/``router`` with a ``top_k`` (see ``_block.is_standard_block``). The others
differ in where the expert weights live or how the block calls its experts; each gets one
:class:`BlockLayout` in :data:`LAYOUTS`, keyed by the block's class name:

* ``Llama4TextMoe`` (Llama 4): fused, transposed ``[E, D, 2F]`` experts called with one
  dense, pre-scaled input ``experts(routed_in)`` (every token for every expert, scaled by
  its router score, zero where not routed); the elastic experts dispatch the routed rows
  as tokens (an expert of a zero row outputs zero, with a zero Jacobian: ``act(0) == 0``);
* ``DbrxFFN`` (DBRX): experts flattened ``experts.mlp.w1 / v1 / w2 [E*F, D]``; held as the
  transformers fused layout (``gate_up_proj = [w1; v1]``, ``down_proj = w2^T``), same math;
* ``JetMoeMoE`` (JetMoE's MLP): parallel experts ``input_linear / output_linear [E, ...]``
  called with tokens sorted by expert; held fused, routed with the model's own router
  (its sorted output turned back into per-token ids and gates);
* ``LongcatFlashMoE`` (LongCat-Flash): router ids ``>= E`` select zero-compute identity
  experts (``h * weight``, computed where the token is); the others are dispatched;
* ``SwitchTransformersSparseMLP``, ``NllbMoeSparseMLP``: one module per expert
  (``experts.expert_<e>``) called with a routing mask; the modules are kept as they are
  (:class:`~lazarus.adapters.hf._modules.ModuleExperts`), the mask's token slots dispatched.

A layout whose weights move (DBRX, JetMoE, LongCat-Flash) gives ``to_original``: the elastic block's state
dict entries back in the original's names and shapes (:func:`original_state_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

__all__ = ["BlockLayout", "ExpertsSpec", "LAYOUTS", "layout_of"]


@dataclass(frozen=True)
class ExpertsSpec:
    """How a block's experts become :class:`~lazarus.adapters.hf._experts.HFExperts`:
    full ``[E, ...]`` tensors in the transformers fused names, the activation and flags."""

    num_experts: int
    tensors: dict[str, torch.Tensor]
    act_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    is_transposed: bool = False
    source: nn.Module | None = None      # plain attributes / parameter-free children carried over
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)   # kept whole on every rank, no gradient


@dataclass(frozen=True)
class BlockLayout:
    """One architecture's MoE block (see the module docstring).

    Attributes:
        arch: the transformers model type, for messages and docs.
        note: what is particular about it, one line (docs/layouts.md's zoo table).
        num_experts: block -> E.
        top_k: block -> k (slots per token).
        experts: block -> :class:`ExpertsSpec` (fused experts); None: per-expert modules kept.
        replaced: children of the block whose weights ``experts`` takes over.
        call: ``"ids"`` (``experts(h, ids, weights)``), ``"ids_identity"`` (the same, ids
            ``>= E`` selecting zero-compute identity experts), ``"dense"``
            (``experts(routed_in)``), ``"mask"`` (``experts(h, mask, weights)``, per-expert modules).
        mask: for ``"mask"``: ``(experts, mask, weights) -> ([T, J, E] 0/1, [T, J] weights)``.
        forward: replaces the block class's forward (the block's experts are not one call).
        to_original: ``(prefix, elastic entries) -> original entries`` of one block.
    """

    arch: str
    note: str
    num_experts: Callable[[Any], int]      # the model's own modules: transformers declares no attribute types
    top_k: Callable[[Any], int]
    experts: Callable[[Any], ExpertsSpec] | None = None
    replaced: tuple[str, ...] = ()
    call: str = "ids"
    mask: Callable[[Any, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    forward: Callable[..., Any] | None = None
    to_original: Callable[[str, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    post_slot: Callable[[Any, torch.Tensor], torch.Tensor] | None = field(default=None)


# -- Llama 4 ---------------------------------------------------------------------------------
def _llama4_experts(block: Any) -> ExpertsSpec:
    ex = block.experts
    return ExpertsSpec(int(ex.num_experts), {"gate_up_proj": ex.gate_up_proj, "down_proj": ex.down_proj},
                       act_fn=ex.act_fn, is_transposed=True, source=ex)


# -- DBRX --------------------------------------------------------------------------------------
def _dbrx_experts(block: Any) -> ExpertsSpec:
    mlp, num = block.experts.mlp, int(block.experts.num_experts)
    f, d = int(block.experts.ffn_hidden_size), int(block.experts.hidden_size)
    w1, v1, w2 = (p.detach().view(num, f, d) for p in (mlp.w1, mlp.v1, mlp.w2))
    return ExpertsSpec(num, {"gate_up_proj": torch.cat([w1, v1], dim=1), "down_proj": w2.transpose(1, 2)},
                       act_fn=mlp.activation_fn)


def _swap(sd: Mapping[str, torch.Tensor], old: tuple[str, ...],
          new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` with the entries ``old`` replaced by ``new``, where the first of them was."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k == old[0]:
            out.update(new)
        elif k not in old:
            out[k] = v
    return out


def _dbrx_original(prefix: str, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gu, down = sd[prefix + "experts.gate_up_proj"], sd[prefix + "experts.down_proj"]
    num, f2, d = gu.shape
    f = f2 // 2
    return _swap(sd, (prefix + "experts.gate_up_proj", prefix + "experts.down_proj"), {
        prefix + "experts.mlp.w1": gu[:, :f].reshape(num * f, d),
        prefix + "experts.mlp.v1": gu[:, f:].reshape(num * f, d),
        prefix + "experts.mlp.w2": down.transpose(1, 2).reshape(num * f, d)})


# -- JetMoE (the MLP's experts; its attention experts stay dense) ----------------------------
def _jetmoe_experts(block: Any) -> ExpertsSpec:
    return ExpertsSpec(int(block.input_linear.num_experts),
                       {"gate_up_proj": block.input_linear.weight, "down_proj": block.output_linear.weight},
                       act_fn=block.activation)


def _jetmoe_original(prefix: str, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return _swap(sd, (prefix + "experts.gate_up_proj", prefix + "experts.down_proj"), {
        prefix + "input_linear.weight": sd[prefix + "experts.gate_up_proj"],
        prefix + "output_linear.weight": sd[prefix + "experts.down_proj"]})


def _jetmoe_forward(self: Any, layer_input: torch.Tensor) -> torch.Tensor:
    """JetMoeMoE.forward with the experts dispatched: the model's router sorts the token
    slots by expert; its output is turned back into per-token ids and gates."""
    bsz, length, emb = layer_input.size()
    h = layer_input.reshape(-1, emb)
    index_sorted, _, batch_gates, expert_size, _ = self.router(h)
    k = int(self.router.top_k)
    sorted_ids = torch.repeat_interleave(torch.arange(len(expert_size), device=h.device),
                                         torch.tensor(expert_size, device=h.device), output_size=index_sorted.numel())
    ids = torch.empty_like(index_sorted)
    ids[index_sorted] = sorted_ids
    gates = torch.empty_like(batch_gates)
    gates[index_sorted] = batch_gates
    out = self.dispatch(h, ids.view(-1, k), gates.view(-1, k))
    return out.view(bsz, length, emb) + self.bias


# -- LongCat-Flash: Z zero-compute (identity) experts after the E real ones ----------------------
def _longcat_experts(block: Any) -> ExpertsSpec:
    ex, num = block.experts, int(block.experts.num_routed_experts)
    # gate_up_proj has E + Z rows; rows E.. belong to the identity experts, which never read
    # them: kept as a buffer (whole on every rank, no gradient, as unused there)
    return ExpertsSpec(num, {"gate_up_proj": ex.gate_up_proj[:num], "down_proj": ex.down_proj}, act_fn=ex.act_fn,
                       buffers={"gate_up_proj_zero": ex.gate_up_proj.detach()[num:]})


def _longcat_original(prefix: str, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gu, zero = prefix + "experts.gate_up_proj", prefix + "experts.gate_up_proj_zero"
    return _swap(sd, (gu, zero), {gu: torch.cat([sd[gu], sd[zero].to(sd[gu])])})


# -- Switch Transformers, NLLB-MoE: one module per expert, a mask ------------------------------
def _switch_mask(experts: Any, selected: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return selected, weights          # [T, 1, E] one-hot (zero beyond capacity), [T, 1]


def _nllb_mask(experts: Any, router_mask: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # NllbMoeExperts.forward: slot (t, j) runs expert ``router_mask[t, j]`` weighted by probs[t, j]
    return torch.nn.functional.one_hot(router_mask, num_classes=experts.num_experts), probs


def _nllb_post(experts: Any, y: torch.Tensor) -> torch.Tensor:
    """NllbMoeExperts' token dropout of each expert output (a scale at evaluation)."""
    p = experts.moe_token_dropout
    if p > 0:
        return experts.token_dropout(y) if experts.training else y * (1 - p)
    return y


LAYOUTS: dict[str, BlockLayout] = {
    "Llama4TextMoe": BlockLayout(
        "llama4_text", "experts called with one dense, pre-scaled input: its routed rows dispatched as tokens",
        lambda b: int(b.experts.num_experts), lambda b: int(b.router.top_k), experts=_llama4_experts, call="dense"),
    "DbrxFFN": BlockLayout(
        "dbrx", "experts flattened `[E*F, D]`: held as fused `gate_up_proj` / `down_proj` rows "
        "(`original_state_dict` converts back)",
        lambda b: int(b.experts.num_experts), lambda b: int(b.top_k), experts=_dbrx_experts,
        to_original=_dbrx_original),
    "JetMoeMoE": BlockLayout(
        "jetmoe", "the MLP's parallel experts held fused (`original_state_dict` converts back); "
        "its attention experts stay dense, replicated",
        lambda b: int(b.input_linear.num_experts), lambda b: int(b.router.top_k), experts=_jetmoe_experts,
        replaced=("input_linear", "output_linear"), forward=_jetmoe_forward, to_original=_jetmoe_original),
    "LongcatFlashMoE": BlockLayout(
        "longcat_flash", "zero-compute identity experts (router ids >= E) computed in place, the E real ones "
        "dispatched; the identity rows of `gate_up_proj` kept whole (`original_state_dict` puts them back)",
        lambda b: int(b.experts.num_routed_experts), lambda b: int(b.router.top_k), experts=_longcat_experts,
        call="ids_identity", to_original=_longcat_original),
    "SwitchTransformersSparseMLP": BlockLayout(
        "switch_transformers", "one module per expert, called with a mask: the mask's slots dispatched",
        lambda b: int(b.experts.num_experts), lambda b: 1, call="mask", mask=_switch_mask),
    "NllbMoeSparseMLP": BlockLayout(
        "nllb-moe", "one module per expert, called with a mask: the mask's slots dispatched",
        lambda b: int(b.experts.num_experts), lambda b: 2, call="mask", mask=_nllb_mask, post_slot=_nllb_post),
}


def layout_of(block: nn.Module) -> BlockLayout | None:
    """The :class:`BlockLayout` of ``block``'s class (by name), or None."""
    return LAYOUTS.get(type(block).__name__)
