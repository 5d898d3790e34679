"""Tests of :mod:`moc._snapshot.engine` (the first level: one rank's triple-buffered
background snapshots), driven through a single-process ``CheckpointManager`` on a tiny
model with a local store.

What is pinned here: the optimizer pre-hook waits for the copy of step t before the
update of step t+1 (and the snapshot holds step t's values), and for nothing else (not the
checksums, not the publish); the buffers cycle
SNAPSHOT -> READY -> PERSIST -> READY and are refilled, never while they are the newest
complete copy; the shared memory is mapped once; a due snapshot with no free buffer is
skipped and counted; failed copies are counted and end training after
``max_consecutive_failures`` in a row.

Synchronisation is by events the test controls (a gated copy), never by sleeping.
"""

from __future__ import annotations

import threading

import pytest
import torch

from moc import CheckpointError, CheckpointManager, MoCConfig
from moc._snapshot.buffers import FREE, PERSIST, READY, SNAPSHOT, SnapshotBuffer
from tests.helpers.moc_helpers import clone_state, make, train_step

GATE_TIMEOUT = 60.0   # seconds; only reached when the product deadlocks


def cfg_for(tmp_path, **kw) -> MoCConfig:
    kw.setdefault("interval", 1)
    kw.setdefault("dynamic_k", False)
    return MoCConfig(storage=str(tmp_path / "ckpt"), snapshot_dir=str(tmp_path / "shm"), **kw)


def _on_snapshot_thread() -> bool:
    return threading.current_thread().name.startswith("moc-snapshot")


def test_pre_hook_blocks_the_update_until_the_copy_of_step_t_is_done(tmp_path):
    """The background copy of step t is held at a gate; the next optimizer step must
    find it still running, wait for it (a counted stall), and only then update. The
    snapshot then holds step t's values, not t+1's. The update waits for the copies
    only: checksums and the publish may still be running."""
    model, opt, task = make(0)
    cfg = cfg_for(tmp_path, k_snapshot=None, persist_every=1000)   # memory only after the first
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        engine = ckpt.engine
        train_step(model, opt, task, 0, ckpt)
        ckpt.wait()

        gate = threading.Event()
        held = threading.Event()
        real_copy = engine._host.copy

        def gated_copy(plan, start, end, out):
            if _on_snapshot_thread():
                held.set()
                assert gate.wait(GATE_TIMEOUT), "the copy was never released"
            real_copy(plan, start, end, out)

        seen = []
        real_wait = engine.wait_copies

        def observed_wait():
            pending = not engine._copied.is_set()
            seen.append(("wait", pending))
            if pending:
                gate.set()               # release the copy only once something waits for it
            return real_wait()

        def after_engine_hook(optimizer, args, kwargs):
            # registered after the manager's hook, so this runs once that hook returned
            seen.append(("update", engine._copied.is_set()))

        engine._host.copy = gated_copy
        engine.wait_copies = observed_wait
        handle = opt.register_step_pre_hook(after_engine_hook)
        try:
            stalls = engine.stalls
            train_step(model, opt, task, 1, ckpt)        # snapshot of step 1 starts, copy held
            assert held.wait(GATE_TIMEOUT)
            assert not engine.in_flight.done()
            expected = clone_state(model, opt)
            seen.clear()
            train_step(model, opt, task, 2, ckpt, batch=8)   # its update must wait for step 1's copy
        finally:
            gate.set()
            handle.remove()
            engine.wait_copies = real_wait
            engine._host.copy = real_copy

        # the hook found the copy running, and the update ran after step 1's copies were done
        assert seen[0] == ("wait", True), seen
        assert seen[1] == ("update", True), seen
        assert engine.stalls == stalls + 1 and engine.stall_last > 0
        # a CPU snapshot: the training thread itself waited (booked as a host stall)
        assert engine.host_stall_last == engine.stall_last and engine.device_stall_total == 0
        assert ckpt.status()["host_stall_seconds_last"] == engine.stall_last

        ckpt.wait(flush=False)
        # the newest complete snapshot is step 2 now; the buffer of step 1 must hold step 1
        step1 = next(b for b in ckpt.pool.buffers if b.step == 1)
        step_got, trees = _decode(ckpt, step1)
        assert step_got == 1
        checked = 0
        for tree in trees.values():
            for key, value in tree.get("model", {}).items():
                assert torch.equal(value, expected["model"][key]), key
                checked += 1
        assert checked == len(expected["model"])


def test_the_update_waits_for_the_copies_only_not_for_checksums_or_the_publish(tmp_path, monkeypatch):
    """Step t's checksums are held at a gate (the copies are done): the next optimizer
    step must run at once, with no stall booked, while the snapshot of step t is still
    unpublished; once released, the snapshot publishes step t's values."""
    import xxhash

    import moc._snapshot.engine as engine_mod

    model, opt, task = make(0)
    cfg = cfg_for(tmp_path, k_snapshot=None, persist_every=1000)   # memory only after the first
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        engine = ckpt.engine
        train_step(model, opt, task, 0, ckpt)
        ckpt.wait()
        gate, held = threading.Event(), threading.Event()

        class _GatedHash:
            def __getattr__(self, name):
                return getattr(xxhash, name)

            @staticmethod
            def xxh3_64_hexdigest(data):
                if threading.current_thread() is not threading.main_thread():
                    held.set()
                    assert gate.wait(GATE_TIMEOUT), "the checksum was never released"
                return xxhash.xxh3_64_hexdigest(data)

        monkeypatch.setattr(engine_mod, "xxhash", _GatedHash())
        updates: list[bool] = []
        handle = None
        try:
            train_step(model, opt, task, 1, ckpt)        # snapshot of step 1 starts; its checksums held
            assert held.wait(GATE_TIMEOUT)
            stalls = engine.stalls
            handle = opt.register_step_pre_hook(
                lambda *a: updates.append(engine.in_flight is not None and not engine.in_flight.done()))
            expected = clone_state(model, opt)
            train_step(model, opt, task, 2, None, batch=8)   # its update must not block
            assert updates == [True]                     # the update ran while the snapshot was unpublished
            assert engine.stalls == stalls
        finally:
            gate.set()
            if handle is not None:
                handle.remove()
        monkeypatch.undo()
        ckpt.wait(flush=False)
        step1 = next(b for b in ckpt.pool.buffers if b.step == 1)
        _, trees = _decode(ckpt, step1)
        values = {k: v for t in trees.values() for k, v in t.get("model", {}).items()}
        assert values.keys() == expected["model"].keys()
        for key, value in values.items():
            assert torch.equal(value, expected["model"][key]), key


def _decode(ckpt, buf: SnapshotBuffer):
    """(step, {unit: tree}) of one buffer, read the way ``newest_state`` reads the newest."""
    from moc._store import TensorMeta, decode_tree

    trees = {}
    for piece in buf.header["pieces"]:
        u = buf.header["units"][piece["unit"]]
        data = bytearray(buf.view(piece["offset"], piece["end"] - piece["start"]))
        trees[piece["unit"]] = decode_tree(u["skeleton"], [TensorMeta.from_json(t) for t in u["tensors"]], data)
    return buf.step, trees


def test_snapshot_state_is_the_step_snapshotted_not_the_next_update(tmp_path):
    """``newest_state`` after the next update: still step t's values."""
    model, opt, task = make(1, optimizer="sgd")
    with CheckpointManager(cfg_for(tmp_path, k_snapshot=None, persist_every=1000), model=model,
                           optimizer=opt) as ckpt:
        for step in range(4):
            train_step(model, opt, task, step, ckpt, batch=8)
            expected = {k: v.clone() for k, v in model.state_dict().items()}
            x, y = task.batch(100 + step, 8)                     # an update with no checkpoint after it
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            got_step, trees = ckpt.snapshot_state()
            assert got_step == step
            values = {k: v for t in trees.values() for k, v in t.get("model", {}).items()}
            assert values.keys() == expected.keys()
            for key, value in values.items():
                assert torch.equal(value, expected[key]), (step, key)
            assert any(not torch.equal(model.state_dict()[k], expected[k]) for k in expected)


class _Recorded(SnapshotBuffer):
    """A buffer that logs every state change, and what it was when it was refilled."""

    log: list

    def __setattr__(self, name, value):
        if name == "state" and "state" in self.__dict__ and value != self.__dict__["state"]:
            self.log.append(("state", self.index, self.__dict__["state"], value))
        super().__setattr__(name, value)

    def invalidate(self) -> None:
        newest = self.pool_ref.newest_complete()
        self.log.append(("refill", self.index, self.step, newest is self))
        super().invalidate()


def test_buffers_cycle_through_their_states_and_are_mapped_once(tmp_path):
    model, opt, task = make(0)
    for step in range(3):          # every expert routed: the optimizer state (so each snapshot) has its full size
        train_step(model, opt, task, 100 + step, batch=256)
    assert len(opt.state) == len(list(model.parameters()))
    cfg = cfg_for(tmp_path, k_snapshot=None, persist_every=2)
    log: list = []
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        pool = ckpt.pool
        assert len(pool.buffers) == 3
        for b in pool.buffers:
            b.__class__ = _Recorded
            b.__dict__["log"] = log
            b.__dict__["pool_ref"] = pool
        maps = None
        for step in range(12):
            train_step(model, opt, task, step, ckpt, batch=8)
            ckpt.wait(flush=False)       # the copy and a due persist done: the picks are deterministic
            if step == 3:                # every buffer has been filled once by now
                maps = [(b._map.data_ptr(), b.capacity) for b in pool.buffers]
                allocated = pool.allocated_bytes()
        assert ckpt.status()["persists_skipped"] == 0
        assert [(b._map.data_ptr(), b.capacity) for b in pool.buffers] == maps   # never remapped
        assert pool.allocated_bytes() == allocated
        assert sorted(p.name for p in (tmp_path / "shm").rglob("buf*.bin")) == ["buf0.bin", "buf1.bin", "buf2.bin"]
        states = [b.state for b in pool.buffers]
        steps = sorted(b.step for b in pool.buffers)
        training = list(log)           # close() withdraws the snapshots: not part of the cycle

    allowed = {(FREE, SNAPSHOT), (SNAPSHOT, READY), (READY, PERSIST), (PERSIST, READY), (READY, SNAPSHOT)}
    changes = [(old, new) for kind, _, old, new in training if kind == "state"]
    assert set(changes) <= allowed, sorted(set(changes) - allowed)
    assert changes.count((FREE, SNAPSHOT)) == 3                    # each buffer starts once
    assert changes.count((SNAPSHOT, READY)) == 12                  # one per snapshot
    assert changes.count((READY, PERSIST)) == changes.count((PERSIST, READY)) == 6   # every 2nd persisted
    refills = [e for e in training if e[0] == "refill"]
    assert len(refills) == 12
    assert all(not newest for *_, newest in refills), refills     # never the newest complete copy
    for i in range(3):
        assert sum(1 for e in refills if e[1] == i) == 4           # all three take turns (the oldest goes)
    assert set(states) <= {READY, PERSIST}
    assert steps == [9, 10, 11]                                    # the three newest snapshots


def test_a_due_snapshot_with_no_buffer_is_skipped_and_counted(tmp_path):
    model, opt, task = make(0)
    with CheckpointManager(cfg_for(tmp_path, k_snapshot=2, k_persist=1), model=model, optimizer=opt) as ckpt:
        for step in range(3):
            train_step(model, opt, task, step, ckpt, batch=8)
        ckpt.wait()
        newest = ckpt.pool.newest_complete()
        others = [b for b in ckpt.pool.buffers if b is not newest]
        leases = [ckpt.pool.lease(b) for b in others]      # readers hold every other buffer
        for lease in leases:
            lease.__enter__()
        try:
            train_step(model, opt, task, 3, ckpt, batch=8)
            ckpt.wait()
            st = ckpt.status()
            assert st["snapshots_skipped"] == 1 and st["last_snapshot_step"] == 2
            assert ckpt.engine.last_skip["step"] == 3
            assert ckpt.snapshot_state()[0] == 2           # the newest complete copy stays
        finally:
            for lease in leases:
                lease.__exit__(None, None, None)
        train_step(model, opt, task, 4, ckpt, batch=8)
        ckpt.wait()
        assert ckpt.status()["last_snapshot_step"] == 4 and ckpt.status()["snapshots_skipped"] == 1


def test_failed_copies_are_counted_and_end_training_after_the_limit(tmp_path):
    model, opt, task = make(0)
    cfg = cfg_for(tmp_path, k_snapshot=2, k_persist=1, max_consecutive_failures=2)
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    train_step(model, opt, task, 0, ckpt, batch=8)
    ckpt.wait()
    engine = ckpt.engine
    real_copy = engine._host.copy

    def broken_copy(plan, start, end, out):
        if _on_snapshot_thread():
            raise RuntimeError("injected copy failure")
        real_copy(plan, start, end, out)

    engine._host.copy = broken_copy
    try:
        train_step(model, opt, task, 1, ckpt, batch=8)
        ckpt.wait(flush=False)
        assert engine.failures == 1 and engine.consecutive_failures == 1
        assert "injected copy failure" in str(engine.last_exception)
        assert ckpt.snapshot_state()[0] == 0       # the failed buffer was not published
        with pytest.raises(CheckpointError, match="2 snapshots in a row failed"):
            for step in range(2, 5):
                train_step(model, opt, task, step, ckpt, batch=8)
        assert engine.failures == 2
    finally:
        engine._host.copy = real_copy
        ckpt.close(raise_errors=False)
