"""Every MoE architecture of the installed transformers (tests/hf_zoo.py enumerates them
from the package), tiny and random: moc checkpoints it, a real process is SIGKILLed,
another restores it, and the test compares with the ground truth it dumped; and
``make_elastic`` computes what the original computes.

An architecture not in the tables below must pass everything; one in them must fail the
way its entry says (a ``ValueError`` naming what is missing), so an architecture that a
new transformers adds, or that starts to work, shows up as a failing test with its name.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import hf_zoo as zoo
from moc import discover_units

transformers = pytest.importorskip("transformers")
WORKER = os.path.join(os.path.dirname(__file__), "mp_zoo_worker.py")
STEPS = 5
ARCHS = zoo.architectures()

# Architectures moc refuses, with the clear error it gives (a ValueError naming the module):
# none today (DBRX, JetMoE, LongCat-Flash and Doge have layouts of their own).
MOC_REFUSED: dict[str, str] = {}
# Tiny configs this zoo cannot build yet (the architecture's own validators or shapes).
NOT_BUILT = {
    "glm5_next_text": r"NoPE",
    "hy_v4_vl_text": r"mrope_section",
    "mimo_v2_flash": r"must match the size",
}
# make_elastic refusals / the reason (a ValueError naming what is missing).
ELASTIC_REFUSED = {
    "dbrx": r"no transformers MoE block", "doge": r"no transformers MoE block",
    "jetmoe": r"no transformers MoE block", "longcat_flash": r"no transformers MoE block",
    "gemma4_text": r"no transformers MoE block",
    "switch_transformers": r"no transformers MoE block", "nllb-moe": r"no transformers MoE block",
    "muse_spark_text": r"post-expert norm",
    "llama4_text": r"one dense, pre-scaled input",
    "openai_privacy_filter": r"OpenAIPrivacyFilter",
}
# Architectures whose PLT the zoo does not check: none.
PLT_DIFFERS: set[str] = set()


def test_the_zoo_comes_from_the_installed_package():
    assert len(ARCHS) >= 40
    for known in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "switch_transformers", "llama4_text"):
        assert known in ARCHS
    stale = (set(MOC_REFUSED) | set(NOT_BUILT) | set(ELASTIC_REFUSED) | PLT_DIFFERS) - set(ARCHS)
    assert not stale, f"tables name architectures transformers {transformers.__version__} no longer has: {stale}"


# -- moc: train, SIGKILL, restore in a new process -----------------------------------------
def _moc_archs() -> list[str]:
    return [a for a in ARCHS if a not in MOC_REFUSED and a not in NOT_BUILT]


def _run(mode: str, root, archs: list[str], timeout: int) -> list[int]:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(WORKER)), os.environ.get("PYTHONPATH", "")]))
    halves = [archs[0::2], archs[1::2]]      # two processes: the machine's cores
    procs = [subprocess.Popen([sys.executable, WORKER, mode, "--dir", str(root), "--steps", str(STEPS), *part],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for part in halves if part]
    codes = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        codes.append(p.returncode)
        if p.returncode not in (0, -9):
            print(out.decode()[-4000:])
    return codes


@pytest.fixture(scope="module")
def zoo_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    archs = _moc_archs()
    codes = _run("train", root, archs, 600)
    assert codes == [-9] * len(codes), f"the training processes should die by SIGKILL, got {codes}"
    codes = _run("restore", root, archs, 600)
    assert codes == [0] * len(codes)
    return root


def _expert_layers(model) -> dict[str, int]:
    return {l: n for l, n in discover_units(model).experts_per_layer.items()}


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in NOT_BUILT])
def test_moc_restores_every_architecture(zoo_runs, arch):
    if arch in MOC_REFUSED:
        from moc import CheckpointManager, MoCConfig

        model = zoo.build(arch)
        with pytest.raises(ValueError, match=MOC_REFUSED[arch]):
            CheckpointManager(MoCConfig(storage=str(zoo_runs / f"{arch}-refused")), model=model)
        return
    d = zoo_runs / arch
    for mode in ("train", "restore"):
        err = d / f"{mode}-error.txt"
        assert not err.exists(), f"{arch} {mode} failed:\n{err.read_text()[-3000:]}"
    info = json.loads((d / "restored.json").read_text())
    gt = {s: torch.load(d / f"gt-{s}.pt", weights_only=True) for s in range(STEPS)}
    restored = torch.load(d / "restored.pt", weights_only=True)
    S = info["start"] - 1
    assert S == STEPS - 1, f"restored step {S}, expected the newest snapshot {STEPS - 1}"
    layout = discover_units(zoo.build(arch))
    versions: dict[tuple[str, int], int] = {}
    for name, (version, _) in info["sources"].items():
        if name.startswith("expert/"):
            layer, e = name.split("#")[0][len("expert/"):].rsplit("/", 1)
            versions[(layer, int(e))] = version
    assert set(versions) == {(l, e) for l, ids in layout.layers.items() for e in ids}
    assert any(v < S for v in versions.values()), "K = 1 leaves experts at older versions"
    where: dict[str, list] = {}
    for u in layout.units.values():
        for ref in u.refs:
            where.setdefault(ref.key, []).append((u, ref))

    def expect(key, pick):
        out = pick(gt[S]).clone()
        for u, ref in where.get(key, []):
            if u.kind == "expert":
                src = pick(gt[versions[(u.layer, u.expert)]])
                if ref.span is not None:          # rows of a flattened tensor (DBRX)
                    out.narrow(*ref.span).copy_(src.narrow(*ref.span))
                elif ref.expert_dim is None:
                    out = src.clone()
                else:
                    out.select(ref.expert_dim, ref.row).copy_(src.select(ref.expert_dim, ref.row))
        return out

    for key, value in restored["model"].items():
        assert torch.equal(value, expect(key, lambda g: g["model"][key])), f"{arch}: {key} differs"
    assert set(restored["opt"]) == set(gt[S]["opt"])
    for key, st in restored["opt"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[name], expect(key, lambda g: g["opt"][key][name])), f"{arch}: {key}.{name}"

    # PLT per layer: slots the stale experts' own calls received since their versions.
    cum = {s: gt[s]["cum"] for s in gt}
    assert set(info["plt_per_layer"]) == set(layout.layers)
    if arch in PLT_DIFFERS:
        return
    for layer in layout.layers:
        assert layer in cum[S], f"{arch}: the test found no experts module for {layer}"
        routed = int(cum[S][layer].sum())
        assert routed > 0
        lost = sum(int(cum[S][layer][e] - cum[v][layer][e]) for (l, e), v in versions.items() if l == layer)
        assert info["plt_per_layer"][layer] == pytest.approx(lost / routed, rel=1e-12, abs=1e-15), \
            f"{arch}: PLT of {layer}"
    assert any(v > 0 for v in info["plt_per_layer"].values()), f"{arch}: no token counted as lost"


# -- make_elastic --------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in NOT_BUILT])
def test_make_elastic_equals_the_original(arch):
    from lazarus.adapters.hf import make_elastic
    from lazarus.moe import sync_moe_gradients

    ref = zoo.build(arch, seed=3)
    ref.train()
    if arch in ELASTIC_REFUSED:
        with pytest.raises(ValueError, match=ELASTIC_REFUSED[arch]):
            make_elastic(copy.deepcopy(ref))
        return
    ad = make_elastic(copy.deepcopy(ref))
    inputs = zoo.batch(arch, 0)
    for m in (ref, ad):
        m.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    l_ref = zoo.loss_of(ref, inputs)
    torch.manual_seed(5)
    l_ad = zoo.loss_of(ad, inputs)
    torch.testing.assert_close(l_ad, l_ref, rtol=1e-5, atol=1e-6)
    l_ref.backward()
    l_ad.backward()
    sync_moe_gradients(ad)
    g_ad = {n: p.grad for n, p in ad.named_parameters()}
    for n, p in ref.named_parameters():
        if p.grad is None:
            assert g_ad.get(n) is None or not g_ad[n].any(), n
        else:
            torch.testing.assert_close(g_ad[n], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{arch} {n}: {m}")
    sd = ad.state_dict()
    assert list(sd) == list(ref.state_dict())
    back = zoo.build(arch, seed=9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back.load_state_dict(sd, strict=True)
    for k, v in back.state_dict().items():
        assert torch.equal(v, sd[k]), k


@pytest.mark.parametrize("arch", sorted(NOT_BUILT))
def test_architectures_the_zoo_cannot_build_yet(arch):
    """Listed so they are not forgotten: when one starts to build, move it to the tests."""
    with pytest.raises(Exception, match=NOT_BUILT[arch]):
        model = zoo.build(arch)
        model.train()
        zoo.loss_of(model, zoo.batch(arch, 0)).backward()


def test_readme_lists_what_the_zoo_checks():
    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "layouts.md")).read()
    table = readme.split("<!-- zoo:begin -->", 1)[1].split("<!-- zoo:end -->", 1)[0]
    rows = {line.split("|")[1].strip(): set(re.findall(r"`([\w.-]+)`", line.split("|")[2]))
            for line in table.strip().splitlines()[2:]}
    assert rows["moc refuses (`ValueError` naming the module)"] == set(MOC_REFUSED)
    assert rows["`make_elastic` refuses (`ValueError` with the reason)"] == set(ELASTIC_REFUSED)
    built = [a for a in ARCHS if a not in NOT_BUILT]
    both = len([a for a in built if a not in MOC_REFUSED and a not in ELASTIC_REFUSED])
    assert f"({both} of the {len(built)} built;" in table
    assert transformers.__version__.rsplit(".", 1)[0] in table
