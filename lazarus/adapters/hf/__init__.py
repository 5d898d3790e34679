"""Hugging Face transformers 5.x MoE models under Lazarus.

:func:`make_elastic` swaps every sparse-MoE block of a transformers model (Mixtral,
Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, and other blocks built the same way; Llama 4,
DBRX, JetMoE, LongCat-Flash, Switch Transformers and NLLB-MoE through per-architecture entries in
``_layouts.LAYOUTS``) for an :class:`ElasticHFBlock`: the model's router, shared experts and expert math stay the
model's own code; Lazarus places the experts (replicas), dispatches tokens with
Algorithm 1 over an uneven all-to-all and synchronises replica gradients::

    model = AutoModelForCausalLM.from_config(cfg)            # same seed on every rank
    model = make_elastic(model, placements=plan)             # a Placement, or {layer: Placement}
    loss = model(input_ids=x, labels=x).loss; loss.backward()
    sync_moe_gradients(model)    # experts summed over replicas; routers, shared experts averaged
    # ... average the dense gradients (DDP or one all-reduce), then opt.step()

With ``placements=None`` (one process) every expert lives on the single rank: the
adapted model computes what the original computes and its ``state_dict()`` is the
original's (same names, ``[E, ...]`` shapes), so it loads into the original class (DBRX,
JetMoE and LongCat-Flash hold their experts otherwise: :func:`original_state_dict` gives
the original's). Under
expert parallelism each rank's ``experts.gate_up_proj`` holds its experts' rows and
declares their global ids (``local_expert_indices``), which moc checkpoints as rows of the
``[E, ...]`` tensors: ``moc export --format safetensors`` of such a job gives weights
``AutoModelForCausalLM.from_pretrained`` loads.

``lazarus.runtime.ElasticTrainer`` runs such a model as it runs the example GPT:
``build_model=lambda placements: make_elastic(build(), placements)``.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from lazarus.moe import layer_placements
from lazarus.planning import Placement

from ._block import ElasticHFBlock, block_top_k, is_hf_moe_block, num_experts_of
from ._diagnose import why_not_elastic
from ._experts import HFExperts
from ._modules import ModuleExperts

__all__ = ["ElasticHFBlock", "HFExperts", "ModuleExperts", "elastic_layout", "make_elastic", "moe_blocks",
           "original_state_dict"]


def moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> module of every transformers sparse-MoE block of ``model`` (not yet
    made elastic), in module order. The names are the MoE layer keys everywhere (plans,
    moc units ``expert/<name>/<e>``, PLT reports)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return {name: m for name, m in model.named_modules() if is_hf_moe_block(m)}


def elastic_layout(model: nn.Module) -> dict[str, Any]:
    """``{"layers": {name: num_experts}, "top_k": k}`` of a transformers MoE model (adapted or
    not): what :class:`lazarus.runtime.ElasticTrainer` and the controller plan from."""
    layers: dict[str, int] = {}
    top_k: int | None = 1
    for name, m in model.named_modules():
        if isinstance(m, ElasticHFBlock):
            layers[name], top_k = m.num_experts, m.top_k
        elif is_hf_moe_block(m):
            layers[name] = num_experts_of(m)
            top_k = block_top_k(m)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no transformers MoE block")
    return {"layers": layers, "top_k": top_k}


def original_state_dict(model: nn.Module, state: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``model.state_dict()`` in the names and shapes of the original transformers class.

    Blocks whose experts Lazarus holds in another layout (DBRX's flattened ``experts.mlp.w1
    / v1 / w2``, JetMoE's ``input_linear / output_linear``: held as fused
    ``experts.gate_up_proj / down_proj``) are converted back; every other entry is the
    model's own. Needs every expert of those blocks on this rank (one process, or a
    checkpoint exported by moc, whose ``[E, ...]`` tensors are whole). ``state``: entries
    in the model's names to convert instead (its gradients, say), default its state dict."""
    sd = dict(model.state_dict() if state is None else state)
    for name, m in model.named_modules():
        if isinstance(m, ElasticHFBlock) and m.layout is not None and m.layout.to_original is not None:
            if len(m.experts.expert_ids) != m.num_experts:
                raise ValueError(f"{name} holds experts {m.experts.expert_ids} of {m.num_experts}: the original layout "
                                 "needs all of them (convert a moc export instead)")
            sd = m.layout.to_original(name + "." if name else "", sd)
    return sd


def make_elastic(model: nn.Module, placements: Mapping[str, Placement] | Placement | None = None,
                 group: Any = None, *, grad_reduction: str = "mean") -> nn.Module:
    """Swap every transformers MoE block of ``model`` for an :class:`ElasticHFBlock`, in
    place; returns ``model``.

    Args:
        model: a transformers 5.x model, built identically on every rank (same config and
            seed): each rank keeps the rows of its own experts and drops the others.
        placements: ``None`` (single process: every expert here), one
            :class:`~lazarus.planning.Placement` for every MoE layer, or a dict
            ``{block name: Placement}`` with exactly the names of :func:`moe_blocks`.
        group: the expert-parallel process group (default: the world).
        grad_reduction: ``"mean"`` (DDP's average) or ``"sum"``.

    Raises:
        ValueError: no MoE block found, placements that do not fit the layers or the group.
    """
    blocks = moe_blocks(model)
    if not blocks:
        already = [n for n, m in model.named_modules() if isinstance(m, ElasticHFBlock)]
        hint = f" (already elastic: {already[:3]})" if already else ""
        why = why_not_elastic(model) if not already else None
        hint += f": {why}" if why else ""
        raise ValueError(f"{type(model).__name__} has no transformers MoE block (a module with fused `experts` "
                         f"and a `gate`/`router` with a top-k){hint}")
    plans = layer_placements({n: num_experts_of(b) for n, b in blocks.items()}, placements, group)
    for name, block in blocks.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, ElasticHFBlock(block, plans[name], group=group, grad_reduction=grad_reduction))
    return model
