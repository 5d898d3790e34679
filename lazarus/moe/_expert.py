"""One expert: a two-layer MLP whose initial weights depend only on (seed, expert id)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ._config import MoEConfig

_SEED_STRIDE = 1_000_003


def seeded_generator(seed: int, slot: int) -> torch.Generator:
    """Generator for one parameter owner: slot 0 is the router, slot e+1 expert e."""
    return torch.Generator().manual_seed(seed * _SEED_STRIDE + slot)


def init_linear_(layer: nn.Linear, gen: torch.Generator) -> None:
    """nn.Linear's default uniform init, drawn from ``gen`` so that every rank agrees."""
    bound = 1.0 / math.sqrt(layer.in_features)
    with torch.no_grad():
        w = torch.empty(layer.weight.shape).uniform_(-bound, bound, generator=gen)
        layer.weight.copy_(w)
        if layer.bias is not None:
            layer.bias.copy_(torch.empty(layer.bias.shape).uniform_(-bound, bound, generator=gen))


class Expert(nn.Module):
    """``w2(act(w1(x)))``; parameters ``w1.weight, w1.bias, w2.weight, w2.bias``."""

    def __init__(self, config: MoEConfig, expert_id: int | None = None) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.d_hidden)
        self.w2 = nn.Linear(config.d_hidden, config.d_model)
        self.act = {"gelu": nn.GELU(), "relu": nn.ReLU(), "silu": nn.SiLU()}[config.activation]
        if expert_id is not None:
            gen = seeded_generator(config.seed, expert_id + 1)
            init_linear_(self.w1, gen)
            init_linear_(self.w2, gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)))
