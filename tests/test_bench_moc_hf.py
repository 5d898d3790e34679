"""``benchmarks/moc_hf`` end to end in its ``--quick`` form: a real transformers Qwen3-MoE
model, every checkpoint method in one process, and a real 2-process FSDP2 gloo job.

Checks that every row of both tables is there (no method failed and was dropped), that
the FSDP2 job ran on both ranks, and that MoC's bytes on disk match the PEC formula,
recomputed here from the parameter split the benchmark measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DCP_BEST = "DCP async_save (DefaultStager, every StagingOptions on, process)"
SINGLE_ROWS = ("torch.save (blocking)", "DCP async_save", "DCP async_save (DefaultStager)", DCP_BEST,
               "MoC all experts, 1 level", "MoC K=1, 1 level", "MoC K=1, 2 levels")
FSDP_ROWS = ("DCP async_save", "DCP async_save (DefaultStager)", DCP_BEST, "MoC K=1, 1 level")


@pytest.mark.timeout(300)
def test_quick_run_has_every_row_and_pec_bytes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    main = ROOT / "benchmarks" / "moc_hf" / "main.py"
    proc = subprocess.run([sys.executable, str(main), "--quick", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = (out / "results.md").read_text()
    data = json.loads((out / "results.json").read_text())
    assert (out / "stall.png").stat().st_size > 10_000

    assert data["errors"] == [], data["errors"]
    assert [r["name"] for r in data["single"]["rows"]] == list(SINGLE_ROWS)
    for name in SINGLE_ROWS:
        assert f"| {name} | " in text
    assert data["fsdp"] is not None and [f["rank"] for f in data["fsdp"]] == [0, 1]
    for f in data["fsdp"]:
        assert [r["name"] for r in f["rows"]] == list(FSDP_ROWS)
        for r in f["rows"]:
            assert r["call"] > 0 and r["step"] > 0
    for name in FSDP_ROWS:
        for rank in (0, 1):
            assert f"| {name} | {rank} | " in text

    # PEC: (P_ne + P_e*K/E) * (4 + 8) + buffers, from the benchmark's own parameter split.
    s, E = data["single"], data["experts"]
    assert s["P_e"] > 0 and s["P_ne"] > 0
    formula = lambda K: (s["P_ne"] + s["P_e"] * K / E) * 12 + s["buffers"]  # noqa: E731
    moc = {r["name"]: r for r in s["rows"] if r["name"].startswith("MoC")}
    cases = [(moc["MoC all experts, 1 level"]["size"], E), (moc["MoC all experts, 1 level"]["bytes_first"], E),
             (moc["MoC K=1, 1 level"]["size"], 1), (moc["MoC K=1, 2 levels"]["size"], 1)]
    fsdp_moc = data["fsdp"][0]["rows"][-1]
    cases += [(fsdp_moc["size"], 1), (fsdp_moc["bytes_first"], E)]
    for measured, K in cases:
        assert formula(K) <= measured <= formula(K) * 1.01, (measured, K, formula(K))
    # K=1 writes less than a full checkpoint, by the formula's ratio.
    assert moc["MoC K=1, 1 level"]["size"] < 0.5 * moc["MoC all experts, 1 level"]["size"]
    checks = data["bytes_checks"]
    assert len(checks) == 6 and all(c["holds"] for c in checks)
    assert "| MoC bytes per checkpoint match the PEC formula | 6 of 6 cases | yes |" in text
