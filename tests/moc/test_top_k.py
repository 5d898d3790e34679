"""moc/_units/top_k.py: top_k read from the model (a real transformers qwen3_moe built from
its config, Lazarus' MoELayer, a plain block), checked against ``MoCConfig.top_k``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moc import CheckpointManager, MoCConfig, discover_units
from moc._units import model_top_k

transformers = pytest.importorskip("transformers")


def _qwen3_moe(top_k: int = 2, experts: int = 4) -> nn.Module:
    config = transformers.AutoConfig.for_model(
        "qwen3_moe", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=128, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=16)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


class _Block(nn.Module):
    """An MoE block that keeps no top_k anywhere moc can read (routes top-1 in code)."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(8, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(experts))


def _cfg(tmp_path, **kw) -> MoCConfig:
    return MoCConfig(storage=str(tmp_path / "ckpt"), snapshot_dir=str(tmp_path / "shm"), interval=2, **kw)


def test_top_k_is_read_from_a_transformers_model(tmp_path):
    model = _qwen3_moe(top_k=2)
    top_k, where = model_top_k(model, sorted(discover_units(model).layers))
    assert top_k == 2 and where.startswith("model.layers.0.mlp") and where.split(" ")[0].endswith(".top_k")
    model.model.layers[0].mlp.gate.top_k = 3   # the routers disagree: the config says it
    assert model_top_k(model, sorted(discover_units(model).layers)) == (2, "model.config.num_experts_per_tok")
    model = _qwen3_moe(top_k=2)
    opt = torch.optim.AdamW(model.parameters())
    with CheckpointManager(_cfg(tmp_path), model=model, optimizer=opt) as ckpt:   # top_k None: the model's
        assert ckpt.cfg.top_k == 2 and ckpt.plt_tracker.top_k == 2


def test_a_top_k_the_model_contradicts_is_an_error_naming_both(tmp_path):
    model = _qwen3_moe(top_k=2, experts=4)
    opt = torch.optim.AdamW(model.parameters())
    for given in (1, 8):
        with pytest.raises(ValueError, match=rf"MoCConfig.top_k = {given} \(given\) but the model routes each token "
                                             r"to 2 experts \(model\.layers\.0\.mlp\.gate\.top_k"):
            CheckpointManager(_cfg(tmp_path, top_k=given), model=model, optimizer=opt)
    with CheckpointManager(_cfg(tmp_path, top_k=2), model=model, optimizer=opt) as ckpt:
        assert ckpt.cfg.top_k == 2


def test_top_k_above_the_experts_of_a_layer_is_an_error(tmp_path):
    model = nn.Module()
    model.moe = _Block(4)
    assert model_top_k(model, ["moe"]) is None
    with pytest.raises(ValueError, match=r"MoCConfig.top_k = 8 \(MoCConfig.top_k \(given\)\) exceeds the 4 experts "
                                         r"of MoE layer 'moe'.*allowed: 1 to 4"):
        CheckpointManager(_cfg(tmp_path, top_k=8), model=model)
    with CheckpointManager(_cfg(tmp_path), model=model) as ckpt:       # nothing to read: 1, as before
        assert ckpt.cfg.top_k == 1
    with pytest.raises(ValueError, match=r"MoCConfig\.top_k must be an integer >= 1 or None, got 0"):
        _cfg(tmp_path, top_k=0)


def test_top_k_of_a_lazarus_moe_layer(tmp_path):
    from lazarus.moe import MoEConfig, MoELayer
    from lazarus.planning import Placement

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        model = nn.Module()
        model.moe = MoELayer(MoEConfig(d_model=8, d_hidden=16, num_experts=4, top_k=2), Placement(nodes=[[0, 1, 2, 3]]))
        layers = sorted(discover_units(model).layers)
        assert model_top_k(model, layers)[0] == 2
        with pytest.raises(ValueError, match=r"top_k = 1 \(given\) but the model routes each token to 2 experts"):
            CheckpointManager(_cfg(tmp_path, top_k=1), model=model)
    finally:
        torch.distributed.destroy_process_group()
