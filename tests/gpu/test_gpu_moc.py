"""moc on CUDA: snapshots copied on a side stream into page-locked shared memory, ordered
after ``optimizer.step()`` and before the next update by events; restores into CUDA
parameters and optimizer state (and the CUDA RNG); FSDP2 (DTensor) parameters on CUDA.
Each test asserts the asynchronous path was the one taken (buffers page-locked, copies
into pinned memory on the side stream, no fallback), so none passes on the slow path.

Run with ``make test-gpu`` (skipped without a GPU).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

from gpu_common import GPU, free_port, shm_dir, to_host  # noqa: F401 - shm_dir is a fixture
from moc import CheckpointManager, MoCConfig
from moc._cuda.copies import CudaCopier, live_registrations
from examples.toy_moe import BigramTask, ToyMoE

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
        for layer, counts in model.routing_counts().items():   # CUDA tensors, as a model on the GPU has them
            ckpt.record_routing(layer, counts)
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


def settle(ckpt) -> None:
    """Wait for the snapshot in flight and every buffer's upkeep (page-locking)."""
    ckpt.wait(flush=False)
    for b in ckpt.pool.buffers:
        b.settle()


def assert_page_locked(ckpt, shm: str) -> None:
    used = [b for b in ckpt.pool.buffers if b.capacity]
    assert used and all(b.pinned and b.data.is_pinned() for b in used), \
        (f"snapshot buffers in {shm} were not page-locked (is it on tmpfs?): "
         f"{ckpt.status()['page_lock_error']}")
    assert len(live_registrations()) == len(used)


def test_cuda_snapshot_uses_a_side_stream_and_page_locked_buffers(tmp_path, shm_dir) -> None:
    """Steady-state snapshots take the asynchronous path: page-locked buffers (no
    registration left to do), every device-to-host copy into pinned memory ("Device ->
    Pinned" in the profiler, never "Pageable") on another stream than the training
    kernels, and the snapshot thread's CUDA calls on the model's device."""
    from torch.profiler import ProfilerActivity, profile

    model, opt, task = make()
    with CheckpointManager(cfg(tmp_path, shm_dir, k_snapshot=1, dynamic_k=False), model=model, optimizer=opt) as ckpt:
        for step in range(5):                   # the buffers are created, then page-locked in the background
            train_step(model, opt, task, step, ckpt)
            settle(ckpt)
        engine = ckpt.engine
        assert isinstance(engine.copier, CudaCopier)
        assert engine.copier.devices == [torch.device("cuda", torch.cuda.current_device())]
        assert_page_locked(ckpt, shm_dir)
        before = ckpt.status()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for step in range(5, 8):
                train_step(model, opt, task, step, ckpt)
            ckpt.wait(flush=False)
            torch.cuda.synchronize()
        st = ckpt.status()
        assert st["device_snapshots_async"] - before["device_snapshots_async"] == 3, st
        assert st["device_snapshots_fallback"] == before["device_snapshots_fallback"], st
        assert engine.device_copy_seconds is not None and engine.device_copy_seconds > 0
        assert st["snapshot_failures"] == 0 and st["last_snapshot_step"] == 7 and st["page_lock_error"] is None

        events = list(prof.profiler.kineto_results.events())
        kernels = [e for e in events if e.device_type() == torch.autograd.DeviceType.CUDA
                   and "Memcpy" not in e.name() and "Memset" not in e.name()]
        d2h = [e for e in events if "Memcpy DtoH" in e.name()]
        assert d2h and kernels, "the profiler saw no CUDA activity: the test proves nothing"
        train_streams = {e.device_resource_id() for e in kernels}
        side = [e for e in d2h if e.device_resource_id() not in train_streams]
        on_train = [e for e in d2h if e.device_resource_id() in train_streams]   # loss.item(), nonzero()
        assert side, f"no device-to-host copy off the training stream(s) {train_streams}"
        assert all("Pinned" in e.name() for e in side), sorted({e.name() for e in side})
        side_ns, train_ns = sum(e.duration_ns() for e in side), sum(e.duration_ns() for e in on_train)
        assert train_ns < 0.1 * side_ns, (train_ns, side_ns)   # the snapshot's bytes did not go that way


def test_step_issues_copies_and_the_update_waits_on_the_device(tmp_path, shm_dir) -> None:
    """With the training stream busy (a 0.2 s device sleep queued behind the update), the
    copies cannot have started when ``step()`` returns nor when the next update is queued
    right after it: neither call blocks the host, and the pre-hook's wait is booked as a
    stall measured on the device with CUDA events (not wall time around a call that
    includes earlier work): about the copies' own device time, the training stream having
    nothing else to do meanwhile."""
    model, opt, task = make(dim=1024, hidden=4096)          # ~1.5 GB of state
    with CheckpointManager(cfg(tmp_path, shm_dir, interval=2, dynamic_k=False), model=model, optimizer=opt) as ckpt:
        for step in range(6):                   # checkpoints 0, 2, 4; buffers sized and page-locked
            train_step(model, opt, task, step, ckpt)
            settle(ckpt)
        assert_page_locked(ckpt, shm_dir)
        x, y = task.batch(6, 1024)
        opt.zero_grad()
        F.cross_entropy(model(x.cuda()), y.cuda()).backward()
        opt.step()
        torch.cuda.synchronize()
        before = ckpt.status()
        torch.cuda._sleep(int(0.2 * torch.cuda.clock_rate() * 1e6))   # clock_rate() is in MHz
        t0 = time.perf_counter()
        ckpt.step(6)                            # a checkpoint; the previous one is complete (settled)
        call = time.perf_counter() - t0
        batch = ckpt.engine._batch
        assert batch is not None and not batch.query(), "the copies were not issued asynchronously"
        t0 = time.perf_counter()
        opt.step()                              # same gradients: the pre-hook orders it after the copies
        hook = time.perf_counter() - t0
        ckpt.wait(flush=False)
        torch.cuda.synchronize()
        ckpt.engine.collect_device_stall()
        st = ckpt.status()
        copy = ckpt.engine.device_copy_seconds
        assert st["device_snapshots_async"] == before["device_snapshots_async"] + 1, st
        assert st["device_snapshots_fallback"] == before["device_snapshots_fallback"], st
        assert call < 0.2 and hook < 0.2, (call, hook)       # the host went on while the device waited
        assert st["stalls"] == before["stalls"] + 1, st
        assert 0.5 * copy <= st["stall_seconds_last"] <= copy + 0.05, (st["stall_seconds_last"], copy)


def test_snapshot_never_sees_the_next_update(tmp_path, shm_dir) -> None:
    """The next optimizer step is queued right behind the snapshot's copies (asynchronous,
    into a page-locked buffer); the event the update waits on keeps it from overwriting
    what is being copied."""
    model, opt, task = make(dim=1024, hidden=4096)
    with CheckpointManager(cfg(tmp_path, shm_dir, interval=3, dynamic_k=False), model=model, optimizer=opt) as ckpt:
        for step in range(9):                      # checkpoints 0, 3, 6: each buffer created and page-locked
            train_step(model, opt, task, step, ckpt)
            settle(ckpt)
        assert_page_locked(ckpt, shm_dir)
        before = ckpt.status()["device_snapshots_async"]
        x, y = task.batch(9, 1024)
        loss = F.cross_entropy(model(x.cuda()), y.cuda())
        opt.zero_grad()
        loss.backward()
        opt.step()
        truth = snapshot_of_now(model, opt)        # the state after step 9
        ckpt.step(9)                               # interval 3: checkpoints step 9
        train_step(model, opt, task, 10)           # the update of step 10 follows at once
        train_step(model, opt, task, 11)
        step, trees = ckpt.snapshot_state()
        assert step == 9
        assert ckpt.status()["device_snapshots_async"] == before + 1, "the slow path was taken"
        assert assert_units_match(trees, truth) > 0
        after = snapshot_of_now(model, opt)
        changed = [k for k, v in truth["model"].items() if not torch.equal(v, after["model"][k])]
        assert changed, "training did not move the weights: the test proves nothing"


def test_restore_into_cuda_from_memory_and_from_storage(tmp_path, shm_dir) -> None:
    model, opt, task = make()
    torch.cuda.manual_seed(4321)
    torch.rand(3, device="cuda")                   # a CUDA RNG state of its own
    with CheckpointManager(cfg(tmp_path, shm_dir, interval=2), model=model, optimizer=opt) as ckpt:
        for step in range(9):                      # checkpoints 0, 2, 4, 6, 8: the first use of each of the
            train_step(model, opt, task, step, ckpt)   # three buffers copies on the host (not page-locked yet),
            settle(ckpt)                           # then they are: 6 and 8 copy on the side stream
        ckpt.wait()
        assert ckpt.status()["device_snapshots_async"] >= 1, ckpt.status()
        ckpt.close(keep_snapshots=True)
    torch.cuda.synchronize()
    truth = snapshot_of_now(model, opt)
    cuda_rng = torch.cuda.get_rng_state()          # training used no CUDA randomness since step 8
    reference_loss = train_step(model, opt, task, 9)

    for level in ("memory", "storage"):
        if level == "storage":
            for name in os.listdir(shm_dir):
                for f in os.listdir(os.path.join(shm_dir, name)):
                    os.remove(os.path.join(shm_dir, name, f))
        m2, o2, _ = make(seed=123)
        torch.cuda.manual_seed(99)
        assert not torch.equal(torch.cuda.get_rng_state(), cuda_rng)
        with CheckpointManager(cfg(tmp_path, shm_dir, interval=2), model=m2, optimizer=o2) as ck2:
            assert ck2.restore() == 9
            torch.cuda.synchronize()
            assert torch.equal(torch.cuda.get_rng_state(), cuda_rng), level
            got = snapshot_of_now(m2, o2)
            for k, v in truth["model"].items():
                assert torch.equal(got["model"][k], v), (level, k)
            for p, st in o2.state.items():
                assert st["exp_avg"].is_cuda and st["exp_avg_sq"].is_cuda
                assert not st["step"].is_cuda          # Adam (not capturable) keeps step on the host
            for k, st in truth["optim"].items():
                for name, v in st.items():
                    assert torch.equal(got["optim"][k][name], v), (level, k, name)
            assert train_step(m2, o2, task, 9) == pytest.approx(reference_loss, rel=1e-6)
            ck2.close(keep_snapshots=True)
        assert not live_registrations()


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


def test_record_routing_of_cuda_counts_never_waits_for_the_device(tmp_path, shm_dir) -> None:
    """``ckpt.record_routing`` with the CUDA counts a model on the GPU has, every step:
    no host sync in the call (torch's sync debug mode set to error), and the PLT counters
    hold exactly the counts given once they are read."""
    model, opt, task = make(dim=64, hidden=128)
    layers = list(model.routing_counts())
    given = {layer: torch.zeros(8, dtype=torch.int64) for layer in layers}
    with CheckpointManager(cfg(tmp_path, shm_dir, interval=4, k_snapshot=2, dynamic_k=False),
                           model=model, optimizer=opt) as ckpt:
        for step in range(10):
            train_step(model, opt, task, step, batch=256)      # no ckpt: the test feeds it below
            counts = model.routing_counts()
            assert all(c.is_cuda for c in counts.values())
            torch.cuda.set_sync_debug_mode("error")
            try:
                for layer, c in counts.items():
                    ckpt.record_routing(layer, c)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            for layer, c in counts.items():
                given[layer] += c.cpu()
            ckpt.step(step)
        ckpt.policy.sync_routing(ckpt._drain)
        for layer in layers:
            assert ckpt.policy.tracker.cum[layer] == given[layer].tolist(), layer
        assert int(given[layers[0]].sum()) == 10 * 256


class _IdsRouter(torch.nn.Module):
    """A router like transformers' (scores, top-k ids): moc's taps read the ids."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(dim, experts, bias=False)

    def forward(self, x: torch.Tensor):
        probs = self.proj(x).softmax(-1)
        return probs, probs.topk(1, dim=-1).indices


def test_router_taps_read_cuda_routing_without_waiting_for_the_device(tmp_path, shm_dir) -> None:
    """Routing that only moc's taps read (no record_routing): a checkpoint's ``step()``
    queued behind a 0.2 s device sleep returns without waiting for it (the readings are
    chosen and checked on the GPU, their flags copied without waiting), and the PLT
    counters end equal to the ids the routers returned."""
    model, opt, task = make(dim=64, hidden=128)
    for block in model.layers:                       # swap the logits router for an ids router
        block.moe.router = _IdsRouter(64, 8).cuda()

        def forward(x, moe=block.moe):
            flat = x.reshape(-1, x.shape[-1])
            _, idx = moe.router(flat)
            out = torch.zeros_like(flat)
            for e, expert in enumerate(moe.experts):
                rows = (idx[:, 0] == e).nonzero(as_tuple=True)[0]
                out.index_add_(0, rows, expert(flat[rows]))
            moe.last_counts = torch.bincount(idx.reshape(-1), minlength=len(moe.experts))
            return out.reshape(x.shape)
        block.moe.forward = forward
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    given = {f"layers.{i}.moe": torch.zeros(8, dtype=torch.int64) for i in range(len(model.layers))}
    with CheckpointManager(cfg(tmp_path, shm_dir, interval=2, k_snapshot=2, dynamic_k=False),
                           model=model, optimizer=opt) as ckpt:
        for step in range(8):
            train_step(model, opt, task, step, batch=256)      # no ckpt: the taps read the routing
            for layer, c in model.routing_counts().items():
                given[layer] += c.cpu()
            if step == 6:                            # a checkpoint step, buffers page-locked by now
                settle(ckpt)
                torch.cuda._sleep(int(0.2 * torch.cuda.clock_rate() * 1e6))
                t0 = time.perf_counter()
                ckpt.step(step)
                assert time.perf_counter() - t0 < 0.2, "step() waited for the device"
            else:
                ckpt.step(step)
        torch.cuda.synchronize()
        ckpt.policy.sync_routing(ckpt._drain)
        for layer, total in given.items():
            assert ckpt.policy.tracker.cum[layer] == total.tolist(), layer


def test_late_copies_allocate_page_locked_memory_once() -> None:
    """Routing counts and check flags go to the host through LateCopies: on the GPU the
    same shapes every step reuse one page-locked tensor (no pinned allocation per copy),
    and the values that arrive are the device's."""
    from moc._cuda.copies import LateCopies

    copies: LateCopies[str] = LateCopies(torch.cat)
    for step in range(20):
        counts = torch.arange(8, device="cuda") * step
        copies.send([(counts, "layer")])
        [(host, labels)] = copies.arrived(wait=True)
        assert host.is_pinned() and host.tolist() == (torch.arange(8) * step).tolist() and labels == ["layer"]
    assert copies.allocations == 1
