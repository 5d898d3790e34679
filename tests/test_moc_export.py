"""``moc export`` to torch / safetensors / DCP, each read back by its own loader and
compared with what moc's own restore gives (the checkpoint's ground truth)."""

from __future__ import annotations

import json

import pytest
import torch

import layout_models as lm
from moc import CheckpointManager, MoCConfig
from moc.cli import main


def _train(kind: str, tmp_path):
    model = lm.build(kind)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = MoCConfig(storage=str(tmp_path / "store"), snapshot_dir=str(tmp_path / "shm"), interval=2, k_snapshot=1,
                    dynamic_k=False)
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        for step in range(7):
            ids = torch.randint(3, lm.VOCAB, (2, 9), generator=torch.Generator().manual_seed(step))
            lm.loss_of(model, ids).backward()
            opt.step()
            opt.zero_grad()
            ckpt.step(step)
    truth = lm.build(kind, seed=99)
    topt = torch.optim.Adam(truth.parameters(), lr=1e-2)
    with CheckpointManager(MoCConfig(storage=str(tmp_path / "store"), snapshot_dir=str(tmp_path / "shm2")),
                           model=truth, optimizer=topt) as ckpt:
        ckpt.restore()
    return truth, topt


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss", "torchtitan"])
def test_export_round_trips_through_each_loader(tmp_path, kind):
    truth, topt = _train(kind, tmp_path)
    store = str(tmp_path / "store")
    want = truth.state_dict()
    # Experts were saved at different steps, so a wrong row would show.
    assert main(["export", store, "-o", str(tmp_path / "full.pt")]) == 0
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert set(full["model"]) == set(want)
    for k, v in want.items():
        assert torch.equal(full["model"][k], v), k
    names = {id(p): n for n, p in truth.named_parameters()}
    for p, st in topt.state.items():
        assert torch.equal(full["optimizer"]["state"][names[id(p)]]["exp_avg"], st["exp_avg"])

    # DCP: load into a fresh model's state dict and the optimizer's, as get_state_dict keys them.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    assert main(["export", store, "--format", "dcp", "-o", str(tmp_path / "dcp")]) == 0
    fresh = lm.build(kind, seed=7)
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    lm.loss_of(fresh, torch.randint(3, lm.VOCAB, (2, 9))).backward()
    fopt.step()   # the optimizer's state exists, as DCP's in-place load needs
    msd, osd = get_state_dict(fresh, fopt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    set_state_dict(fresh, fopt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for k, v in want.items():
        assert torch.equal(fresh.state_dict()[k], v), k
    fnames = {id(p): n for n, p in fresh.named_parameters()}
    for p, st in fopt.state.items():
        ref = topt.state[dict(truth.named_parameters())[fnames[id(p)]]]
        assert torch.equal(st["exp_avg_sq"], ref["exp_avg_sq"])

    if kind not in lm.HF_KINDS:
        return
    # safetensors: from_pretrained with the model's config, sharded past --max-shard-size.
    from transformers import AutoModelForCausalLM

    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(lm.hf_config(kind).to_dict()))
    out = tmp_path / "hf"
    assert main(["export", store, "--format", "safetensors", "-o", str(out), "--max-shard-size", "20KB",
                 "--hf-config", str(cfg_file)]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    got = loaded.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{k} differs after from_pretrained"


def test_export_bad_input_is_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--format", "dcp", "-o", str(tmp_path / "x"),
                 "--max-shard-size", "lots"]) == 2
    assert "max-shard-size" in capsys.readouterr().err
