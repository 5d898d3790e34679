"""Lazarus on one GPU: the backend follows the device, an NCCL group is aborted (not
destroyed) and re-formed in the same process, the MoE layer dispatches with the CUDA
kernel, and a one-node elastic job on CUDA survives a killed worker (moc restore into
CUDA tensors).

One GPU cannot host several NCCL ranks (NCCL refuses two ranks on one device), so the
multi-rank NCCL recovery (a survivor aborting a communicator shared with a dead peer) is
not covered here. Run with ``make test-gpu`` (skipped without a GPU).
"""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gpu_common import GPU, free_port
from lazarus._local_cluster import LocalCluster
from lazarus.dispatch import dispatch_counts, dispatch_device, dispatch_permutation, load_ops
from lazarus.moe import MoEConfig, MoELayer
from lazarus.planning import Placement
from lazarus.runtime._abort import GroupAborter, nccl_backends
from lazarus.runtime._backend import nccl_environment, resolve_backend

pytestmark = GPU


def test_the_backend_follows_the_gpu() -> None:
    auto = resolve_backend("auto", "auto", local_rank=0)
    assert auto.device == torch.device("cuda", 0) and auto.backend == "nccl"
    assert auto.init_backend == "cpu:gloo,cuda:nccl"
    assert resolve_backend("cuda", "gloo").backend == "gloo"     # the override
    assert resolve_backend("cpu", "auto").backend == "gloo"


@pytest.mark.timeout(180)
def test_nccl_group_is_aborted_and_reformed_in_process(monkeypatch) -> None:
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    nccl_environment("test")
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=60))
    aborter = GroupAborter("nccl")
    for generation in range(3):
        with aborter.sockets.track():
            dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.PrefixStore(f"gen{generation}", store),
                                    rank=0, world_size=1, timeout=timedelta(seconds=30))
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


def test_moe_layer_dispatches_with_the_cuda_kernel() -> None:
    state = load_ops()
    if not state.cuda:
        pytest.skip(f"the CUDA dispatch kernel did not build here: {state.reason or 'no nvcc / CUDA_HOME'}")
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

    cfg = MoEConfig(d_model=64, d_hidden=128, num_experts=8, top_k=2, seed=3)
    host_layer = MoELayer(cfg, Placement([list(range(8))]))
    cuda_layer = copy.deepcopy(host_layer).cuda()
    x = torch.randn(512, 64, generator=g)
    xh, xc = x.clone().requires_grad_(), x.cuda().requires_grad_()
    yh, yc = host_layer(xh), cuda_layer(xc)
    torch.testing.assert_close(yc.cpu(), yh, atol=1e-4, rtol=1e-4)
    yh.square().sum().backward()
    yc.square().sum().backward()
    torch.testing.assert_close(xc.grad.cpu(), xh.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cuda_layer.router.weight.grad.cpu(), host_layer.router.weight.grad, atol=1e-4, rtol=1e-4)
    assert torch.equal(cuda_layer.routing_counts, host_layer.routing_counts)


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
