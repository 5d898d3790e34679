"""One rank of a several-rank job for the exact-mode tests (tests/moc/test_exact_mp.py).

A tiny transformers 5.x Qwen3-MoE (fused experts, attention dropout: the RNG matters) with
AdamW and global-norm clipping, on 2 gloo ranks, each rank its own batches (a function of
the step and the rank):

* ``--shard fsdp``: FSDP2 (``fully_shard`` per decoder layer and the root): every
  parameter a DTensor shard, the experts split over the ranks;
* ``--shard replicas``: every rank a whole replica, gradients averaged by all-reduce (DDP's
  arithmetic): every unit held by both ranks;
* ``--shard independent``: every rank a whole replica trained on its own data alone (the
  same unit names on both ranks, different values).

``--kill-rank R --kill-at S``: rank R SIGKILLs itself right after ``step(S)`` (the test
kills the other rank then, as a launcher does). ``--no-moc``: the reference run. At the
end every rank writes its own part (local shards) of the weights and Adam state.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
torch.set_num_threads(1)

from moc import CheckpointManager, MoCConfig  # noqa: E402
from examples.toy_moe import BigramTask  # noqa: E402

VOCAB = 32


def build(shard: str, world: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                  attention_dropout=0.1)
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    if shard == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, opt, shard: str, step: int, rank: int, world: int, data_seed: int) -> None:
    x, y = BigramTask(vocab=VOCAB, seed=1 + data_seed + 100 * rank).batch(step, 64)
    ids = torch.cat([x.view(4, 16), y.view(4, 16)], dim=1)
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    if shard == "replicas":
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def dump(model, opt) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {"model": {k: local(v) for k, v in model.state_dict().items()},
            "optimizer": {names[id(p)]: {k: local(v) for k, v in st.items() if isinstance(v, torch.Tensor)}
                          for p, st in opt.state.items()},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shard", choices=("fsdp", "replicas", "independent"), required=True)
    p.add_argument("--storage", default="")
    p.add_argument("--shm", default="")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--flush-at-kill", action="store_true", help="every rank flushes to storage before the kill")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--data-seed-rank", type=int, default=-1, help="only this rank uses --data-seed")
    p.add_argument("--no-moc", action="store_true")
    p.add_argument("--out", default="")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    model, opt = build(args.shard, world)
    seed = args.data_seed if args.data_seed_rank in (-1, rank) else 0
    start, status = 0, None
    if args.no_moc:
        for step in range(args.steps):
            train_step(model, opt, args.shard, step, rank, world, seed)
    else:
        cfg = MoCConfig(storage=args.storage, snapshot_dir=args.shm, interval=1, k_snapshot=2, exact=True, top_k=2,
                        coordination_timeout=timedelta(seconds=60))
        with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
            start = ckpt.restore()
            for step in range(start, args.steps):
                train_step(model, opt, args.shard, step, rank, world, seed)
                ckpt.step(step)
                if step == args.kill_at:
                    if args.flush_at_kill:
                        ckpt.wait()                 # collective: the newest common window is committed
                    if rank == args.kill_rank:
                        print(f"KILLING rank {rank} after step {step}", flush=True)
                        os.kill(os.getpid(), signal.SIGKILL)
            ckpt.wait()                             # collective: the newest common window is committed
            status = {**ckpt.status()["exact"], "plt": ckpt.plt()}
    if args.out:
        torch.save(dump(model, opt), f"{args.out}.rank{rank}")
    print("RESULT " + json.dumps({"rank": rank, "start": start, "status": status}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
