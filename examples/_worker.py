"""What the example workers (``train_elastic``, ``train_hf``) share: the job's command-line
flags, logging that names the worker, the :class:`ElasticConfig` with its moc part, and the
end-of-run digests the fault tests compare."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from moc import MoCConfig


def _duration(text: str) -> timedelta:
    from lazarus.runtime import parse_duration

    return parse_duration(text, "duration")


def add_job_arguments(p: argparse.ArgumentParser, *, batch_size: int) -> None:
    """The flags of every example worker: data, optimizer, moc, timeouts, device, output."""
    p.add_argument("--steps", type=int, default=300, help="optimizer steps over the job's life")
    p.add_argument("--batch-size", type=int, default=batch_size, help="global batch (sequences per step)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--corpus-bytes", type=int, default=4 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--storage", required=True, help="moc storage URL or path (shared by all nodes)")
    p.add_argument("--storage-connect-timeout", type=_duration, default=None,
                   help="S3 storage: connect timeout of each attempt (storage_backends' default: 5s)")
    p.add_argument("--interval", type=int, default=10, help="moc checkpoint every N steps")
    p.add_argument("--k-snapshot", type=int, default=None, help="experts per layer to memory (default all)")
    p.add_argument("--k-persist", type=int, default=None, help="experts per layer to storage (default k-snapshot)")
    p.add_argument("--persist-every", type=int, default=2)
    p.add_argument("--snapshot-copies", type=int, default=2)
    p.add_argument("--exact", action="store_true",
                   help="moc exact mode (a window of ceil(experts / k-snapshot) steps captured every step; "
                        "--interval and --k-persist are ignored): losing every replica of an expert rolls back "
                        "and replays the window instead of booking PLT")
    p.add_argument("--lost-experts", choices=("restore", "replay"), default=None,
                   help="ElasticConfig.lost_experts (default: replay with --exact, else restore)")
    p.add_argument("--collective-timeout", type=_duration, default=timedelta(seconds=10))
    p.add_argument("--rendezvous-timeout", type=_duration, default=timedelta(seconds=30))
    p.add_argument("--plan-timeout", type=_duration, default=timedelta(seconds=60))
    p.add_argument("--connect-timeout", type=_duration, default=timedelta(milliseconds=300),
                   help="ElasticConfig.connect_timeout: forming a group waits this long for any one member")
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
    p.add_argument("--slow-while", default=None, metavar="FILE",
                   help="fault injection: while FILE exists every step takes 0.5 s longer (a test keeps "
                        "the survivors training until a respawned node is back, however slowly it starts)")
    p.add_argument("--hang-while", default=None, metavar="FILE",
                   help="fault injection: a step that starts while FILE exists blocks its training thread for "
                        "good (a deadlock: no CPU, no progress; the process stays alive)")
    p.add_argument("--stall-at-step", type=int, default=None, metavar="N",
                   help="fault injection: step N (once per process) sleeps --stall-for first (a slow step)")
    p.add_argument("--stall-for", type=_duration, default=timedelta(seconds=6))


def start_worker(args: argparse.Namespace) -> str:
    """Log lines naming the worker (``node`` or ``node/local_rank``), torch's threads;
    returns the node id the agent gave this worker."""
    node = os.environ.get("LAZARUS_NODE_ID", "?")
    local_rank = os.environ.get("LOCAL_RANK", "0")
    where = node if os.environ.get("LOCAL_WORLD_SIZE", "1") == "1" else f"{node}/{local_rank}"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s worker {where} %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    if args.exact and args.device != "cpu":
        # exact mode replays bit-identically on CUDA only with deterministic kernels (moc
        # refuses to start without them, docs/exact.md "On CUDA"); cuBLAS reads its workspace
        # setting when first used, so before the model exists
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    return node


def elastic_config(args: argparse.Namespace, *, top_k: int) -> Any:
    """The :class:`lazarus.runtime.ElasticConfig` of the flags, moc included."""
    from lazarus.runtime import ElasticConfig

    opts = {} if args.storage_connect_timeout is None else {"connect_timeout": args.storage_connect_timeout}
    if args.exact:
        # keep_last=3: a rollback reads the newest committed window while the next may be committed
        moc_cfg = MoCConfig(storage=args.storage, interval=1, k_snapshot=args.k_snapshot, exact=True,
                            persist_every=args.persist_every, top_k=top_k, keep_last=3, storage_options=opts)
    else:
        moc_cfg = MoCConfig(storage=args.storage, interval=args.interval, k_snapshot=args.k_snapshot,
                            k_persist=args.k_persist, persist_every=args.persist_every, top_k=top_k,
                            snapshot_copies=args.snapshot_copies, keep_last=2, storage_options=opts)
    return ElasticConfig(collective_timeout=args.collective_timeout, rendezvous_timeout=args.rendezvous_timeout,
                         plan_timeout=args.plan_timeout, connect_timeout=args.connect_timeout,
                         report_every=args.report_every, moc=moc_cfg,
                         metrics_path=args.metrics, device=args.device, backend=args.backend,
                         lost_experts=args.lost_experts)


def write_digests(args: argparse.Namespace, trainer: Any, node: str, t0: float) -> None:
    """``--digests``: this rank's state digests, losses and torchrun variables, written
    atomically once the run is over (not by a rank that left the job)."""
    if not args.digests or trainer.left:
        return
    path = args.digests.replace("{node}", node).replace("{local_rank}", str(trainer.local_rank))
    with open(path + ".tmp", "w") as f:
        json.dump({"node": node, "local_rank": trainer.local_rank, "step": trainer.step, "rank": trainer.rank,
                   "world": trainer.world,
                   "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                           "GROUP_RANK")},
                   "generation": trainer.generation, "experts": trainer.expert_digests(),
                   "dense": trainer.dense_digest(), "losses": trainer.losses,
                   "seconds": time.time() - t0}, f)
    os.replace(path + ".tmp", path)


def imports_done() -> None:
    """Turn the collector back on if the entry module turned it off for its imports
    (``python -m examples.train_elastic``), with the import heap frozen out of its passes
    (it lives as long as the process); a no-op where it is on."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def run_job(args: argparse.Namespace, cfg: Any, *, layout: Any, build_model: Any, loss_fn: Any, node: str) -> int:
    """Train under Lazarus until ``--steps`` (AdamW of ``moe_gpt.make_optimizer`` at
    ``--lr``), then write ``--digests``; the worker's exit status."""
    from lazarus.runtime import ElasticTrainer

    from .moe_gpt import make_optimizer

    imports_done()
    trainer = ElasticTrainer(cfg, layout=layout, build_model=build_model,
                             make_optimizer=lambda model: make_optimizer(model, lr=args.lr))
    if args.slow_while:
        inner, flag = loss_fn, args.slow_while

        def loss_fn(model: Any, step: int, rank: int, world: int) -> Any:
            if os.path.exists(flag):
                time.sleep(0.5)
            return inner(model, step, rank, world)

    if args.hang_while:
        inner_h, hang_flag = loss_fn, args.hang_while

        def loss_fn(model: Any, step: int, rank: int, world: int) -> Any:
            if os.path.exists(hang_flag):
                logging.getLogger("examples").warning("step %d: --hang-while: the training thread blocks", step)
                lock = threading.Lock()
                lock.acquire()
                lock.acquire()   # never returns
            return inner_h(model, step, rank, world)
    if args.stall_at_step is not None:
        inner_s, stalled = loss_fn, []

        def loss_fn(model: Any, step: int, rank: int, world: int) -> Any:
            if step == args.stall_at_step and not stalled:
                stalled.append(step)
                logging.getLogger("examples").warning("step %d: --stall-at-step: sleeping %s", step, args.stall_for)
                time.sleep(args.stall_for.total_seconds())
            return inner_s(model, step, rank, world)

    t0 = time.time()
    trainer.run(loss_fn, args.steps)
    write_digests(args, trainer, node, t0)
    return 0
