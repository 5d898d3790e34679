"""``benchmarks/exact/ettr.py --quick``: ETTR against MTBF from the simulator for every
checkpoint mode, exact mode's curve beside PEC's, full checkpoints' and MoEvement's figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.exact import ettr  # noqa: E402


def test_ettr_quick_table_plot_and_curves(tmp_path: Path) -> None:
    assert ettr.main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "ettr.json").read_text())
    text = (tmp_path / "ettr.md").read_text()
    assert (tmp_path / "ettr.png").stat().st_size > 10_000
    mtbfs = ettr.QUICK["mtbf_min"]
    cell = {(r["system"], r["mode"], r["mtbf_min"]): r for r in data["rows"]}
    assert set(cell) == {(s, m, t) for s in ettr.SYSTEMS for m in ettr.MODES for t in mtbfs}
    for (system, mode, _), r in cell.items():
        assert 0.0 < r["ettr"] < 1.0
        assert r["rollbacks"] > 0 or system == "lazarus"   # a replica always survives one node's loss
        if mode in ("full", "exact"):
            assert r["plt"] == 0.0, (system, mode)
    for system in ettr.SYSTEMS:
        for mode in ettr.MODES:   # rarer failures, more of the time trains
            assert cell[(system, mode, mtbfs[1])]["ettr"] > cell[(system, mode, mtbfs[0])]["ettr"]
    # checkpoint-restart: exact mode far above blocking full checkpoints, and without PEC's PLT
    assert cell[("ds", "exact", 10)]["ettr"] > cell[("ds", "full", 10)]["ettr"] + 0.1
    assert cell[("ds", "pec", 10)]["plt"] > 0.05
    assert "| MoEvement (published) |" in text and "**>= 0.94**" in text
    assert "| ds | exact | " in text
