"""Checkpoint overhead on a transformers Qwen3-MoE model (fused experts): MoC vs torch.save and DCP.

    python benchmarks/moc_hf/main.py            # full run: ~1.3 GB of fp32 + Adam state (~20-30 min on 2 cores)
    python benchmarks/moc_hf/main.py --quick    # tiny model, smoke test (< 2 min)
    python benchmarks/moc_hf/main.py --profile  # also: where MoC K=1's time in step() goes (cProfile)
    python benchmarks/moc_hf/main.py --fsdp-only --moc-only --profile   # just MoC's FSDP2 rows (~6 min)
    python benchmarks/moc_hf/main.py --render benchmarks/moc_hf/results.json   # tables and plot again

Writes ``results.md``, ``results.json`` and ``stall.png`` beside this file (or under
``--out``) and prints the tables. Everything is measured in one run, on one model:

* **Model.** ``AutoModelForCausalLM.from_config`` of a transformers 5.x ``qwen3_moe``
  config (random init, nothing downloaded), sized so that weights + Adam state in fp32 are
  >= 1 GB, almost all of it in the fused experts (``mlp.experts.gate_up_proj`` [E, 2F, D],
  ``down_proj`` [E, D, F]). moc recognises that layout and counts routing through forward
  hooks on the model's own routers (``mlp.gate``); nothing model-specific is passed to it
  beyond ``top_k``.
* **One process** (2 threads): ``torch.save`` (blocking), DCP ``async_save`` of
  ``get_state_dict`` with and without a ``DefaultStager``, MoC with all experts and with
  K=1 (one level: every snapshot persisted; two levels: ``persist_every=4``). The stall per
  checkpoint is measured as in ``benchmarks/moc_overhead`` (shared code in
  ``benchmarks/_ckpt_bench.py``): ABBA pairs of windows of training steps with and without
  one checkpoint, the checkpoint's background work awaited at the end of its window; stall =
  sum over step positions of the median (over pairs) step-time difference + median final wait.
* **FSDP2, 2 processes** (gloo, one thread each): the same model ``fully_shard``-ed per
  decoder layer and at the root, each rank training on its half of the batch. DCP
  ``async_save`` of ``get_state_dict`` (FSDP2's native checkpoint path, sharded; on a gloo
  group of its own, as torchtitan does) with and without ``DefaultStager``, vs MoC K=1 (which
  saves the DTensors' local shards). Same ABBA windows on both ranks; stall reported per rank.
* **Bytes** per checkpoint on disk vs the DESIGN.md formula ``(P_ne + P_e*K/E) * (4 + 8)``
  (+ persistent buffers): fp32 weights and Adam's two moments.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import os
import pstats
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import torch.distributed as dist  # noqa: E402

from benchmarks._ckpt_bench import (GB, MB, DCPAsync, Method, MoC, TorchSave, fmt_ms, loadavg, machine,  # noqa: E402
                                    measure, report_footer, stall_target_rows, verdict)

# seq: tokens per sequence; tokens: tokens per training step (the whole batch; FSDP ranks
# take half each). moe_hidden is Qwen3-MoE's moe_intermediate_size (F).
FULL = dict(vocab=4096, dim=512, layers=4, experts=32, moe_hidden=512, top_k=4, heads=8, kv_heads=2, seq=512,
            tokens=1024, window=5, reps=4, fsdp_window=3, fsdp_reps=4)
QUICK = dict(vocab=512, dim=128, layers=2, experts=8, moe_hidden=128, top_k=2, heads=4, kv_heads=2, seq=128,
             tokens=256, window=3, reps=2, fsdp_window=2, fsdp_reps=2)
EXPERT_PARAM = re.compile(r"\.experts\.(?:gate_up_proj|down_proj)(?:_bias)?$")
FORMULA_TOLERANCE = 0.01  # measured bytes may exceed the formula by Adam's step scalars, alignment, RNG state
WORLD = 2                 # FSDP ranks
PROFILED = 4              # --profile: profiled MoC checkpoints per row, after the measured windows
# --profile: parts of CheckpointManager.step() reported by name (label, file, functions); indented
# parts are inside the one above them, collectives are inside the parts that issue them.
PARTS = (
    ("CheckpointManager.step(), all", "moc/_manager.py", ("step",)),
    ("planning units (`_plan_units`: cached unit plans checked, extra unit planned)", "moc/_modes.py",
     ("_plan_units",)),
    ("- plan cache check (`UnitPlans.refresh`: signatures, re-plans of changed units)", "moc/_units/plans.py",
     ("refresh",)),
    ("- - capturing units (`capture_unit`: state-dict views, Adam state)", "moc/_units/capture.py", ("capture_unit",)),
    ("- serialisation plans (`plan_tree`)", "moc/_store/codec.py", ("plan_tree",)),
    ("the round (`_agree`: ballot, its collective(s), router-hook drain)", "moc/_modes.py", ("_agree",)),
    ("shares of this checkpoint (`plan_snapshot`, no collective)", "moc/_snapshot/plan.py", ("plan_snapshot",)),
    ("snapshot start (`SnapshotEngine.start`: buffer, synchronous copies, background job)",
     "moc/_snapshot/engine.py", ("start",)),
    ("moc's collectives, all (`sum_int64`, `gather_bytes`, `gather_json`, `any_true`)", "moc/_dist.py",
     ("sum_int64", "gather_bytes", "gather_json", "any_true")),
    ("- waiting in gloo (`Work.wait`, incl. waiting for the other rank)", "~",
     ("<built-in method torch._C._distributed_c10d.wait>",)),
)


# --------------------------------------------------------------------------------------
# the model and its training step
def hf_config(p: dict[str, Any]):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3_moe", hidden_size=p["dim"], intermediate_size=4 * p["dim"], moe_intermediate_size=p["moe_hidden"],
        num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
        head_dim=p["dim"] // p["heads"], vocab_size=p["vocab"], num_experts=p["experts"],
        num_experts_per_tok=p["top_k"], norm_topk_prob=True, tie_word_embeddings=False,
        max_position_embeddings=max(2048, p["seq"]), pad_token_id=0, bos_token_id=1, eos_token_id=2)


class HFTrainer:
    """A Qwen3-MoE causal LM, Adam, and a fixed batch; ``step()`` = forward + backward +
    ``optimizer.step()``. ``shard=True``: FSDP2 over the default process group."""

    def __init__(self, p: dict[str, Any], *, rank: int = 0, world: int = 1, shard: bool = False) -> None:
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.model = AutoModelForCausalLM.from_config(hf_config(p))
        self.model.config.use_cache = False
        self.model.train()
        names = [n for n, _ in self.model.named_parameters()]
        params = set(names)
        self.P_e = sum(q.numel() for n, q in self.model.named_parameters() if EXPERT_PARAM.search(n))
        self.P_ne = sum(q.numel() for q in self.model.parameters()) - self.P_e
        self.expert_tensors = [n for n in names if EXPERT_PARAM.search(n)]
        self.buffer_bytes = sum(t.numel() * t.element_size() for k, t in self.model.state_dict().items()
                                if k not in params)
        if shard:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(1 + rank)
        per_rank = p["tokens"] // world
        self.ids = torch.randint(3, p["vocab"], (max(1, per_rank // p["seq"]), min(p["seq"], per_rank)), generator=g)
        self.step_no = -1
        self.on_step: Callable[[int], None] | None = None

    def step(self) -> int:
        self.opt.zero_grad(set_to_none=False)
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.opt.step()
        self.step_no += 1
        if self.on_step is not None:
            self.on_step(self.step_no)
        return self.step_no

    def step_time(self, warm: int = 2, timed: int = 3) -> float:
        for _ in range(warm):
            self.step()
        t0 = time.perf_counter()
        for _ in range(timed):
            self.step()
        return (time.perf_counter() - t0) / timed


def pec_bytes(P_ne: int, P_e: int, K: int, E: int, buffers: int) -> float:
    """DESIGN.md: (P_ne + P_e*K/E) * (B_w + B_o), B_w = 4 (fp32), B_o = 8 (Adam), + buffers."""
    return (P_ne + P_e * K / E) * (4 + 8) + buffers


# --------------------------------------------------------------------------------------
# MoC K=1's step() under cProfile (--profile)
class StepProfile:
    """Accumulates cProfile stats over profiled ``CheckpointManager.step()`` calls."""

    def __init__(self) -> None:
        self.prof = cProfile.Profile()
        self.calls = 0

    def __call__(self, fn: Callable[[], None]) -> None:
        self.calls += 1
        self.prof.enable()
        try:
            fn()
        finally:
            self.prof.disable()

    def after(self, tr: HFTrainer, n: int) -> Callable[[Method], None]:
        """``measure(before_teardown=...)``: ``n`` more checkpoints of the MoC method, each
        after a training step and waited to completion, with ``step()`` under cProfile
        (after the measured windows, so the table's timings carry no profiler overhead)."""
        def run(m: Method) -> None:
            assert isinstance(m, MoC)
            for _ in range(n):
                s = tr.step()
                self(lambda: m.ckpt.step(s))
                m.last = s
                m.drain()
                m.after()
        return run

    def _stats(self) -> dict[tuple[str, int, str], tuple[Any, ...]]:
        return pstats.Stats(self.prof, stream=io.StringIO()).stats  # type: ignore[attr-defined]

    def top(self, n: int = 18) -> list[dict[str, Any]]:
        """The ``n`` functions with the most cumulative time, per checkpoint (nested)."""
        rows = []
        for (file, line, func), (_, ncalls, tt, ct, _) in self._stats().items():
            where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if file != "~" else "~"
            rows.append({"func": f"{func} ({where})", "ncalls": ncalls, "cum": ct / max(1, self.calls),
                         "own": tt / max(1, self.calls)})
        rows.sort(key=lambda r: -r["cum"])
        return rows[:n]

    def result(self) -> dict[str, Any]:
        return {"calls": self.calls, "top": self.top(), "parts": self.parts()}

    def parts(self) -> list[dict[str, Any]]:
        """Cumulative time per checkpoint of the parts of ``step()`` named in ``PARTS``."""
        stats = self._stats()
        out = []
        for label, file, funcs in PARTS:
            cum = calls = 0.0
            for (f, _, fn), (_, ncalls, _, ct, _) in stats.items():
                if fn in funcs and (f.replace(os.sep, "/").endswith(file) if file != "~" else f == "~"):
                    cum += ct
                    calls += ncalls
            out.append({"part": label, "ms": 1e3 * cum / max(1, self.calls), "calls": calls / max(1, self.calls)})
        return out


# --------------------------------------------------------------------------------------
# one process
def model_info(p: dict[str, Any]) -> dict[str, Any]:
    """What the report says about the model, without training it (``--fsdp-only``)."""
    tr = HFTrainer(p)
    return {"P_e": tr.P_e, "P_ne": tr.P_ne, "buffers": tr.buffer_bytes, "state_bytes": (tr.P_ne + tr.P_e) * 12,
            "expert_tensors": tr.expert_tensors[:2], "step": float("nan"), "rows": [], "profile": {}}


def run_single(p: dict[str, Any], root: Path, shm: Path, log, errors: list[str], *, quick: bool,
               profile: bool) -> dict[str, Any]:
    tr = HFTrainer(p)
    step = tr.step_time()
    state = (tr.P_ne + tr.P_e) * 12
    log(f"model: {tr.P_e/1e6:.1f} M expert (P_e) + {tr.P_ne/1e6:.2f} M other (P_ne) params, state {state/GB:.2f} GB "
        f"(fp32 + Adam), buffers {tr.buffer_bytes} B, step {step:.2f} s; load {loadavg()}")
    moc_kw = dict(top_k=p["top_k"])
    methods: list[Method] = [
        TorchSave(tr, root), DCPAsync(tr, root, cached=False), DCPAsync(tr, root, cached=True),
        DCPAsync(tr, root, cached=True, best=True),
        MoC(tr, root, shm, "all experts, 1 level", None, None, 1, **moc_kw),
        MoC(tr, root, shm, "K=1, 1 level", 1, 1, 1, **moc_kw),
        MoC(tr, root, shm, "K=1, 2 levels", 1, 1, 4, **moc_kw),
    ]
    if p.get("moc_only"):
        methods = [m for m in methods if isinstance(m, MoC)]
    profiles: dict[str, StepProfile] = {}
    rows, retried = [], []
    for m in methods:
        prof = None
        if profile and isinstance(m, MoC) and m.k_snapshot == 1:
            prof = profiles[m.name] = StepProfile()
        try:
            row = measure(tr, m, p["window"], p["reps"], log, prof.after(tr, PROFILED) if prof else None)
            if row["spread"] > 1.5 and not quick:
                # Outside load made baseline windows differ by > 1.5x: measure once more.
                log(f"  {m.name}: baseline windows differ {row['spread']:.1f}x (outside load); re-measuring")
                retried.append(m.name)
                row = measure(tr, m, p["window"], p["reps"], log, prof.after(tr, PROFILED) if prof else None)
            if isinstance(m, MoC):
                row["layout"] = m.ckpt.layout_info["description"]
            rows.append(row)
        except Exception as exc:  # noqa: BLE001 - one broken baseline must not hide the rest
            if isinstance(m, MoC):
                raise
            errors.append(f"{m.name}: {type(exc).__name__}: {exc}")
            log(f"  {m.name}: FAILED: {type(exc).__name__}: {exc}")
            try:
                m.teardown()
            except Exception:  # noqa: BLE001
                pass
    if retried:
        errors.append("re-measured once because a burst of outside load made its baseline windows differ by "
                      "more than 1.5x: " + ", ".join(retried))
    out = {"P_e": tr.P_e, "P_ne": tr.P_ne, "buffers": tr.buffer_bytes, "state_bytes": state,
           "expert_tensors": tr.expert_tensors[:2],
           "step": statistics.median(r["step"] for r in rows) if rows else step,
           "rows": rows, "profile": {k: v.result() for k, v in profiles.items()}}
    return out


# --------------------------------------------------------------------------------------
# FSDP2, two processes: this file run with --fsdp-worker RANK
def fsdp_worker(rank: int, workdir: Path, shm: Path) -> int:
    p = json.loads((workdir / "params.json").read_text())
    torch.set_num_threads(1)  # two ranks on two cores
    log = lambda s: print(f"[fsdp rank {rank}] {s}", flush=True)  # noqa: E731
    dist.init_process_group("gloo", init_method=f"file://{workdir / 'pg-init'}", rank=rank, world_size=WORLD,
                            timeout=timedelta(minutes=10))
    try:
        tr = HFTrainer(p, rank=rank, world=WORLD, shard=True)
        step = tr.step_time(warm=1, timed=2)
        log(f"sharded over {WORLD} ranks; step {step:.2f} s; load {loadavg()}")
        dcp_group = dist.new_group(backend="gloo", timeout=timedelta(minutes=10))
        root = workdir / "ckpt"
        moc = MoC(tr, root, shm, "K=1, 1 level", 1, 1, 1, top_k=p["top_k"])
        prof = StepProfile() if p.get("profile") else None
        methods: list[Method] = [
            DCPAsync(tr, root, cached=False, process_group=dcp_group),
            DCPAsync(tr, root, cached=True, process_group=dcp_group),
            DCPAsync(tr, root, cached=True, process_group=dcp_group, best=True),
            moc,
        ]
        if p.get("moc_only"):
            methods = [moc]
        rows = []
        for m in methods:
            row = measure(tr, m, p["fsdp_window"], p["fsdp_reps"], log,
                          prof.after(tr, PROFILED) if prof and m is moc else None)
            if isinstance(m, MoC):
                row["layout"] = m.ckpt.layout_info["description"]
            rows.append(row)
        for row in rows:
            arrivals(row)
        result = {"rank": rank, "step": statistics.median(r["step"] for r in rows), "rows": rows,
                  "profile": {moc.name: prof.result()} if prof else {}}
        (workdir / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def arrivals(row: dict[str, Any]) -> None:
    """How long after this rank the last rank entered each measured checkpoint call
    (collective). A call that waits for every rank (MoC's one all-reduce) spends that long
    waiting for the slower rank, which the step would otherwise spend in FSDP's next
    all-gather; the rest of the call is the method's own cost."""
    mine = torch.tensor(row["entered"], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(WORLD)]
    dist.all_gather(every, mine)
    waits = (torch.stack(every).max(0).values - mine).tolist()
    row["arrival_wait"] = statistics.mean(waits)
    row["call_after_arrival"] = statistics.mean(max(0.0, c - w) for c, w in zip(row["calls"], waits))


def run_fsdp(p: dict[str, Any], shm: Path, log, errors: list[str], timeout: timedelta) -> list[dict[str, Any]] | None:
    """Start the two ranks, wait, and return their results (None if the job failed)."""
    workdir = Path(tempfile.mkdtemp(prefix="moc-hf-fsdp-"))
    procs: list[subprocess.Popen] = []
    try:
        (workdir / "params.json").write_text(json.dumps(p))
        procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--fsdp-worker", str(r),
                                   "--workdir", str(workdir), "--shm", str(shm)]) for r in range(WORLD)]
        deadline = time.monotonic() + timeout.total_seconds()
        failed = None
        while failed is None and any(pr.poll() is None for pr in procs):
            bad = [r for r, pr in enumerate(procs) if pr.poll() not in (None, 0)]
            if bad:
                failed = f"rank {bad[0]} exited with {procs[bad[0]].returncode}"
            elif time.monotonic() > deadline:
                failed = f"not finished within {timeout}"
            time.sleep(0.5)
        bad = [r for r, pr in enumerate(procs) if pr.poll() not in (None, 0)]
        if failed is None and bad:
            failed = f"rank {bad[0]} exited with {procs[bad[0]].returncode}"
        if failed is not None:
            errors.append(f"FSDP2 job: {failed}")
            log(f"  FSDP2 job failed: {failed}")
            return None
        return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    finally:
        for pr in procs:  # our own children only: a rank left waiting in a collective
            if pr.poll() is None:
                pr.kill()
            pr.wait()
        shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------------------
# checks and the report
def bytes_checks(single: dict[str, Any], fsdp: list[dict[str, Any]] | None, E: int) -> list[dict[str, Any]]:
    """MoC's bytes on disk per checkpoint vs the formula, one entry per distinct case."""
    P_ne, P_e, buf = single["P_ne"], single["P_e"], single["buffers"]
    out = []

    def add(label: str, K: int, measured: float) -> None:
        f = pec_bytes(P_ne, P_e, K, E, buf)
        ratio = measured / f
        out.append({"label": label, "K": K, "formula": f, "measured": measured, "ratio": ratio,
                    "holds": 1.0 - 1e-9 <= ratio <= 1.0 + FORMULA_TOLERANCE})

    first = next((r for r in single["rows"] if r.get("bytes_first")), None)
    if first is not None:
        add("first checkpoint of a run (always full), 1 process", E, first["bytes_first"])
    for r in single["rows"]:
        if "kp" in r and r["size"]:
            add(f"{r['name']}, 1 process", E if r["kp"] is None else r["kp"], r["size"])
    if fsdp:
        r0 = fsdp[0]["rows"]
        moc = next((r for r in r0 if r["name"].startswith("MoC") and r["size"]), None)
        if moc is not None:
            if moc.get("bytes_first"):
                add("first checkpoint of a run (always full), FSDP2 2 ranks", E, moc["bytes_first"])
            add(f"{moc['name']}, FSDP2 2 ranks (both ranks' objects)", E if moc["kp"] is None else moc["kp"],
                moc["size"])
    return out


def report(p: dict[str, Any], mach: dict[str, str], info: dict[str, Any], single: dict[str, Any],
           fsdp: list[dict[str, Any]] | None, checks: list[dict[str, Any]], quick: bool, errors: list[str]) -> str:
    rows = single["rows"]
    save = next((r for r in rows if r["name"].startswith("torch.save")), None)
    asyncs = [r for r in rows if r["name"].startswith("DCP")]
    best_async = min(asyncs, key=lambda r: r["stall"]) if asyncs else None
    k1 = [r for r in rows if r["name"].startswith("MoC K=1")]
    E, P_ne, P_e = p["experts"], single["P_ne"], single["P_e"]

    L: list[str] = []
    L.append("# MoC checkpoint overhead on a transformers Qwen3-MoE model" + (" (--quick smoke run)" if quick else ""))
    L.append("")
    L.append(f"Machine: {mach['cpu']}, {mach['cores']} cores, {mach['ram']} RAM, Python {mach['python']}, "
             f"torch {mach['torch']} (CPU; intra-op threads: {mach['threads']} in the 1-process part, 1 per FSDP2 "
             f"rank), transformers {info['transformers']}; {mach['date']}. "
             f"Load average (1, 5, 15 min) before / after the 1-process part / after the FSDP2 part: "
             f"{info['load_before']} / {info['load_mid']} / {info['load_after']}.")
    L.append("")
    base = QUICK if quick else FULL
    flags = (" --quick" if quick else "") + "".join(f" --{k.replace('_', '-')} {p[k]}"
                                                    for k in ("reps", "window", "fsdp_reps", "fsdp_window")
                                                    if p[k] != base[k]) + (" --profile" if p.get("profile") else "") \
        + (" --fsdp-only" if p.get("fsdp_only") else "") + (" --moc-only" if p.get("moc_only") else "") \
        + (f" --threads {p['threads']}" if p["threads"] != (1 if quick else info["default_threads"]) else "")
    L.append(f"Rerun: `python benchmarks/moc_hf/main.py{flags}` (whole run {info['wall']:.0f} s).")
    L.append("")
    layout = next((r["layout"] for r in rows + [x for f in fsdp or [] for x in f["rows"]] if "layout" in r), "?")
    L.append(f"Model: transformers `qwen3_moe` from a config (random init): {p['layers']} decoder layers, hidden "
             f"{p['dim']}, {p['heads']} heads ({p['kv_heads']} KV), vocab {p['vocab']}, {E} experts per layer "
             f"(moe_intermediate_size {p['moe_hidden']}), top-{p['top_k']}; fused experts "
             f"(`{single['expert_tensors'][0]}` ...), seen by moc as: {layout}. "
             f"P_e = {P_e/1e6:.2f} M expert + P_ne = {P_ne/1e6:.2f} M non-expert parameters "
             f"({100*P_e/(P_e+P_ne):.1f}% in experts), persistent buffers {single['buffers']} B; fp32 weights + Adam = "
             f"{single['state_bytes']/GB:.2f} GB of state."
             + (f" Training step ({p['tokens']} tokens, forward + backward + Adam): {single['step']:.2f} s in one "
                "process (median)." if rows else ""))
    L.append("")
    L.append(f"Method: {p['reps']} ABBA pairs of windows per method in one process ({p['window']} steps each), "
             f"{p['fsdp_reps']} pairs of {p['fsdp_window']} steps on the FSDP2 ranks; a checkpoint window takes one "
             "checkpoint right after its first step's `optimizer.step()` and waits at its end until the "
             "checkpoint's background work is complete; stall = sum over step positions of (median over pairs of "
             "the step time with - without) + median final wait. Shared code: `benchmarks/_ckpt_bench.py` "
             "(as `benchmarks/moc_overhead`).")
    L.append("")

    L.append("## Stall per checkpoint, one process")
    L.append("")
    if not rows:
        L.append("Not measured in this run (`--fsdp-only`).")
    else:
        L.append("| method | configuration | call returns (ms) | loop blocked (ms) | stall (ms) | "
                 "window mean +- s.e. (ms) | "
                 "% of torch.save | vs best async | checkpoint CPU (s) | on disk per checkpoint (MB) |")
        L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        pct = f"{100*r['stall']/save['stall']:.1f}%" if save and save["stall"] > 0 else "-"
        va = f"{r['stall']/best_async['stall']:.2f}x" if best_async and best_async["stall"] > 0 else "-"
        L.append(f"| {r['name']} | {r['note']} | {fmt_ms(r['call'])} | {fmt_ms(r['blocked'])} | "
                 f"{fmt_ms(r['stall'])} | {fmt_ms(r['stall_mean'])} +- {fmt_ms(r['stall_se'])} | {pct} | {va} | "
                 f"{r['cpu']:.2f} | {r['size']/MB:,.1f} |")
    L.append("")
    L.append("\"call returns\": time inside the checkpoint call. \"loop blocked\": the call plus the optimizer "
             "pre-hook waits (MoC: `status()['stall_seconds_total']`; DCP with DefaultStager: the wait for its "
             "staging copy). \"stall\": what the training loop really lost, contention of background threads "
             "with training on 2 cores included; negative values are noise. \"vs best async\": stall / the "
             f"smaller DCP stall ({best_async['name'] if best_async else '-'}). \"checkpoint CPU\": extra CPU time "
             "of the process in a checkpoint window vs a baseline window (medians).")
    L.append("")

    L.append(f"## FSDP2, {WORLD} ranks (gloo, one thread each)")
    L.append("")
    dcp_best = None
    if fsdp:
        per = {r["name"]: [f["rows"][i] for f in fsdp] for i, r in enumerate(fsdp[0]["rows"])}
        dcps = {n: v for n, v in per.items() if n.startswith("DCP")}
        if dcps:
            dcp_best = min(dcps, key=lambda n: max(x["stall"] for x in dcps[n]))
        L.append(f"Step ({p['tokens'] // WORLD} tokens per rank): "
                 + ", ".join(f"rank {f['rank']} {f['step']:.2f} s" for f in fsdp)
                 + " (median, no checkpoint). The ranks wait for each other in every all-gather and "
                 "reduce-scatter, so one rank's stall shows up in the other's step times too.")
        L.append("")
        L.append(f"| method | rank | call returns (ms) | last rank enters the call (ms later) | call after the last "
                 f"rank entered (ms) | loop blocked (ms) | stall (ms) | window mean +- s.e. (ms) | "
                 f"vs {dcp_best or 'DCP'} (same rank) | checkpoint CPU (s) | on disk per checkpoint, all ranks (MB) |")
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, rs in per.items():
            for i, r in enumerate(rs):
                ref = per[dcp_best][i]["stall"] if dcp_best else float("nan")
                va = f"{r['stall']/ref:.2f}x" if ref > 0 else "-"
                size = f"{fsdp[0]['rows'][list(per).index(name)]['size']/MB:,.1f}" if i == 0 else "\""
                wait = fmt_ms(r["arrival_wait"]) if "arrival_wait" in r else "-"
                own = fmt_ms(r["call_after_arrival"]) if r.get("syncs_ranks") and "call_after_arrival" in r else "-"
                L.append(f"| {name} | {i} | {fmt_ms(r['call'])} | {wait} | {own} | {fmt_ms(r['blocked'])} | "
                         f"{fmt_ms(r['stall'])} | {fmt_ms(r['stall_mean'])} +- {fmt_ms(r['stall_se'])} | {va} | "
                         f"{r['cpu']:.2f} | {size} |")
        L.append("")
        L.append("\"last rank enters the call\": how long after this rank the slower rank started the same "
                 "checkpoint (one clock for both processes). MoC's `step()` holds one all-reduce over the ranks, so "
                 "it spends that long waiting for the slower rank, time the faster rank would otherwise wait in "
                 "FSDP's next all-gather; \"call after the last rank entered\" is the rest, MoC's own cost. DCP's "
                 "call holds no collective (its planning runs in its background thread).")
        L.append("")
        L.append("DCP rows: `async_save(get_state_dict(model, optimizer))`, sharded DTensors, each rank writing its "
                 "shards, on a gloo group of its own. MoC: `CheckpointManager` on the same model, default "
                 "`snapshot_copies=2` (each rank's snapshot share is also copied into the other rank's memory).")
    else:
        L.append("Not measured in this run (see the notes below).")
    L.append("")

    L.append("## MoC checkpoint bytes vs the DESIGN.md formula")
    L.append("")
    L.append("`(P_ne + P_e*K/E) * (B_w + B_o)` + persistent buffers, B_w = 4 (fp32 weights), B_o = 8 (Adam exp_avg + "
             "exp_avg_sq). Measured: bytes of the step's data objects in the store. Holds when measured / formula is "
             f"in [1, {1 + FORMULA_TOLERANCE}] (Adam's per-parameter `step` scalars, 16-byte alignment and the "
             "extra state (RNG, step) make the small remainder).")
    L.append("")
    L.append("| checkpoint | K (persisted experts / layer) | formula (MB) | measured (MB) | measured / formula "
             "| holds |")
    L.append("|---|---:|---:|---:|---:|---|")
    for c in checks:
        L.append(f"| {c['label']} | {c['K']} | {c['formula']/MB:,.2f} | {c['measured']/MB:,.2f} | {c['ratio']:.4f} | "
                 f"{'yes' if c['holds'] else 'NO'} |")
    full = [r for r in rows if r.get("kp", 0) is None and r["size"]]
    one = [r for r in rows if r.get("kp") == 1 and r["size"]]
    if full and one:
        L.append("")
        L.append(f"K=1 persists {one[0]['size']/full[0]['size']*100:.1f}% of a full checkpoint's bytes (formula: "
                 f"{100*(P_ne + P_e/E)/(P_ne + P_e):.1f}%). Shared-memory snapshot buffers (three) at the end: "
                 + ", ".join(f"{r['name']}: {r['buffer_bytes']/MB:,.0f} MB" for r in rows if "buffer_bytes" in r) + ".")
    L.append("")

    L.append("## Targets")
    L.append("")
    L.append("| target | measured | met? |")
    L.append("|---|---|---|")
    L.extend(stall_target_rows(save, k1, best_async))
    if fsdp and dcp_best:
        for f in fsdp:
            moc = next(r for r in f["rows"] if r["name"].startswith("MoC"))
            ref = next(r for r in f["rows"] if r["name"] == dcp_best)
            lim = 0.5 * ref["stall"]
            L.append(f"| FSDP2 rank {f['rank']}: {moc['name']} stall <= half of {dcp_best} ({fmt_ms(ref['stall'])} ms) "
                     f"| {fmt_ms(moc['stall'])} ms (window mean {fmt_ms(moc['stall_mean'])} +- "
                     f"{fmt_ms(moc['stall_se'])} ms); loop blocked {fmt_ms(moc['blocked'])} ms | "
                     f"{verdict(moc['stall'], lim, moc['stall_se'])} |")
        stager = next((r for r in fsdp[0]["rows"] if "DefaultStager" in r["name"]), None)
        for f in fsdp if stager is not None else []:
            moc = next(r for r in f["rows"] if r["name"].startswith("MoC"))
            ref = next(r for r in f["rows"] if r["name"] == stager["name"])
            after = moc.get("call_after_arrival")
            L.append(f"| FSDP2 rank {f['rank']}: {moc['name']} loop blocked <= half of {ref['name']}'s "
                     f"({fmt_ms(ref['blocked'])} ms) | {fmt_ms(moc['blocked'])} ms, of which "
                     f"{fmt_ms(moc.get('arrival_wait', float('nan')))} ms waiting for the other rank to arrive "
                     f"({fmt_ms(after) if after is not None else '-'} ms after it did) | "
                     f"{'yes' if moc['blocked'] <= 0.5 * ref['blocked'] else 'no'} (after the arrival: "
                     f"{'yes' if after is not None and after <= 0.5 * ref['blocked'] else 'no'}) |")
    L.append(f"| MoC bytes per checkpoint match the PEC formula | {sum(c['holds'] for c in checks)} of {len(checks)} "
             f"cases | {'yes' if checks and all(c['holds'] for c in checks) else 'no'} |")
    L.append("")

    profiles = [(f"{name}, 1 process", prof) for name, prof in single.get("profile", {}).items()]
    for f in fsdp or []:
        profiles += [(f"{name}, FSDP2 rank {f['rank']}", prof) for name, prof in f.get("profile", {}).items()]
    if profiles:
        L.append("## Where MoC K=1's checkpoint call spends its time (cProfile, `--profile`)")
        L.append("")
        for name, prof in profiles:
            L.append(f"{name}: mean over {prof['calls']} `CheckpointManager.step()` calls taken after the measured "
                     "windows, each after a training step (cProfile overhead included, so larger than the "
                     "unprofiled \"call returns\").")
            L.append("")
            if prof.get("parts"):
                L.append("| part of `step()` | ms per checkpoint | calls per checkpoint |")
                L.append("|---|---:|---:|")
                for t in prof["parts"]:
                    L.append(f"| {t['part']} | {t['ms']:.2f} | {t['calls']:.0f} |")
                L.append("")
            L.append("| function (nested: cumulative includes callees) | calls per checkpoint | cumulative (ms) "
                     "| own (ms) |")
            L.append("|---|---:|---:|---:|")
            for t in prof["top"]:
                L.append(f"| `{t['func']}` | {t['ncalls'] / max(1, prof['calls']):.0f} | {t['cum']*1e3:.2f} | "
                         f"{t['own']*1e3:.2f} |")
            L.append("")

    L.append("## Reading the numbers")
    L.append("")
    L.append("- \"loop blocked\" is exact (timers around the call and the pre-hook); \"stall\" also catches what "
             "background threads take from training on 2 cores, but carries the noise of whole windows of steps "
             "on a shared VM. A stall within about two standard errors of zero (or negative) is below what this "
             "run can resolve; the load averages in the header say how busy the machine was.")
    L.append("- Sizes are exact and do not depend on the machine.")
    L.append("- FSDP2 on gloo/CPU spends most of a step in all-gathers and reduce-scatters; a checkpoint's "
             "background copies and writes compete with them for the same two cores.")
    L.append("")
    L.extend(report_footer(errors, "benchmarks/moc_hf/stall.png"))
    return "\n".join(L)


def plot(single: dict[str, Any], fsdp: list[dict[str, Any]] | None, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.6, 1]})
    a, b = axes
    rows = single["rows"]
    names = [r["name"] for r in rows]
    stall = [max(r["stall"], 0) * 1e3 for r in rows]
    err = [r["stall_se"] * 1e3 if math.isfinite(r["stall_se"]) else 0 for r in rows]
    y = list(range(len(rows)))
    a.barh(y, stall, xerr=err, color=["#1f77b4" if n.startswith("MoC") else "#888888" for n in names], capsize=3)
    a.scatter([r["blocked"] * 1e3 for r in rows], y, marker="|", s=200, color="k", zorder=3,
              label="loop blocked (call + pre-hook waits)")
    a.set_yticks(y, names)
    a.invert_yaxis()
    for i, s in enumerate(stall):
        a.text(s, i, f" {s:,.0f}", va="center", fontsize=8)
    a.set_xlabel("stall per checkpoint (ms)")
    a.set_title("Qwen3-MoE, 1 process (mean +- s.e.)")
    a.legend(loc="lower right", fontsize=8)
    if fsdp:
        names = [r["name"] for r in fsdp[0]["rows"]]
        width = 0.8 / len(fsdp)
        for k, f in enumerate(fsdp):
            vals = [max(r["stall"], 0) * 1e3 for r in f["rows"]]
            errs = [r["stall_se"] * 1e3 if math.isfinite(r["stall_se"]) else 0 for r in f["rows"]]
            pos = [i + (k - (len(fsdp) - 1) / 2) * width for i in range(len(names))]
            b.barh(pos, vals, height=width, xerr=errs, capsize=2, label=f"rank {f['rank']}",
                   color=["#1f77b4", "#6baed6"][k % 2])
            b.scatter([r["blocked"] * 1e3 for r in f["rows"]], pos, marker="|", s=120, color="k", zorder=3,
                      label="loop blocked" if k == 0 else None)
            for yy, v in zip(pos, vals):
                b.text(v, yy, f" {v:,.0f}", va="center", fontsize=8)
        b.set_yticks(list(range(len(names))), names)
        b.invert_yaxis()
        b.legend(loc="lower right", fontsize=8)
    else:
        b.text(0.5, 0.5, "FSDP2 job not measured", ha="center", va="center", transform=b.transAxes)
    b.set_xlabel("stall per checkpoint (ms)")
    b.set_title(f"FSDP2, {WORLD} ranks (gloo; mean +- s.e.)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, few windows (< 2 min)")
    ap.add_argument("--reps", type=int, help="checkpoint/baseline window pairs per method, one process")
    ap.add_argument("--window", type=int, help="training steps per window, one process")
    ap.add_argument("--fsdp-reps", type=int, help="window pairs per method on the FSDP2 ranks")
    ap.add_argument("--fsdp-window", type=int, help="training steps per window on the FSDP2 ranks")
    ap.add_argument("--no-fsdp", action="store_true", help="skip the 2-rank FSDP2 job")
    ap.add_argument("--fsdp-only", action="store_true", help="only the 2-rank FSDP2 job (no 1-process part)")
    ap.add_argument("--moc-only", action="store_true", help="only the MoC rows (no torch.save / DCP baselines)")
    ap.add_argument("--threads", type=int, help="intra-op threads of the 1-process part (default: torch's, "
                    "1 with --quick); FSDP2 ranks always use 1")
    ap.add_argument("--profile", action="store_true", help="cProfile MoC K=1's CheckpointManager.step() calls")
    ap.add_argument("--out", type=Path, default=HERE, help="where results.md, results.json and stall.png go")
    ap.add_argument("--fsdp-worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--shm", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--render", type=Path, metavar="RESULTS_JSON",
                    help="measure nothing: rewrite results.md and stall.png under --out from a results.json")
    args = ap.parse_args(argv)
    if args.fsdp_worker is not None:
        return fsdp_worker(args.fsdp_worker, args.workdir, args.shm)
    if args.render is not None:
        data = json.loads(args.render.read_text())
        print(write_outputs(data, args.out))
        return 0
    p = dict(QUICK if args.quick else FULL)
    for k in ("reps", "window", "fsdp_reps", "fsdp_window"):
        v = getattr(args, k)
        if v is not None:
            if v < 1:
                raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {v}")
            p[k] = v

    if args.fsdp_only and args.no_fsdp:
        raise ValueError("--fsdp-only and --no-fsdp exclude each other")
    p["profile"] = bool(args.profile)
    p["moc_only"] = bool(args.moc_only)
    p["fsdp_only"] = bool(args.fsdp_only)
    default_threads = torch.get_num_threads()
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    elif args.quick:
        # A smoke run must finish on a loaded machine: one intra-op thread avoids OpenMP
        # oversubscription (2 threads on 2 busy cores make tiny steps 10-100x slower).
        torch.set_num_threads(1)
    p["threads"] = torch.get_num_threads()
    # SIGTERM (a timeout, a CI cancel) unwinds like an exception, so the temp folders in
    # /tmp and /dev/shm are removed and the FSDP2 ranks are killed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    import transformers

    t_start = time.perf_counter()
    mach = machine()
    load_before = loadavg()
    log = lambda s: print(s, flush=True)  # noqa: E731
    root = Path(tempfile.mkdtemp(prefix="moc-hf-"))
    shm = Path(tempfile.mkdtemp(prefix="moc-hf-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    errors: list[str] = []
    dist.init_process_group("gloo", store=dist.FileStore(str(root / "pg-store"), 1), rank=0, world_size=1)
    try:
        if args.fsdp_only:
            single = model_info(p)
            errors.append("1-process part skipped (--fsdp-only)")
        else:
            log(f"one process; load {load_before}; temp {root}, {shm}")
            single = run_single(p, root, shm, log, errors, quick=args.quick, profile=args.profile)
        if not args.quick and single["state_bytes"] < 1e9:
            raise RuntimeError(f"the full model must hold >= 1 GB of state, has {single['state_bytes']/GB:.2f} GB")
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    gc.collect()
    load_mid = loadavg()
    fsdp = None
    try:
        if not args.no_fsdp:
            log(f"FSDP2, {WORLD} processes; load {load_mid}")
            fsdp = run_fsdp(p, shm, log, errors, timedelta(minutes=10 if args.quick else 90))
        else:
            errors.append("FSDP2 job skipped (--no-fsdp)")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    info = {"load_before": load_before, "load_mid": load_mid, "load_after": loadavg(),
            "wall": time.perf_counter() - t_start, "transformers": transformers.__version__,
            "default_threads": default_threads}
    data = {"params": p, "quick": bool(args.quick), "machine": mach, "info": info, "experts": p["experts"],
            "single": single, "fsdp": fsdp, "errors": errors}
    print()
    print(write_outputs(data, args.out))
    return 0


def write_outputs(data: dict[str, Any], out: Path) -> str:
    """results.md, results.json and stall.png under ``out`` from one run's data."""
    data["bytes_checks"] = bytes_checks(data["single"], data["fsdp"], data["experts"])
    text = report(data["params"], data["machine"], data["info"], data["single"], data["fsdp"], data["bytes_checks"],
                  data["quick"], data["errors"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(data, indent=1))
    plot(data["single"], data["fsdp"], out / "stall.png")
    return text


if __name__ == "__main__":
    raise SystemExit(main())
