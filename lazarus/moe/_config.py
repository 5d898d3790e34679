"""Configuration of a Lazarus MoE layer."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

ACTIVATIONS = ("gelu", "relu", "silu")
GRAD_REDUCTIONS = ("mean", "sum")
TOP_K = (1, 2)
ROUTER_DTYPES = ("float32", "input")


def _int(name: str, value: object, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"MoEConfig.{name} must be an integer >= {lo}, got {value!r}")


@dataclass(frozen=True)
class MoEConfig:
    """Shape and training semantics of one MoE layer.

    Attributes:
        d_model: token width.
        d_hidden: hidden width of each expert's two-layer MLP.
        num_experts: E, global expert ids ``0..E-1`` (parameter names use these ids).
        top_k: experts per token, 1 or 2. With 2 the two gate probabilities are
            renormalised to sum to one.
        activation: ``"gelu"``, ``"relu"`` or ``"silu"``.
        seed: every rank draws the router and expert ``e`` from generators seeded by
            ``(seed, e)``, so all copies start identical without any communication.
        grad_reduction: ``"mean"`` (default) divides synchronised gradients by the world
            size, the same average data-parallel training applies to dense gradients, so a
            step equals single-model training on the mean of the per-rank losses;
            ``"sum"`` leaves them summed (pair it with summed dense gradients).
        router_dtype: ``"float32"`` (default) scores the router in float32 whatever the
            model's dtype (in bf16, ties between experts' probabilities make the top-k
            depend on the device's rounding); ``"input"`` scores in the input's dtype.
    """

    d_model: int
    d_hidden: int
    num_experts: int
    top_k: int = 1
    activation: str = "gelu"
    seed: int = 0
    grad_reduction: str = "mean"
    router_dtype: str = "float32"

    def __post_init__(self) -> None:
        _int("d_model", self.d_model, 1)
        _int("d_hidden", self.d_hidden, 1)
        _int("num_experts", self.num_experts, 1)
        _int("seed", self.seed, 0)
        if isinstance(self.top_k, bool) or self.top_k not in TOP_K:
            raise ValueError(f"MoEConfig.top_k must be one of {list(TOP_K)}, got {self.top_k!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k must be <= num_experts = {self.num_experts}, got {self.top_k}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation must be one of {list(ACTIVATIONS)}, got {self.activation!r}")
        if self.grad_reduction not in GRAD_REDUCTIONS:
            raise ValueError(
                f"MoEConfig.grad_reduction must be one of {list(GRAD_REDUCTIONS)}, got {self.grad_reduction!r}"
            )
        if self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(
                f"MoEConfig.router_dtype must be one of {list(ROUTER_DTYPES)}, got {self.router_dtype!r}"
            )
