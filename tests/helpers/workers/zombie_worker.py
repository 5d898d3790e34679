"""A checkpointing trainer of one fencing generation, for the zombie test.

    python tests/helpers/workers/zombie_worker.py STORE SHM GENERATION STEPS PROGRESS [--fence]

Restores, then (``--fence``) fences the older generations from the step it resumes at,
trains to STEPS with every checkpoint persisted before the next step, writing the last
step done to PROGRESS, prints one JSON line (start, status) and closes. Exit 0; exit 4
when closing raised moc.FencedError (a newer generation took over: its writes were
refused), with the error on stderr.
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

from moc import CheckpointManager, FencedError, MoCConfig  # noqa: E402
from tests.helpers.moc_helpers import make, train_step  # noqa: E402


def main() -> int:
    store, shm, generation, steps, progress = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    torch.set_num_threads(1)
    model, opt, task = make(0, num_experts=4, layers=1, dim=4, hidden=4)
    cfg = MoCConfig(storage=store, snapshot_dir=shm, interval=1, persist_every=1, dynamic_k=False,
                    keep_last=1000)   # every commit stays: the test checks none is lost
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt, generation=generation)
    start = ckpt.restore()
    if "--fence" in sys.argv:
        ckpt.fence(generation, resume_step=start)
    for step in range(start, steps):
        train_step(model, opt, task, step, ckpt)
        ckpt.wait(flush=False)
        with open(progress + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(progress + ".tmp", progress)
        time.sleep(0.02)
    print(json.dumps({"start": start, "status": ckpt.status()}, default=str), flush=True)
    try:
        ckpt.close()
    except FencedError:
        traceback.print_exc()
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
