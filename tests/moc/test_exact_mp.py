"""Exact mode on 2 gloo ranks (real processes): FSDP2 (DTensor shards, experts split over
the ranks) and whole replicas. One rank is SIGKILLed mid-window, the other is killed as a
launcher would; the job is restarted, restores (from the shared-memory snapshots, or from
storage after they are gone), replays, and ends with each rank's weights and Adam state
``torch.equal`` to an uninterrupted 2-rank run without moc (global-norm clipping in the
loop). A rank fed other data on replay stops both ranks with a clear error."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WORKER = os.path.join(ROOT, "tests", "helpers", "workers", "exact_mp_worker.py")
WORLD = 2
TIMEOUT = 240

pytestmark = pytest.mark.timeout(600)


def _launch(args: list[str], *, victim: int | None = None) -> list[tuple[int, str, dict | None]]:
    """Run the worker on WORLD ranks; return (exit code, output, RESULT) per rank. With
    ``victim``: once that rank has died (by SIGKILL), the others are SIGKILLed (a launcher
    tears the job down when one worker fails)."""
    from tests.conftest import free_port

    env = dict(os.environ, PYTHONPATH=ROOT, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1")
    logs = [tempfile.TemporaryFile("w+") for _ in range(WORLD)]
    procs = [subprocess.Popen([sys.executable, WORKER, *args], env=dict(env, RANK=str(r)), stdout=logs[r],
                              stderr=subprocess.STDOUT) for r in range(WORLD)]
    deadline = time.monotonic() + TIMEOUT
    try:
        if victim is not None:
            procs[victim].wait(timeout=TIMEOUT)
            for r, p in enumerate(procs):
                if r != victim and p.poll() is None:
                    p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = []
    for p, f in zip(procs, logs):
        f.seek(0)
        text = f.read()
        f.close()
        res = next((json.loads(l[len("RESULT "):]) for l in text.splitlines() if l.startswith("RESULT ")), None)
        out.append((p.returncode, text, res))
    return out


def _reference(tmp: str, shard: str, steps: int) -> str:
    out = os.path.join(tmp, "ref.pt")
    runs = _launch(["--shard", shard, "--no-moc", "--steps", str(steps), "--out", out])
    assert all(code == 0 for code, _, _ in runs), [text[-3000:] for _, text, _ in runs]
    return out


def _assert_equal_state(got: str, ref: str) -> None:
    for r in range(WORLD):
        g, f = torch.load(f"{got}.rank{r}", weights_only=True), torch.load(f"{ref}.rank{r}", weights_only=True)
        assert g["model"].keys() == f["model"].keys()
        for k, v in f["model"].items():
            assert torch.equal(g["model"][k], v), f"rank {r}: weights of {k} differ"
        assert g["optimizer"].keys() == f["optimizer"].keys(), f"rank {r}: parameters with Adam state differ"
        for name, st in f["optimizer"].items():
            assert st.keys() == g["optimizer"][name].keys()
            for k, v in st.items():
                assert torch.equal(g["optimizer"][name][k], v), f"rank {r}: Adam {k} of {name} differs"
        assert g["groups"] == f["groups"]


def test_fsdp2_sigkill_mid_window_replays_to_the_uninterrupted_state(tmp_path):
    ref = _reference(str(tmp_path), "fsdp", 16)
    common = ["--shard", "fsdp", "--storage", str(tmp_path / "store"), "--shm", str(tmp_path / "shm"), "--steps", "16"]
    # W = 4 (8 experts, k_snapshot=2): windows 0-3, 4-7, 8-11, 12-15; rank 0 (the one that
    # commits) is killed after step 13, once window 8-11 is committed
    runs = _launch([*common, "--kill-rank", "0", "--kill-at", "13", "--flush-at-kill"], victim=0)
    assert runs[0][0] == -signal.SIGKILL and "KILLING rank 0 after step 13" in runs[0][1], runs[0][1][-3000:]
    shutil.copytree(tmp_path / "store", tmp_path / "store2")
    for source, store, shm in (("memory", "store", "shm"), ("storage", "store2", "shm-empty")):
        # the same job restarted on the same nodes, then on nodes whose memory is gone
        args = [*common, "--out", str(tmp_path / f"got-{source}.pt")]
        args[args.index("--storage") + 1], args[args.index("--shm") + 1] = str(tmp_path / store), str(tmp_path / shm)
        for code, text, res in _launch(args):
            assert code == 0 and res is not None, text[-4000:]
            assert res["start"] == 9, res             # window 8-11: replay 9, 10, 11
            st = res["status"]
            assert st["last_replay"] == {"start": 8, "end": 11, "source": source}
            assert st["replays"] == 1 and st["replayed_steps"] == 3 and st["plt"] == 0.0
            # after the replay: window 12-15 captured, and committed by the final flush
            assert st["windows_complete"] == 1 and st["windows_skipped"] == 0 and st["last_persisted_step"] == 15
        _assert_equal_state(str(tmp_path / f"got-{source}.pt"), ref)


def test_divergence_on_one_rank_stops_both_then_replay_from_storage(tmp_path):
    # each rank its own replica (no gradient exchange): only rank 1 sees its other data
    ref = _reference(str(tmp_path), "independent", 12)
    common = ["--shard", "independent", "--storage", str(tmp_path / "store"), "--shm", str(tmp_path / "shm"),
              "--steps", "12"]
    runs = _launch([*common, "--kill-rank", "1", "--kill-at", "9", "--flush-at-kill"], victim=1)
    assert runs[1][0] == -signal.SIGKILL, runs[1][1][-3000:]
    # rank 1 alone feeds other data on replay: both ranks stop at the window's second step
    runs = _launch([*common, "--data-seed", "7", "--data-seed-rank", "1"])
    assert [code for code, _, _ in runs] == [1, 1], [text[-3000:] for _, text, _ in runs]
    assert "rank 1 step 5: replay diverged: the gradients" in runs[1][1], runs[1][1][-3000:]
    assert "rank 0 step 5: replay diverged on another rank" in runs[0][1], runs[0][1][-3000:]
    # the same data again, after the memory is gone: the window comes from storage, where the
    # units both ranks hold (same names, different values) are stored per rank (<unit>@rank<r>)
    shutil.rmtree(tmp_path / "shm")
    runs = _launch([*common, "--out", str(tmp_path / "got.pt")])
    for code, text, res in runs:
        assert code == 0 and res is not None, text[-4000:]
        assert res["start"] == 5 and res["status"]["replayed_steps"] == 3
        assert res["status"]["last_replay"]["source"] == "storage"
    _assert_equal_state(str(tmp_path / "got.pt"), ref)


def _one_rank_without_room(rank: int, world: int, storage: str, shm: str, grow: str, out: str) -> None:
    from datetime import timedelta
    from pathlib import Path

    from moc import CheckpointManager, MoCConfig
    from tests.helpers.moc_helpers import make, train_step

    cfg = MoCConfig(storage=storage, snapshot_dir=shm, interval=1, k_snapshot=4, exact=True,
                    coordination_timeout=timedelta(seconds=30))
    model, opt, task = make(0)          # 8 experts, k_snapshot=4: W = 2
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        for step in range(3):
            train_step(model, opt, task, step, ckpt)
        before = ckpt.status()
        torch.distributed.barrier()
        if rank == 1:   # make room on this rank's tmpfs (a real remount to a larger size)
            subprocess.run(["mount", "-o", "remount,size=64m", grow], check=True)
        torch.distributed.barrier()
        for step in range(3, 8):
            train_step(model, opt, task, step, ckpt)
        ckpt.wait()
        after = ckpt.status()
    Path(out, f"status{rank}.json").write_text(json.dumps({"before": before, "after": after}, default=str))


@pytest.mark.timeout(240)
def test_a_window_is_skipped_on_every_rank_when_one_has_no_room(tmp_path):
    """Rank 1's shared memory cannot hold a window: every rank skips it (one round), none
    captures a window the other could not, and nothing is committed; once rank 1 has room
    both open the same windows, and their parts are committed as one manifest."""
    from moc import CheckpointStore
    from tests.helpers.rank_harness import run_ranks
    from storage_backends import open_store
    from tests.moc.test_resources import PAGE, tmpfs

    base = tmp_path / "shm"
    with tmpfs(base / "rank1", 4 * PAGE):
        run_ranks(_one_rank_without_room, 2, tmp_path, str(tmp_path / "ckpt"), str(base), str(base / "rank1"),
                  str(tmp_path))
        st = [json.loads((tmp_path / f"status{r}.json").read_text()) for r in range(2)]
    for r, s in enumerate(st):
        b, a = s["before"]["exact"], s["after"]["exact"]
        assert b["windows_skipped"] == 3 and b["windows_started"] == 0 and b["rounds"] == 3, (r, b)
        assert b["last_persisted_step"] is None
        # room again at step 3: windows 3-4, 5-6 (7 starts one the run ends inside)
        assert a["windows_skipped"] == 3 and a["windows_started"] == 3 and a["windows_complete"] == 2, (r, a)
        assert a["last_window"]["start"] == 5 and a["last_persisted_step"] == 6, (r, a)
    assert "No space left" in st[1]["before"]["last_error"]
    assert "no snapshot buffer on another rank" in st[0]["before"]["last_error"]
    cs = CheckpointStore(open_store(str(tmp_path / "ckpt")))
    assert cs.steps()[0] >= 4 and cs.steps()[-1] == 6 and cs.verify(6) == []
    m = cs.read_manifest(6)
    assert m.meta["exact"]["world"] == 2 and m.meta["exact"]["start"] == 5
    assert any(n.endswith("@rank1") for n in m.units) and any(n.endswith("@rank0") for n in m.units)
    # one process cannot replay what two ranks trained: refused, naming both counts
    from moc import CheckpointError, CheckpointManager, MoCConfig
    from tests.helpers.moc_helpers import make

    model, opt, _ = make(0)
    cfg = MoCConfig(storage=str(tmp_path / "ckpt"), snapshot_dir=str(base), interval=1, k_snapshot=4, exact=True)
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        with pytest.raises(CheckpointError, match=r"written by 2 rank\(s\); this job has 1"):
            ckpt.restore()


def _sigterm_on_one_rank(rank: int, world: int, storage: str, shm: str, out: str) -> None:
    from datetime import timedelta
    from pathlib import Path

    from moc import CheckpointManager, MoCConfig
    from tests.helpers.moc_helpers import make, train_step

    cfg = MoCConfig(storage=storage, snapshot_dir=shm, interval=1, k_snapshot=4, exact=True,
                    coordination_timeout=timedelta(seconds=30))
    model, opt, task = make(0)          # W = 2: windows 0-1, 2-3, 4-5, ...
    code, at = None, None
    try:
        with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
            for step in range(20):
                at = step
                train_step(model, opt, task, step, ckpt)
                if step == 4 and rank == 1:
                    os.kill(os.getpid(), signal.SIGTERM)
    except SystemExit as exc:
        code = exc.code
    Path(out, f"sigterm{rank}.json").write_text(json.dumps({"code": code, "step": at}))


@pytest.mark.timeout(240)
def test_sigterm_on_one_rank_flushes_and_stops_every_rank_at_the_next_window(tmp_path):
    """A SIGTERM on rank 1 mid-window (after step 4 of window 4-5) stops both ranks at the
    next window's round (step 6), after the newest window complete on both (4-5) is committed."""
    from moc import CheckpointStore
    from tests.helpers.rank_harness import run_ranks
    from storage_backends import open_store

    run_ranks(_sigterm_on_one_rank, 2, tmp_path, str(tmp_path / "ckpt"), str(tmp_path / "shm"), str(tmp_path))
    got = [json.loads((tmp_path / f"sigterm{r}.json").read_text()) for r in range(2)]
    assert got == [{"code": 128 + signal.SIGTERM, "step": 6}] * 2, got
    cs = CheckpointStore(open_store(str(tmp_path / "ckpt")))
    assert cs.steps()[-1] == 5 and cs.read_manifest(5).meta["exact"]["start"] == 4 and cs.verify(5) == []
