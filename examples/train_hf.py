"""Elastic training worker for a Hugging Face MoE model: a tiny random Qwen3-MoE (transformers
5.x) on the stdlib byte corpus, made elastic by :func:`lazarus.adapters.hf.make_elastic`.

``lazarus agent`` starts this as its worker command, exactly like ``train_elastic``::

    lazarus agent --controller HOST:PORT --secret-file S --node-id n0 -- \\
        python -m examples.train_hf --steps 300 --storage /mnt/nfs/run1

The model is built from the same config and seed on every rank (``from_config``, no
download); each rank keeps the rows of the experts the controller's plan gives it. The
router, the SwiGLU experts and everything else are transformers' own code. moc checkpoints
the fused expert tensors as rows of ``[E, ...]``, so ``moc export --format safetensors``
of the run loads with ``AutoModelForCausalLM.from_pretrained``.

Needs transformers >= 5 (``pip install 'moc-lazarus[hf]'``).
"""

from __future__ import annotations

import gc

if __name__ == "__main__":
    # A worker trains only once its imports are done (a joining node waits on them); the
    # collector's full passes over torch's import heap are 0.3-0.5 s of a quiet core. Off
    # while importing; run_job freezes what the imports built and turns it back on.
    gc.disable()

import argparse  # noqa: E402
import os
import sys
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from ._worker import add_job_arguments, elastic_config, run_job, start_worker
from .corpus import ByteCorpus


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.train_hf", description=__doc__.split("\n")[0])
    add_job_arguments(p, batch_size=12)
    p.add_argument("--layers", type=int, default=2, help="decoder layers (every one is MoE)")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-expert", type=int, default=64, help="moe_intermediate_size of each expert")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--hf-config-out", default=None, help="write the model's config.json here (for moc export)")
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
    node = start_worker(args)
    from lazarus.adapters.hf import elastic_layout, make_elastic

    config = qwen3_moe_config(args)
    if args.hf_config_out:
        os.makedirs(args.hf_config_out, exist_ok=True)
        config.save_pretrained(args.hf_config_out)
    corpus = ByteCorpus(args.corpus_bytes)
    cfg = elastic_config(args, top_k=args.top_k)
    layout = elastic_layout(build_model(config, args.seed))

    def build(placements: Mapping[str, Any]) -> torch.nn.Module:
        return make_elastic(build_model(config, args.seed), placements)

    def loss_fn(model: torch.nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
        x, y = corpus.batch(step, rank, world, args.batch_size, args.seq_len, seed=args.seed)
        device = next(model.parameters()).device
        x, y = x.to(device), y.to(device)
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return run_job(args, cfg, layout=layout, build_model=build, loss_fn=loss_fn, node=node)


if __name__ == "__main__":
    sys.exit(main())
