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
