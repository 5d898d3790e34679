"""Routers: the model-owned callable that picks each token's experts.

A router is any module whose ``forward(h [tokens, d])`` returns ``(expert_ids [tokens, k]
int64, gates [tokens, k])``; :class:`~lazarus.moe.ElasticMoE` dispatches the token slots
and combines the expert outputs as ``sum_k gates[:, k] * expert_out[:, k]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._config import ROUTER_DTYPES
from ._expert import seeded_generator

__all__ = ["SoftmaxRouter"]


class SoftmaxRouter(nn.Module):
    """Linear scores, softmax, top-k; with ``k > 1`` the k gates are renormalised to sum
    to one. Parameter ``weight`` [E, d] (no bias), drawn like ``nn.Linear``'s default init
    from a generator seeded by ``seed`` (the same on every rank).

    ``score_dtype="float32"`` (default) scores in float32 (or float64 for float64 inputs), the gates
    returned in the input's dtype: in bf16 the probabilities of two experts tie often
    (8 bits of mantissa), and which one ``topk`` picks then depends on the device's
    rounding, so a token's experts could differ between a CPU and a GPU run, or after a
    kernel change (seen on an H200: 0.1-0.3% of the outputs). The cost is a float32 copy
    of the router's input ([tokens, d], kept for the backward). ``"input"`` scores in the
    input's dtype."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, seed: int = 0,
                 score_dtype: str = "float32") -> None:
        super().__init__()
        if top_k > num_experts:
            raise ValueError(f"top_k must be <= num_experts = {num_experts}, got {top_k}")
        if score_dtype not in ROUTER_DTYPES:
            raise ValueError(f"SoftmaxRouter score_dtype must be one of {list(ROUTER_DTYPES)}, got {score_dtype!r}")
        self.top_k = top_k
        self.score_dtype = score_dtype
        self.in_features = d_model
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        bound = 1.0 / math.sqrt(d_model)
        with torch.no_grad():
            self.weight.copy_(torch.empty(num_experts, d_model).uniform_(-bound, bound,
                                                                          generator=seeded_generator(seed, 0)))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Scores [tokens, E]: at least float32 with ``score_dtype="float32"``, else ``h``'s dtype."""
        if self.score_dtype == "float32":
            dtype = torch.promote_types(h.dtype, torch.float32)     # float64 stays float64
            return F.linear(h.to(dtype), self.weight.to(dtype))
        return F.linear(h, self.weight)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.logits(h), dim=-1)
        gates, idx = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            gates = gates / gates.sum(-1, keepdim=True)
        return idx, gates.to(h.dtype)
