"""moc on CUDA: snapshots copied on a side stream into page-locked shared memory, ordered
after ``optimizer.step()`` and before the next update by events; restores into CUDA
parameters and optimizer state; FSDP2 (DTensor) parameters on CUDA.

Run with ``make test-gpu`` (skipped without a GPU).
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

from gpu_common import GPU, free_port, shm_dir, to_host  # noqa: F401 - shm_dir is a fixture
from moc import CheckpointManager, MoCConfig
from moc._device_copy import CudaCopier
from moc._toy import BigramTask, ToyMoE

pytestmark = GPU

VOCAB = 256


def make(seed: int = 0, *, dim: int = 512, hidden: int = 2048, layers: int = 2, experts: int = 8):
    torch.manual_seed(seed)
    model = ToyMoE(vocab=VOCAB, dim=dim, hidden=hidden, num_layers=layers, num_experts=experts).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt, BigramTask(vocab=VOCAB, seed=0)


def train_step(model, opt, task, step: int, ckpt=None, batch: int = 1024) -> float:
    x, y = task.batch(step, batch)
    loss = F.cross_entropy(model(x.cuda()), y.cuda())
    opt.zero_grad()
    loss.backward()
    opt.step()
    if ckpt is not None:
        ckpt.step(step)
    return loss.item()


def snapshot_of_now(model, opt) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {"model": to_host(model.state_dict()),
            "optim": {names[id(p)]: to_host(dict(st)) for p, st in opt.state.items()}}


def cfg(tmp_path, shm: str, **kw) -> MoCConfig:
    kw.setdefault("interval", 1)
    return MoCConfig(storage=str(tmp_path / "ckpt"), snapshot_dir=shm, **kw)


def assert_units_match(trees: dict, truth: dict) -> int:
    """Every tensor of every snapshotted unit equals the truth; returns how many."""
    n = 0
    for unit, tree in trees.items():
        for key, value in tree.get("model", {}).items():
            assert torch.equal(value.cpu(), truth["model"][key]), (unit, key)
            n += 1
        for key, st in tree.get("optimizer", {}).get("state", {}).items():
            for name, v in st.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v.cpu().reshape(truth["optim"][key][name].shape), truth["optim"][key][name]), \
                        (unit, key, name)
                    n += 1
    return n


def test_cuda_snapshot_uses_a_side_stream_and_page_locked_buffers(tmp_path, shm_dir) -> None:
    model, opt, task = make()
    with CheckpointManager(cfg(tmp_path, shm_dir), model=model, optimizer=opt) as ckpt:
        for step in range(4):
            train_step(model, opt, task, step, ckpt)
        ckpt.wait(flush=False)
        engine = ckpt.engine
        assert isinstance(engine.copier, CudaCopier)
        assert engine.copier.devices == [torch.device("cuda", torch.cuda.current_device())]
        used = [b for b in ckpt.pool.buffers if b.capacity]
        assert used and all(b.pinned and b.data.is_pinned() for b in used), \
            f"snapshot buffers in {shm_dir} were not page-locked (is it on tmpfs? see the log's cudaHostRegister line)"
        assert engine.device_copy_seconds is not None and engine.device_copy_seconds > 0
        st = ckpt.status()
        assert st["snapshot_failures"] == 0 and st["last_snapshot_step"] == 3


def test_step_returns_before_the_device_copies_finish(tmp_path, shm_dir) -> None:
    """The copies run on the device while the host goes on: the host time of ``step()``
    (planning + issuing) is shorter than the copies themselves (~1.6 GB of state)."""
    model, opt, task = make(dim=1024, hidden=4096)
    with CheckpointManager(cfg(tmp_path, shm_dir), model=model, optimizer=opt) as ckpt:
        for step in range(4):                   # buffers reach their size at the first ones
            train_step(model, opt, task, step, ckpt)
        ckpt.wait(flush=False)
        call, copy = ckpt.status()["step_call_seconds_last"], ckpt.engine.device_copy_seconds
        assert call < copy, (call, copy)


def test_snapshot_never_sees_the_next_update(tmp_path, shm_dir) -> None:
    """The next optimizer step is queued right behind the snapshot's copies; the event the
    update waits on keeps it from overwriting what is being copied."""
    model, opt, task = make(dim=1024, hidden=4096)
    with CheckpointManager(cfg(tmp_path, shm_dir, interval=3), model=model, optimizer=opt) as ckpt:
        for step in range(3):                      # checkpoints step 0 (a run's first step)
            train_step(model, opt, task, step, ckpt)
        x, y = task.batch(3, 1024)
        loss = F.cross_entropy(model(x.cuda()), y.cuda())
        opt.zero_grad()
        loss.backward()
        opt.step()
        truth = snapshot_of_now(model, opt)        # the state after step 3
        ckpt.step(3)                               # interval 3: checkpoints step 3
        train_step(model, opt, task, 4)            # the update of step 4 follows at once
        train_step(model, opt, task, 5)
        step, trees = ckpt.snapshot_state()
        assert step == 3
        assert assert_units_match(trees, truth) > 0
        after = snapshot_of_now(model, opt)
        changed = [k for k, v in truth["model"].items() if not torch.equal(v, after["model"][k])]
        assert changed, "training did not move the weights: the test proves nothing"


def test_restore_into_cuda_from_memory_and_from_storage(tmp_path, shm_dir) -> None:
    model, opt, task = make()
    with CheckpointManager(cfg(tmp_path, shm_dir, interval=2), model=model, optimizer=opt) as ckpt:
        for step in range(5):                      # checkpoints 0, 2, 4
            train_step(model, opt, task, step, ckpt)
        ckpt.wait()
        ckpt.close(keep_snapshots=True)
    torch.cuda.synchronize()
    truth = snapshot_of_now(model, opt)
    reference_loss = train_step(model, opt, task, 5)

    for level in ("memory", "storage"):
        if level == "storage":
            for name in os.listdir(shm_dir):
                for f in os.listdir(os.path.join(shm_dir, name)):
                    os.remove(os.path.join(shm_dir, name, f))
        m2, o2, _ = make(seed=123)
        with CheckpointManager(cfg(tmp_path, shm_dir, interval=2), model=m2, optimizer=o2) as ck2:
            assert ck2.restore() == 5
            torch.cuda.synchronize()
            got = snapshot_of_now(m2, o2)
            for k, v in truth["model"].items():
                assert torch.equal(got["model"][k], v), (level, k)
            for p, st in o2.state.items():
                assert st["exp_avg"].is_cuda and st["exp_avg_sq"].is_cuda
                assert not st["step"].is_cuda          # Adam (not capturable) keeps step on the host
            for k, st in truth["optim"].items():
                for name, v in st.items():
                    assert torch.equal(got["optim"][k][name], v), (level, k, name)
            assert train_step(m2, o2, task, 5) == pytest.approx(reference_loss, rel=1e-6)
            ck2.close(keep_snapshots=True)


@pytest.mark.timeout(300)
def test_fsdp2_dtensor_parameters_on_cuda(tmp_path, shm_dir) -> None:
    """FSDP2 on a one-rank NCCL mesh: DTensor shards on the GPU are snapshotted as local
    shards and restored into a fresh FSDP2 model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cuda", (1,))

        def build(seed: int):
            model, _, task = make(seed)
            for block in model.layers:          # the modules ToyMoE calls (blocks have no forward)
                fully_shard(block.norm, mesh=mesh)
                fully_shard(block.moe, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model, torch.optim.Adam(model.parameters(), lr=1e-3), task

        model, opt, task = build(0)
        assert any(hasattr(p, "device_mesh") for p in model.parameters())
        with CheckpointManager(cfg(tmp_path, shm_dir, interval=2), model=model, optimizer=opt) as ckpt:
            for step in range(3):                  # checkpoints 0, 2
                train_step(model, opt, task, step, ckpt)
            ckpt.wait()
            assert isinstance(ckpt.engine.copier, CudaCopier)
            ckpt.close(keep_snapshots=True)
        torch.cuda.synchronize()
        truth = snapshot_of_now(model, opt)
        m2, o2, _ = build(77)
        with CheckpointManager(cfg(tmp_path, shm_dir, interval=2), model=m2, optimizer=o2) as ck2:
            assert ck2.restore() == 3
            torch.cuda.synchronize()
            got = snapshot_of_now(m2, o2)
            for k, v in truth["model"].items():
                assert torch.equal(got["model"][k], v), k
            for k, st in truth["optim"].items():
                for name, v in st.items():
                    assert torch.equal(got["optim"][k][name], v), (k, name)
    finally:
        dist.destroy_process_group()
