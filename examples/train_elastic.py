"""Elastic training worker: the byte-level MoE GPT on the stdlib corpus under Lazarus.

``lazarus agent`` starts this as its worker command; the controller's plans decide which
experts it holds and who its peers are::

    lazarus agent --controller HOST:PORT --secret-file S --node-id n0 -- \\
        python -m examples.train_elastic --steps 300 --storage /mnt/nfs/run1

Every rank trains on its slice of the same global batch (the stream depends only on the
seed and the step), so the data of a step is the same whatever the world size.
"""

from __future__ import annotations

import gc

if __name__ == "__main__":
    # A worker trains only once its imports are done (a joining node waits on them); the
    # collector's full passes over torch's import heap are 0.3-0.5 s of a quiet core. Off
    # while importing; run_job freezes what the imports built and turns it back on.
    gc.disable()

import argparse  # noqa: E402
import sys
import time
from datetime import timedelta
from typing import Any, Mapping, Sequence

import torch

from ._worker import _duration, add_job_arguments, elastic_config, run_job, start_worker
from .corpus import ByteCorpus
from .moe_gpt import GPTConfig, MoEGPT, moe_layer_names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.train_elastic", description=__doc__.split("\n")[0])
    add_job_arguments(p, batch_size=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--moe-every", type=int, default=1)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-hidden", type=int, default=128)
    p.add_argument("--slow-build", type=_duration, default=timedelta(0),
                   help="fault injection: sleep this long whenever the model is built (a joiner slow to set up)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    node = start_worker(args)

    gpt = GPTConfig(d_model=args.d_model, n_layers=args.layers, moe_every=args.moe_every, num_experts=args.experts,
                    top_k=args.top_k, d_hidden=args.d_hidden, seq_len=args.seq_len, tie_head=False, seed=args.seed)
    corpus = ByteCorpus(args.corpus_bytes)
    cfg = elastic_config(args, top_k=args.top_k)
    layout = {"layers": {name: args.experts for name in moe_layer_names(gpt)}, "top_k": args.top_k}

    def loss_fn(model: torch.nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
        x, y = corpus.batch(step, rank, world, args.batch_size, args.seq_len, seed=args.seed)
        device = next(model.parameters()).device
        _, loss = model(x.to(device), y.to(device))
        return loss

    def build(placements: Mapping[str, Any]) -> torch.nn.Module:
        time.sleep(args.slow_build.total_seconds())
        return MoEGPT(gpt, placements)

    return run_job(args, cfg, layout=layout, build_model=build, loss_fn=loss_fn, node=node)


if __name__ == "__main__":
    sys.exit(main())
