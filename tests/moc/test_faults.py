"""Faults around the manager: a storage outage mid-training, and SIGTERM (spot notice)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest

from tests.conftest import MotoS3
from moc import CheckpointManager, CheckpointStore, MoCConfig
from tests.helpers.moc_helpers import make, train_step
from storage_backends import RetryPolicy, open_store

QUICK = RetryPolicy(attempts=2, initial=timedelta(milliseconds=20), maximum=timedelta(milliseconds=50))


@pytest.mark.timeout(180)
def test_s3_outage_training_continues_and_persists_resume(tmp_path):
    server = MotoS3()
    server.start()
    try:
        server.reset()   # moto's servers in one process share one backend: no other test's objects
        server.make_bucket("ckpt")
        opts = dict(server.options, retry=QUICK, connect_timeout=timedelta(seconds=1),
                    read_timeout=timedelta(seconds=5))
        cfg = MoCConfig(storage="s3://ckpt/run", storage_options=opts, snapshot_dir=str(tmp_path / "shm"),
                        interval=2, k_snapshot=4, k_persist=2, keep_last=20)
        model, opt, task = make(0)
        committed_before = []
        with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
            for step in range(0, 10):
                train_step(model, opt, task, step, ckpt)
            ckpt.wait()
            cs = CheckpointStore(open_store("s3://ckpt/run", **opts))
            committed_before = cs.steps()
            manifests = {s: cs.read_manifest(s).to_bytes() for s in committed_before}
            server.stop()  # the endpoint disappears
            step = 10
            deadline = time.monotonic() + 60
            while step < 20 or ckpt.status()["persist_failures"] == 0:
                train_step(model, opt, task, step, ckpt)  # training must not notice
                step += 1
                time.sleep(0.02)
                assert time.monotonic() < deadline, "no persist failure reported during the outage"
            status = ckpt.status()
            assert status["last_error"] and "ConnectionError" in status["last_error"]
            assert status["last_snapshot_step"] >= 18
            assert status["last_persisted_step"] == committed_before[-1]
            server.start()  # back
            end = step + 8
            while step < end:
                train_step(model, opt, task, step, ckpt)
                step += 1
                time.sleep(0.02)
            ckpt.wait()
            last = ckpt.status()["last_snapshot_step"]
            assert ckpt.status()["last_persisted_step"] == last
        cs = CheckpointStore(open_store("s3://ckpt/run", **opts))
        steps = cs.steps()
        assert set(committed_before) <= set(steps) and steps[-1] == last
        for s in committed_before:  # nothing committed before the outage changed or went missing
            assert cs.read_manifest(s).to_bytes() == manifests[s]
            assert cs.verify(s) == []
        assert cs.verify(last) == []
    finally:
        server.stop()


SIGTERM_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from moc import CheckpointManager, MoCConfig
    from tests.helpers.moc_helpers import make, train_step
    cfg = MoCConfig(storage={storage!r}, snapshot_dir={shm!r}, interval=3, persist_every=100,
                    k_snapshot=2, k_persist=1)
    model, opt, task = make(0)
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    for step in range(10_000):
        train_step(model, opt, task, step, ckpt)
        if step % 3 == 0:
            print("snapshot", step, flush=True)
        time.sleep(0.01)
""")


@pytest.mark.timeout(120)
def test_sigterm_flushes_newest_snapshot(tmp_path):
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    code = SIGTERM_CHILD.format(root=root, storage=str(tmp_path / "ckpt"), shm=str(tmp_path / "shm"))
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    last = None
    for line in proc.stdout:
        last = int(line.split()[1])
        if last >= 12:
            break
    proc.send_signal(signal.SIGTERM)
    rest = proc.stdout.read()
    proc.wait(60)
    assert proc.returncode == 128 + signal.SIGTERM
    snaps = [last] + [int(l.split()[1]) for l in rest.splitlines() if l.startswith("snapshot")]
    cs = CheckpointStore(str(tmp_path / "ckpt"))
    # persist_every=100: only step 0 was due for storage; the flush wrote the newest snapshot.
    assert cs.steps()[0] == 0 and cs.latest_step() == max(snaps)
    assert cs.verify() == []


@pytest.mark.timeout(120)
def test_sigterm_ignored_by_the_parent_stays_ignored(tmp_path):
    """A process started with SIGTERM ignored (a Lazarus worker under SLURM, whose step
    signals every process: the agent decides) keeps training through a SIGTERM; the
    manager installs no handler of its own."""
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    code = SIGTERM_CHILD.format(root=root, storage=str(tmp_path / "ckpt"), shm=str(tmp_path / "shm"))
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if int(line.split()[1]) >= 6:
                break
        proc.send_signal(signal.SIGTERM)
        after = []
        for line in proc.stdout:
            after.append(int(line.split()[1]))
            if len(after) >= 3:
                break
        assert len(after) == 3 and proc.poll() is None, f"the SIGTERM stopped it: {proc.returncode}"
    finally:
        proc.kill()
        proc.wait(30)
