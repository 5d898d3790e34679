"""moc on the layouts people train: transformers 5.x fused experts (Mixtral, Qwen3-MoE,
OLMoE, DeepSeek-V3, GPT-OSS), torchtitan GroupedExperts, Megatron names; a real process
SIGKILLed mid-run, restored in a new one, compared with the ground truth it dumped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import layout_models as lm
from moc import CheckpointManager, CheckpointStore, ExpertLayout, MoCConfig, discover_units
from storage_backends import open_store

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WORKER = os.path.join(ROOT, "tests", "helpers", "workers", "mp_layout_worker.py")
EXPECTED_KIND = {"mixtral": "hf_fused", "qwen3_moe": "hf_fused", "olmoe": "hf_fused", "deepseek_v3": "hf_fused",
                 "gpt_oss": "hf_fused", "torchtitan": "torchtitan", "megatron": "megatron_sequential"}


# -- discovery ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", lm.KINDS)
def test_auto_layout_finds_every_expert(kind):
    model = lm.build(kind)
    layout = discover_units(model)
    assert set(layout.kinds.values()) == {EXPECTED_KIND[kind]}
    assert all(n == lm.EXPERTS for n in layout.experts_per_layer.values())
    assert all(ids == list(range(lm.EXPERTS)) for ids in layout.layers.values())
    state = model.state_dict()
    expert_keys = {k for u in layout.units.values() if u.kind == "expert" for k in u.keys}
    # Every expert tensor belongs to the experts, nothing else does.
    assert expert_keys == {k for k in state if re.search(r"\.experts\.", k)}
    if kind == "deepseek_v3":
        assert "model.layers.0.mlp" not in layout.layers            # the dense first layer
        assert any(u.kind == "module" and "shared_experts" in u.name for u in layout.units.values())
    # Unit bytes: a fused expert unit holds 1/E of each fused tensor.
    total_expert = sum(v.numel() * v.element_size() for k, v in state.items() if k in expert_keys)
    assert sum(u.nbytes for u in layout.units.values() if u.kind == "expert") == total_expert


def test_unknown_layout_gets_a_clear_error():
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"matched no parameter.*ExpertLayout"):
        discover_units(dense)
    with pytest.raises(ValueError, match="expert_layout must be one of"):
        MoCConfig(storage="memory://x", expert_layout="deepspeed")


def test_explicit_fused_layout_and_bad_layouts():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe_bank = torch.nn.Parameter(torch.randn(6, 3, 5))   # experts on dim 1
            self.proj = torch.nn.Linear(5, 5)

    model = Odd()
    layout = discover_units(model, layout=ExpertLayout(r"(?P<layer>moe)_bank", expert_dim=1))
    assert layout.layers == {"moe": [0, 1, 2]}
    unit = layout.expert_unit("moe", 2)
    assert unit.refs[0].expert_dim == 1 and unit.refs[0].row == 2
    with pytest.raises(ValueError, match="named group 'layer'"):
        ExpertLayout(r"x(?P<expert>\d+)")
    with pytest.raises(ValueError, match="expert_dim"):
        ExpertLayout(r"(?P<layer>a)(?P<expert>\d)", expert_dim=0)


def test_other_tensor_subclass_is_refused_by_name():
    class Weird(torch.Tensor):
        pass

    model = lm.build("torchtitan")
    model.head.weight = torch.nn.Parameter(model.head.weight.detach().as_subclass(Weird))
    with pytest.raises(ValueError, match=r"'head.weight' is a .*Weird"):
        discover_units(model)


def test_explicit_fused_layout_round_trip(tmp_path):
    """A fused layout on a non-zero expert dim, saved partially and restored."""
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe_bank = torch.nn.Parameter(torch.randn(3, 4, 5))
            self.proj = torch.nn.Linear(4, 5)

        def forward(self, x):
            return self.proj(torch.einsum("bd,ked->be", x, self.moe_bank))

    layout = ExpertLayout(r"(?P<layer>moe)_bank", expert_dim=1)
    torch.manual_seed(0)
    model = Odd()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    cfg = MoCConfig(storage=str(tmp_path / "s"), snapshot_dir=str(tmp_path / "shm"), interval=1, k_snapshot=4,
                    expert_layout=layout)
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        for step in range(3):
            model(torch.randn(2, 5)).sum().backward()
            opt.step()
            opt.zero_grad()
            ckpt.step(step)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_avg = opt.state[model.moe_bank]["exp_avg"].clone()
    torch.manual_seed(1)
    fresh = Odd()
    opt2 = torch.optim.Adam(fresh.parameters(), lr=0.1)
    with CheckpointManager(cfg, model=fresh, optimizer=opt2) as ckpt:
        assert ckpt.restore() == 3
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert torch.equal(opt2.state[fresh.moe_bank]["exp_avg"], saved_avg)


# -- routing counted from the model's own routers ----------------------------------------
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_router_counts_survive_activation_recompute(tmp_path, reentrant):
    """Gradient checkpointing runs each router forward again during backward: the manager
    must count the step's tokens once, as without it."""
    torch.manual_seed(0)
    model = lm.build("qwen3_moe")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)   # weights stay put: same routing twice
    ids = torch.randint(3, lm.VOCAB, (2, 9))
    cfg = MoCConfig(storage=str(tmp_path / "s"), snapshot_dir=str(tmp_path / "shm"), interval=1000)
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        model.train()
        lm.loss_of(model, ids).backward()
        ckpt._sync_routing()
        plain = {l: list(v) for l, v in ckpt.plt_tracker.cum.items()}
        assert sum(plain[next(iter(plain))]) == ids.numel() * model.config.num_experts_per_tok
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        lm.loss_of(model, ids).backward()
        ckpt._sync_routing()
        twice = {l: list(v) for l, v in ckpt.plt_tracker.cum.items()}
    assert twice == {l: [2 * c for c in v] for l, v in plain.items()}


# -- SIGKILL mid-run, restore in a new process -------------------------------------------
def _run(args: list[str], world: int = 1, timeout: int = 240) -> list[int]:
    from tests.conftest import free_port

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT,
                                                       os.environ.get("PYTHONPATH", "")]),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, WORKER, *args], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    codes = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        codes.append(p.returncode)
        if p.returncode not in (0, -9):
            print(out.decode()[-4000:])
    return codes


def _train_and_restore(tmp_path, kind: str, *, shard: str = "none", world: int = 1, restore_shard: str | None = None,
                       restore_world: int | None = None, kill_at: int = 6, k: int = 1) -> dict:
    store, shm, dump = tmp_path / "store", tmp_path / "shm", tmp_path / "dump"
    dump.mkdir()
    common = ["--kind", kind, "--store", str(store), "--dump", str(dump), "--k", str(k)]
    codes = _run(["train", *common, "--shm", str(shm), "--steps", "12", "--kill-at", str(kill_at),
                  "--shard", shard], world)
    assert codes == [-9] * world, f"the training processes should die by SIGKILL, got {codes}"
    # A different world size restores on other nodes' memory: give it its own folder.
    rshm = shm if (restore_world or world) == world else tmp_path / "shm2"
    codes = _run(["restore", *common, "--shm", str(rshm), "--shard", restore_shard or shard],
                 restore_world or world)
    assert codes == [0] * (restore_world or world)
    info = json.loads((dump / "restored.json").read_text())
    gt = {int(p.name[3:-3]): torch.load(p, weights_only=True) for p in dump.glob("gt-*.pt")}
    return {"info": info, "gt": gt, "restored": torch.load(dump / "restored.pt", weights_only=True),
            "store": str(store), "dump": dump}


def _versions(info: dict) -> dict[tuple[str, int], int]:
    out = {}
    for name, (version, _) in info["sources"].items():
        if name.startswith("expert/"):
            layer, e = name.split("#")[0][len("expert/"):].rsplit("/", 1)
            v = out.setdefault((layer, int(e)), version)
            assert v == version, f"pieces of {name} restored from different versions"
    return out


def _check_against_ground_truth(kind: str, run: dict, *, exact_dense: bool = True) -> None:
    info, gt, restored = run["info"], run["gt"], run["restored"]
    S = info["start"] - 1
    assert S in gt and S >= 2
    layout = discover_units(lm.build(kind))
    versions = _versions(info)
    assert set(versions) == {(l, e) for l, ids in layout.layers.items() for e in ids}
    assert all(0 <= v <= S for v in versions.values())
    assert any(v < S for v in versions.values()), "K=1 must leave some experts at older versions"
    where: dict[str, list] = {}
    for u in layout.units.values():
        for ref in u.refs:
            where.setdefault(ref.key, []).append((u, ref))

    def expect(key: str, pick) -> torch.Tensor:
        out = pick(gt[S]).clone()
        for u, ref in where.get(key, []):
            if u.kind != "expert":
                continue
            src = pick(gt[versions[(u.layer, u.expert)]])
            if ref.expert_dim is None:
                out = src.clone()
            else:
                out.select(ref.expert_dim, ref.row).copy_(src.select(ref.expert_dim, ref.row))
        return out

    for key, value in restored["model"].items():
        want = expect(key, lambda d: d["model"][key])
        assert torch.equal(value, want), f"{key}: restored weights differ from the saved version"
    assert set(restored["opt"]) == set(gt[S]["opt"])
    for key, st in restored["opt"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            want = expect(key, lambda d: d["opt"][key][name])
            assert torch.equal(st[name], want), f"{key}.{name}: restored Adam state differs"

    # PLT from the routing the test captured itself: tokens each expert saw after its version.
    layers = sorted(layout.layers)
    tokens = sum(int(gt[t]["routing"][layers[0]].sum()) for t in range(S + 1))
    lost = []
    for layer in layers:
        lost.append(sum(int(gt[t]["routing"][layer][e]) for (l, e), v in versions.items() if l == layer
                        for t in range(v + 1, S + 1)))
    expected = sum(x / tokens for x in lost) / len(layers)
    assert expected > 0
    assert info["plt"] == pytest.approx(expected, rel=1e-9, abs=1e-12)

    # Bytes of every partial checkpoint = the PEC formula (fp32 weights, Adam: 2 x fp32).
    model = lm.build(kind)
    params = dict(model.named_parameters())
    expert_keys = {k for u in layout.units.values() if u.kind == "expert" for k in u.keys}
    p_e = sum(p.numel() for k, p in params.items() if k in expert_keys)
    p_ne = sum(p.numel() for k, p in params.items() if k not in expert_keys)
    buffers = sum(v.numel() * 4 for k, v in model.state_dict().items() if k not in params)
    cs = CheckpointStore(open_store(run["store"]))
    checked = 0
    for step in cs.steps():
        if step == 0 or step > S:
            continue
        m = cs.read_manifest(step)
        written = sum(t["nbytes"] for r in m.units.values() if r.step == step and r.kind != "extra"
                      for t in r.tensors if t["shape"])
        k = m.meta["k_persist"]
        assert written == (p_ne + p_e * k // lm.EXPERTS) * (4 + 8) + buffers, f"step {step}"
        assert m.meta["layout"]["kind"] == EXPECTED_KIND[kind]
        checked += 1
    assert checked >= 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", lm.KINDS)
def test_sigkill_mid_run_restores_every_layout(tmp_path, kind):
    run = _train_and_restore(tmp_path, kind)
    _check_against_ground_truth(kind, run)
    assert json.loads((run["dump"] / "continued.json").read_text())["loss"] > 0


@pytest.mark.timeout(300)
def test_snapshot_failures_raise_instead_of_exiting_quietly(tmp_path):
    """A job whose snapshots keep failing stops with CheckpointError carrying the cause."""
    from moc import CheckpointError

    model = lm.build("qwen3_moe")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = MoCConfig(storage=str(tmp_path / "s"), snapshot_dir=str(tmp_path / "shm"), interval=1,
                    max_consecutive_failures=2)
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    ckpt.step(0)
    ckpt.wait()
    boom = OSError("disk of the snapshot buffers is gone")

    def failing_fill(*a, **kw):
        raise boom

    ckpt.engine._fill = failing_fill
    with pytest.raises(CheckpointError, match="2 snapshots in a row failed") as err:
        for step in range(1, 10):
            ids = torch.randint(3, lm.VOCAB, (2, 9))
            lm.loss_of(model, ids).backward()
            opt.step()
            opt.zero_grad()
            ckpt.step(step)
    assert err.value.__cause__ is boom
    assert step == 3
    status = ckpt.status()
    assert status["snapshot_failures"] == 2 and "disk of the snapshot buffers" in status["last_error"]
    ckpt.close(raise_errors=False)

    # Leaving the block after a failed last snapshot raises too.
    model2 = lm.build("qwen3_moe")
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match="snapshot"):
        with CheckpointManager(MoCConfig(storage=str(tmp_path / "s2"), snapshot_dir=str(tmp_path / "shm2"),
                                         interval=1), model=model2, optimizer=opt2) as ckpt2:
            ckpt2.step(0)
            ckpt2.wait()
            ckpt2.engine._fill = failing_fill
            ckpt2.step(1)


# -- DTensor: FSDP2, expert parallel, both; restore onto other shardings -----------------
@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind,shard,world,restore_shard,restore_world", [
    ("qwen3_moe", "fsdp", 2, "fsdp", 2),          # same sharding: memory snapshots
    ("qwen3_moe", "fsdp", 2, "none", 1),          # FSDP2 -> one plain process
    ("mixtral", "none", 1, "fsdp", 2),            # plain -> FSDP2
    ("torchtitan", "fsdp", 4, "fsdp", 2),         # FSDP 4 -> 2
    ("torchtitan", "ep", 2, "none", 1),           # EP Shard(0) -> plain
    ("torchtitan", "fsdp_ep", 4, "ep", 2),        # FSDP x EP (2 x 2) -> EP 2
], ids=["fsdp2-2to2", "fsdp2-2to1", "plain-1to2", "fsdp2-4to2", "ep-2to1", "fsdpxep-4to2ep"])
def test_sharded_jobs_save_local_shards_and_reshard_on_restore(tmp_path, kind, shard, world, restore_shard,
                                                               restore_world):
    run = _train_and_restore(tmp_path, kind, shard=shard, world=world, restore_shard=restore_shard,
                             restore_world=restore_world)
    _check_against_ground_truth(kind, run)
    names = run["info"]["sources"]
    if shard in ("fsdp", "fsdp_ep"):
        # Each rank wrote its own shard: module units come in pieces, and no piece is the
        # whole module (nothing was gathered).
        assert any("#p" in n for n in names if n.startswith("module/"))
    if shard == "fsdp" and restore_shard == shard and restore_world == world:
        assert any(level == "snapshot" for _, level in names.values()), "same sharding restores from memory"
    cs = CheckpointStore(open_store(run["store"]))
    m = cs.read_manifest(cs.steps()[-1])
    # data/<step>/g<gen>.<writer>.<nonce>.<group>.bin (moc._store.format)
    writers = {c.key.rsplit("/", 1)[-1].split(".")[1] for r in m.units.values() for c in r.chunks}
    assert writers == {f"r{r}" for r in range(world)}, "every rank writes what it holds"


def test_torchtitan_0_3_routed_experts_names_are_found():
    """torchtitan 0.3.0 names its GroupedExperts ``<layer>.moe.routed_experts.inner_experts.w1_EFD``
    (DeepSeek-V3 / Qwen3 debug models); the router is ``<layer>.moe.router``."""
    class Grouped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1_EFD = torch.nn.Parameter(torch.randn(4, 6, 8))
            self.w2_EDF = torch.nn.Parameter(torch.randn(4, 8, 6))
            self.w3_EFD = torch.nn.Parameter(torch.randn(4, 6, 8))

    class Routed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner_experts = Grouped()

    class MoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(8, 4, bias=False)
            self.routed_experts = Routed()
            self.shared_experts = torch.nn.Linear(8, 8)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = MoE()

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"1": Block(), "2": Block()})
    layout = discover_units(model)
    assert layout.layers == {"layers.1.moe": [0, 1, 2, 3], "layers.2.moe": [0, 1, 2, 3]}
    unit = layout.expert_unit("layers.2.moe", 3)
    assert sorted(r.key for r in unit.refs) == [f"layers.2.moe.routed_experts.inner_experts.{w}"
                                                 for w in ("w1_EFD", "w2_EDF", "w3_EFD")]
    assert all(r.row == 3 for r in unit.refs)
