"""How many experts the model routes each token to (top-k), read from the model itself, and
checked against ``MoCConfig.top_k`` (the PLT denominator counts tokens x top-k).

Where it can be read:

* the routers: a module at or beside an MoE layer with an integer ``top_k`` attribute
  (transformers 5.x routers such as ``Qwen3MoeTopKRouter`` and ``MixtralSparseMoeBlock``,
  torchtitan's ``TokenChoiceTopKRouter``, Lazarus' ``SoftmaxRouter``, a plain MoE block
  keeping its ``top_k``), or a router class named for its k (``SwitchTransformersTop1Router``,
  ``NllbMoeTop2Router``), when they all agree;
* a transformers config (``model.config``, its text config, DBRX's ``ffn_config``):
  ``num_experts_per_tok`` (also what ``moe_k`` is mapped to), ``moe_top_k`` (DBRX),
  ``moe_topk`` (Aria, LongCat-Flash, Hunyuan), ``top_k_experts`` (Gemma 4),
  ``num_selected_experts``, ``experts_per_token``.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from torch import nn

__all__ = ["CONFIG_FIELDS", "model_top_k", "resolve_top_k"]

_CLASS_TOP_K = re.compile(r"Top(\d+)Router$")
CONFIG_FIELDS = ("num_experts_per_tok", "moe_top_k", "moe_topk", "top_k_experts", "moe_k", "num_selected_experts",
                 "experts_per_token")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _from_routers(model: nn.Module, layers: list[str]) -> tuple[int, str] | None:
    """The routers' common top_k, with where it was read (None: none readable, or they differ)."""
    # routers sit in the MoE layer (transformers, torchtitan, Lazarus) or beside its experts
    # container (Megatron's mlp.router beside mlp.experts)
    scopes = {layer for layer in layers} | {layer.rsplit(".", 1)[0] for layer in layers if "." in layer}
    found: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if not any(name == s or name.startswith(s + ".") for s in scopes):
            continue
        value = _int(getattr(module, "top_k", None))
        named = _CLASS_TOP_K.search(type(module).__name__)
        if value is None and named is not None:     # routers whose k is their class: Top1Router, Top2Router
            value = int(named.group(1))
        if value is not None:
            found.setdefault(value, []).append(name)
    if len(found) != 1:
        return None
    (value, names), = found.items()
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    module, label = model.get_submodule(names[0]), names[0] or type(model).__name__
    where = (f"{label}.top_k" if _int(getattr(module, "top_k", None)) is not None
             else f"{label} ({type(module).__name__})")
    return value, where + more


def _from_config(model: nn.Module) -> tuple[int, str] | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    candidates = [("model.config", config)]
    text = getattr(config, "get_text_config", None)
    if callable(text):
        try:
            candidates.append(("model.config.get_text_config()", text()))
        except Exception:  # noqa: BLE001 - a config without a text part: nothing more to read
            pass
    ffn = getattr(config, "ffn_config", None)
    if ffn is not None:
        candidates.append(("model.config.ffn_config", ffn))
    for where, cfg in candidates:
        for field in CONFIG_FIELDS:
            value = _int(getattr(cfg, field, None))
            if value is not None:
                return value, f"{where}.{field}"
    return None


def model_top_k(model: nn.Module, layers: list[str]) -> tuple[int, str] | None:
    """``(top_k, where it was read)`` for ``model`` whose MoE layers are ``layers`` (module
    names), or None when the model does not say."""
    return _from_routers(model, layers) or _from_config(model)


def resolve_top_k(given: int | None, model: nn.Module, num_experts: Mapping[str, int]) -> int:
    """The top_k moc counts with: ``given`` (``MoCConfig.top_k``) checked against the model's
    own (an error naming both when they differ), else the model's, else 1; never more than
    a layer's experts."""
    read = model_top_k(model, sorted(num_experts))
    if given is not None and read is not None and given != read[0]:
        raise ValueError(f"MoCConfig.top_k = {given} (given) but the model routes each token to {read[0]} experts "
                         f"({read[1]} = {read[0]}); pass top_k={read[0]}, or leave it None to read it from the model")
    top_k = given if given is not None else (read[0] if read is not None else 1)
    if num_experts:
        layer = min(num_experts, key=lambda name: num_experts[name])
        if top_k > num_experts[layer]:
            source = "MoCConfig.top_k (given)" if given is not None else read[1] if read is not None else "default"
            raise ValueError(f"MoCConfig.top_k = {top_k} ({source}) exceeds the {num_experts[layer]} experts of MoE "
                             f"layer {layer!r}: a token is routed to at most as many experts as its layer has; "
                             f"allowed: 1 to {num_experts[layer]}")
    return top_k
