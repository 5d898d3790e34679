"""Every MoE architecture of the installed transformers (tests/helpers/hf_zoo.py enumerates them
from the package), tiny and random: moc checkpoints it, a real process is SIGKILLed,
another restores it, and the test compares with the ground truth it dumped; and
``make_elastic`` computes what the original computes.

An architecture not in the tables below must pass everything; one in them must fail the
way its entry says (a ``ValueError`` naming what is missing), so an architecture that a
new transformers adds, or that starts to work, shows up as a failing test with its name.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from tests.helpers import hf_zoo as zoo
from moc import discover_units

transformers = pytest.importorskip("transformers")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WORKER = os.path.join(ROOT, "tests", "helpers", "workers", "mp_zoo_worker.py")
STEPS = 4      # step 0 full, then 3 partial checkpoints of K = 1: some experts stay at 0
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
# make_elastic refusals: (what the ValueError says, the reason in docs/layouts.md's table).
# DBRX, JetMoE, Llama 4, LongCat-Flash, Switch Transformers and NLLB-MoE have layouts of their own
# (lazarus/adapters/hf/_layouts.py): make_elastic refused them before.
ELASTIC_REFUSED = {
    "doge": (r"product-key retrieval experts", "product-key experts computed inline: no experts module to dispatch to"),
    "muse_spark_text": (r"post-expert norm", "a post-expert norm inside the experts"),
    "openai_privacy_filter": (r"OpenAIPrivacyFilter", "the block's `num_experts` is not its experts' count"),
}
# Dropout drawn per expert call in the original's expert order (NLLB-MoE runs expert 0 on
# every zero-weight slot too): its random draws cannot match; compared without dropout.
NO_DROPOUT = {"nllb-moe"}
# Architectures whose PLT the zoo does not check: none.
PLT_DIFFERS: set[str] = set()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread (no spinning workers on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_zoo_comes_from_the_installed_package():
    assert len(ARCHS) >= 40
    for known in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "switch_transformers", "llama4_text"):
        assert known in ARCHS
    stale = (set(MOC_REFUSED) | set(NOT_BUILT) | set(ELASTIC_REFUSED) | PLT_DIFFERS) - set(ARCHS)
    assert not stale, f"tables name architectures transformers {transformers.__version__} no longer has: {stale}"


# -- moc: train, SIGKILL, restore in a new process -----------------------------------------
def _moc_archs() -> list[str]:
    return [a for a in ARCHS if a not in MOC_REFUSED and a not in NOT_BUILT]


def _part(root, archs: list[str]) -> tuple[int, int, str]:
    """Train ``archs`` in one process (it SIGKILLs itself), then restore them in a new one."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    codes, outs = [], []
    for mode in ("train", "restore"):
        p = subprocess.run([sys.executable, WORKER, mode, "--dir", str(root), "--steps", str(STEPS), *archs],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
        codes.append(p.returncode)
        outs.append(p.stdout.decode()[-4000:])
    return codes[0], codes[1], "\n".join(outs)


@pytest.fixture(scope="module")
def zoo_runs(tmp_path_factory):
    """Every architecture trained, killed and restored: the machine's cores each run a
    part of the list, its restore starting as soon as its training process is dead."""
    root = tmp_path_factory.mktemp("zoo")
    archs = _moc_archs()
    n = max(2, min(4, os.cpu_count() or 2))
    parts = [archs[i::n] for i in range(n) if archs[i::n]]
    with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
        results = list(pool.map(lambda part: _part(root, part), parts))
    for (train, restore, out), part in zip(results, parts):
        if (train, restore) != (-9, 0):
            print(out)
        assert train == -9, f"the training process of {part} should die by SIGKILL, got {train}"
        assert restore == 0, f"the restoring process of {part} exited with {restore}"
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
    from lazarus.adapters.hf import make_elastic, original_state_dict
    from lazarus.moe import sync_moe_gradients

    ref = zoo.build(arch, seed=3)
    ref.train()
    if arch in NO_DROPOUT:
        for m in ref.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    if arch in ELASTIC_REFUSED:
        with pytest.raises(ValueError, match=ELASTIC_REFUSED[arch][0]):
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
    # gradients in the original's names (DBRX and JetMoE hold their experts fused)
    grads = {n: torch.zeros_like(b) for n, b in ad.named_buffers()}   # LongCat's identity rows: no gradient
    grads.update({n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in ad.named_parameters()})
    g_ad = original_state_dict(ad, grads)
    for n, p in ref.named_parameters():
        if p.grad is None:
            assert g_ad.get(n) is None or not g_ad[n].any(), n
        else:
            # fp32 summation order differs (grouped matmuls): elements near 0 are compared
            # to the tensor's scale (1e-5 of its largest gradient), the others to 1e-4
            atol = max(1e-6, 1e-5 * float(p.grad.abs().max()))
            torch.testing.assert_close(g_ad[n], p.grad, rtol=1e-4, atol=atol, msg=lambda m, n=n: f"{arch} {n}: {m}")
    sd = original_state_dict(ad)
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


def zoo_table() -> str:
    """docs/layouts.md's zoo table, as this test file's lists make it."""
    built = [a for a in ARCHS if a not in NOT_BUILT]
    both = len([a for a in built if a not in MOC_REFUSED and a not in ELASTIC_REFUSED])
    version = transformers.__version__.rsplit(".", 1)[0]
    refused = ", ".join(f"`{a}`" for a in sorted(MOC_REFUSED)) or "none"
    rows = [
        "| | architectures |",
        "|---|---|",
        f"| moc: checkpoint, SIGKILL, restore, PLT per layer | all {len(built) - len(MOC_REFUSED)} built, with "
        "layouts of their own for `dbrx` (flattened), `jetmoe` (parallel experts, MLP and attention), "
        "`longcat_flash` (zero-compute rows), `doge` (product-key rows) |",
        f"| moc refuses (`ValueError` naming the module) | {refused} |",
    ]
    from lazarus.adapters.hf._layouts import LAYOUTS

    for layout in sorted(LAYOUTS.values(), key=lambda l: l.arch):
        rows.append(f"| `make_elastic` takes `{layout.arch}` | {layout.note} |")
    for arch, (_, why) in sorted(ELASTIC_REFUSED.items()):
        rows.append(f"| `make_elastic` refuses `{arch}` | {why} |")
    rows.append(f"| both supported | {both} of the {len(built)} MoE architectures of transformers {version} "
                f"built ({len(NOT_BUILT)} tiny configs do not build yet) |")
    return "\n".join(rows)


def test_readme_lists_what_the_zoo_checks():
    """The table is generated from this file: on a mismatch, paste the expected text."""
    readme = open(os.path.join(ROOT, "docs", "layouts.md")).read()
    table = readme.split("<!-- zoo:begin -->", 1)[1].split("<!-- zoo:end -->", 1)[0]
    assert table.strip() == zoo_table(), f"docs/layouts.md's zoo table should read:\n{zoo_table()}"
