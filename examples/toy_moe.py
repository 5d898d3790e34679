"""A small MoE language model for demos, tests and benchmarks (CPU friendly)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ToyMoE", "Expert", "MoEBlock", "BigramTask"]


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class MoEBlock(nn.Module):
    """Top-k routed experts (a plain local implementation; lazarus.moe distributes this)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int = 1) -> None:
        super().__init__()
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(num_experts))
        self.top_k = top_k
        self.last_counts = torch.zeros(num_experts, dtype=torch.int64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(-1)
        weight, idx = probs.topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weight[rows, slot, None])
        self.last_counts = torch.bincount(idx.reshape(-1), minlength=len(self.experts))
        return out.reshape(x.shape)


class ToyMoE(nn.Module):
    """Embedding -> L x (LayerNorm + MoE, residual) -> head. Names match the default pattern:
    ``layers.<i>.moe.experts.<e>.w1.weight``."""

    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 64, num_layers: int = 2,
                 num_experts: int = 8, top_k: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList()
        for _ in range(num_layers):
            block = nn.Module()
            block.norm = nn.LayerNorm(dim)
            block.moe = MoEBlock(dim, hidden, num_experts, top_k)
            self.layers.append(block)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.layers:
            h = h + block.moe(block.norm(h))
        return self.head(h)

    def routing_counts(self) -> dict[str, torch.Tensor]:
        """Tokens routed to each expert in the last forward, keyed by layer name."""
        return {f"layers.{i}.moe": block.moe.last_counts for i, block in enumerate(self.layers)}


class BigramTask:
    """Next-token prediction on a fixed, skewed random bigram table.

    ``batch(step)`` depends only on the seed and the step, so a resumed run sees exactly
    the data an uninterrupted run would have seen.
    """

    def __init__(self, vocab: int = 64, seed: int = 0, sharpness: float = 3.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.seed = seed
        self.table = (torch.randn(vocab, vocab, generator=g) * sharpness).softmax(-1)
        self.prior = torch.randn(vocab, generator=g).mul(1.5).softmax(-1)  # skewed inputs

    def batch(self, step: int, size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x = torch.multinomial(self.prior, size, replacement=True, generator=g)
        y = torch.multinomial(self.table[x], 1, generator=g).squeeze(-1)
        return x, y
