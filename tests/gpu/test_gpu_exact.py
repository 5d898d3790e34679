"""Exact mode on CUDA: a training process SIGKILLed mid-run, restored in a new process and
replayed, ends bit-identical (every weight and AdamW moment, SHA-256 of the bytes) to an
uninterrupted run without moc; the killed run's captures went through the side stream into
page-locked buffers. Exact mode on CUDA without the deterministic settings is refused,
naming them (``docs/exact.md``, "On CUDA").

The process is ``exact_cuda_worker.py``; ``kill_and_replay(tmp_path, "cpu")`` runs the same
logic on the CPU (no side stream there: its checks of the CUDA path are skipped), e.g.
``PYTHONPATH=. python -c "import sys; sys.path.insert(0, 'tests/gpu'); import pathlib, tempfile,
test_gpu_exact as t; t.kill_and_replay(pathlib.Path(tempfile.mkdtemp()), 'cpu')"``.

Run with ``make test-gpu`` / ``make gpu-check`` (skipped without a GPU).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpu_common import GPU, shm_dir  # noqa: F401 - shm_dir is a fixture

pytestmark = GPU

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("exact_cuda_worker.py")
STEPS, KILL_AT = 24, 15          # windows of 4 steps (8 experts, k_snapshot=2): killed inside the 4th
TIMEOUT = 300


def _env() -> dict[str, str]:
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _run(args: list[str], out: Path) -> dict:
    proc = subprocess.run([sys.executable, str(WORKER), *args, "--out", str(out)], env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def kill_and_replay(tmp_path: Path, device: str, shm: str | None = None) -> None:
    """Reference run; a run SIGKILLed after step KILL_AT; a restore that replays; compare."""
    store, shm = str(tmp_path / "store"), shm or str(tmp_path / "shm")
    ref = _run(["--device", device, "--no-moc", "--steps", str(STEPS)], tmp_path / "ref.json")

    cmd = [sys.executable, str(WORKER), "--device", device, "--storage", store, "--shm", shm, "--steps", str(STEPS),
           "--step-sleep", "0.3", "--out", str(tmp_path / "killed.json")]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + TIMEOUT
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line.strip())
            if line.startswith(f"STEP {KILL_AT} "):
                os.kill(proc.pid, signal.SIGKILL)       # mid-run: the next step follows in 0.3 s
                break
            assert time.monotonic() < deadline, seen[-5:]
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, seen[-5:], proc.stderr.read()[-4000:]
                                                if proc.stderr else "")
    assert not (tmp_path / "killed.json").exists()
    last = dict(kv.split("=") for kv in seen[-1].split()[2:])
    if device.startswith("cuda"):
        # the side-stream path was taken once the first windows' buffers were page-locked
        assert int(last["async"]) > 0, (
            f"no capture was issued on the side stream into a page-locked buffer (snapshot dir {shm}: page-locking "
            f"needs tmpfs, see gpu_common.shm_dir): {seen[-3:]}")

    got = _run(["--device", device, "--storage", store, "--shm", shm, "--steps", str(STEPS), "--restore"],
               tmp_path / "restored.json")
    status = got["status"]
    assert 0 < got["start"] <= KILL_AT + 1, got["start"]
    assert status["replays"] == 1 and status["replayed_steps"] >= 1, status
    assert status["windows_failed"] == 0, status
    assert got["state"].keys() == ref["state"].keys()
    differ = [k for k, v in ref["state"].items() if got["state"][k] != v]
    assert not differ, f"{len(differ)} of {len(ref['state'])} tensors differ from the uninterrupted run: {differ[:5]}"


@pytest.mark.timeout(900)
def test_exact_mode_killed_on_cuda_replays_bit_identically(tmp_path, shm_dir) -> None:
    kill_and_replay(tmp_path, "cuda", shm_dir)


def test_exact_mode_on_cuda_refuses_without_deterministic_kernels(tmp_path, monkeypatch) -> None:
    from moc import CheckpointError, CheckpointManager, MoCConfig
    from examples.toy_moe import ToyMoE
    model = ToyMoE(vocab=32, dim=16, hidden=32, num_layers=1, num_experts=4).cuda()
    opt = torch.optim.AdamW(model.parameters())
    cfg = MoCConfig(storage=str(tmp_path / "s"), snapshot_dir=str(tmp_path / "m"), interval=1, k_snapshot=2,
                    exact=True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        with pytest.raises(CheckpointError) as err:
            CheckpointManager(cfg, model=model, optimizer=opt)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert "torch.use_deterministic_algorithms(True)" in str(err.value)
    assert "CUBLAS_WORKSPACE_CONFIG" in str(err.value)
