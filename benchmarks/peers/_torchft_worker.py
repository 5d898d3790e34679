"""One torchft replica group (of one process) training the benchmark's MoE GPT.

torchft's documented DDP integration: a ``Manager`` (its own ``TCPStore``, which torchrun
would otherwise provide; ``ProcessGroupGloo(timeout=5 s)`` as torchft's ``train_ddp.py``),
``torchft.DistributedDataParallel`` and ``torchft.Optimizer``; ``--pg-timeout`` sets that
timeout (what a killed peer costs the survivors: the tuned setting uses the shortest one
its steps allow). One change, for a pitfall:
torchft's DDP comm hook asserts on the managed future (``torchft/ddp.py``, ``assert
fut._fut``), which fails on the *survivors* when a peer dies inside the gradient allreduce
(``wait()`` returns False before that future exists). Our hook returns the bucket when the
wait fails; ``should_commit()`` is then False and torchft discards the step, as it
documents for a failed allreduce.

Run by ``benchmarks/peers/main.py``; not a public entry point.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

T_START = time.time()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from _common import MetricsWriter, ModelSpec  # noqa: E402


def _ddp_class():
    import torch
    import torchft

    class _DDP(torchft.DistributedDataParallel):
        """torchft's DDP with a comm hook that survives a peer dying mid-allreduce."""

        @staticmethod
        def _comm_hook(state, bucket):  # type: ignore[override]
            work = state.allreduce(bucket.buffer())
            ok = work.wait()
            inner = getattr(work.get_future(), "_fut", None)
            if ok is False or inner is None:
                # The allreduce failed (the manager recorded the error): hand the bucket
                # back; should_commit() is False on every group and the step is discarded.
                fut = torch.futures.Future()
                fut.set_result(bucket.buffer())
                return fut
            return inner

    return _DDP


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    ModelSpec.add_arguments(p)
    p.add_argument("--replica-id", required=True)
    p.add_argument("--lighthouse", required=True, help="http://127.0.0.1:PORT")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=5.0,
                   help="seconds a collective may wait for a peer (ProcessGroupGloo's timeout; torchft's "
                        "train_ddp.py: 5 s): what a killed peer costs the survivors")
    p.add_argument("--start-when", default=None, metavar="FILE",
                   help="after building, wait for FILE before joining (the job's first groups start together)")
    args = p.parse_args(argv)
    spec = ModelSpec.from_args(args)
    out = MetricsWriter(args.metrics, args.replica_id)
    out.write("start", t_process=T_START)

    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo

    torch.set_num_threads(args.threads)
    model, inner_opt, corpus = spec.build()
    _DDP = _ddp_class()

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner_opt.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner_opt.load_state_dict(sd["optim"])

    out.write("built")
    while args.start_when and not os.path.exists(args.start_when):
        time.sleep(0.02)
    # The Manager expects the replica group's TCPStore to exist (torchrun's); one process
    # per group, so this process hosts it, on loopback.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    if not args.pg_timeout > 0:
        raise ValueError(f"--pg-timeout must be > 0 seconds, got {args.pg_timeout}")
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=args.replica_id,
                      timeout=timedelta(seconds=30), store_addr="127.0.0.1", store_port=store.port, rank=0,
                      world_size=1, lighthouse_addr=args.lighthouse, hostname="127.0.0.1")
    ddp = _DDP(manager, model)
    opt = Optimizer(manager, inner_opt)
    out.write("ready")
    while manager.current_step() < args.steps:
        opt.zero_grad()                       # starts the quorum
        rank = manager.participating_rank()   # waits for it: the batch slice depends on it
        world = manager.num_participants()
        step = manager.current_step()         # a healed group jumps to its peers' step
        if rank is None:                      # healing: not in this step's quorum
            rank, world = 0, 1
        x, y = corpus.batch(step, rank, world, spec.batch_size, spec.seq_len, seed=spec.seed)
        _, loss = ddp(x, y)
        loss.backward()
        # torchft.Optimizer.step() is exactly should_commit() then the inner step; inlined
        # to record whether the step was committed.
        if manager.should_commit():
            inner_opt.step()
            out.write("step", step=step, world=world, loss=float(loss.detach()))
        else:
            out.write("discarded", step=step, world=world)
    out.write("done", step=manager.current_step())
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
