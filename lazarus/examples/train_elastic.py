"""Elastic training worker: the byte-level MoE GPT on the stdlib corpus under Lazarus.

``lazarus agent`` starts this as its worker command; the controller's plans decide which
experts it holds and who its peers are::

    lazarus agent --controller HOST:PORT --secret-file S --node-id n0 -- \\
        python -m lazarus.examples.train_elastic --steps 300 --storage /mnt/nfs/run1

Every rank trains on its slice of the same global batch (the stream depends only on the
seed and the step), so the data of a step is the same whatever the world size.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Sequence

import torch

from moc import MoCConfig

from .corpus import ByteCorpus
from .moe_gpt import GPTConfig, MoEGPT, make_optimizer, moe_layer_names


def _duration(text: str) -> timedelta:
    from lazarus.runtime._config import parse_duration

    return parse_duration(text, "duration")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lazarus.examples.train_elastic", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps over the job's life")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--moe-every", type=int, default=1)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-hidden", type=int, default=128)
    p.add_argument("--corpus-bytes", type=int, default=4 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--storage", required=True, help="moc storage URL or path (shared by all nodes)")
    p.add_argument("--interval", type=int, default=10, help="moc checkpoint every N steps")
    p.add_argument("--k-snapshot", type=int, default=None, help="experts per layer to memory (default all)")
    p.add_argument("--k-persist", type=int, default=None, help="experts per layer to storage (default k-snapshot)")
    p.add_argument("--persist-every", type=int, default=2)
    p.add_argument("--snapshot-copies", type=int, default=2)
    p.add_argument("--collective-timeout", type=_duration, default=timedelta(seconds=10))
    p.add_argument("--rendezvous-timeout", type=_duration, default=timedelta(seconds=30))
    p.add_argument("--plan-timeout", type=_duration, default=timedelta(seconds=60))
    p.add_argument("--report-every", type=int, default=10)
    p.add_argument("--metrics", default=None, help="JSON-lines metrics file written by rank 0")
    p.add_argument("--digests", default=None,
                   help="write this rank's state digests here at the end; {node} and {local_rank} are replaced "
                        "by the node id and the worker's local rank (give both with --nproc-per-node > 1)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda, cuda:<i> or auto (the process group follows: gloo on CPU, NCCL on CUDA)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="torch.distributed backend (auto: follows --device)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    node = os.environ.get("LAZARUS_NODE_ID", "?")
    local_rank = os.environ.get("LOCAL_RANK", "0")
    where = node if os.environ.get("LOCAL_WORLD_SIZE", "1") == "1" else f"{node}/{local_rank}"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s worker {where} %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    from lazarus.runtime import ElasticConfig, ElasticTrainer

    gpt = GPTConfig(d_model=args.d_model, n_layers=args.layers, moe_every=args.moe_every, num_experts=args.experts,
                    top_k=args.top_k, d_hidden=args.d_hidden, seq_len=args.seq_len, tie_head=False, seed=args.seed)
    corpus = ByteCorpus(args.corpus_bytes)
    moc_cfg = MoCConfig(storage=args.storage, interval=args.interval, k_snapshot=args.k_snapshot,
                        k_persist=args.k_persist, persist_every=args.persist_every, top_k=args.top_k,
                        snapshot_copies=args.snapshot_copies, keep_last=2)
    cfg = ElasticConfig(collective_timeout=args.collective_timeout, rendezvous_timeout=args.rendezvous_timeout,
                        plan_timeout=args.plan_timeout, report_every=args.report_every, moc=moc_cfg,
                        metrics_path=args.metrics, device=args.device, backend=args.backend)
    layout = {"layers": {name: args.experts for name in moe_layer_names(gpt)}, "top_k": args.top_k}

    def loss_fn(model: torch.nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
        x, y = corpus.batch(step, rank, world, args.batch_size, args.seq_len, seed=args.seed)
        device = next(model.parameters()).device
        _, loss = model(x.to(device), y.to(device))
        return loss

    trainer = ElasticTrainer(cfg, layout=layout, build_model=lambda placements: MoEGPT(gpt, placements),
                             make_optimizer=lambda model: make_optimizer(model, lr=args.lr))
    t0 = time.time()
    trainer.run(loss_fn, args.steps)
    if args.digests and not trainer.left:
        import json

        path = args.digests.replace("{node}", node).replace("{local_rank}", local_rank)
        with open(path + ".tmp", "w") as f:
            json.dump({"node": node, "local_rank": trainer.local_rank, "step": trainer.step, "rank": trainer.rank,
                       "world": trainer.world,
                       "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                               "GROUP_RANK")},
                       "generation": trainer.generation, "experts": trainer.expert_digests(),
                       "dense": trainer.dense_digest(), "losses": trainer.losses,
                       "seconds": time.time() - t0}, f)
        os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
