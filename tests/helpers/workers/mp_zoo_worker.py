"""The zoo's training / restoring process: many tiny transformers MoE models, one after the
other, each checkpointed by its own moc manager (see tests/moc/test_hf_zoo.py).

    train:   per architecture: train --steps steps (Adam), checkpoint every step with
             K = 1, dump the ground truth after every step (gt-<step>.pt: weights, Adam
             state, the expert slots each experts module received, counted by the test's
             own hooks); once every architecture has trained, SIGKILL this process.
    restore: per architecture: a differently seeded model, ``restore()``, dump what it
             holds (restored.pt) and what moc says (restored.json: PLT per layer, sources).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
import warnings
from datetime import timedelta

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
torch.set_num_threads(1)
warnings.filterwarnings("ignore")

from tests.helpers import hf_zoo as zoo  # noqa: E402
from moc import CheckpointManager, MoCConfig  # noqa: E402


def _num(mod: torch.nn.Module) -> int | None:
    for attr in ("num_routed_experts", "num_experts"):      # LongCat: routed, not zero-compute
        n = getattr(mod, attr, None)
        if isinstance(n, int):
            return n
    return None


def expert_counters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """layer -> slots per expert, filled by hooks on the modules that run the experts: the
    expert ids (or counts) they are called with, every call of the layer, read
    independently of moc:

    * ``<layer>.experts(hidden, ids | mask, weights)`` (transformers), or one dense
      pre-scaled input (Llama 4);
    * JetMoE's ``<layer>.input_linear(inputs, tokens_per_expert)``;
    * Doge's ``<layer>.down_embed(ids)`` (row e of the embedding is expert e).
    """
    counts: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for name, mod in modules.items():
        leaf = name.rsplit(".", 1)[-1]
        parent = modules.get(name.rsplit(".", 1)[0]) if "." in name else None
        if leaf == "experts" and _num(mod) is not None:
            kind = "experts"
        elif leaf == "input_linear" and _num(mod) is not None:
            kind = "counts"
        elif leaf == "down_embed" and parent is not None and _num(parent) == getattr(mod, "num_embeddings", None):
            kind = "ids"
        else:
            continue
        num = _num(mod) if kind != "ids" else _num(parent)
        layer = name.rsplit(".", 1)[0]
        counts[layer] = torch.zeros(num, dtype=torch.int64)

        def hook(mod, args, layer=layer, num=num, kind=kind):
            if not mod.training:
                return
            if kind == "counts":
                counts[layer] += torch.tensor(list(args[1]), dtype=torch.int64)
                return
            if kind == "ids":
                ids = args[0].reshape(-1).long()
                counts[layer] += torch.bincount(ids, minlength=num)
                return
            if len(args) == 1:          # Llama 4: [E * tokens, D], rows of unselected experts are 0
                x = args[0].detach().reshape(num, -1, args[0].shape[-1])
                counts[layer] += (x != 0).any(-1).sum(1)
                return
            sel = args[1]
            if sel.dim() >= 2 and sel.shape[-1] == num and num != zoo.TOP_K:   # a 0/1 dispatch mask
                counts[layer] += sel.reshape(-1, num).sum(0).long()
                return
            ids = sel.reshape(-1).long()      # ids >= num: LongCat's zero-compute experts
            counts[layer] += torch.bincount(ids[(ids >= 0) & (ids < num)], minlength=num)

        mod.register_forward_pre_hook(hook)
    return counts


def state_dump(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optim = {names[id(p)]: {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
             for p, st in opt.state.items()}
    return {"model": weights, "opt": optim}


def config(arch_dir: str, shm: str) -> MoCConfig:
    return MoCConfig(storage=os.path.join(arch_dir, "store"), snapshot_dir=shm, interval=1, k_snapshot=1,
                     k_persist=1, dynamic_k=False, keep_last=50)     # top_k: the model's (ZAYA routes top-1)


def train(arch: str, arch_dir: str, shm: str, steps: int, keep: list) -> None:
    model = zoo.build(arch, seed=0)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    counts = expert_counters(model)
    ckpt = CheckpointManager(config(arch_dir, shm), model=model, optimizer=opt)
    for step in range(steps):
        loss = zoo.loss_of(model, zoo.batch(arch, step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.step(step)
        if step == 0:
            ckpt.wait()                  # the full first checkpoint: every later one is partial
        dump = state_dump(model, opt)
        dump["cum"] = {l: c.clone() for l, c in counts.items()}
        torch.save(dump, os.path.join(arch_dir, f"gt-{step}.pt"))
    ckpt.engine.wait()                   # the newest snapshot is complete in memory
    # Nothing is closed cleanly (no flush, the shared-memory files stay, as a SIGKILL leaves
    # them); detaching lets this architecture's model go before the next one is built.
    keep.append(ckpt.detach(grace=timedelta(seconds=60)))


def restore(arch: str, arch_dir: str, shm: str) -> None:
    model = zoo.build(arch, seed=1234)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with CheckpointManager(config(arch_dir, shm), model=model, optimizer=opt) as ckpt:
        start = ckpt.restore()
        torch.save(state_dump(model, opt), os.path.join(arch_dir, "restored.pt"))
        plan = ckpt.last_restore
        info = {"start": start, "plt": ckpt.plt(), "plt_per_layer": ckpt.plt_tracker.per_layer(),
                "layers": ckpt.num_experts,
                "sources": {n: [s.version, s.level] for n, s in plan.sources.items()} if plan else {}}
        with open(os.path.join(arch_dir, "restored.json"), "w") as f:
            json.dump(info, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "restore"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("archs", nargs="+")
    args = ap.parse_args()
    keep: list = []
    for arch in args.archs:
        arch_dir = os.path.join(args.dir, arch)
        os.makedirs(arch_dir, exist_ok=True)
        shm = os.path.join(arch_dir, "shm")
        try:
            if args.mode == "train":
                train(arch, arch_dir, shm, args.steps, keep)
            else:
                restore(arch, arch_dir, shm)
        except Exception:   # noqa: BLE001 - reported per architecture by the test
            with open(os.path.join(arch_dir, f"{args.mode}-error.txt"), "w") as f:
                f.write(traceback.format_exc())
    if args.mode == "train":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
