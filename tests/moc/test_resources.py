"""The snapshot level running out of something never raises into training.

Each test drives one resource to exhaustion against real parts (a moto S3 server behind a
proxy that hangs, a real tmpfs that fills up, real gloo ranks) and checks the rule of
``moc._snapshot.buffers``: the due snapshot is skipped and counted (or another buffer serves it),
the newest complete snapshot stays recoverable, nothing committed is lost, and snapshots
and persists resume once the resource is back.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from moc import CheckpointManager, CheckpointStore, MoCConfig
from tests.helpers.moc_helpers import clone_state, make, train_step
from tests.helpers.rank_harness import run_ranks
from storage_backends import RetryPolicy, open_store
from storage_backends.testing import StorageProxy

PAGE = 4096


@contextlib.contextmanager
def tmpfs(path: Path, size: int):
    """A real tmpfs of ``size`` bytes mounted at ``path`` (the test machine runs as root, as CI does)."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"mounting a {size}-byte tmpfs at {path} failed (needs root): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _buffer_digest(buf) -> str:
    return hashlib.sha1(buf.data.numpy().tobytes()).hexdigest()


@pytest.mark.timeout(240)
def test_handover_while_storage_hangs_never_refills_a_buffer_still_being_read(tmp_path, s3):
    """A persist hung on storage outlives its manager (a reconfiguration detaches it): its
    buffer stays untouched until it lets go, the successor's own persist hangs too, and
    the due snapshots that find no buffer are skipped and counted, never raised."""
    proxy = StorageProxy(s3.port).start()
    try:
        opts = dict(s3.options, endpoint_url=proxy.url, read_timeout=timedelta(seconds=60),
                    retry=RetryPolicy(attempts=2, initial=timedelta(milliseconds=50)))
        cfg = MoCConfig(storage="s3://ckpt/run", storage_options=opts, snapshot_dir=str(tmp_path / "shm"),
                        interval=1, k_snapshot=2, k_persist=1, keep_last=50)
        model, opt, task = make(0)
        a = CheckpointManager(cfg, model=model, optimizer=opt)
        for step in range(4):
            train_step(model, opt, task, step, a)
        a.wait()
        committed = CheckpointStore(open_store("s3://ckpt/run", **opts)).steps()
        assert committed and committed[-1] == 3

        proxy.hang()
        before = proxy.requests
        train_step(model, opt, task, 4, a)        # its persist starts and hangs in a write
        deadline = time.monotonic() + 30
        while not (any(x.state == "persist" for x in a.pool.buffers) and proxy.requests > before):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        handover = a.detach(grace=timedelta(milliseconds=50))
        read = [b for b in handover.pool.buffers if b.users > 0]
        assert len(read) == 1, "the detached manager's hung persist holds a lease on the buffer it reads"
        stale = read[0]
        stale_step, stale_digest = stale.step, _buffer_digest(stale)

        b = CheckpointManager(cfg, model=model, optimizer=opt, handover=handover)
        assert b.pool is handover.pool and b.run.lock is handover.pool.lock
        snaps = {}
        for step in range(5, 12):
            train_step(model, opt, task, step, b)   # never raises
            snaps[step] = b.status()
        st = b.status()
        assert st["snapshots_skipped"] >= 2, st
        assert "every snapshot buffer" in st["last_skip"]["reason"]
        # the buffer the stale persist reads was never refilled
        assert stale.step == stale_step and _buffer_digest(stale) == stale_digest
        newest = st["last_snapshot_step"]
        assert newest is not None and newest >= 6
        assert b.snapshot_state()[0] == newest    # the newest complete snapshot stays recoverable

        proxy.heal()
        live = {}
        for step in range(12, 20):
            train_step(model, opt, task, step, b)
            live[step] = clone_state(model, opt)
            time.sleep(0.05)
        deadline = time.monotonic() + 60
        while stale.users:                          # the stale thread ends and lets go
            assert time.monotonic() < deadline
            time.sleep(0.05)
        b.wait()
        last = b.status()["last_snapshot_step"]
        assert last == 19 and b.status()["last_persisted_step"] == 19
        b.close()

        cs = CheckpointStore(open_store("s3://ckpt/run", **opts))
        assert set(committed) <= set(cs.steps()) and cs.steps()[-1] == 19
        assert cs.verify(19) == []
        m2, o2, _ = make(5)
        with CheckpointManager(cfg, model=m2, optimizer=o2) as c:
            assert c.restore() == 20
        restored = clone_state(m2, o2)
        dense = [k for k in live[19]["model"] if ".experts." not in k]   # experts: their saved versions (PEC)
        assert dense
        for k in dense:
            assert torch.equal(live[19]["model"][k], restored["model"][k]), k
    finally:
        proxy.close()


def _sizes(tmp_path: Path) -> tuple[int, int]:
    """Bytes of the buffer and the header (whole pages) of a first, full snapshot (a dry run)."""
    cfg = MoCConfig(storage=str(tmp_path / "dry-store"), snapshot_dir=str(tmp_path / "dry-shm"), interval=1,
                    k_snapshot=2, k_persist=1)
    model, opt, task = make(0)
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        train_step(model, opt, task, 0, ckpt)
        ckpt.wait()
        full = ckpt.status()["buffer_bytes"]
        header = max(os.path.getsize(p) for p in Path(ckpt.snapshot_dir).glob("*.json"))
    return full, -(-header // PAGE) * PAGE


@pytest.mark.timeout(180)
def test_full_shared_memory_skips_snapshots_then_resumes(tmp_path, s3):
    """/dev/shm full (a real tmpfs with no room for a second buffer): the due snapshots are
    skipped with ENOSPC named, never a SIGBUS or an exception; the first snapshot stays the
    recoverable one and is persisted; once room is made, snapshots and commits resume."""
    full, header = _sizes(tmp_path)
    filler_bytes = full          # room for any snapshot once it is gone
    with tmpfs(tmp_path / "shm", full + header + filler_bytes + 2 * PAGE) as shm:
        filler = shm / "filler"
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, filler_bytes)
        # (keep_last: steps 6, 7 and 8 may all persist, and with the default 3 step 0 would be
        # retired, as it should be, before the check below that it was committed)
        cfg = MoCConfig(storage="s3://ckpt/run", storage_options=s3.options, snapshot_dir=str(shm), interval=1,
                        k_snapshot=2, k_persist=1, keep_last=10)
        model, opt, task = make(0)
        with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
            train_step(model, opt, task, 0, ckpt)
            ckpt.wait()
            for step in range(1, 6):
                train_step(model, opt, task, step, ckpt)
            st = ckpt.status()
            assert st["snapshots_skipped"] == 5 and st["snapshots_skipped_here"] == 5, st
            assert "No space left" in st["last_skip"]["reason"] and str(shm) in st["last_skip"]["reason"]
            assert st["last_snapshot_step"] == 0 and ckpt.snapshot_state()[0] == 0
            assert st["last_persisted_step"] == 0

            filler.unlink()                          # room again
            for step in range(6, 9):
                train_step(model, opt, task, step, ckpt)
            live = clone_state(model, opt)
            ckpt.wait()
            st = ckpt.status()
            assert st["snapshots_skipped"] == 5
            assert st["last_snapshot_step"] == 8 and st["last_persisted_step"] == 8
        cs = CheckpointStore(open_store("s3://ckpt/run", **s3.options))
        assert cs.steps()[0] == 0 and cs.steps()[-1] == 8 and cs.verify(8) == []
        m2, o2, _ = make(3)
        with CheckpointManager(cfg, model=m2, optimizer=o2) as c:
            assert c.restore() == 9
        got = clone_state(m2, o2)
        dense = [k for k in live["model"] if ".experts." not in k]
        assert dense
        for k in dense:
            assert torch.equal(live["model"][k], got["model"][k]), k


def _two_ranks_one_full(rank: int, world: int, storage: str, shm: str, grow: str, out: str) -> None:
    import json

    cfg = MoCConfig(storage=storage, snapshot_dir=shm, interval=1, k_snapshot=2, k_persist=1,
                    coordination_timeout=timedelta(seconds=30))
    model, opt, task = make(0)
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        for step in range(4):
            train_step(model, opt, task, step, ckpt)
        ckpt.wait(flush=False)
        before = ckpt.status()
        torch.distributed.barrier()
        if rank == 1:   # make room on this rank's tmpfs (a real remount to a larger size)
            subprocess.run(["mount", "-o", "remount,size=64m", grow], check=True)
        torch.distributed.barrier()
        for step in range(4, 8):
            train_step(model, opt, task, step, ckpt)
        ckpt.wait()
        after = ckpt.status()
    Path(out, f"status{rank}.json").write_text(json.dumps({"before": before, "after": after}, default=str))


@pytest.mark.timeout(240)
def test_one_rank_without_room_skips_alone_and_its_peers_do_not_wait(tmp_path):
    """Rank 1's shared memory cannot hold its share: it skips its copies after the round
    (counted there only), still takes part in the remote-copy exchange, so rank 0 neither
    hangs nor fails; nothing is committed without rank 1's share; after rank 1's tmpfs grows,
    both snapshot and the checkpoint commits."""
    import json

    base = tmp_path / "shm"
    with tmpfs(base / "rank1", 4 * PAGE):
        run_ranks(_two_ranks_one_full, 2, tmp_path, str(tmp_path / "ckpt"), str(base), str(base / "rank1"),
                  str(tmp_path))
        st = [json.loads((tmp_path / f"status{r}.json").read_text()) for r in range(2)]
    r0, r1 = st[0], st[1]
    assert r1["before"]["snapshots_skipped_here"] == 4 and r0["before"]["snapshots_skipped_here"] == 0
    assert "No space left" in r1["before"]["last_skip"]["reason"]
    assert r0["before"]["last_snapshot_step"] == 3 and r1["before"]["last_snapshot_step"] is None
    assert r0["before"]["last_persisted_step"] is None       # never committed without rank 1's share
    assert r0["before"]["snapshot_failures"] == 0 and r1["before"]["snapshot_failures"] == 0
    for s in st:   # the persists rank 1 had no snapshot for were skipped, not storage failures
        assert s["before"]["persists_skipped"] >= 1 and s["before"]["persist_failures"] == 0, s["before"]
    for s in st:
        assert s["after"]["last_snapshot_step"] == 7 and s["after"]["last_persisted_step"] == 7
    cs = CheckpointStore(open_store(str(tmp_path / "ckpt")))
    assert min(cs.steps()) >= 4 and cs.steps()[-1] == 7     # nothing before rank 1 had room
    assert all(cs.verify(s) == [] for s in cs.steps())


@pytest.mark.timeout(120)
def test_a_manager_starts_while_storage_is_down_and_persists_once_it_is_back(tmp_path):
    """Opening the manager during an outage (a worker restarted mid-outage) is not a
    configuration error: it starts, training snapshots, persists fail and are retried,
    and the newest snapshot is committed once the endpoint is back."""
    from tests.conftest import MotoS3

    server = MotoS3()
    server.start()
    # moto's servers in one process share one backend: without a reset this job found the
    # objects of the previous test's job under s3://ckpt/run (two jobs on one path)
    server.reset()
    server.make_bucket("ckpt")
    proxy = StorageProxy(server.port).start()
    try:
        opts = dict(server.options, endpoint_url=proxy.url, connect_timeout=timedelta(seconds=1),
                    retry=RetryPolicy(attempts=2, initial=timedelta(milliseconds=20)))
        cfg = MoCConfig(storage="s3://ckpt/run", storage_options=opts, snapshot_dir=str(tmp_path / "shm"),
                        interval=1, k_snapshot=2, k_persist=1)
        proxy.refuse()
        model, opt, task = make(0)
        with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
            for step in range(3):
                train_step(model, opt, task, step, ckpt)
            ckpt.wait(flush=False)
            st = ckpt.status()
            assert st["last_snapshot_step"] == 2 and st["last_persisted_step"] is None
            assert st["persist_failures"] >= 1 and "ConnectionError" in st["last_error"]
            proxy.heal()
            for step in range(3, 6):
                train_step(model, opt, task, step, ckpt)
            ckpt.wait()
            assert ckpt.status()["last_persisted_step"] == 5
        with pytest.raises(FileNotFoundError, match="bucket 'nope' does not exist"):
            CheckpointManager(MoCConfig(storage="s3://nope/run", storage_options=opts,
                                        snapshot_dir=str(tmp_path / "shm2")), model=model, optimizer=opt)
    finally:
        proxy.close()
        server.stop()


def _train_through_a_hung_commit(rank: int, world: int, opts: dict, shm: str, out: str) -> None:
    import json

    cfg = MoCConfig(storage="s3://ckpt/run", storage_options=opts, snapshot_dir=shm, interval=1, k_snapshot=2,
                    k_persist=1, coordination_timeout=timedelta(seconds=4), persist_timeout=timedelta(minutes=5))
    model, opt, task = make(0)
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    for step in range(3):
        train_step(model, opt, task, step, ckpt)
    ckpt.wait()
    Path(out, f"ready{rank}").touch()
    while not Path(out, "hung").exists():       # the parent holds every commit from here on
        time.sleep(0.05)
    # Rank 0's commit of step 3 hangs meanwhile, for three of the persist group's 4 s
    # timeouts (the same steps on both ranks): the persist threads keep meeting every tick.
    step = 3
    while step < 3 + 12 * 20:
        train_step(model, opt, task, step, ckpt)
        step += 1
        time.sleep(0.05)
    st = ckpt.status()
    Path(out, f"trained{rank}.json").write_text(json.dumps(
        {"steps": step, "persist_in_flight": st["persist_in_flight"], "last_snapshot_step": st["last_snapshot_step"]}))
    while not Path(out, "healed").exists():
        time.sleep(0.05)
    ckpt.wait()          # collective: the hung commit ends, then the newest snapshot is persisted
    st = ckpt.status()
    Path(out, f"flushed{rank}.json").write_text(json.dumps(
        {k: st[k] for k in ("last_persisted_step", "persist_failures", "persists_skipped", "last_error")}))
    ckpt.close(keep_snapshots=True, raise_errors=False, flush=False)


@pytest.mark.timeout(240)
def test_no_rank_waits_for_its_own_commit_hung_on_storage(tmp_path):
    """Rank 0 commits the manifest while the other ranks wait for the outcome; with the
    endpoint hung on that request only, no rank waits for the job at its rounds (rank 0
    did, for up to persist_timeout, and rank 1's next round then timed out): both ranks
    train 240 more steps, ~12 s, three of the persist group's timeouts, while the commit
    is still hung. No persist collective times out meanwhile (it did on rank 1, which
    then booked a failure rank 0 did not: the ranks disagreed on what was committed, and
    the group was out of step): once storage is back, both ranks book the same commits
    and no failure."""
    import json

    from tests.conftest import MotoS3

    server = MotoS3()
    server.start()
    # moto's servers in one process share one backend: without a reset this job found the
    # objects of the previous test's job under s3://ckpt/run (two jobs on one path)
    server.reset()
    server.make_bucket("ckpt")
    proxy = StorageProxy(server.port).start()
    try:
        opts = dict(server.options, endpoint_url=proxy.url, read_timeout=timedelta(seconds=120),
                    retry=RetryPolicy(attempts=1))
        import threading

        def hang_when_ready() -> None:
            deadline = time.monotonic() + 120
            while not all((tmp_path / f"ready{r}").exists() for r in range(2)) and time.monotonic() < deadline:
                time.sleep(0.05)
            proxy.hang(match="/manifests/")
            (tmp_path / "hung").touch()
            while not all((tmp_path / f"trained{r}.json").exists() for r in range(2)) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            proxy.heal()
            (tmp_path / "healed").touch()

        t = threading.Thread(target=hang_when_ready, daemon=True)
        t.start()
        run_ranks(_train_through_a_hung_commit, 2, tmp_path, opts, str(tmp_path / "shm"), str(tmp_path))
        t.join(5)
        res = [json.loads((tmp_path / f"trained{r}.json").read_text()) for r in range(2)]
        assert res[0]["persist_in_flight"], "rank 0's commit was still hung when it had trained 240 more steps"
        for r in res:
            assert r["steps"] == 243 and r["last_snapshot_step"] >= 241   # (the newest copy may still run)
        assert res[1]["persist_in_flight"], "rank 1 gave up waiting for rank 0's commit"
        flushed = [json.loads((tmp_path / f"flushed{r}.json").read_text()) for r in range(2)]
        assert flushed[0] == flushed[1], flushed
        assert flushed[0]["last_persisted_step"] == 242 and flushed[0]["persist_failures"] == 0, flushed
        steps = CheckpointStore(open_store("s3://ckpt/run", **server.options)).steps()
        assert steps[-1] == 242 and 3 <= steps[-2] < 242, steps    # the hung commit landed once healed
    finally:
        proxy.close()
        server.stop()
