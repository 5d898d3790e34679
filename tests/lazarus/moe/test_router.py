"""The softmax router scores in float32 for low-precision models (``MoEConfig.router_dtype``)."""

from __future__ import annotations

import pytest
import torch

from lazarus.moe import MoEConfig, MoELayer, SoftmaxRouter
from lazarus.planning import Placement


def _router(score_dtype: str = "float32") -> SoftmaxRouter:
    return SoftmaxRouter(64, 8, 2, seed=3, score_dtype=score_dtype)


def test_bf16_scores_in_float32_and_returns_bf16_gates() -> None:
    h = torch.randn(2048, 64, generator=torch.Generator().manual_seed(0))
    router = _router().to(torch.bfloat16)
    hb = h.to(torch.bfloat16)
    assert router.logits(hb).dtype == torch.float32
    ids, gates = router(hb)
    assert ids.dtype == torch.int64 and gates.dtype == torch.bfloat16
    # the same choice as scoring the same bf16 values in float64: no bf16 ties decide it
    ref = torch.nn.functional.linear(hb.double(), router.weight.double()).softmax(-1).topk(2, dim=-1).indices
    assert torch.equal(ids, ref)
    # in the input's dtype, bf16 probabilities tie and some tokens' choice differs
    low_ids, low_gates = _router("input").to(torch.bfloat16)(hb)
    assert low_gates.dtype == torch.bfloat16 and not torch.equal(low_ids, ref)


def test_float64_is_not_narrowed_and_float32_is_unchanged() -> None:
    h = torch.randn(16, 64, dtype=torch.float64)
    assert _router().double().logits(h).dtype == torch.float64
    h32 = h.float()
    r32, rin = _router(), _router("input")
    assert torch.equal(r32.logits(h32), rin.logits(h32))


def test_bf16_router_backward_reaches_the_bf16_weight() -> None:
    router = _router().to(torch.bfloat16)
    h = torch.randn(32, 64).to(torch.bfloat16).requires_grad_()
    _, gates = router(h)
    gates.float().sum().backward()
    assert router.weight.grad is not None and router.weight.grad.dtype == torch.bfloat16
    assert h.grad is not None and h.grad.dtype == torch.bfloat16


def test_the_layer_takes_router_dtype_from_its_config() -> None:
    layer = MoELayer(MoEConfig(d_model=16, d_hidden=32, num_experts=4, router_dtype="input"), Placement([[0, 1, 2, 3]]))
    assert layer.router.score_dtype == "input"
    default = MoELayer(MoEConfig(d_model=16, d_hidden=32, num_experts=4), Placement([[0, 1, 2, 3]]))
    assert default.router.score_dtype == "float32"


def test_bad_router_dtype_names_the_field_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"MoEConfig.router_dtype must be one of \['float32', 'input'\], got 'bf16'"):
        MoEConfig(d_model=16, d_hidden=32, num_experts=4, router_dtype="bf16")
    with pytest.raises(ValueError, match=r"score_dtype must be one of \['float32', 'input'\]"):
        SoftmaxRouter(16, 4, 1, score_dtype="half")
