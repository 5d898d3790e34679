"""``moc export``: each format written from a real checkpoint and read back by its own loader.

Ground truth is what moc's own ``CheckpointManager.restore()`` puts into a fresh model and
optimizer (restored from storage only). Models: transformers 5.x tiny random configs
(Qwen3-MoE, Mixtral, GPT-OSS with expert biases; fused ``experts.gate_up_proj`` [E, ...])
and the project's per-expert-module toy model, trained a few steps with K=1 so the
experts' saved versions differ. Every tensor is compared, so no expert can go missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from moc import CheckpointManager, CheckpointStore, MoCConfig
from moc._export.plan import plan_export
from moc.cli import main
from tests.helpers.moc_helpers import make, train_step

transformers = pytest.importorskip("transformers")

HF_CONFIGS = {
    "qwen3_moe": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16),
    "mixtral": dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=128, num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=128, num_local_experts=4, num_experts_per_tok=2, head_dim=8),
}
STEPS = 7


def hf_config(kind):
    return transformers.AutoConfig.for_model(kind, **HF_CONFIGS[kind])


def hf_model(kind, seed):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def cfg(root, shm):
    return MoCConfig(storage=str(root / "ckpt"), interval=2, k_snapshot=1, snapshot_dir=str(root / shm))


def named_opt_state(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: st for p, st in opt.state.items()}


class Checkpoint:
    """A trained run's store plus the ground truth restored from it into a fresh model."""

    def __init__(self, root, build, train):
        model, opt = build(0)
        with CheckpointManager(cfg(root, "shm"), model=model, optimizer=opt) as ckpt:
            for step in range(STEPS):
                train(model, opt, step, ckpt)
                if step == 0:
                    # Partial checkpoints start once a full one is committed: waiting for the
                    # first makes the later ones K=1 however slowly it persists.
                    ckpt.wait()
        self.root, self.build = root, build
        self.url = str(root / "ckpt")
        self.store = CheckpointStore(self.url)
        self.manifest = self.store.latest_manifest()
        fresh, fresh_opt = build(123)   # other initial weights
        restorer = CheckpointManager(cfg(root, "shm-restore"), model=fresh, optimizer=fresh_opt)
        assert restorer.restore() == STEPS
        restorer.close()
        self.model = {k: v.detach().clone() for k, v in fresh.state_dict().items()}
        self.optim = {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in st.items()}
                      for k, st in named_opt_state(fresh, fresh_opt).items()}
        self.groups = [{k: v for k, v in g.items() if k != "params"} for g in fresh_opt.param_groups]
        versions = {r.step for r in self.manifest.units.values() if r.kind == "expert"}
        assert len(versions) > 1, "K=1 over several checkpoints must leave experts at different versions"

    def assert_model(self, state, what):
        assert set(state) == set(self.model), (what, set(state) ^ set(self.model))
        for key, value in self.model.items():
            got = state[key]
            assert got.dtype == value.dtype and got.shape == value.shape, (what, key)
            assert torch.equal(got, value), (what, key)

    def assert_optim(self, state, what):
        assert set(state) == set(self.optim), what
        for key, st in self.optim.items():
            assert set(state[key]) == set(st), (what, key)
            for name, value in st.items():
                assert torch.equal(torch.as_tensor(state[key][name]), torch.as_tensor(value)), (what, key, name)


def hf_train(model, opt, step, ckpt):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, model.config.vocab_size, (4, 12), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    ckpt.step(step)


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def hf_ckpt(request, tmp_path_factory):
    kind = request.param
    ck = Checkpoint(tmp_path_factory.mktemp(kind), lambda seed: hf_model(kind, seed), hf_train)
    ck.kind = kind
    return ck


@pytest.fixture(scope="module")
def toy_ckpt(tmp_path_factory):
    task = make(0)[2]

    def build(seed):
        model, opt, _ = make(seed, optimizer="adam", num_experts=4)
        return model, opt

    def train(model, opt, step, ckpt):
        train_step(model, opt, task, step, ckpt)

    return Checkpoint(tmp_path_factory.mktemp("toy"), build, train)


def export(url, *args):
    assert main(["export", url, *args]) == 0


def fused_keys(state):
    return [k for k in state if k.endswith(("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"))]


# -- safetensors -> transformers from_pretrained -----------------------------------------------
@pytest.mark.parametrize("shard", [None, "40KB"])
def test_safetensors_loads_with_from_pretrained(hf_ckpt, tmp_path, shard):
    out = tmp_path / "hf"
    hf_config(hf_ckpt.kind).save_pretrained(tmp_path / "cfg")
    args = ["--format", "safetensors", "-o", str(out), "--hf-config", str(tmp_path / "cfg" / "config.json")]
    export(hf_ckpt.url, *args, *(["--max-shard-size", shard] if shard else []))
    files = sorted(os.listdir(out))
    if shard is None:
        assert files == ["config.json", "model.safetensors"]
    else:
        shards = [f for f in files if f.startswith("model-")]
        assert len(shards) > 1 and "model.safetensors.index.json" in files and "model.safetensors" not in files
        index = json.load(open(out / "model.safetensors.index.json"))
        assert set(index["weight_map"]) == set(hf_ckpt.model) and set(index["weight_map"].values()) == set(shards)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hf_ckpt.assert_model(model.state_dict(), "from_pretrained")
    # The files hold the model's own (fused) names: nothing renamed, every expert row present.
    from safetensors import safe_open

    keys = set()
    for f in (p for p in os.listdir(out) if p.endswith(".safetensors")):
        with safe_open(str(out / f), "pt") as st:
            keys |= set(st.keys())
            for k in st.keys():
                assert torch.equal(st.get_tensor(k), hf_ckpt.model[k]), k
    assert keys == set(hf_ckpt.model) and fused_keys(keys)


def test_safetensors_of_per_expert_modules(toy_ckpt, tmp_path):
    from safetensors.torch import load_file

    export(toy_ckpt.url, "--format", "safetensors", "-o", str(tmp_path / "st"))
    toy_ckpt.assert_model(load_file(str(tmp_path / "st" / "model.safetensors")), "safetensors")


def test_reexport_with_other_sharding_leaves_no_stale_shards(toy_ckpt, tmp_path):
    out = tmp_path / "st"
    export(toy_ckpt.url, "--format", "safetensors", "-o", str(out), "--max-shard-size", "4KB")
    assert len([f for f in os.listdir(out) if f.startswith("model-")]) > 2
    (out / "notes.txt").write_text("kept")
    export(toy_ckpt.url, "--format", "safetensors", "-o", str(out))
    assert sorted(os.listdir(out)) == ["model.safetensors", "notes.txt"]


# -- DCP -> torch.distributed.checkpoint.load ------------------------------------------------
def dcp_roundtrip(ck, out):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = ck.build(321)
    for g in opt.param_groups:
        g["lr"] = 0.5          # the checkpoint's hyper-parameters must come back too
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=str(out))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    ck.assert_model(model.state_dict(), "dcp model")
    ck.assert_optim(named_opt_state(model, opt), "dcp optimizer")
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == ck.groups


def test_dcp_restores_model_and_optimizer(hf_ckpt, tmp_path):
    export(hf_ckpt.url, "--format", "dcp", "-o", str(tmp_path / "dcp"))
    dcp_roundtrip(hf_ckpt, tmp_path / "dcp")
    # Keys as get_state_dict flattens them: optimizer state by parameter name.
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    key = fused_keys(hf_ckpt.model)[0]
    assert tuple(meta[f"model.{key}"].size) == tuple(hf_ckpt.model[key].shape)
    assert f"optimizer.state.{key}.exp_avg_sq" in meta and "optimizer.param_groups.0.lr" in meta


def test_dcp_of_per_expert_modules(toy_ckpt, tmp_path):
    export(toy_ckpt.url, "--format", "dcp", "-o", str(tmp_path / "dcp"))
    dcp_roundtrip(toy_ckpt, tmp_path / "dcp")


# -- torch.save format -> torch.load(weights_only=True) ---------------------------------------
def torch_roundtrip(ck, out):
    export(ck.url, "--format", "torch", "-o", str(out))
    for mmap in (False, True):
        state = torch.load(out, weights_only=True, mmap=mmap)
        ck.assert_model(state["model"], "torch")
        ck.assert_optim(state["optimizer"]["state"], "torch")
        assert [{k: v for k, v in g.items() if k != "params"} for g in state["optimizer"]["param_groups"]] == ck.groups
        assert state["moc"]["step"] == STEPS - 1 and state["extra"]["rank0"]["step"] == STEPS - 1
    # The full state, loaded into a fresh model and optimizer, is the checkpoint.
    model, opt = ck.build(7)
    model.load_state_dict(state["model"])
    names = [n for n, _ in model.named_parameters()]
    osd = {"state": {i: state["optimizer"]["state"][n] for i, n in enumerate(names)
                     if n in state["optimizer"]["state"]},
           "param_groups": [{**g, "params": [names.index(n) for n in g["params"]]}
                            for g in state["optimizer"]["param_groups"]]}
    opt.load_state_dict(osd)
    ck.assert_optim(named_opt_state(model, opt), "torch -> load_state_dict")


def test_torch_format_loads_weights_only(hf_ckpt, tmp_path):
    torch_roundtrip(hf_ckpt, tmp_path / "full.pt")


def test_torch_format_of_per_expert_modules(toy_ckpt, tmp_path):
    torch_roundtrip(toy_ckpt, tmp_path / "full.pt")


def test_library_export_matches_the_file(toy_ckpt, tmp_path):
    state = CheckpointStore(toy_ckpt.url).export()
    toy_ckpt.assert_model(state["model"], "CheckpointStore.export")
    toy_ckpt.assert_optim(state["optimizer"]["state"], "CheckpointStore.export")


# -- pieces: DTensor shards and fused rows written by several ranks -----------------------------
def test_sharded_pieces_are_reassembled(tmp_path):
    """Units as FSDP2 x EP ranks write them: a module's rows split over two ranks (``#p``
    pieces) and a fused expert tensor whose rows are further split on dim 1; each rank's
    extra unit names only its own parameters."""
    torch.manual_seed(0)
    emb = torch.randn(6, 4)
    fused = torch.randn(4, 6, 3)          # [E, F, D]
    state = {"emb": {"exp_avg": torch.randn(6, 4), "step": torch.tensor(5.0)},
             "experts.w": {"exp_avg": torch.randn(4, 6, 3)}}
    units = {}
    for r, rows in enumerate((slice(0, 4), slice(4, 6))):
        place = {"shape": [6, 4], "offset": [rows.start, 0], "expert_dim": None}
        units[f"module/#p{r}"] = ({"model": {"emb": emb[rows].clone()}, "place": {"emb": place},
                                   "optimizer": {"state": {"emb": {"exp_avg": state["emb"]["exp_avg"][rows].clone(),
                                                                   "step": torch.tensor(5.0)}}}},
                                  {"kind": "module"})
        for e in range(4):
            cols = slice(3 * r, 3 * r + 3)
            p = {"shape": [4, 6, 3], "offset": [e, cols.start, 0], "expert_dim": 0}
            units[f"expert/L/{e}#p{r}"] = (
                {"model": {"experts.w": fused[e, cols].clone()}, "place": {"experts.w": p},
                 "optimizer": {"state": {"experts.w": {"exp_avg": state["experts.w"]["exp_avg"][e, cols].clone(),
                                                       "step": torch.tensor(float(e))}}}},
                {"kind": "expert", "layer": "L", "expert": e})
        units[f"extra/rank{r}"] = ({"extra": {"step": 9, "optimizer_groups": [
            {"lr": 0.1, "params": ["emb"] if r == 0 else ["experts.w", "emb"]}]}}, {"kind": "extra"})
    cs = CheckpointStore(str(tmp_path / "s"))
    cs.save(9, units)
    out = cs.export()
    assert torch.equal(out["model"]["emb"], emb) and torch.equal(out["model"]["experts.w"], fused)
    assert torch.equal(out["optimizer"]["state"]["emb"]["exp_avg"], state["emb"]["exp_avg"])
    assert torch.equal(out["optimizer"]["state"]["experts.w"]["exp_avg"], state["experts.w"]["exp_avg"])
    assert out["optimizer"]["state"]["experts.w"]["step"].item() == 3.0   # the newest expert's
    assert out["optimizer"]["param_groups"] == [{"lr": 0.1, "params": ["emb", "experts.w"]}]
    assert set(out["extra"]) == {"rank0", "rank1"}
    # moc's own restore of the same units agrees.
    from moc._units.capture import apply_units

    live = torch.nn.Module()
    live.emb = torch.nn.Parameter(torch.zeros(6, 4))
    live.experts = torch.nn.Module()
    live.experts.w = torch.nn.Parameter(torch.zeros(4, 6, 3))
    trees = [t for n, (t, _) in units.items() if not n.startswith("extra")]
    assert apply_units(live, None, trees, None) == []
    assert torch.equal(live.emb, out["model"]["emb"]) and torch.equal(live.experts.w, out["model"]["experts.w"])


def test_a_missing_piece_is_an_error_not_a_hole(hf_ckpt, tmp_path):
    manifest = hf_ckpt.store.latest_manifest()
    victim = sorted(n for n in manifest.units if n.startswith("expert/"))[1]
    del manifest.units[victim]
    with pytest.raises(ValueError, match=r"cover .* elements|no saved version of experts"):
        plan_export(manifest)
    manifest.meta.pop("layout", None)     # without the layout record: still caught by coverage
    with pytest.raises(ValueError, match=r"pieces cover \d+ of its \d+ elements"):
        plan_export(manifest)


def test_streaming_groups_hold_one_layer_at_most(hf_ckpt):
    """Each group is one unit, or the experts of one MoE layer (read together to rebuild
    its fused tensors), never more: what bounds the export's memory."""
    plan = plan_export(hf_ckpt.manifest)
    for g in plan.groups:
        layers = {n.split("/")[1] for n in g.units if n.startswith("expert/")}
        assert len(g.units) == 1 or (len(layers) == 1 and all(n.startswith("expert/") for n in g.units)), g.units
    assert sum(len(g.units) for g in plan.groups) == len([n for n in hf_ckpt.manifest.units
                                                          if not n.startswith("extra")])


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("args,fragment", [
    (["--format", "onnx", "-o", "{out}"], "invalid choice: 'onnx'"),
    (["--format", "dcp"], "required: -o/--output"),
    (["--format", "safetensors", "-o", "{out}", "--max-shard-size", "5XB"], "is not a size"),
    (["--format", "safetensors", "-o", "{out}", "--max-shard-size", "0"], "must be > 0"),
    (["--format", "dcp", "-o", "{out}", "--hf-config", "{out}"], "--hf-config applies to --format safetensors"),
    (["--format", "safetensors", "-o", "{out}", "--hf-config", "/no/such/config.json"], "no such file"),
    (["--format", "torch", "-o", "/no/such/dir/x.pt"], "does not exist"),
])
def test_bad_input_is_one_line_exit_2(toy_ckpt, tmp_path, capsys, args, fragment):
    args = [a.format(out=tmp_path / "out") for a in args]
    try:
        code = main(["export", toy_ckpt.url, *args])
    except SystemExit as exc:   # argparse
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and fragment in err[0], err
    assert "Traceback" not in err[0]


def test_cli_process_exit_code_and_summary(toy_ckpt, tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "moc.cli", "export", toy_ckpt.url, *args],
                              capture_output=True, text=True, timeout=120)

    bad = run("--format", "safetensors", "-o", str(tmp_path / "o"), "--max-shard-size", "lots")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    ok = run("--format", "safetensors", "-o", str(tmp_path / "o"))
    assert ok.returncode == 0, ok.stderr
    assert f"exported step {STEPS - 1}" in ok.stdout and "safetensors" in ok.stdout
    assert ok.stderr == ""   # no progress bar when stderr is not a terminal


# -- memory: streaming, not the model ---------------------------------------------------------
MEMORY_PROBE = r"""
import resource, sys, torch
import moc._export.plan as ex
from moc import CheckpointStore
from moc._export.formats import export
import moc._export.formats as fm
ex.READ_AHEAD_BYTES = 4 << 20
fm.DCP_FILE_BYTES = 8 << 20
cs = CheckpointStore(sys.argv[1])
ex.plan_export(cs.latest_manifest())
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base = peak()
for fmt, out in (("safetensors", "st"), ("torch", "x.pt"), ("dcp", "dcp")):
    export(cs, fmt, sys.argv[2] + "/" + out)
    print(fmt, peak() - base, flush=True)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB is Linux's")
def test_export_memory_stays_near_one_unit(tmp_path):
    """96 MB of weights in 24 units: each format's export peaks far below the model
    (the peak is a high-water mark: each line is the largest of the exports so far)."""
    cs = CheckpointStore(str(tmp_path / "s"))
    units = {f"module/m{i}": ({"model": {f"m{i}.weight": torch.full((512, 2048), float(i))}}, {"kind": "module"})
             for i in range(24)}
    cs.save(0, units)
    del units
    model_bytes = 24 * 512 * 2048 * 4
    out = tmp_path / "out"
    out.mkdir()
    res = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path / "s"), str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    grown = {line.split()[0]: int(line.split()[1]) for line in res.stdout.splitlines()}
    assert set(grown) == {"safetensors", "dcp", "torch"}
    print("peak growth over the baseline", grown, "model", model_bytes)
    assert all(v < model_bytes // 2 for v in grown.values()), (grown, model_bytes)
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(out / "st" / "model.safetensors"))["m23.weight"], torch.full((512, 2048), 23.0))


def test_every_dtype_round_trips(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(4, generator=g).bfloat16(),
               "f16": torch.randn(2, 2, generator=g).half(), "f64": torch.randn(3, generator=g).double(),
               "i64": torch.arange(6).view(2, 3), "i8": torch.arange(-3, 3, dtype=torch.int8),
               "u8": torch.arange(7, dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    for name in ("float8_e4m3fn", "uint16"):
        if hasattr(torch, name):
            tensors[name] = torch.arange(4).to(getattr(torch, name))
    cs = CheckpointStore(str(tmp_path / "s"))
    cs.save(3, {"module/m": ({"model": tensors}, {"kind": "module"})})

    def raw(t):   # bytes: float8 has no torch.equal
        return t.reshape(-1).view(torch.uint8)

    def same(got, what):
        assert set(got) == set(tensors), what
        for k, v in tensors.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, (what, k)
            assert torch.equal(raw(got[k]), raw(v)), (what, k)

    export(str(tmp_path / "s"), "-o", str(tmp_path / "x.pt"))
    same(torch.load(tmp_path / "x.pt", weights_only=True)["model"], "torch")
    export(str(tmp_path / "s"), "--format", "safetensors", "-o", str(tmp_path / "st"))
    same(load_file(str(tmp_path / "st" / "model.safetensors")), "safetensors")
    export(str(tmp_path / "s"), "--format", "dcp", "-o", str(tmp_path / "dcp"))
    target = {"model": {k: torch.empty_like(v) for k, v in tensors.items()}}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"))
    same(target["model"], "dcp")
