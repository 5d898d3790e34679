"""A training process for the exact-mode tests (tests/moc/test_exact.py).

Trains a small MoE (moc's ToyMoE, or a transformers 5.x Qwen3-MoE with fused experts)
with AdamW, dropout (the RNG matters) and global-norm clipping, on batches that are a
function of the step. ``--kill-at S`` SIGKILLs the process right after ``step(S)``;
``--no-moc`` is the reference run without moc. At the end it writes the model and
optimizer state (``torch.save``) and a JSON line with where it started.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

from moc import CheckpointManager, MoCConfig  # noqa: E402
from examples.toy_moe import BigramTask, ToyMoE  # noqa: E402

VOCAB = 32


def build(kind: str):
    torch.manual_seed(0)
    if kind == "toy":
        model = ToyMoE(vocab=VOCAB, dim=16, hidden=32, num_layers=2, num_experts=8)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM
        config = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                      attention_dropout=0.1)
        model = AutoModelForCausalLM.from_config(config)
        model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(kind: str, model, opt, step: int, data_seed: int) -> float:
    x, y = BigramTask(vocab=VOCAB, seed=1 + data_seed).batch(step, 64)
    if kind == "toy":
        loss = F.cross_entropy(F.dropout(model(x), 0.1), y)
    else:
        ids = torch.cat([x.view(4, 16), y.view(4, 16)], dim=1)
        loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    return float(loss.detach())


def run(args: argparse.Namespace) -> dict:
    model, opt = build(args.model)
    start = 0
    if args.no_moc:
        for step in range(args.steps):
            train_step(args.model, model, opt, step, args.data_seed)
        status = None
    else:
        cfg = MoCConfig(storage=args.storage, snapshot_dir=args.shm, interval=1, k_snapshot=2, exact=True,
                        top_k=1 if args.model == "toy" else 2, persist_every=args.persist_every)
        with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
            start = ckpt.restore()
            for step in range(start, args.steps):
                train_step(args.model, model, opt, step, args.data_seed)
                ckpt.step(step)
                if step == args.kill_at:
                    ckpt.wait()                 # the newest complete window is in storage (storage tests)
                    os.kill(os.getpid(), signal.SIGKILL)
            status = ckpt.status()["exact"]
            plt = ckpt.plt()
        status["plt"] = plt
    if args.out:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, args.out)
    return {"start": start, "status": status}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("toy", "hf"), default="toy")
    p.add_argument("--storage", default="")
    p.add_argument("--shm", default="")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--persist-every", type=int, default=1)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--no-moc", action="store_true")
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.set_num_threads(1)   # as tests/conftest.py: the in-process reference run computes the same sums
    print("RESULT " + json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
