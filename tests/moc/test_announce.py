"""moc/_announce.py: what a restore did reaches a user who configured no logging, in one
line, once per restore (``CheckpointManager.restore`` and its ``last_restore_report``).

Real processes (tests/helpers/workers/restore_report_worker.py) with Python's default
logging set-up, as a user's script has: the first run trains and leaves checkpoints in
storage and shared memory, the next ones restore from them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WORKER = os.path.join(ROOT, "tests", "helpers", "workers", "restore_report_worker.py")


def _run(tmp_path, steps, *flags):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, WORKER, "--dir", str(tmp_path), "--steps", str(steps), *flags],
                         capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


@pytest.mark.timeout(600)
def test_restore_says_what_it_did_at_the_default_logging_set_up(tmp_path):
    first, err = _run(tmp_path, 18)
    assert first["report"]["step"] is None
    assert err.count("moc: nothing to resume in ") == 1, err     # a fresh store says so too
    assert f"nothing to resume in {tmp_path / 'ckpt'}; training starts at step 0" in err

    # Steps 0-17 ran: snapshots at 0, 5, 10, 15 (k_snapshot 4), persisted every second one
    # (k_persist 2); the newest (15) is in memory only.
    second, err = _run(tmp_path, 25)
    report, plan = second["report"], second["plan"]
    lines = [ln for ln in err.splitlines() if ln.startswith("moc: ")]
    assert lines == [report["line"]], err                        # one line, the report's
    assert report["step"] == plan["step"] == 15 and report["next_step"] == 16
    assert report["source"] == "memory" and plan["from_memory"]
    levels = [lv for lv, _ in plan["sources"].values()]
    assert report["units_from_memory"] == levels.count("snapshot") > 0
    assert report["units_from_storage"] == levels.count("persist") > 0
    versions: dict[str, int] = {}
    for name, (_, version) in plan["sources"].items():
        if name.startswith("expert/"):
            versions[str(version)] = versions.get(str(version), 0) + 1
    assert {str(k): v for k, v in report["experts_by_version"].items()} == versions
    assert sum(versions.values()) == 2 * 8 and len(versions) > 1  # partial: some experts older than 15
    assert report["dense"] == len([n for n in plan["sources"] if not n.startswith(("expert/", "extra/"))]) > 0
    assert 0 < report["plt"] < 1 and report["seconds"] > 0
    assert max(map(int, versions)) == 15
    assert lines[0].startswith(f"moc: resumed step 15 from memory (experts {versions['15']} from step 15, ")
    assert f"PLT {100 * report['plt']:.2f}%" in lines[0] and "training continues at step 16" in lines[0]

    # logging.basicConfig() (root at WARNING, a handler): the line still shows, once.
    third, err = _run(tmp_path, 27, "--basic-config")
    assert third["report"]["step"] == 20
    assert [ln for ln in err.splitlines() if "resumed step" in ln] == ["INFO:moc:" + third["report"]["line"]], err

    # A user who set moc's level to WARNING does not see it.
    fourth, err = _run(tmp_path, 29, "--quiet-moc")
    assert fourth["report"]["step"] == 25 and "resumed step" not in err, err


def test_an_exact_restore_says_which_window_it_replays(tmp_path, caplog):
    """Exact mode: the line names the window and the steps the loop replays; it reaches the
    application's handlers (here pytest's) though the root logger is left at WARNING."""
    import torch

    from examples.toy_moe import BigramTask, ToyMoE
    from moc import CheckpointManager, MoCConfig, RestoreReport

    cfg = MoCConfig(storage=str(tmp_path / "s"), snapshot_dir=str(tmp_path / "m"), interval=1, k_snapshot=3,
                    exact=True)
    task = BigramTask(vocab=32)
    torch.manual_seed(0)
    model = ToyMoE(vocab=32, dim=16, hidden=32, num_layers=2, num_experts=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    for step in range(8):      # W = ceil(8 / 3) = 3: windows 0-2 and 3-5 complete, 6-8 not
        x, y = task.batch(step, 64)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(step)
    ckpt.close(keep_snapshots=True, flush=False)
    caplog.clear()
    assert logging_root_level() > 20     # INFO would be dropped by the root's level
    with CheckpointManager(cfg, model=model, optimizer=opt) as again:
        nxt = again.restore()
        report = again.last_restore_report
        assert isinstance(report, RestoreReport) and report.exact_window == (3, 5) and nxt == 4
        assert report.step == 3 and report.source in ("memory", "storage") and report.plt == 0.0
        assert str(report).startswith(f"moc: resumed step 3 from {report.source} (exact window 3-5; the loop "
                                      "replays steps 4-5), PLT 0.00%, ")
        for step in range(nxt, 6):
            x, y = task.batch(step, 64)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            again.step(step)
    said = [r for r in caplog.records if r.name == "moc" and r.getMessage().startswith("moc: ")]
    assert [r.getMessage() for r in said] == [str(report)] and said[0].levelname == "INFO"


def logging_root_level() -> int:
    import logging

    return logging.getLogger().getEffectiveLevel()
