"""Models in the layouts people train, tiny and random-initialised (nothing downloaded).

* transformers 5.x, the real library: Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3 (shared
  experts + a dense first layer), GPT-OSS (expert biases);
* torchtitan's ``GroupedExperts`` layout (``moe.experts.w1/w2/w3`` [E, ...], a router
  returning (scores, expert ids, counts)), written here: torchtitan 0.3.0 pulls wandb,
  datasets, tensorboard and spmd_types, which do not install cleanly beside the pinned torch;
* Megatron-core names (``mlp.experts.local_experts.<i>``, ``local_expert_indices``, a
  router returning (probs, boolean routing map)), written here (megatron-core needs CUDA).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 64
HF_KINDS = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
KINDS = HF_KINDS + ("torchtitan", "megatron")
EXPERTS = 4
TOP_K = 2


def hf_config(kind: str):
    from transformers import AutoConfig

    base = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, num_experts_per_tok=TOP_K, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if kind == "mixtral":
        base.update(num_local_experts=EXPERTS)
    elif kind == "qwen3_moe":
        base.update(num_experts=EXPERTS, moe_intermediate_size=16, norm_topk_prob=True)
    elif kind == "olmoe":
        base.update(num_experts=EXPERTS)
    elif kind == "deepseek_v3":
        base.update(n_routed_experts=EXPERTS, moe_intermediate_size=16, first_k_dense_replace=1,
                    n_shared_experts=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
                    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4,
                    num_hidden_layers=3)
    elif kind == "gpt_oss":
        base.update(num_local_experts=EXPERTS, head_dim=8, layer_types=["full_attention", "sliding_attention"],
                    sliding_window=8)
    else:
        raise ValueError(kind)
    return AutoConfig.for_model(kind, **base)


class _TitanRouter(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, EXPERTS, bias=False)

    def forward(self, x: torch.Tensor):
        scores = self.gate(x).softmax(-1)
        top, ids = scores.topk(TOP_K, dim=-1)
        counts = torch.histc(ids.view(-1).float(), bins=EXPERTS, min=0, max=EXPERTS)
        return top, ids, counts


def _gathered(w: torch.Tensor) -> torch.Tensor:
    """A DTensor weight (expert parallel / FSDP shards) gathered for the forward; its
    gradient is summed over ranks and scattered back to the shards."""
    if not hasattr(w, "full_tensor"):
        return w
    from torch.distributed.tensor import Partial

    return w.full_tensor(grad_placements=[Partial()] * w.device_mesh.ndim)


class _TitanExperts(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, hidden, dim) * 0.1)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, dim, hidden) * 0.1)
        self.w3 = nn.Parameter(torch.randn(EXPERTS, hidden, dim) * 0.1)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (_gathered(w) for w in (self.w1, self.w2, self.w3))
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel():
                h = F.silu(x[tok] @ w1[e].t()) * (x[tok] @ w3[e].t())
                out.index_add_(0, tok, (h @ w2[e].t()) * gates[tok, slot, None])
        return out


class _TitanMoE(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.router = _TitanRouter(dim)
        self.experts = _TitanExperts(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids, _ = self.router(x)
        return self.experts(x, ids, top)


class _MegatronRouter(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, dim) * 0.1)

    def forward(self, x: torch.Tensor):
        probs = (x @ self.weight.t()).softmax(-1)
        top, ids = probs.topk(TOP_K, dim=-1)
        routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter(1, ids, True)
        return probs * routing_map, routing_map


class _MegatronExpert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=False)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class _MegatronExperts(nn.Module):
    """SequentialMLP: this rank's experts, numbered locally; global ids in
    ``local_expert_indices`` (Megatron's attribute)."""

    def __init__(self, dim: int, hidden: int, local: list[int]) -> None:
        super().__init__()
        self.local_expert_indices = list(local)
        self.local_experts = nn.ModuleList(_MegatronExpert(dim, hidden) for _ in local)


class _MegatronMoE(nn.Module):
    def __init__(self, dim: int, hidden: int, local: list[int]) -> None:
        super().__init__()
        self.router = _MegatronRouter(dim)
        self.experts = _MegatronExperts(dim, hidden, local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, routing_map = self.router(x)
        out = torch.zeros_like(x)
        for i, e in enumerate(self.experts.local_expert_indices):
            tok = routing_map[:, e].nonzero(as_tuple=True)[0]
            if tok.numel():
                out.index_add_(0, tok, self.experts.local_experts[i](x[tok]) * probs[tok, e, None])
        return out


class _Block(nn.Module):
    def __init__(self, dim: int, moe: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.mlp = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(self.norm(x))


class SmallLM(nn.Module):
    """Embedding, MoE blocks, head; ``kind`` picks the MoE block's layout."""

    def __init__(self, kind: str, dim: int = 32, hidden: int = 48, layers: int = 2,
                 local_experts: list[int] | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        local = list(range(EXPERTS)) if local_experts is None else local_experts
        make = (lambda: _TitanMoE(dim, hidden)) if kind == "torchtitan" else (lambda: _MegatronMoE(dim, hidden, local))
        self.layers = nn.ModuleList(_Block(dim, make()) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None):
        x = self.embed(ids).reshape(-1, self.embed.embedding_dim)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return F.cross_entropy(logits, labels.reshape(-1)) if labels is not None else logits


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind in HF_KINDS:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(hf_config(kind))
        model.config.use_cache = False
        return model
    return SmallLM(kind)


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(model, SmallLM):
        return model(ids[:, :-1], ids[:, 1:])
    return model(input_ids=ids, labels=ids).loss


def routers(model: nn.Module) -> dict[str, nn.Module]:
    """MoE layer name -> its router, found independently of moc (by class name)."""
    out = {}
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if cls.endswith(("TopKRouter", "TopkRouter")) or cls in ("_TitanRouter", "_MegatronRouter"):
            out[name.rsplit(".", 1)[0]] = mod
    return out
