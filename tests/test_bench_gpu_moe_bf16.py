"""``benchmarks/gpu/moe_bf16.py`` (bench-gpu's section (d)) on the CPU: the MoE layer and
the plain references it is timed against compute the same thing.

Ours (fused SwiGLU experts through the layer's dispatch) against ``torch._grouped_mm`` over
the slots sorted by expert and against a per-expert matmul loop, float32, tiny size, the
same tokens, routing and weights: outputs and every gradient (tokens, gates, both
projections) equal element-wise; a changed routing is caught. Then the section itself runs
as ``benchmarks/gpu/main.py --device cpu`` and its figure reaches the gpu-check figures
file. The bf16 throughput on a GPU is not measured here (``make gpu-check``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import moe_bf16  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")


def test_the_layer_and_both_references_give_the_same_outputs_and_gradients() -> None:
    p = moe_bf16.SIZES["tiny"]
    layer = moe_bf16.build(p, torch.device("cpu"), torch.float32)
    h = torch.randn(p["tokens"], p["dim"], generator=torch.Generator().manual_seed(1))
    ids, gates = moe_bf16._routing(layer, h)
    assert ids.shape == (p["tokens"], 2) and len(set(ids.flatten().tolist())) == p["experts"]   # every expert used
    sides = moe_bf16._sides(layer)
    assert set(sides) == {"lazarus", "grouped", "loop"}
    ours_out, ours = moe_bf16._fwd_bwd(layer, sides.pop("lazarus"), h, ids, gates)
    assert ours_out.abs().sum() > 0 and all(g.abs().sum() > 0 for g in ours.values())
    for name, fn in sides.items():
        out, grads = moe_bf16._fwd_bwd(layer, fn, h, ids, gates)
        torch.testing.assert_close(out, ours_out, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        assert set(grads) == {"h", "gates", "gate_up_proj", "down_proj"}
        for key, g in grads.items():
            torch.testing.assert_close(g, ours[key], rtol=1e-5, atol=1e-6, msg=lambda m, n=name, k=key: f"{n} {k}: {m}")
    # the comparison sees a difference: the same reference with the top-2 gates swapped
    ex = layer.experts
    swapped = moe_bf16.reference_grouped(h, ids, gates.flip(1), ex.gate_up_proj, ex.down_proj)
    assert not torch.allclose(swapped, ours_out, rtol=1e-3, atol=1e-4)
    errors = moe_bf16.compare(layer, h, rel_tol=1e-5)
    assert set(errors) == {f"{n}/{k}" for n in ("grouped", "loop") for k in ("out", "h", "gates", "gate_up_proj",
                                                                             "down_proj")}
    assert max(errors.values()) <= 1e-5


def test_compare_names_what_differs() -> None:
    p = moe_bf16.SIZES["tiny"]
    layer = moe_bf16.build(p, torch.device("cpu"), torch.float32)
    h = torch.randn(p["tokens"], p["dim"], generator=torch.Generator().manual_seed(2))
    sides = moe_bf16._sides      # a reference that gates with the other expert's gate
    try:
        moe_bf16._sides = lambda lay: {**sides(lay), "grouped": lambda hh, ids, g: moe_bf16.reference_grouped(
            hh, ids, g.flip(1), lay.experts.gate_up_proj, lay.experts.down_proj)}
        with pytest.raises(ValueError, match=r"differ beyond a relative error of 1e-05: .*'grouped/out'"):
            moe_bf16.compare(layer, h, rel_tol=1e-5)
    finally:
        moe_bf16._sides = sides


@pytest.mark.timeout(600)
def test_the_bench_section_runs_on_the_cpu_and_records_its_figure(tmp_path: Path) -> None:
    figures = tmp_path / "figures.jsonl"
    out = tmp_path / "smoke.md"
    env = {**os.environ, "LAZARUS_GPU_FIGURES": str(figures), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "main.py"), "--device", "cpu", "--quick",
                           "--skip", "stall,bandwidth,layer", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = out.read_text()
    assert "## (d) MoE layer in bf16 vs a plain grouped-mm reference" in text
    assert "| lazarus |" in text and "| grouped |" in text and "| loop |" in text
    assert "CPU smoke run, meaningless" in text and "float32" in text
    fig = [json.loads(line) for line in figures.read_text().splitlines()]
    assert len(fig) == 1 and fig[0]["name"] == "moe_bf16_vs_grouped_mm" and fig[0]["device"] == "cpu"
    assert fig[0]["ratio"] > 0 and set(fig[0]["ms"]) == {"lazarus", "grouped", "loop"}
