"""Train a tiny many-layer ToyMoE with a CheckpointManager, for the ``moc inspect`` tests.

    python tests/helpers/workers/inspect_writer.py STORE SHM --layers 8 --experts 64 --steps 40 [--crash]

Restores first (so a second run continues a crashed one and books PLT), trains up to
``--steps``, waits for every copy and persist after each checkpoint (deterministic
stores), then either closes normally or exits abruptly with ``--crash``, leaving its
shared-memory snapshots behind as a killed process would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

# the repository root: examples, tests
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

from moc import CheckpointManager, MoCConfig  # noqa: E402
from tests.helpers.moc_helpers import make, train_step  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("shm")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--k-snapshot", type=int, default=8)
    ap.add_argument("--k-persist", type=int, default=2)
    ap.add_argument("--persist-every", type=int, default=2)
    ap.add_argument("--crash", action="store_true", help="exit abruptly at the end (snapshots stay)")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    model, opt, task = make(0, num_experts=args.experts, layers=args.layers, dim=4, hidden=4)
    cfg = MoCConfig(storage=args.store, snapshot_dir=args.shm, interval=args.interval,
                    k_snapshot=args.k_snapshot, k_persist=args.k_persist, persist_every=args.persist_every,
                    dynamic_k=False, keep_last=3)
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    start = ckpt.restore()
    for step in range(start, args.steps):
        train_step(model, opt, task, step, ckpt, batch=256)
        ckpt.wait(flush=False)
    print(json.dumps({"start": start, "status": ckpt.status()}))
    sys.stdout.flush()
    if args.crash:
        os._exit(0)
    ckpt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
