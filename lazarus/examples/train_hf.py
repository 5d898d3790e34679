"""Elastic training worker for a Hugging Face MoE model: a tiny random Qwen3-MoE (transformers
5.x) on the stdlib byte corpus, made elastic by :func:`lazarus.adapters.hf.make_elastic`.

``lazarus agent`` starts this as its worker command, exactly like ``train_elastic``::

    lazarus agent --controller HOST:PORT --secret-file S --node-id n0 -- \\
        python -m lazarus.examples.train_hf --steps 300 --storage /mnt/nfs/run1

The model is built from the same config and seed on every rank (``from_config``, no
download); each rank keeps the rows of the experts the controller's plan gives it. The
router, the SwiGLU experts and everything else are transformers' own code. moc checkpoints
the fused expert tensors as rows of ``[E, ...]``, so ``moc export --format safetensors``
of the run loads with ``AutoModelForCausalLM.from_pretrained``.

Needs transformers >= 5 (``pip install 'moc-lazarus[hf]'``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from moc import MoCConfig

from .corpus import ByteCorpus
from .moe_gpt import make_optimizer


def _duration(text: str) -> timedelta:
    from lazarus.runtime._config import parse_duration

    return parse_duration(text, "duration")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lazarus.examples.train_hf", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps over the job's life")
    p.add_argument("--batch-size", type=int, default=12, help="global batch (sequences per step)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--layers", type=int, default=2, help="decoder layers (every one is MoE)")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-expert", type=int, default=64, help="moe_intermediate_size of each expert")
    p.add_argument("--heads", type=int, default=4)
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
                        "by the node id and the worker's local rank")
    p.add_argument("--hf-config-out", default=None, help="write the model's config.json here (for moc export)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p


def qwen3_moe_config(args: argparse.Namespace) -> Any:
    """A tiny Qwen3-MoE over bytes (vocab 256): every layer sparse, softmax top-k router
    with renormalised gates, SwiGLU experts fused as ``experts.gate_up_proj``/``down_proj``."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3_moe", vocab_size=256, hidden_size=args.d_model, intermediate_size=2 * args.d_model,
        moe_intermediate_size=args.d_expert, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2), num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, max_position_embeddings=max(128, args.seq_len), tie_word_embeddings=False,
        use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_model(config: Any, seed: int) -> torch.nn.Module:
    """The full model, identical on every rank: weights drawn from ``seed`` only (the
    global RNG is left as it was)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.train()
    return model


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    node = os.environ.get("LAZARUS_NODE_ID", "?")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s worker {node} %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    from lazarus.adapters.hf import elastic_layout, make_elastic
    from lazarus.runtime import ElasticConfig, ElasticTrainer

    config = qwen3_moe_config(args)
    if args.hf_config_out:
        os.makedirs(args.hf_config_out, exist_ok=True)
        config.save_pretrained(args.hf_config_out)
    corpus = ByteCorpus(args.corpus_bytes)
    moc_cfg = MoCConfig(storage=args.storage, interval=args.interval, k_snapshot=args.k_snapshot,
                        k_persist=args.k_persist, persist_every=args.persist_every, top_k=args.top_k,
                        snapshot_copies=args.snapshot_copies, keep_last=2)
    cfg = ElasticConfig(collective_timeout=args.collective_timeout, rendezvous_timeout=args.rendezvous_timeout,
                        plan_timeout=args.plan_timeout, report_every=args.report_every, moc=moc_cfg,
                        metrics_path=args.metrics)
    layout = elastic_layout(build_model(config, args.seed))

    def build(placements: Mapping[str, Any]) -> torch.nn.Module:
        return make_elastic(build_model(config, args.seed), placements)

    def loss_fn(model: torch.nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
        x, y = corpus.batch(step, rank, world, args.batch_size, args.seq_len, seed=args.seed)
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    trainer = ElasticTrainer(cfg, layout=layout, build_model=build,
                             make_optimizer=lambda model: make_optimizer(model, lr=args.lr))
    t0 = time.time()
    trainer.run(loss_fn, args.steps)
    if args.digests and not trainer.left:
        path = args.digests.replace("{node}", node).replace("{local_rank}", str(trainer.local_rank))
        with open(path + ".tmp", "w") as f:
            json.dump({"node": node, "local_rank": trainer.local_rank, "step": trainer.step, "rank": trainer.rank, "world": trainer.world,
                       "generation": trainer.generation, "experts": trainer.expert_digests(),
                       "dense": trainer.dense_digest(), "losses": trainer.losses,
                       "seconds": time.time() - t0}, f)
        os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
