"""Exact mode in an elastic job: ``detach()`` hands an exact manager over to the next one
(same process, its shared-memory windows kept), ``restore(reshard=True)`` restores a window
by unit name onto the same ranks (bit-identical replay, divergence check on) or onto
another number of ranks (check off, every step's update applied once), and a replay cut
short by a hand-over is rolled back again."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moc import CheckpointError, CheckpointManager, MoCConfig
from tests.helpers.moc_helpers import clone_state, make, train_step

STEPS = 12


def _cfg(storage: Path, shm: Path) -> MoCConfig:
    # 8 experts, k_snapshot=2: W = 4, windows 0-3, 4-7, 8-11
    return MoCConfig(storage=str(storage), snapshot_dir=str(shm), interval=1, k_snapshot=2, exact=True)


def _assert_equal(got: dict, ref: dict) -> None:
    assert got["model"].keys() == ref["model"].keys()
    for k, v in ref["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["optim"].keys() == ref["optim"].keys()
    for name, st in ref["optim"].items():
        for k, v in st.items():
            assert torch.equal(got["optim"][name][k], v) if torch.is_tensor(v) else got["optim"][name][k] == v, \
                (name, k)


def test_handover_then_resharded_restore_from_memory_and_a_cut_replay_rolled_back_again(tmp_path: Path) -> None:
    model, opt, task = make(0)
    for step in range(STEPS):
        train_step(model, opt, task, step)
    ref = clone_state(model, opt)

    model, opt, task = make(0)
    cfg = _cfg(tmp_path / "store", tmp_path / "shm")
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    for step in range(10):
        train_step(model, opt, task, step, ckpt)
        if step == 7:
            ckpt.wait()                              # window 4-7 committed
    hand = ckpt.detach()                             # window 8-11 in progress: dropped
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt, handover=hand)
    assert not ckpt.interrupted_replay and ckpt.status()["exact"]["last_persisted_step"] == 7
    assert ckpt.restore(reshard=True) == 5
    rep = ckpt.status()["exact"]["last_replay"]
    # the same process, the same units: every unit from its own memory copy, the check on
    assert rep == {"start": 4, "end": 7, "source": "memory", "resharded": True, "checked": True,
                   "units": {"memory": len(ckpt.layout.units), "storage": 0}, "world": 1}, rep
    for step in range(5, 7):                         # replay cut short at step 6 by another hand-over
        train_step(model, opt, task, step, ckpt)
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt, handover=ckpt.detach())
    assert ckpt.interrupted_replay                   # the model is half replayed
    assert ckpt.restore(reshard=True) == 5
    for step in range(5, STEPS):
        train_step(model, opt, task, step, ckpt)
    st = ckpt.status()["exact"]
    assert st["replays"] == 2 and st["replayed_steps"] == 2 + 3 and ckpt.plt() == 0.0
    ckpt.close()
    _assert_equal(clone_state(model, opt), ref)


def test_resharded_restore_refuses_other_units_and_needs_exact_mode(tmp_path: Path) -> None:
    model, opt, task = make(0)
    cfg = _cfg(tmp_path / "store", tmp_path / "shm")
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        for step in range(4):
            train_step(model, opt, task, step, ckpt)
    other, opt2, _ = make(0, layers=3)               # a layer the window never had
    with CheckpointManager(cfg, model=other, optimizer=opt2) as ckpt:
        with pytest.raises(CheckpointError, match=r"has no record of units \['.*layers\.2"):
            ckpt.restore(reshard=True)
    plain = MoCConfig(storage=str(tmp_path / "plain"), snapshot_dir=str(tmp_path / "shm2"))
    with CheckpointManager(plain, model=model, optimizer=opt) as ckpt:
        with pytest.raises(ValueError, match=r"restore\(reshard=True\) needs MoCConfig\(exact=True\)"):
            ckpt.restore(reshard=True)


def _step(model, opt, task, step: int, rank: int, world: int, ckpt=None) -> None:
    """Data parallel over ``world`` ranks: rank r trains on rows r::world of the step's
    global batch, gradients averaged (the global batch's mean gradient in any world)."""
    x, y = task.batch(step, 64)
    loss = F.cross_entropy(model(x[rank::world]), y[rank::world])
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        if p.grad is None:          # an expert no token of this rank reached: a zero gradient, in any world
            p.grad = torch.zeros_like(p)
        if world > 1:
            torch.distributed.all_reduce(p.grad)
            p.grad /= world
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    if ckpt is not None:
        ckpt.step(step)


def _first_run(rank: int, world: int, storage: str, shm: str, copy: str, out: str) -> None:
    """Steps 0-11 with exact checkpoints; at step 9 (window 8-11 under way) the store holds
    window 4-7 and is copied aside (what a crash at step 9 leaves); the final state is the
    uninterrupted run's. SGD with momentum: Adam would turn the rounding differences of
    another world's sums into updates of a whole learning rate where a gradient is ~0."""
    model, opt, task = make(0, optimizer="sgd")
    with CheckpointManager(_cfg(Path(storage), Path(shm)), model=model, optimizer=opt) as ckpt:
        for step in range(STEPS):
            _step(model, opt, task, step, rank, world, ckpt)
            if step == 9:
                ckpt.wait()
                torch.distributed.barrier()
                if rank == 0:
                    shutil.copytree(storage, copy)
                torch.distributed.barrier()
    torch.save(clone_state(model, opt), f"{out}/ref{rank}.pt")


def _restart(rank: int, world: int, storage: str, shm: str, out: str) -> None:
    model, opt, task = make(0, optimizer="sgd")
    with CheckpointManager(_cfg(Path(storage), Path(shm)), model=model, optimizer=opt) as ckpt:
        start = ckpt.restore(reshard=True)
        for step in range(start, STEPS):
            _step(model, opt, task, step, rank, world, ckpt)
        torch.save({"start": start, "replay": ckpt.status()["exact"]["last_replay"], "plt": ckpt.plt(),
                    **clone_state(model, opt)}, f"{out}/got{world}-{rank}.pt")


@pytest.mark.timeout(300)
def test_resharded_restore_same_world_is_bit_identical_and_another_world_applies_every_step(tmp_path: Path) -> None:
    from tests.helpers.rank_harness import run_ranks

    out = tmp_path / "out"
    for d in ("out", "a", "b"):
        (tmp_path / d).mkdir()
    run_ranks(_first_run, 2, tmp_path / "a", str(tmp_path / "store"), str(tmp_path / "shm"),
              str(tmp_path / "crash"), str(out))
    # new processes (no memory), the same 2 ranks: every unit by name from storage, where
    # both ranks' replicated units are stored per holder; the check on, the state bit-identical
    shutil.copytree(tmp_path / "crash", tmp_path / "crash2")
    run_ranks(_restart, 2, tmp_path / "b", str(tmp_path / "crash"), str(tmp_path / "shm-b"), str(out))
    for r in range(2):
        got = torch.load(out / f"got2-{r}.pt", weights_only=True)
        ref = torch.load(out / f"ref{r}.pt", weights_only=True)
        assert got["start"] == 5 and got["plt"] == 0.0
        assert got["replay"]["checked"] is True and got["replay"]["world"] == 2 and got["replay"]["source"] == "storage"
        _assert_equal(got, ref)
    # one rank instead of two: the check off (other batches per rank, other sums), each
    # step's update applied once: the state close to the 2-rank run's, not bit-identical
    _restart(0, 1, str(tmp_path / "crash2"), str(tmp_path / "shm-c"), str(out))   # here: no process group
    got, ref = torch.load(out / "got1-0.pt", weights_only=True), torch.load(out / "ref0.pt", weights_only=True)
    assert got["start"] == 5 and got["plt"] == 0.0
    assert got["replay"]["checked"] is False and got["replay"]["world"] == 2
    assert got["replay"]["units"]["memory"] == 0 and got["replay"]["units"]["storage"] > 0
    for k, v in ref["model"].items():
        assert torch.allclose(got["model"][k], v, rtol=1e-4, atol=1e-6), k
    for name, st in ref["optim"].items():
        assert torch.allclose(got["optim"][name]["momentum_buffer"], st["momentum_buffer"], rtol=1e-4, atol=1e-6)
