"""Exact mode (MoCConfig(exact=True)): the window schedule, its size formula, and real
processes SIGKILLed mid-window that restore, replay and end bit-identical (weights and
Adam state) to an uninterrupted run without moc; a replay fed other data is stopped."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from moc import CheckpointError, CheckpointManager, CheckpointStore, MoCConfig
from moc._store.codec import ALIGN

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

from tests.helpers.workers import exact_worker  # noqa: E402

TIMEOUT = 240


def _worker(tmp_path, *extra: str, model: str = "toy", expect_kill: bool = False):
    cmd = [sys.executable, os.path.join(ROOT, "tests", "helpers", "workers", "exact_worker.py"), "--model", model,
           "--storage", str(tmp_path / "store"), "--shm", str(tmp_path / "shm"), *extra]
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    if expect_kill:
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        return None
    if proc.returncode != 0:
        return proc
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _reference(model: str, steps: int, out: str) -> None:
    exact_worker.run(argparse.Namespace(model=model, steps=steps, no_moc=True, data_seed=0, out=out))


def _assert_equal_state(got_path: str, ref_path: str) -> None:
    got, ref = torch.load(got_path, weights_only=True), torch.load(ref_path, weights_only=True)
    assert got["model"].keys() == ref["model"].keys()
    for k, v in ref["model"].items():
        assert torch.equal(got["model"][k], v), f"weights of {k} differ"
    gs, rs = got["optimizer"]["state"], ref["optimizer"]["state"]
    assert gs.keys() == rs.keys(), "parameters with Adam state differ"
    for i, st in rs.items():
        assert st.keys() == gs[i].keys()
        for name, v in st.items():
            assert torch.equal(gs[i][name], v), f"Adam {name} of parameter {i} differs"
    assert got["optimizer"]["param_groups"] == ref["optimizer"]["param_groups"]


# -- configuration -------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    ({"interval": 50}, "interval"), ({"interval": "auto"}, "interval"), ({"k_snapshot": "auto"}, "k_snapshot"),
    ({"k_persist": 1, "k_snapshot": 2}, "k_persist"), ({"selection": "load_aware"}, "selection"),
])
def test_exact_config_refuses_what_it_cannot_honour(tmp_path, kwargs, field):
    base = {"interval": 1, **kwargs}
    with pytest.raises(ValueError, match=rf"MoCConfig\.{field} must"):
        MoCConfig(storage=str(tmp_path), exact=True, **base)
    with pytest.raises(ValueError, match="exact must be True or False"):
        MoCConfig(storage=str(tmp_path), interval=1, exact="yes")
    MoCConfig(storage=str(tmp_path), exact=False, **kwargs)   # the same values are fine without exact


def test_exact_accepted_by_elastic_trainer_config_with_replay(tmp_path):
    from lazarus.runtime import ElasticConfig
    exact = MoCConfig(storage=str(tmp_path), interval=1, exact=True)
    assert ElasticConfig(moc=exact).lost_experts == "replay"
    with pytest.raises(ValueError, match="lost_experts='restore' cannot go with an exact moc"):
        ElasticConfig(moc=exact, lost_experts="restore")


# -- schedule and size ---------------------------------------------------------------------
def _padded(t: torch.Tensor) -> int:
    n = t.numel() * t.element_size()
    return n + (-n) % ALIGN


def test_window_schedule_and_bytes_per_step_match_the_formula(tmp_path):
    from examples.toy_moe import BigramTask, ToyMoE
    torch.manual_seed(0)
    model = ToyMoE(vocab=32, dim=16, hidden=32, num_layers=2, num_experts=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = MoCConfig(storage=str(tmp_path / "s"), snapshot_dir=str(tmp_path / "m"), interval=1, k_snapshot=3,
                    exact=True, persist_every=2)
    task = BigramTask(vocab=32)
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        for step in range(9):
            x, y = task.batch(step, 64)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            ckpt.step(step)
        ckpt.wait()
        status = ckpt.status()["exact"]
        sched = ckpt.exact.schedule()
        # W = ceil(8 / 3) = 3; experts 0-2 at slot 0, 3-5 at 1, 6-7 at 2 in each layer
        assert sched.window == 3
        assert [sched.slots[f"expert/layers.0.moe/{e}"] for e in range(8)] == [0, 0, 0, 1, 1, 1, 2, 2]
        # sizes from the tensors themselves: weights (every state_dict entry), full = + Adam state
        params = dict(model.named_parameters())
        sd = model.state_dict()
        weights, full = {}, {}
        for name, spec in ckpt.layout.units.items():
            weights[name] = sum(_padded(sd[k]) for k in spec.keys)
            full[name] = weights[name] + sum(_padded(v) for k in spec.keys if k in params
                                             for v in opt.state.get(params[k], {}).values())
        formula = sched.step_bytes(full, weights)
        measured = status["last_window"]["step_bytes"]
        extra = {m - f for m, f in zip(measured, formula)}
        assert len(extra) == 1 and 0 < extra.pop() < 16384, (measured, formula)   # + the extra unit, constant
        full_bytes = sum(full.values())
        assert sum(measured) == sum(full[u] + sched.slots[u] * weights[u] for u in full) + \
            len(measured) * (measured[0] - formula[0])
        assert max(measured) < full_bytes
        # three windows complete (steps 0-2, 3-5, 6-8); persist_every=2 counts windows: 1st and 3rd
        assert status["windows_complete"] == 3 and status["windows_persisted"] == 2
        assert ckpt.store.steps() == [2, 8]
        assert ckpt.plt() == 0.0


def test_steps_must_come_in_order_and_restore_units_is_refused(tmp_path):
    from examples.toy_moe import ToyMoE
    model = ToyMoE(vocab=16, dim=8, hidden=8, num_layers=1, num_experts=4)
    opt = torch.optim.AdamW(model.parameters())
    cfg = MoCConfig(storage=str(tmp_path / "s"), snapshot_dir=str(tmp_path / "m"), interval=1, k_snapshot=2,
                    exact=True)
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        ckpt.step(0)
        with pytest.raises(CheckpointError, match="expected step 1, got 2"):
            ckpt.step(2)
        with pytest.raises(CheckpointError, match="restore_units"):
            ckpt.restore_units(["expert/layers.0.moe/0"])


# -- SIGKILL mid-window, restore, replay -----------------------------------------------------
@pytest.mark.parametrize("source", ["memory", "storage"])
def test_sigkill_mid_window_replays_to_the_uninterrupted_state(tmp_path, source):
    steps = 20
    ref = str(tmp_path / "ref.pt")
    _reference("toy", steps, ref)
    # W = 4 (8 experts, k_snapshot=2): windows 0-3, 4-7, 8-11, 12-15; killed after step 13
    _worker(tmp_path, "--steps", str(steps), "--kill-at", "13", expect_kill=True)
    if source == "storage":
        shutil.rmtree(tmp_path / "shm")           # the node's memory is gone too
    got = str(tmp_path / "got.pt")
    res = _worker(tmp_path, "--steps", str(steps), "--out", got)
    assert isinstance(res, dict), res.stderr[-3000:]
    assert res["start"] == 9                        # window 8-11: replay 9, 10, 11
    st = res["status"]
    assert st["replays"] == 1 and st["replayed_steps"] == 3 and st["plt"] == 0.0
    _assert_equal_state(got, ref)


def test_replay_fed_other_data_is_stopped(tmp_path):
    _worker(tmp_path, "--steps", "12", "--kill-at", "9", expect_kill=True)
    proc = _worker(tmp_path, "--steps", "12", "--data-seed", "7")
    assert not isinstance(proc, dict) and proc.returncode != 0
    assert "replay diverged" in proc.stderr and "step 5" in proc.stderr, proc.stderr[-3000:]


def test_sigkill_mid_window_hf_fused_experts(tmp_path):
    steps = 12
    ref = str(tmp_path / "ref.pt")
    _reference("hf", steps, ref)
    _worker(tmp_path, "--steps", str(steps), "--kill-at", "9", model="hf", expect_kill=True)
    got = str(tmp_path / "got.pt")
    res = _worker(tmp_path, "--steps", str(steps), "--out", got, model="hf")
    assert isinstance(res, dict), res.stderr[-3000:]
    assert res["start"] == 5 and res["status"]["replayed_steps"] == 3
    _assert_equal_state(got, ref)


def test_restore_refuses_an_older_version_for_an_unreadable_window_object(tmp_path):
    """An exact window with a truncated object: an older version of the unit (what a plain
    restore falls back to) would not replay exactly; the restore says so instead."""
    from examples.toy_moe import BigramTask, ToyMoE

    def fresh():
        torch.manual_seed(0)
        model = ToyMoE(vocab=32, dim=16, hidden=32, num_layers=2, num_experts=8)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    cfg = MoCConfig(storage=str(tmp_path / "s"), snapshot_dir=str(tmp_path / "m"), interval=1, k_snapshot=3,
                    exact=True, keep_last=5)
    model, opt = fresh()
    task = BigramTask(vocab=32)
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        for step in range(9):
            x, y = task.batch(step, 64)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            ckpt.step(step)
    store = CheckpointStore(str(tmp_path / "s"))
    manifest = store.latest_manifest()
    assert len(store.steps()) > 1           # older windows hold older versions of the units
    name = next(n for n, r in sorted(manifest.units.items()) if r.kind == "expert" and r.step == manifest.step)
    chunk = manifest.units[name].chunks[0]
    with open(tmp_path / "s" / chunk.key, "r+b") as f:
        f.truncate(chunk.start)
    model, opt = fresh()
    with CheckpointManager(cfg, model=model, optimizer=opt) as again:
        with pytest.raises(CheckpointError, match=rf"exact window at step {manifest.step} cannot be restored.*"
                                                  r"truncated.*no older version.*moc verify"):
            again.restore()
