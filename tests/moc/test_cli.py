"""The ``moc`` CLI: inspect, verify, export, and one-line errors on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from moc import CheckpointStore
from moc.cli import main
from tests.moc.test_store import save_step


@pytest.fixture
def ckpt_dir(tmp_path):
    root = tmp_path / "run"
    cs = CheckpointStore(str(root), compression="zstd")
    m = save_step(cs, 0, range(4), None)
    m = save_step(cs, 10, [0, 1], m)
    save_step(cs, 20, [2], m)
    return root


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moc.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_inspect_json(ckpt_dir, capsys):
    assert main(["inspect", str(ckpt_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["steps"] == [0, 10, 20] and info["step"] == 20
    assert info["layers"]["l0"]["version_steps"] == [10, 10, 20, 0]
    assert info["layers"]["l1"]["ages"] == [10, 10, 0, 20]
    units = {u["name"]: u for u in info["units"]}
    assert units["expert/l0/3"]["version_step"] == 0
    assert all(u["stored_nbytes"] > 0 for u in info["units"])
    assert info["stored_nbytes"] < info["nbytes"]  # zstd on constant tensors
    assert info["plt"]["unsaved"]["l0"] == [20] * 4


def test_inspect_text_older_step(ckpt_dir, capsys):
    assert main(["inspect", str(ckpt_dir), "--step", "10", "--units"]) == 0
    out = capsys.readouterr().out
    assert "step     10" in out and "l0: 0:0 1:0 2:10 3:10" in out


def test_verify_ok_then_corrupt_exits_1_naming_object(ckpt_dir):
    ok = run_cli("verify", str(ckpt_dir))
    assert ok.returncode == 0 and "OK" in ok.stdout
    cs = CheckpointStore(str(ckpt_dir))
    chunk = cs.read_manifest(20).units["expert/l1/2"].chunks[0]
    key = chunk.key
    path = ckpt_dir / key
    data = bytearray(path.read_bytes())
    data[chunk.start + chunk.stored_nbytes // 2] ^= 0x10
    path.write_bytes(bytes(data))
    bad = run_cli("verify", str(ckpt_dir))
    assert bad.returncode == 1
    assert key in bad.stdout and "expert/l1/2" in bad.stdout
    assert "Traceback" not in bad.stderr


def test_export_is_weights_only_loadable(ckpt_dir, tmp_path):
    out = tmp_path / "full.pt"
    assert main(["export", str(ckpt_dir), "-o", str(out)]) == 0
    state = torch.load(out, weights_only=True)
    assert state["moc"]["step"] == 20
    assert torch.equal(state["model"]["layers.1.moe.experts.0.w"], torch.full((4, 8), 1010.0))
    assert torch.equal(state["model"]["emb.weight"], torch.full((16, 8), 20.0))


@pytest.mark.parametrize(
    "args,fragment",
    [(["inspect", "/definitely/not/here"], "does not exist"),
     (["inspect", "gs://b/x"], "unsupported scheme"),
     (["verify", "{root}", "--step", "7"], "no checkpoint at step 7"),
     (["export", "{empty}", "-o", "/tmp/x.pt"], "no committed checkpoint")],
)
def test_bad_input_is_one_line_exit_2(ckpt_dir, tmp_path, args, fragment):
    (tmp_path / "empty").mkdir()
    args = [a.format(root=ckpt_dir, empty=tmp_path / "empty") for a in args]
    res = run_cli(*args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in res.stderr


def test_cli_against_s3(s3):
    from storage_backends import open_store

    cs = CheckpointStore(open_store("s3://ckpt/run", **s3.options))
    save_step(cs, 0, range(2), None, layers=1)
    env = {"AWS_ENDPOINT_URL": s3.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    res = run_cli("inspect", "s3://ckpt/run", "--json", env=env)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["steps"] == [0]
    res = run_cli("verify", "s3://ckpt/run", env=env)
    assert res.returncode == 0 and "OK s3://ckpt/run" in res.stdout
    res = run_cli("inspect", "s3://missing-bucket/run", env=env)
    assert res.returncode == 2 and "bucket 'missing-bucket' does not exist" in res.stderr


def test_help_for_every_command():
    for cmd in ("inspect", "verify", "export"):
        res = run_cli(cmd, "--help")
        assert res.returncode == 0 and "url" in res.stdout


def test_progress_reports_reach_total(ckpt_dir, capsys):
    from moc.cli import _bar

    calls = []
    CheckpointStore(str(ckpt_dir)).verify(progress=lambda d, t: calls.append((d, t)))
    assert calls and calls[-1][0] == calls[-1][1] > 0
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
    with _bar("export", enabled=True) as bar:
        CheckpointStore(str(ckpt_dir)).export(progress=bar)
    err = capsys.readouterr().err
    assert "export" in err and "100%" in err
    with _bar("export") as hidden:   # stderr is not a terminal here: no bar
        assert hidden is None


def _truncate_unit(root, unit: str) -> tuple[int, int]:
    """Truncate the newest stored object of ``unit`` before its chunk; return (bad, older) steps."""
    cs = CheckpointStore(str(root))
    manifest = cs.latest_manifest()
    rec = manifest.units[unit]
    chunk = rec.chunks[0]
    with open(root / chunk.key, "r+b") as f:
        f.truncate(chunk.start)
    older = max(cs.read_manifest(s).units[unit].step for s in cs.steps() if cs.read_manifest(s).units[unit].step
                < rec.step)
    return rec.step, older


@pytest.mark.parametrize("fmt,out_name", [("torch", "out.pt"), ("safetensors", "st")])
def test_export_of_a_checkpoint_that_needs_a_fallback_fails_unless_allowed(ckpt_dir, tmp_path, fmt, out_name):
    bad, older = _truncate_unit(ckpt_dir, "expert/l0/2")
    out = tmp_path / out_name
    res = run_cli("export", str(ckpt_dir), "--format", fmt, "-o", str(out))
    assert res.returncode == 1, res.stderr
    assert f"unit expert/l0/2: the version of step {bad} is unreadable" in res.stderr
    assert "--allow-fallback" in res.stderr and "moc verify" in res.stderr
    assert not out.exists()                       # nothing half-right left behind
    res = run_cli("export", str(ckpt_dir), "--format", fmt, "-o", str(out), "--allow-fallback")
    assert res.returncode == 0, res.stderr
    assert f"warning: unit expert/l0/2: the version of step {bad} is unreadable; exported its version of step " \
           f"{older}" in res.stderr
    assert out.exists()


def test_export_allow_fallback_in_help():
    res = run_cli("export", "--help")
    assert res.returncode == 0 and "--allow-fallback" in res.stdout


def test_verify_names_what_is_corrupt_in_a_manifest(ckpt_dir):
    path = ckpt_dir / "manifests" / "000000000020.json"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    res = run_cli("verify", str(ckpt_dir))
    assert res.returncode == 1
    line = next(l for l in res.stdout.splitlines() if "000000000020.json" in l)
    assert "(units: )" not in line
    assert f"manifest of step 20 is unreadable ({len(data) // 2} bytes, cut short)" in line
    assert "not valid JSON" in line and "use step 10" in line
