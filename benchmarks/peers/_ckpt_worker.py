"""One rank of the checkpoint-restart arm: a torchrun-style worker (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` from its launcher), data parallel over
gloo, saving a DCP checkpoint (``torch.distributed.checkpoint.save`` of the model and
AdamW state) every N steps and resuming from the newest one when started again.

N is Young/Daly's: the first run saves at step 0 (timing the save), times ``--calibrate``
steps, and every rank takes ``N = sqrt(2 * save * MTBF) / step`` with the
slowest rank's figures (``MTBF = --mtbf-steps`` steps, or ``--mtbf-s`` seconds); rank 0 writes N to
``<ckpt>/interval.json`` and later runs read it.

Run by ``benchmarks/peers/main.py``; not a public entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

T_START = time.time()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from _common import MetricsWriter, ModelSpec, young_daly_interval  # noqa: E402


def _newest(ckpt: str) -> int | None:
    steps = [int(n.split("-", 1)[1]) for n in os.listdir(ckpt) if n.startswith("step-")
             and os.path.exists(os.path.join(ckpt, n, "COMMITTED"))] if os.path.isdir(ckpt) else []
    return max(steps, default=None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    ModelSpec.add_arguments(p)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--run", type=int, required=True, help="launch number (0 first, +1 per restart)")
    mtbf = p.add_mutually_exclusive_group(required=True)
    mtbf.add_argument("--mtbf-steps", type=float, default=None, help="mean steps between failures")
    mtbf.add_argument("--mtbf-s", type=float, default=None,
                      help="mean seconds between failures (a trace's removals; the steps follow from the step time)")
    p.add_argument("--calibrate", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    spec = ModelSpec.from_args(args)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = os.environ.get("NODE_ID", str(rank))
    out = MetricsWriter(args.metrics, node)
    out.write("start", t_process=T_START, run=args.run)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))   # torchrun stops the others with SIGTERM

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    model, opt, corpus = spec.build()
    start = _newest(args.ckpt)
    if start is not None:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(args.ckpt, f"step-{start}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    interval_file = os.path.join(args.ckpt, "interval.json")
    every = json.load(open(interval_file))["every"] if os.path.exists(interval_file) else None
    out.write("ready", run=args.run, resumed_from=start)

    def save(step: int) -> float:
        t0 = time.time()
        msd, osd = get_state_dict(model, opt)
        path = os.path.join(args.ckpt, f"step-{step}")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        dist.barrier()
        if rank == 0:
            open(os.path.join(path, "COMMITTED"), "w").close()
        return time.time() - t0

    step = first = 0 if start is None else start
    # Young/Daly needs the save's cost: time one (at step 0, or at the resumed step when a
    # restart came before the interval was decided)
    save_s = save(step) if every is None else None
    t_calib = None
    dense = None
    while step < args.steps:
        if step == first + 1 and every is None:
            t_calib = time.time()
        x, y = corpus.batch(step, rank, world, spec.batch_size, spec.seq_len, seed=spec.seed)
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        if dense is None:
            dense = [q for q in model.parameters() if q.requires_grad]
        flat = torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1) for q in dense])
        dist.all_reduce(flat)
        flat.div_(world)
        pos = 0
        for q in dense:
            q.grad = flat[pos: pos + q.numel()].view_as(q).clone()
            pos += q.numel()
        opt.step()
        out.write("step", step=step, world=world, run=args.run, loss=float(loss.detach()))
        step += 1
        if every is None and step == first + args.calibrate + 1 and save_s is not None and t_calib is not None:
            figures = torch.tensor([save_s, (time.time() - t_calib) / args.calibrate], dtype=torch.float64)
            dist.all_reduce(figures, op=dist.ReduceOp.MAX)
            mtbf_s = args.mtbf_s if args.mtbf_s is not None else args.mtbf_steps * float(figures[1])
            every = young_daly_interval(float(figures[0]), float(figures[1]), mtbf_s)
            mtbf_steps = mtbf_s / float(figures[1])
            if rank == 0:
                with open(interval_file + ".tmp", "w") as f:
                    json.dump({"every": every, "save_s": float(figures[0]), "step_s": float(figures[1]),
                               "mtbf_steps": mtbf_steps}, f)
                os.replace(interval_file + ".tmp", interval_file)
            out.write("interval", every=every, save_s=float(figures[0]), step_s=float(figures[1]),
                      mtbf_steps=mtbf_steps)
        if every is not None and step % every == 0 and step < args.steps:
            s = save(step)
            out.write("saved", step=step, seconds=s, run=args.run)
    out.write("done", step=step, run=args.run)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
