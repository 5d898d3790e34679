"""``lazarus.adapters.hf.make_elastic`` on the real transformers 5.x MoE models.

Tiny random Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3 (group-limited sigmoid router with
``e_score_correction_bias`` and ``routed_scaling_factor``, shared experts, a dense first
layer) and GPT-OSS (router bias, transposed interleaved experts with biases, clamped
SwiGLU), from ``tests/helpers/layout_models.py``:

* one process: the adapted model's loss and every gradient equal the original's (fp32
  reordering tolerance), its ``state_dict()`` has the original names, shapes and values,
  and it loads into the original class;
* 2 and 4 gloo ranks (real processes) with replicated experts: each step's loss (mean
  over ranks) equals the single-process loss on the same global batch, and after three
  SGD-with-momentum steps every weight equals the single-process model's;
* on 2 ranks a moc checkpoint of the job, exported with ``moc export --format
  safetensors``, is loaded by ``AutoModelForCausalLM.from_pretrained`` with no missing or
  unexpected key, equal to the ranks' own weights.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import layout_models as lm
from lazarus.adapters.hf import ElasticHFBlock, elastic_layout, make_elastic, moe_blocks
from lazarus.moe import moe_layers, sync_moe_gradients
from lazarus.planning import Placement
from tests.helpers.dense_sync import sync_dense
from tests.helpers.rank_harness import run_ranks

transformers = pytest.importorskip("transformers")

STEPS = 3
PER_RANK, SEQ = 2, 12


def global_ids(step: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(3, lm.VOCAB, (world * PER_RANK, SEQ), generator=g)


# ----- one process ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", lm.HF_KINDS)
def test_one_process_equals_the_original(kind: str) -> None:
    ref = lm.build(kind, seed=3)
    ad = make_elastic(copy.deepcopy(ref))
    blocks = [m for _, m in moe_layers(ad)]
    assert blocks and all(isinstance(b, ElasticHFBlock) for b in blocks)
    assert not moe_blocks(ad)                            # nothing left to adapt
    for step in range(2):
        ids = global_ids(step, 2)
        for m in (ref, ad):
            m.zero_grad(set_to_none=True)
        l_ref = lm.loss_of(ref, ids)
        l_ad = lm.loss_of(ad, ids)
        torch.testing.assert_close(l_ad, l_ref, rtol=1e-6, atol=1e-6)
        l_ref.backward()
        l_ad.backward()
        sync_moe_gradients(ad)                           # one rank: a no-op on the values
        g_ref = {n: p.grad for n, p in ref.named_parameters()}
        g_ad = {n: p.grad for n, p in ad.named_parameters()}
        assert set(g_ad) == set(g_ref)
        for n, g in g_ref.items():
            if g is None:
                assert g_ad[n] is None or not g_ad[n].any(), n
            else:
                torch.testing.assert_close(g_ad[n], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
        with torch.no_grad():                            # move the weights, keep them equal
            for p_ref, p_ad in zip(ref.parameters(), ad.parameters()):
                if p_ref.grad is not None:
                    p_ref -= 0.5 * p_ref.grad
                    p_ad -= 0.5 * p_ad.grad
    sd_ref, sd_ad = ref.state_dict(), ad.state_dict()
    assert list(sd_ad) == list(sd_ref)                   # names and order
    for k, v in sd_ref.items():
        assert sd_ad[k].shape == v.shape and sd_ad[k].dtype == v.dtype, k
        torch.testing.assert_close(sd_ad[k], v, rtol=1e-5, atol=1e-6)
    fresh = lm.build(kind, seed=11)
    fresh.load_state_dict(sd_ad, strict=True)           # the original class loads it
    ids = global_ids(7, 1)
    torch.testing.assert_close(lm.loss_of(fresh, ids), lm.loss_of(ad, ids), rtol=1e-6, atol=1e-6)


def test_layout_names_and_top_k() -> None:
    model = lm.build("deepseek_v3")
    layout = elastic_layout(model)
    assert layout == {"layers": {"model.layers.1.mlp": 4, "model.layers.2.mlp": 4}, "top_k": lm.TOP_K}
    make_elastic(model)
    assert elastic_layout(model) == layout
    assert [n for n, _ in moe_layers(model)] == list(layout["layers"])


def test_gpt_oss_block_keeps_its_two_outputs() -> None:
    model = make_elastic(lm.build("gpt_oss"))
    block = model.model.layers[0].mlp
    out, scores = block(torch.randn(2, 5, 32))
    assert out.shape == (2, 5, 32) and scores.shape == (10, lm.TOP_K)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="no transformers MoE block"):
        make_elastic(lm.build("torchtitan"))
    model = lm.build("qwen3_moe")
    with pytest.raises(ValueError, match="num_experts = 5"):
        make_elastic(model, Placement([[0, 1, 2, 3, 4]], num_experts=5))
    with pytest.raises(ValueError, match="missing \\['model.layers.1.mlp'\\]"):
        make_elastic(model, {"model.layers.0.mlp": Placement([[0, 1, 2, 3]])})
    with pytest.raises(ValueError, match="process group has 1"):
        make_elastic(model, Placement([[0, 1], [2, 3]]))
    with pytest.raises(ValueError, match="placements must be None"):
        make_elastic(model, [[0, 1, 2, 3]])
    make_elastic(model)
    with pytest.raises(ValueError, match="already elastic"):
        make_elastic(model)


# ----- 2 and 4 gloo ranks ---------------------------------------------------------------------------
def _train(rank: int, world: int, kind: str, slots: list[list[int]], tmp: Path | None) -> None:
    from moc import CheckpointManager, MoCConfig

    ref = lm.build(kind, seed=5)                         # single process, whole global batch
    model = make_elastic(lm.build(kind, seed=5), Placement(slots, num_experts=lm.EXPERTS))
    for _, layer in moe_layers(model):
        assert layer.local_experts == sorted(set(slots[rank]))
        assert layer.experts.gate_up_proj.shape[0] == len(set(slots[rank]))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    ckpt = None
    if tmp is not None:
        cfg = MoCConfig(storage=str(tmp / f"ckpt-{kind}"), interval=1, snapshot_dir=str(tmp / f"shm-{kind}-{rank}"),
                        top_k=lm.TOP_K)
        ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    for step in range(STEPS):
        ids = global_ids(step, world)
        opt_ref.zero_grad()
        loss_ref = lm.loss_of(ref, ids)
        loss_ref.backward()
        opt_ref.step()
        opt.zero_grad()
        loss = lm.loss_of(model, ids[rank * PER_RANK:(rank + 1) * PER_RANK])
        loss.backward()
        sync_moe_gradients(model)                        # experts over replicas, routers/shared averaged
        sync_dense(model, world)
        opt.step()
        if ckpt is not None:
            ckpt.step(step)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, loss_ref.detach(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, s=step: f"{kind} step {s}: {m}")
    if ckpt is not None:
        ckpt.close()
    # Every weight equals the single-process model's: dense ones whole, experts by row.
    ref_state = ref.state_dict()
    held = {}
    for key, value in model.state_dict().items():
        want = ref_state[key]
        if value.shape != want.shape:                   # a fused expert tensor: this rank's rows
            layer = key.rsplit(".experts.", 1)[0]
            ids = model.get_submodule(layer).experts.local_expert_indices
            want = want[ids]
            held[key] = ids
        torch.testing.assert_close(value, want, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{kind} {k}: {m}")
    if tmp is not None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  str(tmp / f"live-{kind}-{rank}.safetensors"))
        (tmp / f"rows-{kind}-{rank}.json").write_text(json.dumps(held))
        if rank == 0:
            ref.config.save_pretrained(str(tmp / f"cfg-{kind}"))


def prog_train(rank: int, world: int, slots: list[list[int]], tmp: str | None) -> None:
    torch.manual_seed(0)
    for kind in lm.HF_KINDS:
        _train(rank, world, kind, slots, Path(tmp) if tmp else None)


# 2 ranks: expert 0 on both; rank 0 has two slots of expert 1; 3 only on rank 1.
SLOTS_2 = [[0, 1, 1], [0, 2, 3]]
# 4 ranks, 2 slots each: experts 0 and 2 twice, 1 and 3 twice.
SLOTS_4 = [[0, 1], [2, 3], [0, 2], [1, 3]]


@pytest.mark.timeout(500)
def test_two_ranks_equal_one_process_and_moc_export_loads(tmp_path: Path) -> None:
    run_ranks(prog_train, 2, tmp_path, SLOTS_2, str(tmp_path), join_s=450)
    from safetensors.torch import load_file

    from moc.cli import main as moc_main

    for kind in lm.HF_KINDS:
        out = tmp_path / f"hf-{kind}"
        assert moc_main(["export", str(tmp_path / f"ckpt-{kind}"), "--format", "safetensors", "-o", str(out),
                         "--hf-config", str(tmp_path / f"cfg-{kind}" / "config.json")]) == 0
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        state = loaded.state_dict()
        covered: dict[str, set[int]] = {}
        for rank in range(2):
            live = load_file(str(tmp_path / f"live-{kind}-{rank}.safetensors"))
            rows = json.loads((tmp_path / f"rows-{kind}-{rank}.json").read_text())
            assert set(live) == set(state)
            for key, value in live.items():
                if key in rows:                          # the exported [E, ...] rows are this rank's
                    assert state[key].shape[0] == lm.EXPERTS
                    assert torch.equal(state[key][rows[key]], value), (kind, key, rank)
                    covered.setdefault(key, set()).update(rows[key])
                else:
                    assert torch.equal(state[key], value), (kind, key, rank)
        assert covered and all(ids == set(range(lm.EXPERTS)) for ids in covered.values()), covered


@pytest.mark.timeout(500)
def test_four_ranks_equal_one_process(tmp_path: Path) -> None:
    run_ranks(prog_train, 4, tmp_path, SLOTS_4, None, join_s=450)


def test_a_copied_adapted_model_runs_its_own_layers() -> None:
    model = make_elastic(lm.build("mixtral"))
    twin = copy.deepcopy(model)
    ids = global_ids(3, 1)
    torch.testing.assert_close(lm.loss_of(twin, ids), lm.loss_of(model, ids))
    with torch.no_grad():
        twin.model.layers[0].mlp.experts.down_proj.zero_()      # the copy's experts are its own
    assert not torch.equal(lm.loss_of(twin, ids), lm.loss_of(model, ids))
    assert twin.model.layers[0].mlp.experts._owner() is twin.model.layers[0].mlp
