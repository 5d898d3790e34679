"""Permanent storage errors fail fast: a local root that cannot be written is refused when
the manager opens it; one that becomes unwritable during training is reported once and
raised at close at once (never after ``persist_timeout``); SIGTERM during a flush stuck on
storage ends the process within ``MoCConfig.stop_timeout``. Real immutable directories,
read-only mounts, hung sockets and processes."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest

from moc import CheckpointManager, CheckpointStore, MoCConfig
from storage_backends import PermanentStorageError
from tests.helpers.moc_helpers import make, train_step
from tests.helpers.unwritable import immutable, make_immutable, make_mutable, read_only_mount

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _cfg(tmp_path, storage, **kw):
    base = dict(storage=str(storage), snapshot_dir=str(tmp_path / "shm"), interval=2, k_snapshot=4, k_persist=2)
    return MoCConfig(**{**base, **kw})


def test_immutable_root_refused_at_construction(tmp_path):
    root = str(tmp_path / "ckpt")
    model, opt, _ = make(0)
    with immutable(root):
        t0 = time.monotonic()
        with pytest.raises(PermanentStorageError) as info:
            CheckpointManager(_cfg(tmp_path, root), model=model, optimizer=opt)
    msg = str(info.value)
    assert time.monotonic() - t0 < 5
    assert f"MoCConfig.storage {root!r} is not writable" in msg
    assert "Operation not permitted" in msg and "chattr -i" in msg
    assert info.value.fault.kind == "permission"
    assert os.listdir(root) == []        # the probe left nothing behind


def test_read_only_mount_refused_at_construction(tmp_path):
    model, opt, _ = make(0)
    with read_only_mount(str(tmp_path / "ro")) as root:
        with pytest.raises(PermanentStorageError, match=r"Read-only file system.*remount") as info:
            CheckpointManager(_cfg(tmp_path, root), model=model, optimizer=opt)
    assert info.value.fault.kind == "read-only" and root in str(info.value)


def test_root_unwritable_after_open_reported_once_and_raised_at_close_at_once(tmp_path, caplog):
    root = str(tmp_path / "ckpt")
    cfg = _cfg(tmp_path, root, persist_timeout=timedelta(seconds=60))
    model, opt, task = make(0)
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    try:
        for step in range(4):
            train_step(model, opt, task, step, ckpt)
        ckpt.wait()
        persisted = ckpt.status()["last_persisted_step"]
        make_immutable(root)
        with caplog.at_level(logging.DEBUG, logger="moc"):
            for step in range(4, 16):
                train_step(model, opt, task, step, ckpt)   # training goes on from memory
                time.sleep(0.03)
            status = ckpt.status()
            assert status["persist_failures"] >= 2 and status["last_snapshot_step"] == 14
            assert status["persist_error_permanent"] == "permission"
            t0 = time.monotonic()
            with pytest.raises(PermanentStorageError) as info:
                ckpt.close()
            elapsed = time.monotonic() - t0
    finally:
        make_mutable(root)
    assert elapsed < 5, f"close() took {elapsed:.1f} s to raise a permanent error"
    msg = str(info.value)
    assert "checkpoint of step 14 cannot be persisted" in msg and "Operation not permitted" in msg
    assert "Fix:" in msg and "chattr -i" in msg and f"newest persisted step is {persisted}" in msg
    reports = [r for r in caplog.records if r.levelno >= logging.WARNING and "refuses writes" in r.getMessage()]
    assert len(reports) == 1 and "Fix:" in reports[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "persist failed" in r.getMessage()]
    # the state newer than storage stays in memory for a restart on this node
    model2, opt2, _ = make(1)
    with CheckpointManager(cfg, model=model2, optimizer=opt2) as again:
        assert again.restore() == 15


def test_root_writable_again_persists_resume(tmp_path, caplog):
    root = str(tmp_path / "ckpt")
    model, opt, task = make(0)
    with CheckpointManager(_cfg(tmp_path, root), model=model, optimizer=opt) as ckpt:
        for step in range(4):
            train_step(model, opt, task, step, ckpt)
        ckpt.wait()
        make_immutable(root)
        try:
            for step in range(4, 10):
                train_step(model, opt, task, step, ckpt)
                time.sleep(0.03)
            assert ckpt.status()["persist_failures"] >= 1
        finally:
            make_mutable(root)
        with caplog.at_level(logging.WARNING, logger="moc"):
            for step in range(10, 16):
                train_step(model, opt, task, step, ckpt)
                time.sleep(0.03)
            ckpt.wait()
    assert CheckpointStore(root).latest_step() == 14
    assert any("writable again" in r.getMessage() for r in caplog.records)


CHILD = textwrap.dedent("""
    import atexit, logging, sys, time
    from datetime import timedelta
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)d ms %(message)s")
    atexit.register(lambda: logging.warning("exiting"))
    sys.path.insert(0, {root!r})
    from moc import CheckpointManager, MoCConfig
    from tests.helpers.moc_helpers import make, train_step
    cfg = MoCConfig(storage="s3://ckpt/run", snapshot_dir={shm!r}, interval=2, k_snapshot=2, k_persist=1,
                    storage_options=dict(endpoint_url={endpoint!r}, key="k", secret="s", check=False),
                    persist_timeout=timedelta(seconds=300), stop_timeout=timedelta(seconds={stop}))
    model, opt, task = make(0)
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    for step in range(8):
        train_step(model, opt, task, step, ckpt)
        time.sleep(0.02)
    if {in_close!r}:
        print("closing", flush=True)
        ckpt.close()
        print("closed", flush=True)
    else:
        print("training", flush=True)
        for step in range(8, 100_000):
            train_step(model, opt, task, step, ckpt)
            time.sleep(0.02)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("in_close", [False, True], ids=["during-training", "during-close"])
def test_sigterm_during_stuck_flush_exits_within_stop_timeout(tmp_path, in_close):
    stop = 3.0
    with socket.socket() as hung:   # an S3 endpoint that accepts and never answers: persists hang
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)
        code = CHILD.format(root=ROOT, shm=str(tmp_path / "shm"), endpoint=f"http://127.0.0.1:{hung.getsockname()[1]}",
                            stop=stop, in_close=in_close)
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=dict(os.environ, PYTHONPATH=ROOT))
        try:
            assert proc.stdout.readline().strip() in ("closing", "training")
            time.sleep(1.0)   # inside close()'s flush, or training with a persist stuck
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(stop + 40)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running {stop + 40:.0f} s after SIGTERM (stop_timeout {stop} s)")
            elapsed = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err = proc.stderr.read()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stop_timeout" in err
    # From the handler's first line to the interpreter's exit handlers, by the child's own
    # clock (the signal itself waits for the step under way, seconds on a loaded machine).
    stamps = {m: int(line.split(" ms ", 1)[0]) for line in err.splitlines() if " ms " in line
              for m in ("SIGTERM received", "exiting") if m in line}
    handled = (stamps["exiting"] - stamps["SIGTERM received"]) / 1000
    print(f"exited {elapsed:.1f} s after SIGTERM, {handled:.1f} s after handling it (stop_timeout {stop} s)")
    assert handled < stop + 3, f"{handled:.1f} s from SIGTERM to exit; stop_timeout {stop} s"
    assert elapsed < stop + 30, f"exited {elapsed:.1f} s after SIGTERM; stop_timeout {stop} s"


def _ranks_on_a_root_that_turns_immutable(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist

    root = os.path.join(tmp, "ckpt")
    cfg = MoCConfig(storage=root, snapshot_dir=os.path.join(tmp, f"shm{rank}"), interval=2, k_snapshot=4,
                    k_persist=2, persist_timeout=timedelta(seconds=60))
    model, opt, task = make(0)
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    for step in range(4):
        train_step(model, opt, task, step, ckpt)
    ckpt.wait()
    dist.barrier()
    if rank == 0:
        make_immutable(root)
    dist.barrier()
    for step in range(4, 12):
        train_step(model, opt, task, step, ckpt)
    t0 = time.monotonic()
    with pytest.raises(PermanentStorageError, match="checkpoint of step 10 cannot be persisted"):
        ckpt.close()
    assert time.monotonic() - t0 < 10, time.monotonic() - t0


@pytest.mark.timeout(240)
def test_two_ranks_raise_a_permanent_error_at_close_together(tmp_path):
    from tests.helpers.rank_harness import run_ranks

    try:
        run_ranks(_ranks_on_a_root_that_turns_immutable, 2, tmp_path, str(tmp_path))
    finally:
        make_mutable(str(tmp_path / "ckpt"))
