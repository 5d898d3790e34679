"""One of two independent jobs pointed at the same storage path by mistake.

    python tests/helpers/workers/two_jobs_worker.py STORE SHM GO_FILE STEPS

Waits for GO_FILE (both jobs start together), then trains a ToyMoE with a checkpoint at
every step, each persisted before the next step. Exit 0 with a JSON line (run id, status)
when it finished; exit 3 with the error on stderr when moc stopped it (ForeignRunError).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

# the repository root: examples, tests
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

from moc import CheckpointManager, ForeignRunError, MoCConfig  # noqa: E402
from tests.helpers.moc_helpers import make, train_step  # noqa: E402


def main() -> int:
    store, shm, go, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    torch.set_num_threads(1)
    model, opt, task = make(0, num_experts=4, layers=1, dim=4, hidden=4)
    cfg = MoCConfig(storage=store, snapshot_dir=shm, interval=1, persist_every=1, dynamic_k=False)
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        for step in range(steps):
            train_step(model, opt, task, step, ckpt)
            ckpt.wait(flush=False)
    except ForeignRunError:
        traceback.print_exc()
        print(json.dumps({"run_id": ckpt.run_id, "status": ckpt.status()}, default=str))
        return 3
    print(json.dumps({"run_id": ckpt.run_id, "status": ckpt.status()}, default=str))
    ckpt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
