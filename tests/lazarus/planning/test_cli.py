"""Tests of the ``lazarus plan`` command, in-process via ``main`` and as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lazarus.cli import SUBCOMMANDS, main

ROOT = Path(__file__).resolve().parents[3]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lazarus.cli", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )


def test_plan_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--loads", "5,3,1,1", "--loads", "1,1,1,4", "--nodes", "4",
               "--slots", "2", "--min-replicas", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("layer ") == 2
    assert "failed  mro      mro-paper  spread   compact" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert any(r[0] == "3" for r in rows)  # failure counts 1..N-1 reported


def test_plan_json_matches_library(capsys: pytest.CaptureFixture[str]) -> None:
    from lazarus.planning import allocate_replicas, place_mro, recovery_probability

    rc = main(["plan", "--loads", "9,1,4,2,2,7,3", "--nodes", "6", "--slots", "4",
               "--min-replicas", "2", "--gpus-per-node", "2", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    layer = data["layers"][0]
    r = allocate_replicas([9, 1, 4, 2, 2, 7, 3], 6, 4, 2)
    assert layer["replicas"] == r
    plan = place_mro(r, 6, 4)
    assert layer["placement"]["nodes"] == plan.nodes
    assert len(layer["placement"]["gpus"][0]) == 2
    assert [row["failed"] for row in layer["recovery"]] == [1, 2, 3, 4, 5]
    for row in layer["recovery"]:
        assert row["mro"] == pytest.approx(recovery_probability(plan, row["failed"]))
        assert row["mro"] >= row["mro-paper"] - 1e-12
        assert set(row) >= {"mro", "mro-paper", "spread", "compact"}


def test_plan_loads_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    j = tmp_path / "loads.json"
    j.write_text(json.dumps({"attn0": [5, 3, 1, 1], "attn1": [1, 1, 1, 1]}))
    assert main(["plan", "--loads-file", str(j), "--nodes", "4", "--slots", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [layer["layer"] for layer in data["layers"]] == ["attn0", "attn1"]

    j2 = tmp_path / "loads2.json"
    j2.write_text("[[5, 3, 1, 1], [2, 2, 2, 2]]")
    assert main(["plan", "--loads-file", str(j2), "--nodes", "4", "--slots", "2", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["layers"]) == 2

    c = tmp_path / "loads.csv"
    c.write_text("5,3,1,1\n\n1,1,1,1\n4,4,1,1\n")
    assert main(["plan", "--loads-file", str(c), "--nodes", "4", "--slots", "2", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["layers"]) == 3


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["plan", "--loads", "5,3,1,1", "--nodes", "1", "--slots", "2"], "slot"),
        (["plan", "--loads", "5,-3", "--nodes", "2", "--slots", "2"], ">= 0"),
        (["plan", "--loads", "5,nan", "--nodes", "2", "--slots", "2"], "finite"),
        (["plan", "--loads", "5,x", "--nodes", "2", "--slots", "2"], "--loads"),
        (["plan", "--loads", "1,2", "--nodes", "2", "--slots", "2", "--min-replicas", "3"], "min_replicas"),
        (["plan", "--loads", "1,2", "--nodes", "2", "--slots", "0"], "--slots"),
        (["plan", "--loads", "1,2", "--nodes", "0", "--slots", "2"], "--nodes"),
        (["plan", "--loads", "1,2", "--nodes", "2", "--slots", "2", "--gpus-per-node", "3"], "gpus_per_node"),
        (["plan", "--loads", "1,2", "--nodes", "two", "--slots", "2"], "--nodes"),
        (["plan", "--nodes", "2", "--slots", "2"], "--loads"),
        (["plan", "--loads-file", "/nonexistent/x.json", "--nodes", "2", "--slots", "2"], "cannot read"),
        (["plan", "--loads", "1,2", "--nodes", "2", "--slots", "2", "--max-failed", "9"], "--max-failed"),
    ],
)
def test_plan_bad_input_one_line(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lazarus plan: error: ")
    assert needle in err
    assert "Traceback" not in err


def test_bad_loads_file_content(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, text in [("a.json", "{not json"), ("b.json", '{"l": ["x"]}'), ("c.csv", "1,2\nfoo,3\n")]:
        p = tmp_path / name
        p.write_text(text)
        assert main(["plan", "--loads-file", str(p), "--nodes", "2", "--slots", "2"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("lazarus plan: error: --loads-file")


def test_unknown_subcommand_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bogus"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lazarus: error:")
    assert main(["plan", "--help"]) == 0
    assert "--loads-file" in capsys.readouterr().out
    assert main([]) == 2
    assert "plan" in SUBCOMMANDS


def test_subprocess_ok_and_error() -> None:
    ok = run_cli("plan", "--loads", "5,3,1,1", "--nodes", "4", "--slots", "2", "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["layers"][0]["replicas"] == [2, 2, 2, 2]
    bad = run_cli("plan", "--loads", "5,3,1,1", "--nodes", "1", "--slots", "2")
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("lazarus plan: error: ")


def test_one_subcommand_imports_only_its_own_module() -> None:
    """``lazarus agent`` starts a joining node's worker first thing: building the other
    subcommands' parsers (the simulator's brings numpy and the planner) only delays it.
    The full parser still lists every subcommand."""
    code = ("import sys; from lazarus.cli import main; rc = main(['agent', '--help']); "
            "print(rc, sorted(m for m in ('numpy', 'torch', 'lazarus.sim', 'lazarus.planning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 []"
    full = subprocess.run([sys.executable, "-m", "lazarus.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert full.returncode == 0 and all(name in full.stdout for name in SUBCOMMANDS)
