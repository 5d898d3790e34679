"""moc's CUDA snapshot path under a fake CUDA runtime (``tests/helpers/fake_cuda.py``) that keeps
CUDA's rules: page-locking registered once per range, released before a truncate or a
new mapping, never inside ``step()``, all released at close / detach; background threads
bound to the model's device; detach waiting for copies in flight; CUDA RNG states saved
and restored. The real GPU path is exercised by ``tests/gpu`` (``make test-gpu``)."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import pytest
import torch

from tests.helpers.fake_cuda import ALREADY_REGISTERED, NOT_REGISTERED, CudaRuleViolation, FakeCuda
from moc import CheckpointManager, MoCConfig
from moc._cuda.copies import CudaCopier, live_registrations
from moc._snapshot.buffers import BufferPool
from tests.helpers.moc_helpers import clone_state, make, train_step

DEVICE = 1      # the rank's GPU: not 0, so a thread that never bound its device shows up


class Blob:
    """Extra state whose size the test changes (forces buffers to grow mid-run)."""

    def __init__(self) -> None:
        self.numel = 16

    def state_dict(self) -> dict:
        return {"x": torch.arange(self.numel, dtype=torch.float32)}

    def load_state_dict(self, sd: dict) -> None:
        self.numel = sd["x"].numel()


def cfg(tmp_path, **kw) -> MoCConfig:
    kw.setdefault("interval", 1)
    return MoCConfig(storage=str(tmp_path / "ckpt"), snapshot_dir=str(tmp_path / "shm"), **kw)


def on_device(fake: FakeCuda, model, opt) -> None:
    """What ``.cuda(DEVICE)`` would do: parameters and optimizer moments on the device
    (Adam's ``step`` stays a host scalar, as in torch)."""
    fake.set_device(DEVICE)       # the training thread, as torch.cuda.set_device(local_rank)
    tensors = list(model.parameters())
    for st in opt.state.values():
        tensors += [v for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    fake.place(tensors, DEVICE)


def settle(ckpt: CheckpointManager) -> None:
    """Wait for the snapshot in flight and then for every buffer's upkeep thread."""
    ckpt.wait(flush=False)
    for b in ckpt.pool.buffers:
        b.settle()


def assert_pinned_exactly(fake: FakeCuda, ckpt: CheckpointManager) -> None:
    """One live registration per buffer in use, covering exactly its capacity."""
    used = [b for b in ckpt.pool.buffers if b.capacity]
    assert used and all(b.pinned for b in used), [(b.index, b.capacity, b.pin_error) for b in used]
    assert sorted((r.ptr, r.nbytes) for r in fake.live.values()) == \
        sorted((b.data.data_ptr(), b.capacity) for b in used)
    assert len(live_registrations()) == len(used)


@pytest.fixture
def fake():
    f = FakeCuda(device_count=2)
    with f.installed():
        yield f
        leftover = live_registrations()
        for reg in leftover:       # not to spill into the next test
            reg.release()
    assert not leftover, f"{len(leftover)} registration(s) outlived their manager"


def test_the_fake_enforces_cudas_rules(tmp_path, fake) -> None:
    """The rules the lifecycle tests rely on fail where CUDA would."""
    t = torch.from_file(str(tmp_path / "f.bin"), shared=True, size=1 << 16, dtype=torch.uint8)
    assert fake.host_register(t.data_ptr(), 1 << 16) == 0
    assert fake.host_register(t.data_ptr() + 4096, 4096) == ALREADY_REGISTERED       # overlap
    assert fake.host_unregister(t.data_ptr() + 4096) == NOT_REGISTERED               # not a start
    with pytest.raises(CudaRuleViolation, match="cuts into"):
        __import__("os").truncate(tmp_path / "f.bin", 4096)
    assert __import__("os").path.getsize(tmp_path / "f.bin") == 1 << 16            # refused, not done
    assert fake.host_unregister(t.data_ptr()) == 0 and not fake.live
    __import__("os").truncate(tmp_path / "f.bin", 4096)                              # fine once released
    ptr = t.data_ptr()
    assert fake.host_register(ptr, 4096) == 0
    del t                                                                            # unmapped while registered
    with pytest.raises(CudaRuleViolation, match="unmapped|another file"):
        fake.check()
    fake.live.clear()
    fake.violations.clear()
    assert [e[1] for e in fake.errors] == [ALREADY_REGISTERED, NOT_REGISTERED]
    assert fake.contexts == {0: {threading.current_thread().name}}                   # device 0 unless set


def test_buffer_resizes_keep_one_registration_per_range(tmp_path, fake) -> None:
    """Grow within the mapping, grow past it (new mapping), shrink (deferred truncate),
    each followed by the upkeep: exactly one registration covering the capacity, never
    two over one range, none cut by a truncate; released by unpin/remove_files."""
    pool = BufferPool(str(tmp_path / "bufs"))
    buf = pool.buffers[0]
    dev = torch.device("cuda", DEVICE)
    for nbytes in (1 << 20, 3 << 20, 8 << 20, 1 << 20, 5 << 20, 12 << 20, 2 << 20):
        buf.ensure(nbytes, pin=dev, defer_upkeep=True)
        assert buf.capacity >= nbytes
        buf.data[:nbytes].fill_(7)                       # the snapshot's copies
        buf.start_upkeep()
        buf.settle()
        assert buf.pinned and list(fake.live) == [buf.data.data_ptr()], nbytes
        assert fake.live[buf.data.data_ptr()].nbytes == buf.capacity
        assert __import__("os").path.getsize(buf.path) == buf.capacity
    assert not fake.errors and not fake.violations
    assert all(r.thread == "moc-buffer0-upkeep" for r in fake.registered)
    assert set(fake.contexts) == {DEVICE}
    pool.unpin()
    assert not fake.live and not buf.pinned and buf.capacity      # contents and mapping stay
    buf.ensure(1 << 20, pin=dev)
    buf.settle()
    assert len(fake.live) == 1
    pool.remove_files()
    assert not fake.live and not fake.violations


@pytest.mark.timeout(120)
def test_k1_run_with_resizes_stays_pinned_and_never_registers_in_step(tmp_path, fake, monkeypatch) -> None:
    """A run of K=1 partial snapshots on (fake) cuda:1 with the buffers resized (the full
    first checkpoint's buffer shrinks, then extra state grows past two mappings): every
    buffer ends page-locked, no registration ever runs on the training thread or during a
    steady-state ``step()``, steady-state snapshots take the asynchronous path, no CUDA
    rule is broken, every thread works on cuda:1, and close() releases everything."""
    model, opt, task = make(0, dim=64, hidden=256)             # ~6 MB of state, 8 experts x 2 layers
    train_step(model, opt, task, 0)                            # Adam's moments exist
    on_device(fake, model, opt)
    blob = Blob()
    in_step = []
    ckpt = CheckpointManager(cfg(tmp_path, k_snapshot=1, k_persist=1, persist_every=4, dynamic_k=False),
                             model=model, optimizer=opt, extra_state={"blob": blob})
    real_step = ckpt.step

    def step(s: int) -> None:
        before = len(fake.registered)
        real_step(s)
        in_step.append((s, len(fake.registered) - before))

    monkeypatch.setattr(ckpt, "step", step)
    assert ckpt.status()["buffers_page_locked"] == 0

    def run(steps, *, one_by_one: bool = False) -> tuple[int, int]:
        st0 = ckpt.status()
        for s in steps:
            train_step(model, opt, task, s, ckpt)
            if one_by_one:        # no persist in flight: the buffers are taken in turn
                ckpt.wait(flush=False)
        st = ckpt.status()
        return (st["device_snapshots_async"] - st0["device_snapshots_async"],
                st["device_snapshots_fallback"] - st0["device_snapshots_fallback"])

    # warm-up: the full first checkpoint (buffer 0), K=1 ones (buffers 1, 2), buffer 0 shrinks at step 4
    run(range(1, 6), one_by_one=True)
    settle(ckpt)
    assert isinstance(ckpt.engine.copier, CudaCopier) and ckpt.engine.copier.devices == [torch.device("cuda", DEVICE)]
    assert_pinned_exactly(fake, ckpt)
    assert ckpt.status()["device_snapshots_async"] >= 1        # the shrink kept its old registration

    registered = len(fake.registered)
    in_step.clear()
    assert run(range(6, 12)) == (6, 0)                          # steady state: all asynchronous
    assert len(fake.registered) == registered and all(n == 0 for _, n in in_step), in_step
    settle(ckpt)
    assert len(fake.registered) == registered

    blob.numel = 3 << 18                                        # +3 MB: the buffers grow as they are used
    run(range(12, 16), one_by_one=True)
    settle(ckpt)
    assert_pinned_exactly(fake, ckpt)
    assert len(fake.registered) > registered                    # the grown buffers were page-locked again
    registered = len(fake.registered)
    in_step.clear()
    # One snapshot at a time, the buffers are taken in the same turn as above (the ones
    # just grown): all asynchronous. Overlapping snapshots may take a buffer that has not
    # grown yet, by timing; its growing snapshot is then copied by the snapshot thread.
    assert run(range(16, 20), one_by_one=True) == (4, 0)
    assert len(fake.registered) == registered and all(n == 0 for _, n in in_step), in_step

    assert not fake.errors, fake.errors                         # no 712, no unknown unregister
    assert not fake.violations, fake.violations                 # no truncate/unmap of a registered range
    assert fake.registrations_by(threading.current_thread().name) == []
    assert {r.thread for r in fake.registered} <= {f"moc-buffer{i}-upkeep" for i in range(3)}
    assert set(fake.contexts) == {DEVICE}, fake.contexts        # no context on GPU 0 from any thread
    ckpt.wait(flush=False)
    st = ckpt.status()
    assert st["buffers_page_locked"] == 3 and st["page_lock_error"] is None
    assert st["snapshot_failures"] == 0 and st["last_snapshot_step"] == 19

    step_no, trees = ckpt.snapshot_state()
    truth = clone_state(model, opt)
    assert step_no == 19
    for unit, tree in trees.items():
        for key, value in tree.get("model", {}).items():
            assert torch.equal(value, truth["model"][key]), (unit, key)
    ckpt.close()
    assert not fake.live and not live_registrations()
    assert not fake.violations and not fake.errors
    fake.check()


@pytest.mark.timeout(120)
def test_steady_state_training_thread_never_waits_on_the_device(tmp_path, monkeypatch) -> None:
    """K=1 snapshots on (fake) cuda:1 whose copies take device time: in steady state the
    training thread makes no host wait on the device (no event or stream ``synchronize``)
    in ``step()`` or in the optimizer's pre-hook, and the pre-hook books no host stall:
    the update is ordered after the copies on the device; the snapshot thread waits."""
    fake = FakeCuda(device_count=2, copy_seconds=0.02)
    with fake.installed():
        model, opt, task = make(0, dim=64, hidden=256)
        train_step(model, opt, task, 0)
        on_device(fake, model, opt)
        # interval 2: every other update follows a snapshot whose copies it was already
        # ordered after (the pre-hook of the update right after the snapshot did that)
        with CheckpointManager(cfg(tmp_path, k_snapshot=1, k_persist=1, persist_every=4, dynamic_k=False,
                                   interval=2), model=model, optimizer=opt) as ckpt:
            for s in range(1, 12):                      # warm-up: buffers created and page-locked
                train_step(model, opt, task, s, ckpt)
                settle(ckpt)
            assert ckpt.status()["buffers_page_locked"] == 3
            main = threading.current_thread().name
            before = len(fake.host_syncs)
            st0 = ckpt.status()
            engine = ckpt.engine
            real_wait_copies = engine.wait_copies
            blocked: list[bool] = []
            monkeypatch.setattr(engine, "wait_copies", lambda: blocked.append(real_wait_copies()) or blocked[-1])
            for s in range(12, 28):
                train_step(model, opt, task, s, ckpt)
            on_main = [c for t, c in fake.host_syncs[before:] if t == main]
            assert on_main == [], on_main
            assert any(t.startswith("moc-snapshot") for t, _ in fake.host_syncs[before:])
            st = ckpt.status()
            assert st["device_snapshots_async"] - st0["device_snapshots_async"] == 8
            assert len(blocked) == 8 and not any(blocked), blocked   # the pre-hook never waited on the host
            monkeypatch.undo()
        for reg in live_registrations():
            reg.release()


@pytest.mark.timeout(120)
def test_detach_waits_for_copies_in_flight_and_a_handover_repins(tmp_path, fake) -> None:
    """Copies still running on the device at detach (snapshot thread past its grace):
    detach returns only once their completion events have fired, with every registration
    released; the successor page-locks the same buffers again off its training thread and
    its close() leaves none."""
    model, opt, task = make(0, dim=64, hidden=256)
    train_step(model, opt, task, 0)
    on_device(fake, model, opt)
    config = cfg(tmp_path, k_snapshot=1, k_persist=1, persist_every=100, dynamic_k=False)
    ckpt = CheckpointManager(config, model=model, optimizer=opt)
    for s in range(1, 6):
        train_step(model, opt, task, s, ckpt)
    settle(ckpt)
    assert_pinned_exactly(fake, ckpt)
    fake.copy_seconds = 0.25                 # each unit's copy now takes 0.25 s of device time
    train_step(model, opt, task, 6, ckpt)
    assert fake.incomplete_events(), "the copies are not in flight: the test proves nothing"
    handover = ckpt.detach(grace=timedelta(milliseconds=20))
    assert not fake.incomplete_events(), "detach handed over buffers the device was still writing"
    assert not fake.live and not live_registrations()
    fake.copy_seconds = 0.0

    succ = CheckpointManager(config, model=model, optimizer=opt, handover=handover)
    assert succ.pool is handover.pool
    for s in range(7, 14):
        train_step(model, opt, task, s, succ)
    settle(succ)
    assert_pinned_exactly(fake, succ)
    assert succ.status()["device_snapshots_async"] >= 3
    succ.close()
    assert not fake.live and not live_registrations()
    assert not fake.errors and not fake.violations, (fake.errors, fake.violations)
    assert fake.registrations_by(threading.current_thread().name) == []
    assert set(fake.contexts) == {DEVICE}


def test_a_buffer_that_cannot_be_pinned_is_reported_once(tmp_path, fake, caplog) -> None:
    """The driver refuses page-locking (locked-memory limits): status() says so, one
    warning is logged, snapshots are copied by the snapshot thread and stay exact, and
    refused buffers are not retried at every snapshot."""
    fake.fail_register = 2                    # cudaErrorMemoryAllocation
    model, opt, task = make(0, dim=32, hidden=64)
    train_step(model, opt, task, 0)
    on_device(fake, model, opt)
    with caplog.at_level(logging.WARNING, logger="moc"):
        with CheckpointManager(cfg(tmp_path, k_snapshot=1, k_persist=1, dynamic_k=False),
                               model=model, optimizer=opt) as ckpt:
            for s in range(1, 10):
                train_step(model, opt, task, s, ckpt)
            settle(ckpt)
            st = ckpt.status()
            assert st["page_lock_error"] is not None and "cudaError 2" in st["page_lock_error"], st
            assert st["buffers_page_locked"] == 0
            assert st["device_snapshots_async"] == 0 and st["device_snapshots_fallback"] == 9
            assert st["snapshot_failures"] == 0
            step_no, trees = ckpt.snapshot_state()
            truth = clone_state(model, opt)
            assert step_no == 9 and trees
            for tree in trees.values():
                for key, value in tree.get("model", {}).items():
                    assert torch.equal(value, truth["model"][key]), key
    warnings = [r for r in caplog.records if "cannot be page-locked" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert len(fake.errors) <= 3                                 # once per buffer, not per snapshot
    assert not fake.live and not fake.violations


def test_cuda_rng_states_of_every_device_round_trip(tmp_path, fake) -> None:
    model, opt, task = make(0, dim=16, hidden=32)
    train_step(model, opt, task, 0)
    on_device(fake, model, opt)
    fake.reseed(0, 1234)
    fake.reseed(1, 999)
    saved = fake.rng_states()
    with CheckpointManager(cfg(tmp_path, interval=1), model=model, optimizer=opt) as ckpt:
        train_step(model, opt, task, 1, ckpt)
        ckpt.wait()
    fake.reseed(0, 1)
    fake.reseed(1, 2)
    assert not torch.equal(fake.rng_states()[1], saved[1])
    model2, opt2, _ = make(3, dim=16, hidden=32)
    with CheckpointManager(cfg(tmp_path, interval=1), model=model2, optimizer=opt2) as ck2:
        assert ck2.restore() == 2
    got = fake.rng_states()
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, saved))
