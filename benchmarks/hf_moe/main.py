"""Hugging Face MoE blocks under Lazarus (``make_elastic``), in one run:

(a) one rank: forward+backward time of each transformers 5.x MoE block made elastic
    (``ElasticHFBlock``: dispatch, grouped experts over fused rows) vs the original block
    with transformers' own experts implementations (``grouped_mm``, its default here, and
    ``eager``), same weights, same tokens; target: elastic / original <= 1.10;
(b) 4 gloo ranks: a tiny Qwen3-MoE trained on the stdlib corpus routes with its own
    router's skew; tokens per rank and per replica, max/mean, and forward time, Lazarus
    (``allocate_replicas`` from the routing history + ``place_mro``, Algorithm 1) vs
    traditional expert parallelism (E/N experts per rank, one replica each); target:
    max/mean <= 1.05.

Run: ``python benchmarks/hf_moe/main.py`` (``make bench-hf``; a few minutes on 2 cores).
Writes ``results.md`` beside this file and prints it.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lazarus.adapters.hf import ElasticHFBlock, make_elastic  # noqa: E402
from lazarus.moe import moe_layers  # noqa: E402
from lazarus.planning import Placement, allocate_replicas, place_mro  # noqa: E402

HERE = Path(__file__).resolve().parent
KINDS = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


# ----- (a) one rank: elastic block vs the original block -------------------------------------------
def block_config(kind: str, d: int, f: int, experts: int, top_k: int):
    from transformers import AutoConfig

    base = dict(hidden_size=d, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                num_experts_per_tok=top_k)
    if kind in ("mixtral", "gpt_oss"):
        base.update(num_local_experts=experts, intermediate_size=f)
    elif kind == "olmoe":
        base.update(num_experts=experts, intermediate_size=f)
    elif kind == "qwen3_moe":
        base.update(num_experts=experts, moe_intermediate_size=f, norm_topk_prob=True)
    elif kind == "deepseek_v3":
        base.update(n_routed_experts=experts, moe_intermediate_size=f, first_k_dense_replace=0, n_shared_experts=1,
                    n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                    qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)
    if kind == "gpt_oss":
        base.update(head_dim=8)
    return AutoConfig.for_model(kind, **base)


def original_block(kind: str, d: int, f: int, experts: int, top_k: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(block_config(kind, d, f, experts, top_k))
    block = model.model.layers[0].mlp
    with torch.no_grad():  # the library's init leaves some tensors at zero (routers); draw them all
        for p in block.parameters():
            p.normal_(0.0, 0.05)
    return block.train()


def _fwd_bwd(block: torch.nn.Module, x: torch.Tensor) -> None:
    xx = x.detach().requires_grad_(True)
    out = block(xx)
    out = out[0] if isinstance(out, tuple) else out
    out.pow(2).mean().backward()


def bench_blocks(args: dict) -> list[dict]:
    torch.set_num_threads(args["threads"])
    rows = []
    d, f, e, k, tokens = args["d_model"], args["d_expert"], args["experts"], args["top_k"], args["tokens"]
    for kind in args["kinds"]:
        orig = original_block(kind, d, f, e, k)
        elastic = ElasticHFBlock(copy.deepcopy(orig), Placement([list(range(e))], num_experts=e))
        x = torch.randn(tokens // 512, 512, d, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():  # same function: the elastic block's output equals the original's
            ref = orig(x)
            got = elastic(x)
            ref, got = (ref[0], got[0]) if isinstance(ref, tuple) else (ref, got)
            err = float((ref - got).abs().max() / ref.abs().max())
        systems = {"original (grouped_mm)": (orig, "grouped_mm"), "original (eager)": (orig, "eager"),
                   "elastic": (elastic, None)}
        times: dict[str, list[float]] = {s: [] for s in systems}
        for rep in range(args["warmup"] + args["reps"]):
            for name, (block, impl) in systems.items():  # interleaved: load changes hit all alike
                if impl is not None:
                    orig.experts.config._experts_implementation = impl
                for p in block.parameters():
                    p.grad = None
                t0 = time.perf_counter()
                _fwd_bwd(block, x)
                if rep >= args["warmup"]:
                    times[name].append(time.perf_counter() - t0)
        base = times["original (grouped_mm)"]
        for name in systems:
            # Ratio per repetition (the systems ran back to back), then the median: robust
            # to the load of a shared machine drifting during the run.
            ratio = statistics.median(t / b for t, b in zip(times[name], base))
            rows.append({"kind": kind, "system": name, "ms": statistics.median(times[name]) * 1e3,
                         "min_ms": min(times[name]) * 1e3, "ratio": ratio,
                         "min_ratio": min(times[name]) / min(base), "max_rel_err": err})
    return rows


# ----- (b) 4 gloo ranks: the router's own skew --------------------------------------------------
def qwen_config(args: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3_moe", vocab_size=256, hidden_size=args["lm_d_model"], intermediate_size=2 * args["lm_d_model"],
        moe_intermediate_size=args["lm_d_model"], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=args["experts"], num_experts_per_tok=args["top_k"], norm_topk_prob=True,
        max_position_embeddings=128, tie_word_embeddings=False, use_cache=False)


def train_router(args: dict, out: Path) -> dict[str, list[int]]:
    """Train the tiny Qwen3-MoE single-process; return each layer's routing counts over
    the last steps (the history a controller would plan from) and save the weights."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from examples.corpus import ByteCorpus
    from examples.moe_gpt import make_optimizer

    torch.set_num_threads(args["threads"])
    torch.manual_seed(0)
    model = make_elastic(AutoModelForCausalLM.from_config(qwen_config(args)))
    opt = make_optimizer(model, lr=3e-3)
    corpus = ByteCorpus(args["corpus_bytes"])
    history = {n: torch.zeros(args["experts"], dtype=torch.int64) for n, _ in moe_layers(model)}
    losses = []
    for step in range(args["train_steps"]):
        x, y = corpus.batch(step, 0, 1, 16, 64)
        loss = F.cross_entropy(model(input_ids=x).logits.reshape(-1, 256), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
        if step >= args["train_steps"] - args["history_steps"]:
            for n, layer in moe_layers(model):
                history[n] += layer.routing_counts
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "trained.safetensors"))
    print(f"trained {args['train_steps']} steps: loss {losses[0]:.2f} -> {sum(losses[-10:]) / 10:.2f}", flush=True)
    return {n: c.tolist() for n, c in history.items()}


def plans(history: dict[str, list[int]], world: int, slots: int, experts: int) -> dict[str, dict[str, Placement]]:
    per = experts // world
    ep = Placement([list(range(j * per, (j + 1) * per)) for j in range(world)], num_experts=experts)
    return {"lazarus": {n: place_mro(allocate_replicas([float(c) for c in counts], world, slots, 1), world, slots)
                        for n, counts in history.items()},
            "traditional EP": {n: ep for n in history}}


def _rank_main(rank: int, world: int, tmp: str, args: dict, history: dict[str, list[int]]) -> None:
    os.environ["RANK"] = str(rank)
    torch.set_num_threads(1)
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from examples.corpus import ByteCorpus

    store = dist.FileStore(str(Path(tmp) / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    corpus = ByteCorpus(args["corpus_bytes"])
    state = load_file(str(Path(tmp) / "trained.safetensors"))
    # A batch of a later training step: the data the history predicts.
    x, _ = corpus.batch(args["train_steps"] + 1000, rank, world, args["eval_batch"], 64)
    out = []
    models = {}
    for system, placements in plans(history, world, args["slots"], args["experts"]).items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(qwen_config(args))
        model.load_state_dict(state)
        models[system] = make_elastic(model, placements).eval()
    times: dict[str, list[float]] = {s: [] for s in models}
    with torch.no_grad():
        for rep in range(args["warmup"] + args["reps"]):
            for system, model in models.items():   # interleaved, like (a)
                dist.barrier()
                t0 = time.perf_counter()
                model(input_ids=x)
                dist.barrier()  # the slowest rank sets the step
                if rep >= args["warmup"]:
                    times[system].append(time.perf_counter() - t0)
    for system, model in models.items():
        for name, layer in moe_layers(model):
            mine = torch.tensor([float(layer.last_received)] + layer.last_received_per_expert.double().tolist())
            gathered = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine)
            per_rank = [float(g[0]) for g in gathered]
            R = layer.replicas.double()                          # [E, W] replicas per rank
            per_replica = [float(gathered[j][1 + e]) / float(R[e, j])
                           for e in range(layer.num_experts) for j in range(world) if R[e, j] > 0]
            routed = [sum(float(g[1 + e]) for g in gathered) for e in range(layer.num_experts)]
            out.append({"system": system, "layer": name, "per_rank": per_rank,
                        "rank_max_over_mean": max(per_rank) / (sum(per_rank) / world),
                        "replica_max_over_mean": max(per_replica) / (sum(per_replica) / len(per_replica)),
                        "expert_skew": max(routed) / (sum(routed) / len(routed)),
                        "replicas": [int(r) for r in R.sum(1).tolist()],
                        "forward_ms": statistics.median(times[system]) * 1e3})
    if rank == 0:
        (Path(tmp) / "result.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def bench_balance(args: dict, world: int = 4) -> tuple[list[dict], dict[str, list[int]]]:
    with tempfile.TemporaryDirectory() as tmp:
        history = train_router(args, Path(tmp))
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank_main, args=(r, world, tmp, args, history), daemon=True)
                 for r in range(world)]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(900)
            if any(p.exitcode != 0 for p in procs):
                raise RuntimeError(f"benchmark ranks failed: exit codes {[p.exitcode for p in procs]}")
            return json.loads((Path(tmp) / "result.json").read_text()), history
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()


# ----- report ---------------------------------------------------------------------------------------
def render(blocks: list[dict], balance: list[dict], history: dict[str, list[int]], args: dict) -> str:
    import transformers

    lines = [
        "# Hugging Face MoE blocks under Lazarus",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}.",
        "Rerun: `make bench-hf` (or `python benchmarks/hf_moe/main.py`).",
        "",
        "## (a) one rank: elastic block vs the original transformers block",
        "",
        f"One MoE block per model (random weights), E={args['experts']}, top-{args['top_k']}, "
        f"d_model={args['d_model']}, expert width {args['d_expert']}, {args['tokens']:,} tokens, "
        f"{args['threads']} threads; forward + backward, {args['reps']} repetitions, the three systems back to "
        "back in each, against the original with transformers' default `grouped_mm` experts (target for elastic: "
        "<= 1.10): ratio = median over repetitions of time / the original's time in the same repetition; "
        "ratio of minima = fastest / fastest (the estimate least affected by other load on a shared machine). "
        "max rel. err = max |elastic - original| / max |original| of the block's output.",
        "",
        "| model | system | fwd+bwd ms (median) | min ms | ratio | ratio of minima | max rel. err |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in blocks:
        lines.append(f"| {r['kind']} | {r['system']} | {r['ms']:.1f} | {r['min_ms']:.1f} | {r['ratio']:.3f} | "
                     f"{r['min_ratio']:.3f} | {r['max_rel_err']:.1e} |")
    lines += [
        "",
        "## (b) 4 gloo ranks: the router's own skew, Lazarus vs traditional expert parallelism",
        "",
        f"A tiny Qwen3-MoE (2 MoE layers, E={args['experts']}, top-{args['top_k']}, d_model={args['lm_d_model']}) "
        f"trained {args['train_steps']} steps on the stdlib byte corpus; its routing counts over the last "
        f"{args['history_steps']} steps "
        f"are the history Lazarus plans from (`allocate_replicas(counts, 4, {args['slots']}, 1)` + `place_mro`); "
        f"traditional EP: {args['experts'] // 4} experts per rank, one replica each. Measured on the batch of a later "
        f"training step ({args['eval_batch']} x 64 bytes, {args['eval_batch'] // 4} sequences per rank), 1 thread "
        "per rank; replicas of one expert on a rank share one weight copy, so slots set the granularity of token "
        "shares, not memory. "
        "expert skew = max/mean tokens per expert (the router's); per rank / per replica = max/mean tokens "
        "processed (target <= 1.05; a cold expert's single replica gets less than the mean by design, the "
        "busiest replica is what counts); forward = whole model, median of "
        f"{args['reps']}, barrier to barrier, the two systems alternating.",
        "",
        "| layer | system | expert skew | replicas per expert | tokens per rank | max/mean per rank | "
        "max/mean per replica | forward ms |",
        "|---|---|---:|---|---|---:|---:|---:|",
    ]
    for r in balance:
        tok = ", ".join(f"{int(t):,}" for t in r["per_rank"])
        lines.append(f"| {r['layer']} | {r['system']} | {r['expert_skew']:.2f} | {r['replicas']} | {tok} | "
                     f"{r['rank_max_over_mean']:.3f} | {r['replica_max_over_mean']:.3f} | {r['forward_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="(a) tokens per block call (multiple of 512)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-expert", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="(a) intra-op threads")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--train-steps", type=int, default=120)
    ap.add_argument("--slots", type=int, default=40, help="(b) Lazarus replica slots per rank")
    ap.add_argument("--skip-blocks", action="store_true", help="only (b)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="(a) models, comma-separated")
    a = ap.parse_args()
    args = {"tokens": a.tokens, "d_model": a.d_model, "d_expert": a.d_expert, "experts": 8, "top_k": 2,
            "threads": a.threads, "reps": a.reps, "warmup": 2, "train_steps": a.train_steps, "slots": a.slots,
            "lm_d_model": 64, "eval_batch": 64, "corpus_bytes": 2 << 20, "history_steps": 40,
            "kinds": [k for k in a.kinds.split(",") if k]}
    blocks = [] if a.skip_blocks else bench_blocks(args)
    balance, history = bench_balance(args)
    text = render(blocks, balance, history, args)
    if not a.skip_blocks:
        (HERE / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
