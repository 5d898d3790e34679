"""Every MoE architecture of the installed transformers, as a tiny random model.

The list is not kept by hand: :func:`architectures` reads it from the package. A model
type is an MoE architecture when its config class has an experts-count field
(``num_experts``, ``num_local_experts``, ``n_routed_experts``, ``moe_num_experts``,
``top_k_experts``) and an auto class builds a model from it (causal LM, seq2seq LM, else
the base model); model types that build the same class as another one (``sarvam_mla`` is
DeepSeek-V3's class) are tested once, under the first name.

:func:`tiny_config` shrinks the default config generically (every size field it knows
of, lists per layer cut to the layer count) and then applies :data:`QUIRKS`, the few
per-architecture settings without which a default config does not build or has no MoE
layer: those are the only hand-written parts, and a new architecture needs none unless it
is unusual.
"""

from __future__ import annotations

import functools
import glob
import importlib
import importlib.util
import os
import warnings
from typing import Any, Callable

import torch

VOCAB = 64
EXPERTS = 4
TOP_K = 2
LAYERS = 2
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "top_k_experts")

# Field -> tiny value, applied wherever the config (or a sub-config) has the field.
_SIZES: dict[str, Any] = {
    "hidden_size": 32, "d_model": 32, "intermediate_size": 48, "ffn_dim": 48, "d_ff": 48,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "expert_ffn_hidden_size": 16,
    "moe_shared_expert_intermediate_size": 16, "share_expert_dim": 16, "moe_hidden_size": 32,
    "num_hidden_layers": LAYERS, "num_layers": LAYERS, "encoder_layers": LAYERS, "decoder_layers": LAYERS,
    "num_decoder_layers": LAYERS,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_heads": 4, "d_kv": 8,
    "vocab_size": VOCAB, "max_position_embeddings": 128,
    "num_experts": EXPERTS, "num_local_experts": EXPERTS, "n_routed_experts": EXPERTS, "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K, "num_experts_per_token": TOP_K, "moe_topk": TOP_K, "moe_k": TOP_K,
    "top_k_experts": TOP_K, "moe_top_k": TOP_K,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "qk_head_dim": 16, "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "sliding_window": 16, "expert_capacity": 64,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0,
    "tie_word_embeddings": False, "use_cache": False,
    "first_k_dense_replace": 0, "moe_layer_start_index": 0, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,     # Gemma 4 (134M params else)
    "unpadded_vocab_size": VOCAB, "swa_head_dim": 8, "linear_head_dim": 8, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "index_n_heads": 4, "index_head_dim": 16, "index_topk": 16,
    "zero_expert_num": 2, "encoder_ffn_dim": 48, "decoder_ffn_dim": 48, "ffn_hidden_size": 48,
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1,
}
# Fields a default config may leave None on purpose (feature off): only shrunk when set.
_KEEP_NONE = {"sliding_window", "q_lora_rank", "kv_lora_rank", "expert_capacity", "head_dim"}

_PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "moe_layers_enum", "layers_block_type", "hybrid_override_pattern")


def _tiny_fields(default: Any) -> dict[str, Any]:
    """Constructor arguments that make ``default`` (a config instance) tiny; passing them
    to the constructor keeps the fields it derives (MLA's ``head_dim``) consistent."""
    fields = default.__dict__
    out = {}
    for key, value in _SIZES.items():
        if key not in fields or (fields[key] is None and key in _KEEP_NONE):
            continue
        out[key] = value
    if fields.get("kv_lora_rank") is not None and fields.get("head_dim") == fields.get("qk_rope_head_dim"):
        out["head_dim"] = out.get("qk_rope_head_dim", 8)   # MLA whose rope runs on head_dim
    layers = out.get("num_hidden_layers", fields.get("num_hidden_layers"))
    for key in _PER_LAYER_LISTS:
        v = fields.get(key)
        if isinstance(v, (list, str)) and isinstance(layers, int) and len(v) > layers:
            out[key] = v[-layers:]   # the deepest layers: MoE where the first ones are dense
    return out


def _config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def _model_class_name(model_type: str) -> tuple[str, str] | None:
    from transformers.models.auto import modeling_auto as ma

    for kind, mapping in (("causal", ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                          ("seq2seq", ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
                          ("base", ma.MODEL_MAPPING_NAMES)):
        name = mapping.get(model_type)
        if isinstance(name, (list, tuple)):
            name = name[0]
        if name:
            return kind, name
    return None


def _config_source_mentions_experts(model_type: str) -> bool:
    """Does the package's configuration source of ``model_type`` name an experts-count
    field? (Read as text: importing and instantiating every config costs most of the
    enumeration.) True when the source cannot be found, so nothing is skipped unread."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    spec = importlib.util.find_spec(f"transformers.models.{model_type_to_module_name(model_type)}")
    if spec is None or not spec.submodule_search_locations:
        return True
    folder = spec.submodule_search_locations[0]
    files = glob.glob(os.path.join(folder, "configuration_*.py"))
    if not files:
        return True
    text = "".join(open(f, encoding="utf-8").read() for f in files)
    return any(k in text for k in EXPERT_KEYS)


@functools.lru_cache(maxsize=1)
def architectures() -> tuple[str, ...]:
    """Model types of the installed transformers whose config declares experts and that
    an auto class builds (one per model class)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    seen: set[str] = set()
    out = []
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        if not _config_source_mentions_experts(model_type):
            continue     # cheap: no config of this type can declare experts (most of the ~800)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fields = _config_class(model_type)().to_dict()
        except Exception:   # noqa: BLE001 - a config that needs arguments to exist at all
            continue
        own = [fields] + [v for v in fields.values()      # DBRX's ffn_config; not text_config (a type itself)
                          if isinstance(v, dict) and v.get("model_type") not in CONFIG_MAPPING_NAMES]
        if not any(k in d for d in own for k in EXPERT_KEYS):
            continue
        found = _model_class_name(model_type)
        if found is None or found[1] in seen:
            continue
        seen.add(found[1])
        out.append(model_type)
    return tuple(out)


def _quirk_dbrx(cfg):
    cfg.attn_config.rope_theta = 10000.0        # as real DBRX configs set them
    cfg.attn_config.clip_qkv = 8.0
    cfg.attn_config.kv_n_heads = 2
    cfg.ffn_config.moe_num_experts = EXPERTS
    cfg.ffn_config.moe_top_k = TOP_K
    cfg.ffn_config.ffn_hidden_size = 16
    cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.max_seq_len = 32, 4, LAYERS, 128


def _set(**fields) -> Callable[[Any], None]:
    def apply(cfg):
        for k, v in fields.items():
            setattr(cfg, k, v)
    return apply


# model type -> what its default config lacks to build tiny with MoE layers
QUIRKS: dict[str, Callable[[Any], None]] = {
    "dbrx": _quirk_dbrx,
    "doge": _set(is_moe=True, num_experts=16, num_experts_per_tok=TOP_K),   # product keys: E is a square
    "dots1": _set(n_shared_experts=1),

    "hunyuan_v1_moe": _set(head_dim=8),
    "lfm2_moe": _set(layer_types=["conv", "full_attention"], num_dense_layers=0),
    "switch_transformers": _set(decoder_start_token_id=0),
    "glm4v_moe_text": lambda cfg: cfg.rope_parameters.update(mrope_section=[1, 1, 0]),
}


# model type -> fields its config derives itself (passing them breaks the derivation)
_DERIVED: dict[str, tuple[str, ...]] = {"mistral4": ("head_dim",), "mimo_v2_flash": ("head_dim",)}
# model types whose per-layer lists are cut to their first layers (the deepest need more)
_FIRST_LAYERS = {"qwen4_exp_text"}
# model type -> constructor fields its validators insist on
_FIELDS: dict[str, dict[str, Any]] = {
    "zaya": {"num_experts_per_tok": 1},
    "gemma4_text": {"enable_moe_block": True},
    # its sliding-attention layers have sizes of their own (else 37M parameters)
    "dots3_note_text": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 16,
                        "swa_kv_lora_rank": 16, "swa_head_dim": 16, "swa_qk_nope_head_dim": 8, "swa_v_head_dim": 8},
}


def tiny_config(model_type: str):
    cls = _config_class(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fields = _tiny_fields(cls())
        for key in _DERIVED.get(model_type, ()):
            fields.pop(key, None)
        fields.update(_FIELDS.get(model_type, {}))
        if model_type in _FIRST_LAYERS:
            for key in _PER_LAYER_LISTS:
                v = getattr(cls(), key, None)
                if key in fields and isinstance(v, (list, str)):
                    fields[key] = v[:LAYERS]
        cfg = cls(**fields)
        if model_type in QUIRKS:
            QUIRKS[model_type](cfg)
    return cfg


def model_class(model_type: str):
    kind, name = _model_class_name(model_type)  # type: ignore[misc]
    import transformers

    return kind, getattr(transformers, name)


def build(model_type: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = tiny_config(model_type)
    _, cls = model_class(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls._from_config(cfg) if hasattr(cls, "_from_config") else cls(cfg)
    model.float()
    return model


def batch(model_type: str, step: int, rows: int = 2, seq: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, VOCAB, (rows, seq), generator=g)
    kind, _ = model_class(model_type)
    if kind == "seq2seq":
        dec = torch.randint(3, VOCAB, (rows, seq - 2), generator=g)
        return {"input_ids": ids, "labels": dec}
    if kind == "causal":
        return {"input_ids": ids, "labels": ids}
    return {"input_ids": ids}


def loss_of(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**inputs)
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden.float().pow(2).mean()
