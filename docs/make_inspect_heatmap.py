"""Regenerate docs/inspect_heatmap.png (``make docs-heatmap``) from a real run.

A byte-level ToyMoE with 16 MoE layers x 64 experts (tiny dimensions) trains on a skewed
bigram task under a CheckpointManager (load-aware selection, 4 experts per layer to
memory and 2 to storage per checkpoint). The first worker process is killed at step 40;
a second one restores (booking the PLT of the experts it gets back at older versions)
and trains to step 100, then exits normally. The picture and the text summary are what
``moc inspect`` prints for that store.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository root: examples

LAYERS, EXPERTS = 16, 64


def worker(store: str, shm: str, steps: int, crash: bool) -> None:
    import torch
    import torch.nn.functional as F

    from moc import CheckpointManager, MoCConfig
    from examples.toy_moe import BigramTask, ToyMoE

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ToyMoE(vocab=64, dim=8, hidden=8, num_layers=LAYERS, num_experts=EXPERTS, top_k=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    task = BigramTask(vocab=64, seed=0)
    cfg = MoCConfig(storage=store, snapshot_dir=shm, interval=4, k_snapshot=4, k_persist=2, persist_every=2,
                    selection="load_aware", dynamic_k=False, keep_last=2)
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    for step in range(ckpt.restore(), steps):
        x, y = task.batch(step, 256)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for layer, counts in model.routing_counts().items():
            ckpt.record_routing(layer, counts)
        ckpt.step(step)
        ckpt.wait(flush=False)
    if crash:
        os._exit(0)  # killed: the snapshots stay in memory, the next process restores from them
    ckpt.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="runs/inspect-heatmap", help="scratch folder for the store")
    ap.add_argument("-o", "--output", default="docs/inspect_heatmap.png")
    ap.add_argument("--worker", nargs=4, metavar=("STORE", "SHM", "STEPS", "CRASH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        store, shm, steps, crash = args.worker
        worker(store, shm, int(steps), crash == "1")
        return 0
    shutil.rmtree(args.dir, ignore_errors=True)
    store, shm = os.path.join(args.dir, "store"), os.path.join(args.dir, "shm")
    for steps, crash in ((40, "1"), (100, "0")):
        subprocess.run([sys.executable, __file__, "--worker", store, shm, str(steps), crash], check=True)
    from moc.cli import main as moc_main

    return moc_main(["inspect", store, "--png", args.output])


if __name__ == "__main__":
    sys.exit(main())
