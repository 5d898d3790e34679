"""Backend choice and abort dispatch of the elastic trainer, on the host.

The backend follows the device (cpu -> gloo, cuda -> NCCL), ``ElasticConfig.backend``
overrides, bad values name the field, NCCL without CUDA is refused with the reason. The
abort dispatch runs in real processes on a real gloo group: the NCCL path aborts (never
destroys) the groups, the gloo path destroys them, and both shut the gloo sockets so a
peer blocked in a collective fails at once. The NCCL communicator abort itself runs only
in ``tests/gpu``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lazarus.runtime import ElasticConfig
from lazarus.runtime._abort import GroupAborter
from lazarus.runtime._backend import TrainerBackend, nccl_environment, resolve_backend

from conftest import free_port

HERE = Path(__file__).resolve().parent
CUDA = torch.cuda.is_available()


def test_cpu_device_uses_gloo_and_auto_follows_the_machine() -> None:
    b = resolve_backend("cpu", "auto")
    assert (b.device, b.backend, b.init_backend) == (torch.device("cpu"), "gloo", "gloo")
    assert b.transfer_device == torch.device("cpu")
    auto = resolve_backend("auto", "auto", local_rank=0)
    assert auto.device.type == ("cuda" if CUDA else "cpu")
    assert auto.backend == ("nccl" if CUDA else "gloo")
    assert resolve_backend("cpu", "gloo").backend == "gloo"


def test_an_nccl_group_carries_gloo_for_host_tensors() -> None:
    b = TrainerBackend(device=torch.device("cuda", 1), backend="nccl")
    assert b.init_backend == "cpu:gloo,cuda:nccl"
    assert b.transfer_device == torch.device("cuda", 1)       # expert transfers over NCCL
    g = TrainerBackend(device=torch.device("cuda", 0), backend="gloo")  # override on a GPU
    assert g.init_backend == "gloo" and g.transfer_device == torch.device("cpu")


@pytest.mark.parametrize("kwargs, field, allowed", [
    ({"backend": "mpi"}, "ElasticConfig.backend", "'auto', 'gloo', 'nccl'"),
    ({"backend": None}, "ElasticConfig.backend", "'auto', 'gloo', 'nccl'"),
    ({"device": "gpu"}, "ElasticConfig.device", "'auto', 'cpu', 'cuda', 'cuda:<index>'"),
    ({"device": "cuda:x"}, "ElasticConfig.device", "'cuda:<index>'"),
    ({"device": "cpu", "backend": "nccl"}, "ElasticConfig.backend", "CUDA device"),
])
def test_bad_backend_or_device_names_the_field_and_the_allowed_values(kwargs: dict, field: str,
                                                                      allowed: str) -> None:
    with pytest.raises(ValueError) as info:
        ElasticConfig(**kwargs)
    assert field in str(info.value) and allowed in str(info.value)


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_nccl_or_cuda_without_cuda_is_refused_with_the_reason() -> None:
    for device, backend, field in [("auto", "nccl", "backend"), ("cuda", "auto", "device"),
                                   ("cuda:0", "gloo", "device")]:
        cfg = ElasticConfig(device=device, backend=backend)       # valid values: checked at start
        with pytest.raises(ValueError) as info:
            resolve_backend(cfg.device, cfg.backend)
        msg = str(info.value)
        assert f"ElasticConfig.{field}" in msg and "needs CUDA" in msg and "is_available() = False" in msg


def test_nccl_error_handling_is_abort_only_unless_the_user_chose(monkeypatch) -> None:
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    nccl_environment("node t")
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    nccl_environment("node t")
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_group_aborter_rejects_an_unknown_backend() -> None:
    with pytest.raises(ValueError, match="'gloo' or 'nccl'"):
        GroupAborter("mpi")


def _run_pair(backend: str, timeout_s: float) -> dict[int, dict]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(HERE / "mp_abort_worker.py"), str(r), str(port), backend,
                               str(timeout_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    out = {}
    try:
        for r, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=timeout_s + 60)
            assert p.returncode == 0, f"rank {r} exited {p.returncode}: {stderr[-2000:]}"
            out[r] = json.loads(stdout.strip().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend, teardown", [("gloo", "destroy"), ("nccl", "abort")])
def test_abort_dispatch_fails_a_blocked_peer_at_once(backend: str, teardown: str) -> None:
    timeout_s = 60.0
    out = _run_pair(backend, timeout_s)
    assert out[0]["first_sum"] == out[1]["first_sum"] == 2.0
    report = out[0]["report"]
    assert report["backend"] == backend and report["teardown"] == teardown
    assert report["sockets_shut"] >= 1
    assert report["nccl_aborted"] == 0          # a gloo group has no NCCL communicator to abort
    assert out[0]["initialized_after"] is False
    assert out[1]["error"] is not None and out[1]["collective_error"], out[1]
    assert out[1]["blocked_s"] < timeout_s / 3, out[1]     # failed on the abort, not on the timeout


def test_an_interrupted_nccl_step_is_refused_before_the_update() -> None:
    """NCCL collectives do not raise where they break: after an abort the trainer's health
    check (before ``optimizer.step()``) must raise a collective error, until the next
    generation is formed. gloo needs no check (its collectives raise themselves)."""
    from lazarus.runtime import is_collective_error

    nccl = GroupAborter("nccl")
    nccl.check_healthy()                       # nothing interrupted, no NCCL group here
    nccl.interrupt()
    with pytest.raises(RuntimeError) as info:
        nccl.check_healthy()
    assert is_collective_error(info.value) and "NCCL" in str(info.value)
    nccl.formed()
    nccl.check_healthy()
    gloo = GroupAborter("gloo")
    gloo.interrupt()
    gloo.check_healthy()
