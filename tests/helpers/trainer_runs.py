"""Running the trainer scripts of tests/test_integrations_*.py as separate processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WORKERS = os.path.join(ROOT, "tests", "helpers", "workers")


def start(script, tmp, name, storage, *extra):
    os.makedirs(tmp / name, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    log = open(tmp / name / "log", "w")
    proc = subprocess.Popen([sys.executable, os.path.join(WORKERS, script), "--storage", str(storage),
                             "--out", str(tmp / name / "rec.json"), *extra], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    return proc, tmp / name


def finish(proc, where, expect_rc=0):
    rc = proc.wait(timeout=240)
    log = (where / "log").read_text()
    assert rc == expect_rc, f"rc {rc} (expected {expect_rc}):\n{log[-4000:]}"
    return json.loads((where / "rec.json").read_text()), log


def same_after(ref, got, resumed, last, keys=("lr", "epoch", "model", "optimizer", "loss")):
    """Steps resumed+1..last of ``got`` trained exactly what the uninterrupted ``ref`` did."""
    assert sorted(map(int, got["steps"])) == list(range(resumed + 1, last + 1))
    for step in range(resumed + 1, last + 1):
        a, b = ref["steps"][str(step)], got["steps"][str(step)]
        assert b["samples"] == a["samples"], f"step {step}: batches differ from the uninterrupted run"
        assert len(b["samples"]) == 4        # 2 micro-batches of 2: nothing repeated or skipped
        for key in keys:
            if key in b:   # a killed run has not logged the loss of its last step
                assert b[key] == a[key], f"step {step}: {key} {b[key]} != uninterrupted {a[key]}"
