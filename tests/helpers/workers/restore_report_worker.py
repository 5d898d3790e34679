"""A user's script with no logging set-up (tests/moc/test_announce.py): trains the tiny MoE
under a CheckpointManager from whatever it restores, then prints the manager's
``last_restore_report`` as JSON on stdout. ``--quiet-moc`` sets moc's logger to WARNING
first, as a user silencing moc would; ``--basic-config`` calls ``logging.basicConfig()``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os

from moc import CheckpointManager, MoCConfig
from tests.helpers.moc_helpers import make, train_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--quiet-moc", action="store_true")
    ap.add_argument("--basic-config", action="store_true")
    a = ap.parse_args()
    if a.quiet_moc:
        logging.getLogger("moc").setLevel(logging.WARNING)
    if a.basic_config:
        logging.basicConfig()
    model, opt, task = make(seed=1)
    cfg = MoCConfig(storage=os.path.join(a.dir, "ckpt"), snapshot_dir=os.path.join(a.dir, "shm"), interval=5,
                    k_snapshot=4, k_persist=2, persist_every=2)
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    start = ckpt.restore()
    for step in range(start, a.steps):
        train_step(model, opt, task, step, ckpt)
        # Each persist ends before the next step, so which buffer a snapshot refills is the
        # same on every machine: a buffer still being persisted is never refilled, and on a
        # quiet machine step 0's persist outlived steps 1-15 (the snapshot at 15 then took
        # step 5's buffer, and no expert had to come from storage).
        ckpt.wait(flush=False)
    ckpt.close(keep_snapshots=True, flush=False)   # as a crash leaves it: the newest snapshot in memory only
    report = ckpt.last_restore_report
    plan = ckpt.last_restore if start else None
    print(json.dumps({"report": {**dataclasses.asdict(report), "line": str(report)},
                      "plan": None if plan is None else {
                          "step": plan.step, "from_memory": plan.from_memory,
                          "sources": {n: [s.level, s.version] for n, s in plan.sources.items()}}}))


if __name__ == "__main__":
    main()
