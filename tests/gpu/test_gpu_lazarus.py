"""Lazarus on one GPU: the backend follows the device, an NCCL group is aborted (not
destroyed) and re-formed in the same process, the MoE layer dispatches with the CUDA
kernel, and a one-node elastic job on CUDA survives a killed worker (moc restore into
CUDA tensors).

Two NCCL ranks share the one GPU as two "hosts" (a distinct ``NCCL_HOSTID`` per process,
sockets on loopback, P2P and SHM off): one is SIGKILLed, or SIGSTOPped, mid-training and
the survivor must abort its communicator and be back within ``collective_timeout`` + 2 s
(no 60 s dump stall, no heartbeat-monitor ``std::abort``). Three NCCL ranks on the GPU
re-form after losing one by shrinking the communicator (NCCL >= 2.27) and by abort + init,
timed side by side, raw (a SIGKILLed peer) and through the trainer's Reconfigurer (a leave);
these figures are not yet measured: no GPU has run them. What one GPU cannot show: the
NVLink / NVLS transports and 8 ranks contending for PCIe. Run with ``make test-gpu``
(skipped without a GPU). The dispatch kernel must build where nvcc and ninja exist: a
failed build fails these tests rather than skipping them.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gpu_common import GPU, free_port, record_figure
from examples.local_cluster import LocalCluster
from lazarus.dispatch import dispatch_counts, dispatch_device, dispatch_permutation, load_ops
from lazarus.moe import MoEConfig, MoELayer
from lazarus.planning import Placement
from lazarus.runtime.worker._abort import GroupAborter, nccl_backends
from lazarus.runtime.worker._backend import (NCCL_SETTINGS, TrainerBackend, nccl_environment, nccl_init_kwargs,
                                             resolve_backend)

pytestmark = GPU


def test_the_backend_follows_the_gpu() -> None:
    auto = resolve_backend("auto", "auto", local_rank=0)
    assert auto.device == torch.device("cuda", 0) and auto.backend == "nccl"
    assert auto.init_backend == "cpu:gloo,cuda:nccl"
    assert resolve_backend("cuda", "gloo").backend == "gloo"     # the override
    assert resolve_backend("cpu", "auto").backend == "gloo"


@pytest.mark.timeout(180)
def test_nccl_group_is_aborted_and_reformed_in_process(monkeypatch) -> None:
    for name in [*NCCL_SETTINGS, "TORCH_NCCL_NONBLOCKING_TIMEOUT"]:
        monkeypatch.delenv(name, raising=False)
    applied = nccl_environment("test", init_timeout=timedelta(seconds=30))
    assert applied["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=60))
    aborter = GroupAborter("nccl")
    backend = TrainerBackend(device=torch.device("cuda", 0), backend="nccl")
    for generation in range(3):
        with aborter.sockets.track():
            dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.PrefixStore(f"gen{generation}", store),
                                    rank=0, world_size=1, timeout=timedelta(seconds=30),
                                    **nccl_init_kwargs(backend))     # eager: formed here
        assert dist.distributed_c10d._get_default_group().bound_device_id == torch.device("cuda", 0)
        assert len(nccl_backends()) >= 1 and aborter.watchdog_error() is None
        dev = torch.ones(1024, device="cuda") * (generation + 1)
        dist.all_reduce(dev)                                   # over NCCL
        host = torch.full((3,), 2.0)
        dist.all_reduce(host)                                  # over gloo
        torch.cuda.synchronize()
        assert float(dev.sum()) == 1024 * (generation + 1) and host.tolist() == [2.0, 2.0, 2.0]
        assert len(nccl_backends()) >= 1
        aborter.check_healthy()                                # the watchdog saw no error
        report = aborter.retire()
        assert report.backend == "nccl" and report.teardown == "abort" and report.nccl_aborted >= 1, report
        assert not dist.is_initialized()
        with pytest.raises(RuntimeError, match="NCCL"):       # a step after the abort is refused
            aborter.check_healthy()
        aborter.formed()


def _cuda_kernel_or_fail() -> None:
    """The CUDA dispatch kernel is loaded; where nvcc (CUDA_HOME) and ninja exist a build
    that failed is a test failure, not a skip."""
    from torch.utils.cpp_extension import CUDA_HOME, is_ninja_available

    state = load_ops()
    if state.cuda:
        return
    if CUDA_HOME and is_ninja_available():
        pytest.fail(f"nvcc ({CUDA_HOME}) and ninja are here but the CUDA dispatch kernel did not load: {state.reason}")
    pytest.skip(f"no CUDA toolchain to build the dispatch kernel (CUDA_HOME={CUDA_HOME}, "
                f"ninja={is_ninja_available()}): {state.reason}")


def test_the_dispatch_kernel_equals_the_torch_implementation() -> None:
    _cuda_kernel_or_fail()
    assert dispatch_device(torch.device("cuda")) == torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    R = torch.randint(0, 3, (16, 4), generator=g)
    R[:, 0] += (R.sum(1) == 0).long()
    T = torch.randint(0, 500, (16, 4), generator=g)
    for rank in range(4):
        send, recv = dispatch_counts(R.cuda(), T.cuda(), rank)
        ref_send, ref_recv = dispatch_counts(R, T, rank, backend="torch")
        assert send.is_cuda and torch.equal(send.cpu(), ref_send) and torch.equal(recv.cpu(), ref_recv)
        experts = torch.repeat_interleave(torch.arange(16), T[:, rank])    # this rank's routed slots
        experts = experts[torch.randperm(experts.numel(), generator=g)]
        perm = dispatch_permutation(experts.cuda(), send)
        assert perm.is_cuda and torch.equal(perm.cpu(), dispatch_permutation(experts, send.cpu(), backend="torch"))
    with pytest.raises(ValueError, match="non-negative"):        # the checks, on the device
        dispatch_counts(-R.cuda(), T.cuda(), 0)


def _fused_layer(dtype: torch.dtype):
    import torch.nn.functional as F

    from lazarus.moe import ElasticMoE, GroupedExperts, SoftmaxRouter, grouped_mm

    E, D, FF = 8, 64, 128

    class SwiGLU(GroupedExperts):
        def run(self, x, counts):
            gate, up = grouped_mm(x, self.gate_up_proj.transpose(-2, -1), counts).chunk(2, dim=-1)
            return grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), counts)

    class Toy(ElasticMoE):
        def __init__(self):
            super().__init__(E)
            g = torch.Generator().manual_seed(6)
            w = {"gate_up_proj": torch.randn(E, 2 * FF, D, generator=g) * 0.1,
                 "down_proj": torch.randn(E, D, FF, generator=g) * 0.1}
            self.router = SoftmaxRouter(D, E, 2, seed=5)
            self.experts = SwiGLU(E, list(range(E)), w)
            self._init_placement(Placement([list(range(E))]))

    return Toy().to(dtype)


def test_gradient_clipping_never_waits_for_the_device() -> None:
    """The step's clipping on the GPU: the experts' squared norm (one per expert, every layer)
    and the clip factor stay on the device (sync debug mode "error" around them); the
    gradients equal torch's clip_grad_norm_ of the same gradients."""
    from lazarus.runtime.worker._step_reduce import clip_total_norm_

    cfg = MoEConfig(d_model=64, d_hidden=128, num_experts=8, top_k=2, seed=3)
    layer = MoELayer(cfg, Placement([list(range(8))])).cuda()
    x = torch.randn(512, 64, device="cuda")
    layer(x).square().sum().backward()
    expert_grads = [p.grad for p in layer.experts.parameters() if p.grad is not None]
    dense = [p.grad for p in layer.replicated_parameters() if p.grad is not None]
    reference = [torch.nn.Parameter(g.detach().clone()) for g in [*dense, *expert_grads]]
    for p, g in zip(reference, [*dense, *expert_grads]):
        p.grad = g.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        expert_sq = layer.expert_grad_sq()
        clip_total_norm_(dense, expert_grads, expert_sq, 0.01)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert expert_sq.is_cuda and expert_sq.dtype == torch.float64
    torch.nn.utils.clip_grad_norm_(reference, 0.01)
    for g, p in zip([*dense, *expert_grads], reference):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_moe_layer_with_the_cuda_kernel_equals_the_cpu_op(dtype: torch.dtype, fused: bool) -> None:
    """Forward and backward of the MoE layer on the GPU (dispatch kernel; bf16 fused experts
    take torch's grouped_mm kernel) against the same layer on the CPU (the C++ op), and
    the forward syncs the host once (torch.cuda.set_sync_debug_mode)."""
    from lazarus.moe import grouped_mm_available

    _cuda_kernel_or_fail()
    if fused:
        host_layer = _fused_layer(dtype)
    else:
        cfg = MoEConfig(d_model=64, d_hidden=128, num_experts=8, top_k=2, seed=3)
        host_layer = MoELayer(cfg, Placement([list(range(8))])).to(dtype)
    cuda_layer = copy.deepcopy(host_layer).cuda()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g).to(dtype)
    xh, xc = x.clone().requires_grad_(), x.cuda().requires_grad_()
    cuda_layer(xc)                                   # warm-up: kernels loaded, caches made
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yc = cuda_layer(xc)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught                  # (not torch's "prototype feature" notice)
             if "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message)]
    assert len(syncs) <= 1, syncs
    # the same experts for every token on both devices (bf16 scores would tie: the router scores in fp32)
    assert torch.equal(cuda_layer.router(xc.detach())[0].cpu(), host_layer.router(x)[0])
    if fused and dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (8, 0):
        w = cuda_layer.experts.gate_up_proj.transpose(-2, -1)
        assert grouped_mm_available(xc.detach()[:16].contiguous(), w)      # the one-call kernel ran
    yh = host_layer(xh)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(yc.cpu(), yh, **tol)
    yh.float().square().sum().backward()
    yc.float().square().sum().backward()
    torch.testing.assert_close(xc.grad.cpu(), xh.grad, **tol)
    torch.testing.assert_close(cuda_layer.router.weight.grad.cpu(), host_layer.router.weight.grad, **tol)
    assert torch.equal(cuda_layer.routing_counts, host_layer.routing_counts)


def _pair(tmp_path: Path, how: signal.Signals, timeout_s: float) -> dict:
    port = free_port()
    repo = Path(__file__).resolve().parents[2]
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_NCCL_", "NCCL_"))}
        env.update(NCCL_HOSTID=f"lazarus-pair-host{rank}", NCCL_SOCKET_IFNAME="lo", NCCL_P2P_DISABLE="1",
                   NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1", CUDA_VISIBLE_DEVICES=env.get("CUDA_VISIBLE_DEVICES", "0"),
                   PYTHONPATH=os.pathsep.join([str(repo), env.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).parent / "mp_nccl_pair.py"), str(rank),
                                       str(port), str(timeout_s), str(tmp_path / f"out{rank}.json")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=120))
        store.wait(["rank0_training"], timedelta(seconds=120))
        os.kill(procs[1].pid, how)
        killed_at = time.monotonic()
        out, _ = procs[0].communicate(timeout=timeout_s + 120)
        assert procs[0].returncode == 0, out[-4000:]
        report = json.loads((tmp_path / "out0.json").read_text())
        report["back_s"] = time.monotonic() - killed_at
        report["log"] = out[-4000:]
        return report
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_two_nccl_ranks_on_one_gpu_survivor_aborts_and_is_back(tmp_path: Path, how: signal.Signals) -> None:
    timeout_s = 10.0
    r = _pair(tmp_path, how, timeout_s)
    assert r["first_sum"] == 2.0 and r["steps"] >= 20, r
    assert r["error"] and "NCCL" in r["error"], r            # the blocked step failed, in-process
    assert r.get("aborted", 0) >= 1 and r.get("watchdog_error") in ("TIMEOUT", "COMM_ERROR", "REMOTE_ERROR"), r
    assert r["blocked_s"] <= timeout_s + 2, r                # no 60 s dump stall, no heartbeat abort
    assert r["solo_sum"] == 12.0 and r["reformed_s"] < 30, r  # back, alone, on the same GPU
    print(f"{how.name}: blocked {r['blocked_s']:.2f} s, watchdog {r['watchdog_error']}, re-formed in "
          f"{r['reformed_s']:.2f} s, back {r['back_s']:.2f} s after the signal")


def _shrink_run(tmp_path: Path, mode: str, world: int = 3, inflight: bool = False) -> list[dict]:
    """``world`` NCCL ranks on one GPU (mp_nccl_shrink.py); the last is SIGKILLed (while
    every rank all-reduces: ``inflight``), the others re-form by ``mode``; returns the
    survivors' reports."""
    tag = f"{mode}{'-inflight' if inflight else ''}"
    repo = Path(__file__).resolve().parents[2]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_NCCL_", "NCCL_"))}
        env.update(NCCL_HOSTID=f"lazarus-shrink-{tag}-host{rank}", NCCL_SOCKET_IFNAME="lo", NCCL_P2P_DISABLE="1",
                   NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1", CUDA_VISIBLE_DEVICES=env.get("CUDA_VISIBLE_DEVICES", "0"),
                   PYTHONPATH=os.pathsep.join([str(repo), env.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).parent / "mp_nccl_shrink.py"), str(rank),
                                       str(world), str(store.port), mode, str(tmp_path / f"{tag}{rank}.json")]
                                      + (["inflight"] if inflight else []),
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        store.wait([f"ready{r}" for r in range(world)], timedelta(seconds=120))
        if inflight:
            time.sleep(0.5)          # every rank back in its all-reduce loop
        os.kill(procs[-1].pid, signal.SIGKILL)
        procs[-1].wait()
        store.set("lost", "1")
        reports = []
        for rank, p in enumerate(procs[:-1]):
            out, _ = p.communicate(timeout=150)
            assert p.returncode == 0, out[-4000:]
            r = json.loads((tmp_path / f"{tag}{rank}.json").read_text())
            r["log"] = out[-3000:]
            reports.append(r)
        return reports
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()


@pytest.mark.timeout(420)
def test_nccl_shrink_and_reinit_side_by_side(tmp_path: Path) -> None:
    """Three NCCL ranks on one GPU, the third SIGKILLed: the two survivors re-form (a) by
    shrinking the communicator (``ElasticConfig.reform``'s shrink: ncclCommShrink, NCCL >=
    2.27) and (b) by abort + ``init_process_group``; both groups work (device and host
    all-reduce) and the time from the loss to a working group is reported side by side
    (gpu-check's summary). Skips, saying why, where this torch/NCCL cannot shrink."""
    from lazarus.runtime.worker._reform import local_shrink_available

    ok, why = local_shrink_available()
    if not ok:
        pytest.skip(f"no NCCL shrink here: {why}")
    results = {mode: _shrink_run(tmp_path, mode) for mode in ("reinit", "shrink")}
    for mode, reports in results.items():
        for r in reports:
            assert "error" not in r, (mode, r["error"], r["log"])
            assert r["first_sum"] == 3.0, r
            assert (r["device_sum"], r["host_sum"]) == (3.0, 2.0), r   # ranks 1 + 2 on the device; 2 on the host
            assert r["nccl_backends"] >= 1, r       # the new communicator is where the aborter finds it
            assert r["errors"] == [], r
    for r in results["shrink"]:
        assert "shrink_error" not in r, (r["shrink_error"], r["log"])   # shrink ran, no fallback
        assert r["shrunk_rank_size"] == [r["rank"], 2] and r["shrunk_used"], r
    worst = {mode: max(r["reformed_s"] for r in reports) for mode, reports in results.items()}
    init = max(r["formed_s"] for r in results["reinit"])
    record_figure("nccl_reform_3_to_2", unit="s", reinit=round(worst["reinit"], 4), shrink=round(worst["shrink"], 4),
                  shrink_call=round(max(r["shrink_s"] for r in results["shrink"]), 4), first_init=round(init, 4),
                  allreduce_ms_after={m: round(max(r["allreduce_ms"] for r in rs), 3) for m, rs in results.items()})
    print(f"NCCL 3 -> 2 ranks after a SIGKILL: working group in {worst['shrink']:.3f} s by shrink "
          f"(ncclCommShrink {max(r['shrink_s'] for r in results['shrink']):.3f} s) vs {worst['reinit']:.3f} s by "
          f"abort + init (first init {init:.3f} s)")


@pytest.mark.timeout(420)
def test_nccl_shrink_with_a_collective_in_flight(tmp_path: Path) -> None:
    """As above, but the peer dies while every rank is inside an all-reduce, the survivors'
    training threads blocked in the device sync (the trainer's failure case). ``reinit``:
    the watcher aborts, as the trainer does; ``shrink``: the watcher shrinks with
    SHRINK_ABORT instead, which should end the blocked kernel (else it aborts 3 s later and
    says so). Both must be back with a working group; whether the shrink released the step,
    and the times, go to gpu-check's figures: they decide whether the trainer's failure
    path (which aborts, so cannot shrink today) should shrink from its watcher."""
    from lazarus.runtime.worker._reform import local_shrink_available

    ok, why = local_shrink_available()
    if not ok:
        pytest.skip(f"no NCCL shrink here: {why}")
    results = {mode: _shrink_run(tmp_path, mode, inflight=True) for mode in ("reinit", "shrink")}
    for mode, reports in results.items():
        for r in reports:
            assert "error" not in r, (mode, r["error"], r["log"])
            assert r["steps_before"] >= 1 and r["step_error"], r          # the blocked step failed, in-process
            assert r["blocked_s"] is not None and r["blocked_s"] < 10, r  # back well before the 30 s timeout
            assert (r["device_sum"], r["host_sum"]) == (3.0, 2.0), r
    shrink = results["shrink"]
    record_figure("nccl_reform_3_to_2_inflight", unit="s",
                  reinit=round(max(r["reformed_s"] for r in results["reinit"]), 4),
                  shrink=round(max(r["reformed_s"] for r in shrink), 4),
                  shrink_ok=all(r.get("shrunk_used") for r in shrink),
                  shrink_released_step=all(r.get("shrink_released_step") for r in shrink),
                  shrink_errors=[r["shrink_error"][:120] for r in shrink if "shrink_error" in r])


def _reform_run(tmp_path: Path, reform: str) -> dict[str, dict]:
    """mp_nccl_reform.py: three nodes on one GPU, n2 leaves, n0 and n1 re-form by ``reform``."""
    repo = Path(__file__).resolve().parents[2]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    procs = {}
    for i, node in enumerate(("n0", "n1", "n2")):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_NCCL_", "NCCL_"))}
        env.update(NCCL_HOSTID=f"lazarus-reform-{reform}-host{i}", NCCL_SOCKET_IFNAME="lo", NCCL_P2P_DISABLE="1",
                   NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1", CUDA_VISIBLE_DEVICES=env.get("CUDA_VISIBLE_DEVICES", "0"),
                   PYTHONPATH=os.pathsep.join([str(repo), env.get("PYTHONPATH", "")]))
        procs[node] = subprocess.Popen([sys.executable, str(Path(__file__).parent / "mp_nccl_reform.py"), node,
                                        str(store.port), reform, str(tmp_path / f"{reform}-{node}.json")],
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        reports = {}
        for node, p in procs.items():
            out, _ = p.communicate(timeout=200)
            assert p.returncode == 0, out[-4000:]
            reports[node] = json.loads((tmp_path / f"{reform}-{node}.json").read_text())
            reports[node]["log"] = out[-3000:]
        return reports
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()


@pytest.mark.timeout(480)
def test_trainer_leave_on_nccl_shrinks_or_reinits(tmp_path: Path) -> None:
    """The trainer's own Reconfigurer on NCCL (three nodes on one GPU): a node leaves and the
    two others re-form with ``ElasticConfig.reform="auto"`` (shrink: ncclCommShrink, the
    shrunk communicator attached to a new cpu:gloo group) and ``"reinit"`` (abort + init);
    both groups work, and the times are reported side by side (gpu-check's figures)."""
    from lazarus.runtime.worker._reform import local_shrink_available

    ok, why = local_shrink_available()
    if not ok:
        pytest.skip(f"no NCCL shrink here: {why}")
    runs = {reform: _reform_run(tmp_path, reform) for reform in ("reinit", "auto")}
    for reform, reports in runs.items():
        assert reports["n2"].get("left") is True and "error" not in reports["n2"], reports["n2"]
        for node in ("n0", "n1"):
            r = reports[node]
            assert "error" not in r, (reform, r["error"], r["log"])
            assert r["first_sum"] == 3.0 and r["rank_world"] == [int(node[1]), 2], r
            assert (r["device_sum"], r["host_sum"]) == (3.0, 2.0), r
            assert r["fallbacks"] == [], r        # no failed shrink
            assert r["how"] == ("shrink" if reform == "auto" else "reinit"), r
            assert r["nccl_backends"] >= 1, r
            assert r["reform_logs"] and f"by {r['how']}" in r["reform_logs"][0], r
    worst = {reform: max(reports[n]["reformed_s"] for n in ("n0", "n1")) for reform, reports in runs.items()}
    record_figure("nccl_trainer_leave_3_to_2", unit="s", reinit=round(worst["reinit"], 4),
                  shrink=round(worst["auto"], 4))
    print(f"trainer leave, NCCL 3 -> 2: re-formed in {worst['auto']:.3f} s by shrink vs {worst['reinit']:.3f} s by "
          "abort + init")


@pytest.mark.timeout(600)
def test_one_node_elastic_job_on_cuda_survives_a_killed_worker(tmp_path: Path) -> None:
    """Controller + agent + worker on ``--device cuda`` (NCCL group of one): the worker is
    SIGKILLed, the agent restarts it, it restores from moc (node memory) into CUDA tensors
    and finishes."""
    worker = ["--steps", "40", "--storage", str(tmp_path / "store"), "--layers", "2", "--experts", "4",
              "--d-model", "64", "--d-hidden", "128", "--batch-size", "8", "--seq-len", "32",
              "--corpus-bytes", str(1 << 20), "--interval", "5", "--persist-every", "1", "--snapshot-copies", "1",
              "--collective-timeout", "20s", "--rendezvous-timeout", "60s", "--report-every", "5",
              "--device", "cuda", "--digests", str(tmp_path / "digest-{node}.json")]
    controller = ["--slots", "4", "--min-replicas", "1", "--expected-nodes", "1", "--heartbeat-timeout", "5s",
                  "--join-window", "1s"]
    with LocalCluster(tmp_path / "job", worker_args=worker, controller_args=controller,
                      agent_args=["--heartbeat-interval", "250ms"]) as c:
        c.start(["n0"])
        c.wait_step(12, timeout=300)
        c.kill_worker("n0")
        assert c.wait(timeout=400) == 0, (c.dir / "controller.log").read_text()[-3000:]
        c.agents["n0"].wait(timeout=60)
        log = (c.dir / "node-n0.log").read_text()
        assert "backend nccl" in log and "device cuda" in log, log[-3000:]
        starts = [r for r in c.reconfigurations() if r.get("reason") == "start"]
        assert len(starts) == 2 and starts[1]["step"] >= 10, starts      # resumed from a checkpoint
    digest = json.loads((tmp_path / "digest-n0.json").read_text())
    assert digest["step"] == 40
    losses = [loss for _, loss in digest["losses"]]
    assert losses[-1] < losses[0]


def test_the_step_reduction_reads_the_device_once() -> None:
    """The step's own machinery (``all_reduce_step``: the experts' squared norm, the plan
    agreement and the loss) syncs the host exactly once per step on the GPU: one
    synchronizing operation reported by sync debug mode "warn"."""
    from lazarus.runtime.worker._step_reduce import all_reduce_step

    p = torch.nn.Parameter(torch.zeros(64, device="cuda"))
    p.grad = torch.ones(64, device="cuda")
    expert_sq = p.grad.double().pow(2).sum()          # a device scalar, as the layer's expert_grad_sq()
    loss = (p.grad * 3).sum()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            totals = all_reduce_step([(p, lambda g: g)], sums=[expert_sq], maxima=[3], local=[loss],
                                     rank=0, world=1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert totals.sums == [64.0] and totals.maxima == [3] and totals.local == [192.0]
