"""A training process for the layout tests: a real model (see layout_models), optionally
sharded (FSDP2, expert parallel as DTensor Shard(0), or both), checkpointed by moc.

    train:   train --steps N, dump the ground truth after every step (gt-<step>.pt: full
             weights, Adam state, routing counts seen by the test's own router hooks),
             SIGKILL itself after step --kill-at.
    restore: build a differently seeded model, restore, dump what it holds (restored.pt,
             restored.json), then train one more step.

Ranks come from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (gloo) when WORLD_SIZE > 1.
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

from tests.helpers import layout_models as lm  # noqa: E402
from moc import CheckpointManager, MoCConfig  # noqa: E402


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor().detach().clone() if hasattr(t, "full_tensor") else t.detach().clone()


def shard(model: torch.nn.Module, mode: str, world: int) -> None:
    if mode == "none":
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    if mode in ("ep", "fsdp_ep"):
        # Expert parallel: every fused expert tensor as DTensor Shard(0) on the EP mesh
        # (FSDP x EP: Shard(1) on the data-parallel dim as well).
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)) if mode == "ep" else \
            init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep"))
        placements = [Shard(0)] if mode == "ep" else [Shard(1), Shard(0)]
        for name, mod in list(model.named_modules()):
            if name.endswith("mlp.experts"):
                for pname, p in list(mod.named_parameters(recurse=False)):
                    mod.register_parameter(pname, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
        if mode == "fsdp_ep":
            dense = init_device_mesh("cpu", (world,))
            for layer in model.layers:
                fully_shard(layer.attn, mesh=dense)
        return
    mesh = init_device_mesh("cpu", (world,))
    layers = model.model.layers if hasattr(model, "model") else model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def sync_dense_grads(model: torch.nn.Module, world: int) -> None:
    """Plain (replicated) parameters of an EP job: average gradients over ranks."""
    for p in model.parameters():
        if p.grad is not None and not hasattr(p, "device_mesh"):
            dist.all_reduce(p.grad)
            p.grad /= world


def state_dump(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    weights = {k: full(v) for k, v in model.state_dict().items()}
    optim = {}
    for p, st in opt.state.items():
        optim[names[id(p)]] = {k: full(v) for k, v in st.items() if isinstance(v, torch.Tensor)}
    return {"model": weights, "opt": optim}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "restore"])
    ap.add_argument("--kind", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--shm", required=True)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--shard", default="none", choices=["none", "fsdp", "ep", "fsdp_ep"])
    ap.add_argument("--k", type=int, default=1)
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    model = lm.build(args.kind, seed=0 if args.mode == "train" else 1234)
    model.train()
    shard(model, args.shard, world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    counts: dict[str, torch.Tensor] = {}
    for layer, router in lm.routers(model).items():
        def hook(mod, inp, out, layer=layer):
            outs = out if isinstance(out, tuple) else (out,)
            for t in outs:
                if t.dtype == torch.bool:
                    c = t.sum(0).long()
                    break
                if not t.is_floating_point():
                    c = torch.bincount(t.reshape(-1), minlength=lm.EXPERTS)
                    break
            counts[layer] = counts.get(layer, 0) + c
        router.register_forward_hook(hook)

    cfg = MoCConfig(storage=args.store, snapshot_dir=args.shm, interval=2, k_snapshot=args.k, k_persist=args.k,
                    dynamic_k=False, keep_last=50, top_k=lm.TOP_K, coordination_timeout=timedelta(seconds=60))
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        start = ckpt.restore()
        if args.mode == "restore":
            dump = state_dump(model, opt)
            if rank == 0:
                torch.save(dump, os.path.join(args.dump, "restored.pt"))
                plan = ckpt.last_restore
                info = {"start": start, "plt": ckpt.plt(), "layout": ckpt.layout_info,
                        "sources": {n: [s.version, s.level] for n, s in plan.sources.items()}}
                with open(os.path.join(args.dump, "restored.json"), "w") as f:
                    json.dump(info, f)
        for step in range(start, args.steps if args.mode == "train" else start + 1):
            g = torch.Generator().manual_seed(1000 * step + rank)
            ids = torch.randint(3, lm.VOCAB, (2, 9), generator=g)
            counts.clear()
            loss = lm.loss_of(model, ids)
            opt.zero_grad()
            loss.backward()
            if args.shard in ("ep", "fsdp_ep"):
                sync_dense_grads(model, world)
            opt.step()
            ckpt.step(step)
            if step in (0, 2) and args.mode == "train":
                # Partial checkpoints start once the first (full) one is committed: waiting
                # for it here makes every later checkpoint partial however loaded the machine.
                # Step 2's (the first partial one) is waited for too: the test checks the bytes
                # of the partial checkpoints in storage, and on a loaded machine the persists
                # can lag the SIGKILL at step 6 (seen once: none in storage but step 0's).
                ckpt.wait()
            routed = {k: v.clone() for k, v in counts.items()}
            if world > 1:
                for v in routed.values():
                    dist.all_reduce(v)
            dump = state_dump(model, opt)
            if rank == 0 and args.mode == "train":
                dump["routing"] = routed
                dump["loss"] = loss.item()
                tmp = os.path.join(args.dump, f"gt-{step}.pt.tmp")
                torch.save(dump, tmp)
                os.replace(tmp, os.path.join(args.dump, f"gt-{step}.pt"))
            if step == args.kill_at:
                if world > 1:
                    dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
        if args.mode == "restore" and rank == 0:
            with open(os.path.join(args.dump, "continued.json"), "w") as f:
                json.dump({"loss": loss.item()}, f)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
