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
from lazarus.runtime.worker._abort import GroupAborter
from lazarus.runtime.worker._backend import (NCCL_SETTINGS, TrainerBackend, local_cuda_index, nccl_init_kwargs,
                                             resolve_backend)

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[3]
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


_WORKER_ENV = """
import json, os, sys
from datetime import timedelta
from lazarus.runtime.worker._backend import nccl_environment
applied = nccl_environment("node t", init_timeout=timedelta(seconds=float(sys.argv[1])))
print(json.dumps({"applied": applied, "env": {k: v for k, v in os.environ.items() if k.startswith("TORCH_NCCL_")}}))
"""


def _worker_env(extra: dict[str, str], rendezvous_s: float = 30.0) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_NCCL_", "NCCL_"))}
    env.update(extra, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _WORKER_ENV, str(rendezvous_s)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_an_nccl_worker_gets_the_in_process_recovery_settings() -> None:
    """A worker process with none of the variables set gets every setting: no dump on a
    timeout and a short dump wait, no heartbeat monitor, CUDA errors not rethrown, torch's
    async error handling off (Lazarus aborts), non-blocking communicator init bounded by
    the rendezvous timeout."""
    got, _ = _worker_env({}, rendezvous_s=45.5)
    expected = dict(NCCL_SETTINGS, TORCH_NCCL_NONBLOCKING_TIMEOUT="45")
    assert got["applied"] == expected
    assert got["env"] == expected
    assert expected["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and expected["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert expected["TORCH_NCCL_ENABLE_MONITORING"] == "0" and expected["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0"
    assert int(expected["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"]) * 4 <= 1000     # at most a second of dump wait


def test_nccl_settings_the_user_chose_are_kept_and_named() -> None:
    got, stderr = _worker_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "0"})
    assert got["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"              # kept
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in got["applied"]
    assert "TORCH_NCCL_ENABLE_MONITORING" not in got["applied"]             # already the wanted value
    assert got["env"]["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"                  # the others still applied
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (Lazarus would set 0)" in stderr
    assert "TORCH_NCCL_ENABLE_MONITORING" not in stderr                     # no warning for an agreeing value


def test_the_nccl_settings_are_variables_this_torch_reads() -> None:
    """The names are torch's, not typos: the ones declared in ProcessGroupNCCL.hpp (shipped
    with every torch wheel) are found there. TORCH_NCCL_USE_COMM_NONBLOCKING and
    TORCH_NCCL_NONBLOCKING_TIMEOUT are read in ProcessGroupNCCL.cpp / NCCLUtils.cpp, which
    only a CUDA build has: those two cannot be checked here."""
    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    if not header.exists():
        pytest.fail(f"{header} missing: this torch wheel ships no c10d headers to check the names against")
    text = header.read_text()
    in_cpp_only = {"TORCH_NCCL_USE_COMM_NONBLOCKING"}
    for name in set(NCCL_SETTINGS) - in_cpp_only:
        assert f'"{name}"' in text, name


@pytest.mark.parametrize("local_rank, count", [(2, 2), (3, 1), (1, 0)])
def test_a_local_rank_without_its_own_gpu_is_refused(local_rank: int, count: int) -> None:
    with pytest.raises(ValueError) as info:
        local_cuda_index(local_rank, count)
    msg = str(info.value)
    assert f"LOCAL_RANK={local_rank}" in msg and f"{count} CUDA device(s)" in msg
    assert "--nproc-per-node" in msg and "ElasticConfig.device" in msg
    if count:
        assert local_cuda_index(count - 1, count) == count - 1
    with pytest.raises(ValueError, match="LOCAL_RANK must be an integer >= 0"):
        local_cuda_index(-1, 4)


def test_device_mapping_is_one_gpu_per_local_rank(monkeypatch) -> None:
    """resolve_backend's mapping as on a 2-GPU node (torch.cuda's count and availability
    stand in for a CUDA runtime; backend gloo, since this torch has no NCCL to check)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for spec in ("auto", "cuda"):
        assert resolve_backend(spec, "gloo", local_rank=1).device == torch.device("cuda", 1)
        with pytest.raises(ValueError, match=r"LOCAL_RANK=2 has no GPU of its own.*--nproc-per-node 2"):
            resolve_backend(spec, "gloo", local_rank=2)        # was cuda:0 (2 % 2): a shared GPU
    assert resolve_backend("cuda:1", "gloo", local_rank=5).device == torch.device("cuda", 1)   # explicit
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        resolve_backend("cuda:2", "gloo", local_rank=0)
    monkeypatch.setenv("LOCAL_RANK", "3")                       # read from the environment by default
    with pytest.raises(ValueError, match="LOCAL_RANK=3"):
        resolve_backend("auto", "gloo")


def test_an_nccl_group_is_formed_eagerly_on_its_device() -> None:
    assert nccl_init_kwargs(TrainerBackend(device=torch.device("cpu"), backend="gloo")) == {}
    assert nccl_init_kwargs(TrainerBackend(device=torch.device("cuda", 0), backend="gloo")) == {}
    kw = nccl_init_kwargs(TrainerBackend(device=torch.device("cuda", 3), backend="nccl"))
    assert kw == {"device_id": torch.device("cuda", 3)}
    import inspect
    assert "device_id" in inspect.signature(torch.distributed.init_process_group).parameters
    with pytest.raises(ValueError, match="CUDA device with an index"):
        nccl_init_kwargs(TrainerBackend(device=torch.device("cuda"), backend="nccl"))


def test_group_aborter_rejects_an_unknown_backend() -> None:
    with pytest.raises(ValueError, match="'gloo' or 'nccl'"):
        GroupAborter("mpi")


def _run_pair(backend: str, timeout_s: float) -> dict[int, dict]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    worker = ROOT / "tests" / "helpers" / "workers" / "mp_abort_worker.py"
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), str(port), backend,
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
