"""Exact mode on CUDA, checked under the fake CUDA runtime (``tests/helpers/fake_cuda.py``):
captures copied on the snapshot engine's side streams behind an event recorded after
``optimizer.step()`` (into page-locked buffers once the upkeep thread has locked them), the
next update ordered after them on the device instead of a host wait, the capture thread
bound to the model's device; the gradient digest computed on the device with one host copy;
and the settings bit-exact replay needs on CUDA refused when missing, each by name. The real
GPU path (a SIGKILLed process replayed bit for bit) is ``tests/gpu/test_gpu_exact.py``."""

from __future__ import annotations

import threading

import pytest
import torch

from moc import CheckpointError, CheckpointManager, MoCConfig
from moc._cuda.copies import CudaCopyBatch, live_registrations
from moc._exact import state as exact_state
from moc._exact.state import digest_kind, grad_digest, grad_digest_later
from tests.helpers.fake_cuda import FakeCuda
from tests.helpers.moc_helpers import clone_state, make, train_step

DEVICE = 1      # not 0: a thread that never bound its device shows up as a context on 0


def on_device(fake: FakeCuda, model, opt) -> None:
    """What ``.cuda(DEVICE)`` would do to the parameters and optimizer moments."""
    fake.set_device(DEVICE)
    tensors = list(model.parameters())
    for st in opt.state.values():
        tensors += [v for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    fake.place(tensors, DEVICE)


def cfg(tmp_path) -> MoCConfig:
    # 8 experts, k_snapshot=3: windows of W=3 steps
    return MoCConfig(storage=str(tmp_path / "ckpt"), snapshot_dir=str(tmp_path / "shm"), interval=1, k_snapshot=3,
                     exact=True, persist_every=1)


@pytest.fixture
def deterministic(monkeypatch):
    """The settings exact replay needs on CUDA (restored afterwards: they are global)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.fixture
def fake():
    f = FakeCuda(device_count=2, copy_seconds=0.01)
    with f.installed():
        yield f
        leftover = live_registrations()
        for reg in leftover:
            reg.release()
    assert not leftover, f"{len(leftover)} registration(s) outlived their manager"


@pytest.mark.timeout(240)
def test_exact_captures_on_side_streams_and_a_restore_replays_bit_identically(tmp_path, fake, deterministic,
                                                                              monkeypatch) -> None:
    """Windows captured from (fake) cuda:1: once a buffer is page-locked every step's copies
    are issued on the side stream from ``step()`` and the next update waits for them on the
    device (order_update), never on the host; the capture thread waits for the copies' events
    bound to cuda:1. A new model restored from those windows replays and ends bit-identical."""
    ordered: list[int] = []
    real_order = CudaCopyBatch.order_update
    monkeypatch.setattr(CudaCopyBatch, "order_update", lambda self: ordered.append(1) or real_order(self))
    model, opt, task = make(0, dim=32, hidden=64)
    train_step(model, opt, task, 0)                     # Adam state exists, so it is placed too
    on_device(fake, model, opt)
    main = threading.current_thread().name
    with CheckpointManager(cfg(tmp_path), model=model, optimizer=opt) as ckpt:
        for s in range(1, 13):                          # windows 1-3, 4-6, 7-9, 10-12: each buffer used once
            train_step(model, opt, task, s, ckpt)
            if s % 3 == 0:
                ckpt.wait(flush=False)
                for b in ckpt.pool.buffers:
                    b.settle()                          # the upkeep thread page-locks the buffer just filled
        st0 = ckpt.status()["exact"]
        assert st0["device_captures_fallback"] == 9 and st0["device_captures_async"] == 3, st0
        syncs = len(fake.host_syncs)
        stall_before = st0["stall_seconds_total"]
        for s in range(13, 20):                         # windows 13-15, 16-18 in page-locked buffers; 19 opens one
            train_step(model, opt, task, s, ckpt)
        ckpt.wait()
        st = ckpt.status()["exact"]
        assert st["device_captures_async"] == 10 and st["device_captures_fallback"] == 9, st
        assert len(ordered) == 9, ordered               # after each async capture (10-18): the update waits
                                                        # on the device
        assert st["stall_seconds_total"] == stall_before, st   # ... and the pre-hook never waited on the host
        waits = fake.host_syncs[syncs:]
        assert waits and all(t.startswith("moc-exact") for t, _ in waits), waits   # the capture thread waits
        assert set(fake.contexts) == {DEVICE}, fake.contexts
        assert not any(t == main for t, _ in fake.host_syncs), fake.host_syncs
        assert st["last_window"]["end"] == 18 and st["windows_failed"] == 0
        truth = clone_state(model, opt)
    assert not fake.violations and not fake.errors, (fake.violations, fake.errors)

    model2, opt2, _ = make(1, dim=32, hidden=64)
    on_device(fake, model2, opt2)
    with CheckpointManager(cfg(tmp_path), model=model2, optimizer=opt2) as ckpt2:
        start = ckpt2.restore()
        assert start == 17, start                       # the window 16-18, replayed from step 17
        for s in range(start, 20):
            train_step(model2, opt2, task, s, ckpt2)
        st2 = ckpt2.status()["exact"]
        assert st2["replayed_steps"] == 2 and st2["last_replay"]["end"] == 18, st2
        got = clone_state(model2, opt2)
    for k, v in truth["model"].items():
        assert torch.equal(got["model"][k], v), k
    for name, st_ in truth["optim"].items():
        for key, v in st_.items():
            assert torch.equal(got["optim"][name][key], v) if torch.is_tensor(v) else got["optim"][name][key] == v, \
                (name, key)
    assert not fake.violations and not fake.errors, (fake.violations, fake.errors)


def test_gradient_digest_on_the_device_reads_the_host_once(fake, monkeypatch) -> None:
    """A model on (fake) CUDA: the digest is computed with device ops and reaches the host
    in one copy, never one per gradient; it changes with one flipped bit or two gradients'
    bytes swapped, and is the same when computed again. On the CPU it stays xxh3."""
    model, opt, task = make(0, dim=16, hidden=32)
    assert digest_kind(model) == "xxh3"
    train_step(model, opt, task, 0)
    cpu = grad_digest(model)
    assert set(cpu) == {"xxh3", "norm"}
    on_device(fake, model, opt)
    assert digest_kind(model) == "dev64"

    reads: list[str] = []
    inside = threading.local()          # the fake's device tensors are CPU ones: its copy is a .cpu()
    real_later = exact_state.to_host_later

    def later(t, out=None):
        reads.append(f"copy of {t.numel()}")
        inside.on = True
        try:
            return real_later(t, out)
        finally:
            inside.on = False

    monkeypatch.setattr(exact_state, "to_host_later", later)
    def counted(name, real):
        def call(self, *a, **k):
            if not getattr(inside, "on", False):
                reads.append(name)
            return real(self, *a, **k)
        return call

    for name in ("cpu", "numpy", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    pending = grad_digest_later(model)
    monkeypatch.undo()
    assert reads == ["copy of 2"], reads                # one copy of two words, no per-gradient read
    first = pending.result()
    assert set(first) == {"dev64", "norm"} and abs(first["norm"] - cpu["norm"]) < 1e-3 * cpu["norm"]
    assert grad_digest(model) == first

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    g = grads[-1].view(-1)
    g.view(torch.int32)[-1] ^= 1                        # one bit of the last gradient
    flipped = grad_digest(model)["dev64"]
    g.view(torch.int32)[-1] ^= 1
    assert flipped != first["dev64"] and grad_digest(model)["dev64"] == first["dev64"]
    a, b = next((x, y) for i, x in enumerate(grads) for y in grads[i + 1:] if x.shape == y.shape
                and not torch.equal(x, y))
    saved = a.clone()
    a.copy_(b)
    b.copy_(saved)
    assert grad_digest(model)["dev64"] != first["dev64"]   # the same bytes in other gradients


def test_exact_mode_on_cuda_refuses_without_the_replay_settings(tmp_path, fake, monkeypatch) -> None:
    """Each missing setting is named; with all of them it starts; a model on the CPU needs
    none of them (exact mode there is unchanged)."""
    model, opt, task = make(0, dim=16, hidden=32)
    train_step(model, opt, task, 0)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    bench = torch.backends.cudnn.benchmark
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        torch.use_deterministic_algorithms(False)
        with CheckpointManager(cfg(tmp_path / "cpu"), model=model, optimizer=opt):
            pass                                        # on the CPU: nothing required
        on_device(fake, model, opt)
        with pytest.raises(CheckpointError) as err:
            CheckpointManager(cfg(tmp_path / "a"), model=model, optimizer=opt)
        msg = str(err.value)
        assert "torch.use_deterministic_algorithms(True)" in msg and "CUBLAS_WORKSPACE_CONFIG is None" in msg, msg
        torch.use_deterministic_algorithms(True, warn_only=True)
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
        torch.backends.cudnn.benchmark = True
        with pytest.raises(CheckpointError) as err:
            CheckpointManager(cfg(tmp_path / "b"), model=model, optimizer=opt)
        msg = str(err.value)
        assert "warn_only=False" in msg and "':0:0'" in msg and "cudnn.benchmark" in msg, msg
        torch.use_deterministic_algorithms(True)
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        torch.backends.cudnn.benchmark = False
        with CheckpointManager(cfg(tmp_path / "c"), model=model, optimizer=opt) as ckpt:
            train_step(model, opt, task, 1, ckpt)
            torch.use_deterministic_algorithms(False)   # switched off mid-run: the next window is refused
            with pytest.raises(CheckpointError, match="use_deterministic_algorithms"):
                for s in range(2, 5):
                    train_step(model, opt, task, s, ckpt)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = bench


@pytest.mark.timeout(120)
def test_buffers_that_cannot_be_page_locked_fall_back_to_the_capture_thread(tmp_path, fake, deterministic,
                                                                            caplog) -> None:
    """The driver refuses page-locking: every capture is copied by the capture thread (on the
    side stream, bound to cuda:1), windows still complete, one warning says why."""
    import logging
    fake.fail_register = 2                  # cudaErrorMemoryAllocation
    model, opt, task = make(0, dim=16, hidden=32)
    train_step(model, opt, task, 0)
    on_device(fake, model, opt)
    with caplog.at_level(logging.WARNING, logger="moc"):
        with CheckpointManager(cfg(tmp_path), model=model, optimizer=opt) as ckpt:
            for s in range(1, 14):
                train_step(model, opt, task, s, ckpt)
                if s % 3 == 0:
                    ckpt.wait(flush=False)
                    for b in ckpt.pool.buffers:
                        b.settle()
            ckpt.wait()
            st = ckpt.status()["exact"]
            assert st["device_captures_async"] == 0 and st["device_captures_fallback"] == 13, st
            assert st["windows_complete"] == 4 and st["windows_failed"] == 0, st
    warnings = [r for r in caplog.records if "cannot be page-locked" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert set(fake.contexts) == {DEVICE} and not fake.live and not fake.violations
