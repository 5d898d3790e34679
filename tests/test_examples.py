"""The training example: the stdlib byte corpus, the MoE GPT on MoELayer, and a 2-rank gloo
step that matches single-process training on the same global batch."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import re
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import moc
from examples import (
    ByteCorpus,
    GPTConfig,
    MoEGPT,
    make_optimizer,
    moe_layer_names,
    param_group_of,
    routing_skew,
    sync_gradients,
    train_step,
)
from examples.corpus import stdlib_source_files
from lazarus.moe import moe_layers
from lazarus.planning import Placement

JOIN_S = 100


@pytest.fixture(scope="module")
def corpus() -> ByteCorpus:
    return ByteCorpus()


# ----- corpus ---------------------------------------------------------------------------------
def test_corpus_is_the_stdlib_sources_in_sorted_order(corpus):
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_source_files()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    parts = {p for f in files for p in f.parts}
    assert not parts & {"site-packages", "test", "tests", "__pycache__"}
    assert len(corpus) == 4 * 1024 * 1024 and corpus.data.dtype == torch.uint8
    first = files[0].read_bytes()
    assert bytes(corpus.data[: len(first)].tolist()) == first
    text = bytes(corpus.data[:200_000].tolist())
    assert b"def " in text and b"import " in text


def test_corpus_split_and_determinism(corpus, tmp_path):
    fresh = ByteCorpus(use_cache=False)
    assert torch.equal(fresh.data, corpus.data)
    n_val = round(len(corpus) * 0.05)
    assert corpus.val.numel() == n_val and corpus.train.numel() == len(corpus) - n_val
    assert torch.equal(torch.cat([corpus.train, corpus.val]), corpus.data)
    small = ByteCorpus(64 * 1024, cache_dir=tmp_path, val_fraction=0.1)
    assert len(small) == 64 * 1024 and torch.equal(small.data, corpus.data[: 64 * 1024])
    assert small.val.numel() == round(64 * 1024 * 0.1)


def test_corpus_cache_roundtrip_corruption_and_unwritable(tmp_path):
    first = ByteCorpus(256 * 1024, cache_dir=tmp_path)
    assert not first.from_cache and first.cache_path.exists()
    t = time.perf_counter()
    again = ByteCorpus(256 * 1024, cache_dir=tmp_path)
    elapsed = time.perf_counter() - t
    assert again.from_cache and torch.equal(again.data, first.data) and elapsed < 1.0
    assert again.num_files == first.num_files > 0
    # a corrupt cache is ignored (and rewritten)
    raw = first.cache_path.read_bytes()
    first.cache_path.write_bytes(raw[:-10] + b"0123456789")
    healed = ByteCorpus(256 * 1024, cache_dir=tmp_path)
    assert not healed.from_cache and torch.equal(healed.data, first.data)
    assert ByteCorpus(256 * 1024, cache_dir=tmp_path).from_cache
    # unwritable cache location (a file where the directory should be): read the files
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    fallback = ByteCorpus(256 * 1024, cache_dir=blocker / "sub")
    assert not fallback.from_cache and torch.equal(fallback.data, first.data)


def test_batch_shapes_targets_and_determinism(corpus):
    x, y = corpus.batch(3, 0, 1, 8, 64, seed=7)
    assert x.shape == y.shape == (8, 64) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 256 and int(x.min()) >= 0
    x2, y2 = corpus.batch(3, 0, 1, 8, 64, seed=7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(corpus.batch(4, 0, 1, 8, 64, seed=7)[0], x)
    assert not torch.equal(corpus.batch(3, 0, 1, 8, 64, seed=8)[0], x)
    vx, vy = corpus.validation_batch(0, 0, 1, 8, 64)
    assert vx.shape == (8, 64) and torch.equal(vx[:, 1:], vy[:, :-1])
    assert torch.equal(vx, corpus.validation_batch(0, 0, 1, 8, 64)[0])


@pytest.mark.parametrize("world,batch_size", [(2, 8), (3, 8), (4, 16), (5, 5)])
def test_rank_slices_partition_the_global_batch(corpus, world, batch_size):
    gx, gy = corpus.batch(11, 0, 1, batch_size, 32, seed=1)
    parts = [corpus.batch(11, r, world, batch_size, 32, seed=1) for r in range(world)]
    for r, (x, y) in enumerate(parts):
        assert x.shape[0] == ByteCorpus.local_batch_size(r, world, batch_size)
        assert torch.equal(x, gx[r::world]) and torch.equal(y, gy[r::world])
    assert sum(x.shape[0] for x, _ in parts) == batch_size


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(step=0, rank=0, world=4, batch_size=2, seq_len=8), "smaller than world"),
        (dict(step=0, rank=2, world=2, batch_size=8, seq_len=8), "rank must be in"),
        (dict(step=-1, rank=0, world=1, batch_size=8, seq_len=8), "step must be"),
        (dict(step=0, rank=0, world=0, batch_size=8, seq_len=8), "world must be"),
        (dict(step=0, rank=0, world=1, batch_size=8, seq_len=0), "seq_len must be"),
        (dict(step=True, rank=0, world=1, batch_size=8, seq_len=8), "step must be an integer"),
        (dict(step=0, rank=0, world=1, batch_size=8, seq_len=10**9), "split has"),
    ],
)
def test_batch_argument_errors(corpus, kwargs, match):
    with pytest.raises(ValueError, match=match):
        corpus.batch(**kwargs)


def test_corpus_argument_errors():
    with pytest.raises(ValueError, match="max_bytes"):
        ByteCorpus(10)
    with pytest.raises(ValueError, match="val_fraction"):
        ByteCorpus.from_bytes(b"x" * 100, val_fraction=0.0)
    with pytest.raises(ValueError, match="does not exist"):
        ByteCorpus(4096, stdlib="/nonexistent/dir", use_cache=False)
    tiny = ByteCorpus.from_bytes(b"abcdefghij" * 10, val_fraction=0.1)
    with pytest.raises(ValueError, match="validation split has 10"):
        tiny.validation_batch(0, 0, 1, 2, 10)


# ----- model ------------------------------------------------------------------------------------
@pytest.mark.parametrize("moe_every", [1, 2])
def test_layer_names_layout_and_moc_units(moe_every):
    cfg = GPTConfig(moe_every=moe_every, top_k=2)
    model = MoEGPT(cfg)
    built = [n for n, _ in moe_layers(model)]
    assert moe_layer_names(cfg) == built
    assert built == ([f"blocks.{i}.moe" for i in range(4)] if moe_every == 1 else ["blocks.1.moe", "blocks.3.moe"])
    assert model.moe_layout() == {"layers": {n: 8 for n in built}, "top_k": 2}
    layout = moc.discover_units(model)
    assert layout.layers == {n: list(range(8)) for n in built}
    pattern = re.compile(moc.DEFAULT_EXPERT_PATTERN)
    expert_names = [n for n, _ in model.named_parameters() if ".experts." in n]
    assert expert_names and all(pattern.match(n) for n in expert_names)
    assert {pattern.match(n)["layer"] for n in expert_names} == set(built)


def test_init_is_seeded_identical_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a = MoEGPT(GPTConfig(seed=3))
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(999)
    b = MoEGPT(GPTConfig(seed=3))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    c = MoEGPT(GPTConfig(seed=4))
    assert not torch.equal(c.state_dict()["tok_emb.weight"], sa["tok_emb.weight"])
    # distinct layers and experts start differently
    w = "moe.experts.0.w1.weight"
    assert not torch.equal(sa[f"blocks.0.{w}"], sa[f"blocks.1.{w}"])
    assert not torch.equal(sa["blocks.0.moe.experts.0.w1.weight"], sa["blocks.0.moe.experts.1.w1.weight"])
    assert a.config.tie_head and a.head.weight is a.tok_emb.weight


def test_model_trains_on_the_corpus(corpus):
    cfg = GPTConfig()
    model = MoEGPT(cfg)
    opt = make_optimizer(model, lr=3e-3, weight_decay=0.1)
    losses = []
    counts = {n: torch.zeros(cfg.num_experts, dtype=torch.int64) for n in moe_layer_names(cfg)}
    for step in range(60):
        x, y = corpus.batch(step, 0, 1, 16, cfg.seq_len, seed=0)
        losses.append(train_step(model, opt, x, y))
        for n, c in model.routing_counts().items():
            counts[n] += c
    assert abs(losses[0] - math.log(256)) < 0.15, losses[0]
    assert sum(losses[-10:]) / 10 < losses[0] - 1.5, (losses[0], losses[-10:])
    for n, c in counts.items():
        assert int(c.sum()) == 60 * 16 * cfg.seq_len * cfg.top_k
        assert routing_skew(c) > 1.0  # no balance loss: real skew (measured ~1.7-4 per layer)


def test_forward_shapes_and_aux_loss():
    cfg = GPTConfig(n_layers=2, aux_loss_coef=0.01, top_k=2)
    model = MoEGPT(cfg)
    x = torch.randint(0, 256, (2, 10))
    logits = model(x)
    assert logits.shape == (2, 10, 256)
    _, loss = model(x, x)
    assert model.last_aux_loss is not None and model.last_aux_loss >= 1.0 - 1e-6
    assert float(loss.detach()) == pytest.approx(model.last_lm_loss + 0.01 * model.last_aux_loss, rel=1e-5)
    off = MoEGPT(GPTConfig(n_layers=2))
    _, loss_off = off(x, x)
    assert off.last_aux_loss is None and float(loss_off.detach()) == pytest.approx(off.last_lm_loss)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="shape of x"):
        model(x, x[:, :5])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(top_k=3), r"top_k must be one of \[1, 2\]"),
        (dict(num_experts=1, top_k=2), "top_k must be <= num_experts"),
        (dict(n_heads=5), "n_heads must divide d_model"),
        (dict(moe_every=5), r"moe_every must be an integer in \[1, 4\]"),
        (dict(moe_every=0), "moe_every"),
        (dict(dropout=1.0), r"dropout must be a number in \[0, 1\)"),
        (dict(activation="tanh"), "activation must be one of"),
        (dict(aux_loss_coef=-0.1), "aux_loss_coef"),
        (dict(d_model=True), "d_model"),
        (dict(seed=-1), "seed"),
        (dict(tie_head=1), "tie_head"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_placement_arguments():
    cfg = GPTConfig(n_layers=2)
    names = moe_layer_names(cfg)
    one = Placement([list(range(8))])
    model = MoEGPT(cfg, {n: one for n in names})
    assert model.set_placements(one) == {n: ([], []) for n in names}
    with pytest.raises(ValueError, match="missing"):
        MoEGPT(cfg, {names[0]: one})
    with pytest.raises(ValueError, match="num_experts = 4"):
        MoEGPT(cfg, Placement([[0, 1, 2, 3]]))
    with pytest.raises(ValueError, match="process group has 1"):
        MoEGPT(cfg, Placement([[0, 1, 2, 3], [4, 5, 6, 7]]))
    with pytest.raises(ValueError, match="placements must be"):
        MoEGPT(cfg, [one])


def test_optimizer_groups_by_name_and_rebuild():
    model = MoEGPT(GPTConfig(n_layers=2, num_experts=12))
    opt = make_optimizer(model, lr=1e-3, weight_decay=0.05)
    assert [g["group"] for g in opt.param_groups] == ["decay", "no_decay"]
    assert opt.param_groups[0]["weight_decay"] == 0.05 and opt.param_groups[1]["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decay = [names[id(p)] for p in opt.param_groups[0]["params"]]
    no_decay = [names[id(p)] for p in opt.param_groups[1]["params"]]
    assert all(n.endswith("weight") and "ln" not in n for n in decay)
    assert all(n.endswith("bias") or ".ln" in n or n.startswith("ln_f") for n in no_decay)
    assert len(decay) + len(no_decay) == len(names)
    e9 = decay.index("blocks.0.moe.experts.9.w1.weight")
    assert decay.index("blocks.0.moe.experts.10.w1.weight") > e9  # natural order
    assert param_group_of("blocks.0.moe.experts.3.w1.weight", torch.zeros(2, 2)) == "decay"
    assert param_group_of("blocks.0.ln1.weight", torch.zeros(4)) == "no_decay"
    # a step, an lr change, then a rebuild carries state and lr by parameter
    x = torch.randint(0, 256, (2, 16))
    train_step(model, opt, x, x)
    for g in opt.param_groups:
        g["lr"] = 5e-4
    rebuilt = make_optimizer(model, lr=1e-3, weight_decay=0.05, previous=opt)
    assert [g["lr"] for g in rebuilt.param_groups] == [5e-4, 5e-4]
    p = model.tok_emb.weight
    assert rebuilt.state[p]["exp_avg"] is opt.state[p]["exp_avg"]
    with pytest.raises(ValueError, match="lr"):
        make_optimizer(model, lr=0)


def test_routing_skew():
    assert routing_skew([10, 10, 10, 10]) == 1.0
    assert routing_skew(torch.tensor([40, 0, 0, 0])) == 4.0
    assert routing_skew([30, 10, 0, 0]) == pytest.approx(3.0)
    for bad in ([], [0, 0], [1, -1]):
        with pytest.raises(ValueError):
            routing_skew(bad)


# ----- 2 gloo ranks vs one process ----------------------------------------------------------------
DIST_CFG = dict(n_layers=4, top_k=2, seed=5)
DIST_BATCH = 8
DIST_STEPS = 3
DIST_LR = 3e-3


def _dist_placements() -> dict[str, Placement]:
    return {
        "blocks.0.moe": Placement([[0, 1, 2, 3], [4, 5, 6, 7]]),            # split
        "blocks.1.moe": Placement([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]]),      # 3, 4 replicated
        "blocks.2.moe": Placement([list(range(8)), list(range(8))]),        # all replicated
        "blocks.3.moe": Placement([[0, 2, 4, 6], [1, 3, 5, 7]]),            # interleaved
    }


def _step_with_grads(model: MoEGPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    """train_step, also returning the synchronised gradients by parameter name."""
    opt.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    sync_gradients(model, group=model.group)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    return float(loss.detach()), grads


def _rank_main(rank: int, world: int, tmp: str) -> None:
    os.environ["RANK"] = str(rank)
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(tmp) / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        corpus = ByteCorpus()
        cfg = GPTConfig(**DIST_CFG)
        model = MoEGPT(cfg, _dist_placements())
        opt = make_optimizer(model, lr=DIST_LR)
        losses = []
        for step in range(DIST_STEPS):
            x, y = corpus.batch(step, rank, world, DIST_BATCH, cfg.seq_len, seed=2)
            local, grads = _step_with_grads(model, opt, x, y)
            if step == 0:
                torch.save(grads, Path(tmp) / f"grads.{rank}.pt")
            loss = torch.tensor([local], dtype=torch.float64)
            dist.all_reduce(loss)
            losses.append(float(loss) / world)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save(state, Path(tmp) / f"state.{rank}.pt")
        (Path(tmp) / f"losses.{rank}.json").write_text(json.dumps(losses))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _entry(rank: int, world: int, tmp: str) -> None:
    try:
        _rank_main(rank, world, tmp)
    except BaseException:
        (Path(tmp) / f"err.{rank}").write_text(traceback.format_exc())
        os._exit(1)


@pytest.mark.timeout(150)
def test_two_gloo_ranks_match_single_process_training(tmp_path, corpus):
    from lazarus.dispatch import load_ops

    load_ops()  # build/load the extension once here; the ranks only load it
    world = 2
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, world, str(tmp_path)), daemon=True) for r in range(world)]
    try:
        for p in procs:
            p.start()
        # single-process reference on the same global batches while the ranks run
        cfg = GPTConfig(**DIST_CFG)
        ref = MoEGPT(cfg)
        opt = make_optimizer(ref, lr=DIST_LR)
        ref_steps = [_step_with_grads(ref, opt, *corpus.batch(s, 0, 1, DIST_BATCH, cfg.seq_len, seed=2))
                     for s in range(DIST_STEPS)]
        ref_losses = [loss for loss, _ in ref_steps]
        ref_grads = ref_steps[0][1]
        for p in procs:
            p.join(JOIN_S)
        errors = [(tmp_path / f"err.{r}").read_text() for r in range(world) if (tmp_path / f"err.{r}").exists()]
        assert not errors, "\n".join(errors)
        assert [p.exitcode for p in procs] == [0] * world
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    losses = [json.loads((tmp_path / f"losses.{r}.json").read_text()) for r in range(world)]
    assert losses[0] == losses[1]
    # first step: same parameters, same global batch -> same loss
    assert abs(losses[0][0] - ref_losses[0]) < 1e-5, (losses[0], ref_losses)
    # later steps: the synchronised gradients gave the same updates (float reorderings only)
    for got, want in zip(losses[0][1:], ref_losses[1:]):
        assert abs(got - want) < 1e-4, (losses[0], ref_losses)
    ref_state = ref.state_dict()
    for r in range(world):
        # the synchronised first-step gradients of everything this rank holds (dense,
        # routers, its experts, replicated or not) are the single-process gradients
        grads = torch.load(tmp_path / f"grads.{r}.pt")
        assert any(".experts." in n for n in grads)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], atol=1e-6, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
        # and after three AdamW steps the parameters still agree
        state = torch.load(tmp_path / f"state.{r}.pt")
        for k, v in state.items():
            torch.testing.assert_close(v, ref_state[k], atol=1e-4, rtol=1e-3, msg=lambda m, k=k: f"{k}: {m}")
