"""Fencing of stale writers (moc._store.format, CheckpointStore, CheckpointManager.fence):
generations in data and manifest keys, conditional manifest commits, fence markers that
refuse older generations' writes and hide their manifests from readers, stores written
before fencing still read as generation 0, and two jobs on one storage path."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

from moc import CheckpointManager, CheckpointStore, FencedError, ForeignRunError, Manifest, MoCConfig
from moc._store.format import ChunkRecord, UnitRecord, manifest_key
from storage_backends import CommitConflict, open_store
from tests.helpers.moc_helpers import make, train_step

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def tree(value: float) -> dict:
    return {"model": {"w": torch.full((4,), value)}}


def save(cs: CheckpointStore, step: int, value: float, *, run: str = "run-a", generation: int | None = None):
    w = cs.writer(step, "r0", generation=generation)
    rec = w.add_unit("module/m", tree(value), kind="module")
    w.finish()
    return cs.commit(step, [rec], meta={"run_id": run}, generation=generation)


def value(cs: CheckpointStore, step: int | None = None) -> float:
    return float(cs.load(step).units["module/m"]["model"]["w"][0])


@pytest.fixture(params=["local", "memory", "s3"])
def url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store"), {}
    if request.param == "memory":
        return f"memory://fence-{os.getpid()}-{time.monotonic_ns()}", {}
    server = request.getfixturevalue("s3")
    return "s3://ckpt/fence", dict(server.options)


def open_cs(url) -> CheckpointStore:
    u, opts = url
    return CheckpointStore(open_store(u, **opts))


def test_generation_is_in_data_and_manifest_keys(url):
    cs = open_cs(url)
    cs.generation = 3
    save(cs, 10, 1.0)
    assert cs.store.list("manifests/") == ["manifests/000000000010.g3.json"]
    assert all(k.split("/")[-1].startswith(f"g3.r0.{cs.nonce}.") for k in cs.store.list("data/"))
    assert cs.steps() == [10] and cs.read_manifest(10).meta["generation"] == 3


def test_a_fence_refuses_an_older_generation_and_hides_its_manifests(url):
    old, new = open_cs(url), open_cs(url)
    old.generation = 1
    save(old, 0, 0.0)
    save(old, 10, 10.0)
    new.generation = 2
    new.write_fence(2, 11, run_id="run-a")
    # the stale writer: neither its data nor its manifest gets through (data writes reuse a
    # listing of the fences for fence_ttl: the one of its last commit is that recent here)
    old.fence_ttl = timedelta(0)
    w = old.writer(20, "r0")
    rec = w.add_unit("module/m", tree(20.0), kind="module")
    with pytest.raises(FencedError, match=r"generation 1 is stale, generation 2 took over at step 11") as info:
        w.finish()
    assert (info.value.step, info.value.generation, info.value.fence) == (20, 1, 2)
    assert not [k for k in old.store.list("data/") if k.startswith("data/000000000020/")]
    with pytest.raises(FencedError):
        old.commit(20, [rec], meta={"run_id": "run-a"})
    assert old.store.list("manifests/") == ["manifests/000000000000.g1.json", "manifests/000000000010.g1.json"]
    # a stale manifest that raced past the check (committed between its check and the fence)
    late = Manifest(step=25, units=old.read_manifest(10).units, meta={"run_id": "run-a", "generation": 1})
    old.store.commit_new(manifest_key(25, 1), late.to_bytes())
    for reader in (old, new, open_cs(url)):
        assert reader.steps() == [0, 10]            # step 25 of generation 1 is behind the fence
        assert reader.verify() == []
        assert value(reader) == 10.0
    save(new, 30, 30.0)
    assert new.steps() == [0, 10, 30] and value(new) == 30.0
    with pytest.raises(FencedError):              # an older generation cannot fence a newer one
        old.write_fence(1, 5)


def test_newest_generation_wins_a_step_both_committed(url):
    """After an exact-mode replay a newer generation commits a step again: its manifest
    is the step's, and the older one is removed by gc."""
    old, new = open_cs(url), open_cs(url)
    old.generation, new.generation = 1, 2
    save(old, 10, 1.0)
    new.write_fence(2, 10)
    save(new, 10, 2.0)
    assert new.steps() == [10] and value(new) == 2.0 and value(old) == 2.0
    hidden = new.manifest_index()[1]
    assert hidden == ["manifests/000000000010.g1.json"]
    new.gc()
    assert new.store.list("manifests/") == ["manifests/000000000010.g2.json"]
    assert new.verify() == [] and value(new) == 2.0


def test_manifests_are_never_overwritten_and_other_runs_are_named(url):
    a, b = open_cs(url), open_cs(url)
    save(a, 5, 1.0, run="run-a")
    with pytest.raises(ForeignRunError) as info:
        save(b, 5, 2.0, run="run-b")
    err = info.value
    assert err.other_run == "run-a" and err.run == "run-b" and err.key == "manifests/000000000005.json"
    assert a.store.url in str(err) and "run-a" in str(err) and "run-b" in str(err)
    with pytest.raises(CommitConflict):         # the same run again: refused too, never overwritten
        save(b, 5, 3.0, run="run-a")
    assert value(open_cs(url), 5) == 1.0 and open_cs(url).verify() == []


def _legacy_store(root: str) -> None:
    """A store as moc wrote it before fencing: ``data/<step>/r0.<group>.bin`` and
    ``manifests/<step>.json``, committed with a plain overwrite, no generation anywhere."""
    cs = CheckpointStore(root)
    store = cs.store
    for step, v in ((0, 0.0), (5, 5.0)):
        w = cs.writer(step, "r0")
        rec = w.add_unit("module/m", tree(v), kind="module")
        w.finish()
        new_key = f"data/{step:012d}/r0.state.bin"
        for key in store.list(f"data/{step:012d}/"):
            store.write(new_key, store.read(key))
            store.delete(key)
        chunks = [ChunkRecord(**{**c.to_json(), "key": new_key}) for c in rec.chunks]
        rec = UnitRecord(**{**rec.__dict__, "chunks": chunks})
        store.commit(manifest_key(step), Manifest(step=step, units={"module/m": rec},
                                                  meta={"run_id": "old-run"}).to_bytes())


def test_a_store_from_before_fencing_reads_as_generation_0(tmp_path):
    root = str(tmp_path / "old")
    _legacy_store(root)
    cs = CheckpointStore(root)
    assert cs.store.list("manifests/") == ["manifests/000000000000.json", "manifests/000000000005.json"]
    assert cs.steps() == [0, 5] and cs.verify() == [] and value(cs) == 5.0
    # a generation-1 job takes it over: the old manifests stay readable below its resume step
    cs.generation = 1
    cs.write_fence(1, 6, run_id="old-run")
    save(cs, 8, 8.0, run="old-run")
    assert cs.steps() == [0, 5, 8] and value(cs, 5) == 5.0 and value(cs) == 8.0 and cs.verify() == []
    out = subprocess.run([sys.executable, "-m", "moc.cli", "verify", root], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr
    assert "steps 0, 5, 8 verified" in out.stdout


def cfg_for(tmp_path, **kw) -> MoCConfig:
    kw.setdefault("interval", 2)
    return MoCConfig(storage=str(tmp_path / "ckpt"), snapshot_dir=str(tmp_path / "shm"), **kw)


def test_manager_refuses_to_commit_once_fenced_and_says_so(tmp_path, caplog):
    model, opt, task = make(0)
    ckpt = CheckpointManager(cfg_for(tmp_path), model=model, optimizer=opt, generation=1)
    assert ckpt.generation == 1
    for step in range(4):
        train_step(model, opt, task, step, ckpt)
    ckpt.wait()
    committed = ckpt.store.steps()
    assert committed and all(k.endswith(".g1.json") for k in ckpt.store.store.list("manifests/"))
    # a newer generation takes over (another process: its own store object)
    CheckpointStore(str(tmp_path / "ckpt")).write_fence(2, committed[-1] + 1, run_id=ckpt.run_id)
    caplog.set_level(logging.ERROR, logger="moc")
    for step in range(4, 10):
        train_step(model, opt, task, step, ckpt)
    ckpt.wait(flush=False)
    st = ckpt.status()
    assert st["writes_refused"] >= 1 and st["generation"] == 1
    assert "generation 1 is stale, generation 2 took over" in st["last_refusal"]
    assert any("write refused, generation 1 is fenced by generation 2" in r.getMessage()
               and "rank 0 step" in r.getMessage() for r in caplog.records)
    assert ckpt.store.steps() == committed      # nothing of the stale generation got in
    with pytest.raises(FencedError):
        ckpt.close()
    assert CheckpointStore(str(tmp_path / "ckpt")).verify() == []


def test_manager_fence_writes_the_marker_and_generation_only_grows(tmp_path):
    model, opt, task = make(0)
    ckpt = CheckpointManager(cfg_for(tmp_path), model=model, optimizer=opt)
    assert ckpt.generation == 0
    ckpt.fence(4, resume_step=0)
    assert ckpt.generation == 4
    assert json.loads(ckpt.store.store.read("fence/g000000000004.json"))["resume_step"] == 0
    with pytest.raises(ValueError, match="generation only grows"):
        ckpt.fence(3, resume_step=0)
    with pytest.raises(ValueError, match="resume_step"):
        ckpt.fence(5, resume_step=-1)
    for step in range(3):
        train_step(model, opt, task, step, ckpt)
    ckpt.close()
    assert CheckpointStore(str(tmp_path / "ckpt")).store.list("manifests/")[-1].endswith(".g4.json")
    with pytest.raises(ValueError, match="generation must be"):
        CheckpointManager(cfg_for(tmp_path), model=model, optimizer=opt, generation=-1)


WORKER = os.path.join(ROOT, "tests", "helpers", "workers", "two_jobs_worker.py")


def test_two_jobs_on_one_storage_path_one_stops_with_a_clear_error(tmp_path):
    """Two independent jobs (real processes, their own run ids) write to one path by
    mistake: each step is one job's, the other stops naming the path and the other run."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    store = str(tmp_path / "ckpt")
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, WORKER, store, str(tmp_path / f"shm{i}"), str(go), "40"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    time.sleep(0.5)
    go.write_text("go")
    outs = [p.communicate(timeout=180) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 3], (codes, outs)
    loser = outs[codes.index(3)]
    winner = outs[codes.index(0)]
    run_winner = json.loads(winner[0].strip().splitlines()[-1])["run_id"]
    assert "ForeignRunError" in loser[1] and "two jobs write checkpoints to" in loser[1]
    assert store in loser[1] and f"run {run_winner} already committed" in loser[1]
    cs = CheckpointStore(store)
    assert cs.verify() == []
    assert cs.read_manifest(cs.steps()[-1]).meta["run_id"] == run_winner


def test_a_new_job_on_a_fenced_path_counts_its_generations_above_the_old_fences(tmp_path):
    """A new controller counts generations from 1 again: a job whose first restore finds an
    earlier job's fences (here up to 5) adds them, so its own writes go through."""
    model, opt, task = make(0)
    old = CheckpointStore(str(tmp_path / "ckpt"))
    old.generation = 5
    old.write_fence(5, 0, run_id="earlier")
    ckpt = CheckpointManager(cfg_for(tmp_path), model=model, optimizer=opt, generation=1)
    start = ckpt.restore()
    assert ckpt.generation == 6
    ckpt.fence(2, resume_step=start)
    assert ckpt.generation == 7
    for step in range(start, start + 4):
        train_step(model, opt, task, step, ckpt)
    ckpt.close()
    cs = CheckpointStore(str(tmp_path / "ckpt"))
    assert cs.store.list("manifests/")[-1].endswith(".g7.json") and cs.store.list("fence/")[-1].endswith("7.json")
    assert ckpt.status()["writes_refused"] == 0 and cs.verify() == []


ZOMBIE = os.path.join(ROOT, "tests", "helpers", "workers", "zombie_worker.py")


def _last_step(path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return -1


@pytest.mark.timeout(300)   # ~25 s on an idle 2-core machine; minutes under heavy load
def test_a_sigstopped_writer_resumed_after_a_newer_generation_took_over_is_refused(tmp_path):
    """The zombie: a generation-1 trainer (a real process) is SIGSTOPped; generation 2
    restores from what it committed, fences it and trains on; woken, the zombie keeps
    training and every write it tries is refused, counted and logged; the store stays
    verifiable and nothing committed is lost."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    store = str(tmp_path / "ckpt")
    old_progress, new_progress = tmp_path / "old.step", tmp_path / "new.step"
    zombie = subprocess.Popen([sys.executable, ZOMBIE, store, str(tmp_path / "shm-old"), "1", "25", str(old_progress)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while _last_step(old_progress) < 6 and zombie.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _last_step(old_progress) >= 6, zombie.communicate(timeout=10)
        zombie.send_signal(19)   # SIGSTOP: frozen wherever it was, a persist in flight or not
        before = CheckpointStore(store).steps()
        assert before
        # the last step it finished (its newest commit may be a step newer than its progress file)
        frozen_at = max(_last_step(old_progress), before[-1])
        new = subprocess.run([sys.executable, ZOMBIE, store, str(tmp_path / "shm-new"), "2", "20", str(new_progress),
                              "--fence"], capture_output=True, text=True, timeout=90, env=env)
        assert new.returncode == 0, new.stderr[-3000:]
        resume = json.loads(new.stdout.strip().splitlines()[-1])["start"]
        zombie.send_signal(18)   # SIGCONT
        out, err = zombie.communicate(timeout=90)
    finally:
        if zombie.poll() is None:
            zombie.kill()
    assert zombie.returncode == 4, err[-3000:]
    status = json.loads(out.strip().splitlines()[-1])["status"]
    # it kept training (a checkpoint at every step) and every write it tried was refused
    assert status["step"] == 24 and status["generation"] == 1
    assert status["writes_refused"] >= 24 - frozen_at - 1
    assert status["last_persisted_step"] <= frozen_at
    assert "generation 1 is stale, generation 2 took over" in status["last_refusal"]
    assert "write refused, generation 1 is fenced by generation 2" in err and "rank 0 step" in err
    assert "FencedError" in err
    cs = CheckpointStore(store)
    index, _ = cs.manifest_index()
    # the zombie's commits from before the takeover are kept, generation 2's are all there,
    # nothing of generation 1 at or after the resume step is read
    assert [s for s in before if s < resume] == [s for s in cs.steps() if s < resume]
    assert [s for s in cs.steps() if s >= resume] == list(range(resume, 20))
    assert all(g == 2 for s, (g, _) in index.items() if s >= resume)
    assert cs.verify() == []
    cli = subprocess.run([sys.executable, "-m", "moc.cli", "verify", store], capture_output=True, text=True,
                         timeout=120, env=env)
    assert cli.returncode == 0, cli.stdout + cli.stderr


@pytest.mark.parametrize("exact", [False, True])
def test_a_restarted_job_writes_as_a_new_generation_and_fences_its_old_incarnation(tmp_path, exact):
    """A job with no runtime counting generations (no ``generation=``): its restore starts
    generation 1 and fences generation 0 from the step after the newest committed one. What
    the restart writes again (exact mode replays its committed window and commits it anew)
    goes under keys of its own, never over a committed manifest; the old incarnation, still
    running, commits nothing more; every committed checkpoint stays readable."""
    kw = dict(interval=1, k_snapshot=4, exact=True) if exact else dict(interval=2, k_snapshot=8)
    cfg = MoCConfig(storage=str(tmp_path / "ckpt"), snapshot_dir=str(tmp_path / "shm-old"), **kw)
    model, opt, task = make(0)
    old = CheckpointManager(cfg, model=model, optimizer=opt)
    for step in range(6):
        train_step(model, opt, task, step, old)
    old.wait()
    before = CheckpointStore(str(tmp_path / "ckpt"))
    committed = before.steps()
    assert committed and old.generation == 0
    # the restart (another process would; its own buffers): restore, then train on
    cfg2 = MoCConfig(storage=str(tmp_path / "ckpt"), snapshot_dir=str(tmp_path / "shm-new"), **kw)
    model2, opt2, _ = make(1)
    new = CheckpointManager(cfg2, model=model2, optimizer=opt2)
    start = new.restore()
    assert start > 0 and new.generation == 1
    fence = json.loads(new.store.store.read("fence/g000000000001.json"))
    assert fence["resume_step"] == committed[-1] + 1
    for step in range(start, 10):
        train_step(model2, opt2, task, step, new)
    new.close()
    assert new.status()["writes_refused"] == 0
    cs = CheckpointStore(str(tmp_path / "ckpt"))
    keys = cs.store.list("manifests/")
    assert any(k.endswith(".g1.json") for k in keys)
    # the old incarnation keeps training: every commit it tries is refused, counted, logged
    # (plain mode: training goes on, close() raises; exact mode stops at the window that
    # could not be committed, naming the fence)
    from moc import CheckpointError

    with pytest.raises((FencedError, CheckpointError), match="generation 0 is stale, generation 1 took over"):
        for step in range(6, 12):
            train_step(model, opt, task, step, old)
        old.wait(flush=False)
        assert old.status()["writes_refused"] >= 1
        old.close()
    assert old.status()["writes_refused"] >= 1
    assert cs.verify() == [] and committed[-1] in cs.steps()     # (retention dropped the oldest)
    stale = [k for k in cs.store.list("manifests/")
             if ".g" not in k and int(k.rsplit("/", 1)[-1].split(".")[0]) > committed[-1]]
    assert stale == []                                           # the old incarnation committed nothing more
