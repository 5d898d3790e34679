"""One rank of a DP x EP training job with moc checkpointing (run by tests/moc/test_distributed.py).

Experts are split over EP ranks (global ids in parameter names); ranks with the same EP
rank are data-parallel replicas. Non-expert gradients are averaged over every rank,
expert gradients over the replicas holding that expert, so replicas stay identical.
Writes, under --out/rank<r>/: counts.jsonl (global-id routing counts per step),
state_<step>.pt at every checkpoint step (the live state the checkpoint captured), and
after a restore restored.pt + restore.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

from moc import CheckpointManager, MoCConfig  # noqa: E402
from examples.toy_moe import BigramTask, Expert  # noqa: E402

VOCAB, DIM, HIDDEN, LAYERS, EXPERTS = 32, 16, 32, 2, 8


class LocalMoE(nn.Module):
    """Routes this rank's tokens among its local experts (global ids as names)."""

    def __init__(self, local: list[int]) -> None:
        super().__init__()
        self.local = local
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleDict({str(e): Expert(DIM, HIDDEN) for e in local})
        self.last_counts = torch.zeros(EXPERTS, dtype=torch.int64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        mask = torch.full((EXPERTS,), float("-inf"))
        mask[self.local] = 0.0
        probs = (logits + mask).softmax(-1)
        weight, idx = probs.max(-1)
        out = torch.zeros_like(x)
        for e in self.local:
            rows = (idx == e).nonzero(as_tuple=True)[0]
            if rows.numel():
                out.index_add_(0, rows, self.experts[str(e)](x[rows]) * weight[rows, None])
        self.last_counts = torch.bincount(idx, minlength=EXPERTS)
        return out


class Model(nn.Module):
    def __init__(self, local: list[int]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList()
        for _ in range(LAYERS):
            block = nn.Module()
            block.norm = nn.LayerNorm(DIM)
            block.moe = LocalMoE(local)
            self.layers.append(block)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.layers:
            h = h + block.moe(block.norm(h))
        return self.head(h)


def state_by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": {names[id(p)]: {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}
                      for p, st in opt.state.items()}}


def main() -> None:
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--ep", type=int, required=True)
    ap.add_argument("--rdzv", required=True)
    ap.add_argument("--storage", required=True)
    ap.add_argument("--snapshot-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--persist-every", type=int, default=3)
    ap.add_argument("--k-snapshot", type=int, default=4)
    ap.add_argument("--k-persist", type=int, default=2)
    args = ap.parse_args()

    dist.init_process_group("gloo", init_method=f"file://{args.rdzv}", rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=30))
    ep_rank = args.rank % args.ep
    per = EXPERTS // args.ep
    local = list(range(ep_rank * per, (ep_rank + 1) * per))
    dp_groups = [dist.new_group([r for r in range(args.world) if r % args.ep == g]) for g in range(args.ep)]
    dp_group = dp_groups[ep_rank]
    dp_size = args.world // args.ep

    torch.manual_seed(1234)  # identical non-expert init everywhere; experts by global id below
    model = Model(local)
    for e in local:
        g = torch.Generator().manual_seed(100 + e)
        for p in model.layers[0].moe.experts[str(e)].parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.1
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    task = BigramTask(vocab=VOCAB, seed=0)
    cfg = MoCConfig(storage=args.storage, snapshot_dir=args.snapshot_dir, interval=args.interval,
                    persist_every=args.persist_every, k_snapshot=args.k_snapshot, k_persist=args.k_persist,
                    expert_pattern=r"(?P<layer>.+)\.experts\.(?P<expert>\d+)\.", keep_last=10,
                    coordination_timeout=timedelta(seconds=30))
    out = os.path.join(args.out, f"rank{args.rank}")
    os.makedirs(out, exist_ok=True)
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    start = ckpt.restore()
    if start > 0:
        plan = ckpt.last_restore
        torch.save(state_by_name(model, opt), os.path.join(out, "restored.pt"))
        with open(os.path.join(out, "restore.json"), "w") as f:
            json.dump({"step": plan.step, "from_memory": plan.from_memory, "plt": ckpt.plt(),
                       "plt_state": ckpt.plt_tracker.state(), "k_snapshot": ckpt.k_snapshot,
                       "k_persist": ckpt.k_persist,
                       "sources": {n: {"version": s.version, "level": s.level} for n, s in plan.sources.items()}}, f)
    counts_log = open(os.path.join(out, "counts.jsonl"), "a")
    for step in range(start, args.steps):
        x, y = task.batch(step * args.world + args.rank, 64)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        for name, p in model.named_parameters():
            if p.grad is None:  # no tokens reached this expert here; its replica's may have
                p.grad = torch.zeros_like(p)
            if ".experts." in name:
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= dp_size
            else:
                dist.all_reduce(p.grad)
                p.grad /= args.world
        opt.step()
        counts = {f"layers.{i}.moe": b.moe.last_counts.tolist() for i, b in enumerate(model.layers)}
        for layer, c in counts.items():
            ckpt.record_routing(layer, c)
        counts_log.write(json.dumps({"step": step, "counts": counts, "tokens": int(x.numel())}) + "\n")
        counts_log.flush()
        if step % args.interval == 0:
            torch.save(state_by_name(model, opt), os.path.join(out, f"state_{step}.pt"))
        ckpt.step(step)
        print(f"step {step}", flush=True)
    ckpt.close()
    dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    main()
