"""``make bench-control`` end to end at a tiny N: 16 simulated agents on the real wire
protocol against a real ``lazarus controller`` process (see benchmarks/control/main.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_control_at_16_nodes(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "control" / "main.py"), "--nodes", "16",
                           "--steady", "2", "--json", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (row,) = out["rows"]
    assert row["n"] == 16
    assert row["errors"] == 0, row["error_detail"]            # nothing refused, reset or closed
    assert 0 < row["register_s"] <= row["first_plan_s"] < 30   # all 16 registered, then planned
    assert [p[2] for p in row["plans"]][:1] == [16]            # the first plan has everyone
    # one node (5% of 16, at least one) failed: the next plan drops exactly it
    assert row["failed"] == 1 and row["failure_plan_lost_ok"] is True
    assert row["failure_detect_s"] >= 0 and 0 < row["failure_plan_s"] < 10
    assert row["plans"][1][1] == "failure" and row["plans"][1][2] == 15
    # two joiners (10% of 16): a plan with the 15 survivors and both
    assert row["joined"] == 2 and row["join_plan_ok"] is True and row["plans"][-1][2] == 17
    assert row["hb_samples"] > 0 and 0 < row["hb_p50_ms"] <= row["hb_p99_ms"] < 5000
    assert 0 <= row["cpu_pct"] < 200
    text = (tmp_path / "results.md").read_text()
    assert "| connections refused / reset / closed | 0 |" in text and "Rerun:" in text
    assert (tmp_path / "cost.png").stat().st_size > 1000
