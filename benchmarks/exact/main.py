"""Exact mode (``MoCConfig(exact=True)``) vs full checkpoints every step vs PEC K=1 every 50 steps.

    python benchmarks/exact/main.py            # the >= 1 GB Qwen3-MoE of benchmarks/moc_hf, W = 8 (~10 min)
    python benchmarks/exact/main.py --quick    # small model, W = 8 (~2 min)
    python benchmarks/exact/main.py --render benchmarks/exact/results.json   # table and plot again

(``make bench-exact``, ``QUICK=1 make bench-exact``.) Writes ``results.md``, ``results.json``
and ``exact.png`` beside this file (or under ``--out``). Everything is measured in one
process, on one model, in one run:

* **Model.** ``benchmarks/moc_hf``'s builder (``HFTrainer``): a transformers 5.x
  ``qwen3_moe`` from a config, fused experts, fp32 + Adam >= 1 GB (``--quick``: the small
  one), one fixed batch per step (a function of the step, as replay needs).
* **Methods**, each a ``CheckpointManager`` on the same model, ``interval=1``:
  exact mode (``k_snapshot`` = E / 8, so W = 8; every window persisted); full checkpoints
  every step (``k_snapshot=None``: every expert's full state snapshotted each step,
  persisted every W-th step, the same durability as exact's windows); PEC K=1 every 50
  steps (``k_snapshot=k_persist=1``: its checkpoints are taken at ``interval=1`` for the
  measurement and their costs divided by 50).
* **Stall per step**: "loop blocked" is what the training loop waits for, the time inside
  ``step()`` plus the optimizer pre-hook's wait for the previous copy
  (``status()``'s stall counters). "Step time +" is the median step time with the method
  minus the median of the baseline blocks (no checkpoint) run before and after every
  method: it adds what the background copies and writes take from training on the two
  shared cores (on a GPU the copies are DMA; here they are CPU memcpy).
* **Bytes per step**: exact: ``status()["exact"]["last_window"]["step_bytes"]`` (bytes
  copied at each step of a window) and the formula of ``docs/exact.md`` from the tensors'
  sizes; full: the snapshot of every unit (its checkpoint on disk); PEC: its checkpoint on
  disk / 50.
* **Recovery**: a crash mid-window (``close(keep_snapshots=True, flush=False)`` after the
  window's last step + 3, the model re-initialised and a new optimizer, as a restarted
  process has), then a new manager: exact = ``restore()`` + the replay of the window's
  W - 1 remaining steps, from memory and (shared memory deleted) from storage; the state
  after the replay is compared ``torch.equal`` with the one saved when the window ended.
  Full = ``restore()`` of the full checkpoint of the same step (memory, storage).
* **Tokens lost**: exact: ``plt()`` after the replay (0). PEC K=1 every 50 steps: moc's PLT
  accounting (``moc._plt.PLTTracker``) over the schedule of sequential K=1 checkpoints,
  fed with the routing counts this run measured on the model, a failure after one cycle of
  E checkpoints; not trained (E x 50 steps of this model would take an hour).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from benchmarks._ckpt_bench import GB, MB, dir_bytes, fmt_ms, loadavg, machine  # noqa: E402
from benchmarks.moc_hf.main import FULL as HF_FULL, QUICK as HF_QUICK, HFTrainer  # noqa: E402
from moc import CheckpointManager, MoCConfig  # noqa: E402
from moc._plt import PLTTracker  # noqa: E402

W_TARGET = 8                         # the window
PEC_INTERVAL = 50                    # PEC K=1 every 50 steps
# warm_windows=3: each of the three shared-memory buffers is first used (its pages
# allocated: posix_fallocate in the window's first step()) before the measured windows
FULL = dict(HF_FULL, k_snapshot=HF_FULL["experts"] // W_TARGET, warm_windows=3, windows=2)
# --quick: small enough for a couple of minutes, big enough that a step is not all overhead
QUICK = dict(HF_QUICK, dim=256, experts=16, moe_hidden=256, tokens=512, seq=256, warm_windows=3, windows=2)
QUICK["k_snapshot"] = QUICK["experts"] // W_TARGET
CRASH_AFTER = 3                      # steps into the next window when the process "dies"


# --------------------------------------------------------------------------------------
# training steps, timed
def one_step(tr: HFTrainer, ckpt: CheckpointManager | None) -> tuple[float, float]:
    """Forward + backward + ``optimizer.step()`` (+ ``ckpt.step``): (step seconds, call seconds)."""
    t0 = time.perf_counter()
    tr.opt.zero_grad(set_to_none=False)
    loss = tr.model(input_ids=tr.ids, labels=tr.ids).loss
    loss.backward()
    tr.opt.step()
    tr.step_no += 1
    c0 = time.perf_counter()
    if ckpt is not None:
        ckpt.step(tr.step_no)
    t1 = time.perf_counter()
    return t1 - t0, t1 - c0


def block(tr: HFTrainer, n: int, ckpt: CheckpointManager | None = None) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"step": [], "call": []}
    for _ in range(n):
        s, c = one_step(tr, ckpt)
        out["step"].append(s)
        out["call"].append(c)
    return out


def stall_total(ckpt: CheckpointManager) -> float:
    st = ckpt.status()
    return st["exact"]["stall_seconds_total"] if st["exact"] else st["stall_seconds_total"]


def snapshot_state(tr: HFTrainer) -> dict[str, Any]:
    return {"model": {k: v.detach().clone() for k, v in tr.model.state_dict().items()},
            "optim": {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                      for i, st in enumerate(tr.opt.state[p] for p in tr.model.parameters())}}


def equal_state(tr: HFTrainer, ref: dict[str, Any]) -> tuple[bool, str]:
    """torch.equal of every weight and every Adam tensor against ``ref``; the first difference."""
    for k, v in tr.model.state_dict().items():
        if not torch.equal(v, ref["model"][k]):
            return False, f"weights {k}"
    for i, p in enumerate(tr.model.parameters()):
        got, want = tr.opt.state[p], ref["optim"][i]
        if set(got) != set(want):
            return False, f"Adam state keys of parameter {i}"
        for k, v in want.items():
            if not (torch.equal(got[k], v) if torch.is_tensor(v) else got[k] == v):
                return False, f"Adam {k} of parameter {i}"
    return True, ""


def restart(tr: HFTrainer) -> None:
    """What a restarted process has: freshly initialised weights and a new optimizer."""
    with torch.no_grad():
        for q in tr.model.parameters():
            q.normal_(0.0, 0.02)
    tr.opt = torch.optim.Adam(tr.model.parameters(), lr=1e-4)


# --------------------------------------------------------------------------------------
# the methods
def make_cfg(kind: str, p: dict[str, Any], root: Path, shm: Path, window: int) -> MoCConfig:
    common = dict(storage=str(root / kind), snapshot_dir=str(shm / kind), interval=1, top_k=p["top_k"],
                  keep_last=2, dynamic_k=False)
    if kind == "exact":
        return MoCConfig(k_snapshot=p["k_snapshot"], exact=True, persist_every=1, **common)
    if kind == "full":
        return MoCConfig(k_snapshot=None, persist_every=window, **common)
    return MoCConfig(k_snapshot=1, k_persist=1, persist_every=1, **common)


def measured(tr: HFTrainer, ckpt: CheckpointManager, n: int) -> dict[str, Any]:
    s0 = stall_total(ckpt)
    b = block(tr, n, ckpt)
    waits = stall_total(ckpt) - s0
    return {"steps": b["step"], "calls": b["call"], "blocked": statistics.mean(b["call"]) + waits / n,
            "call": statistics.mean(b["call"]), "prehook_wait": waits / n}


def recover(tr: HFTrainer, cfg: MoCConfig, source: str, ref: dict[str, Any], end: int, log) -> dict[str, Any]:
    """A restarted process: new weights and optimizer, a new manager, ``restore()`` (+ the
    replay of the window in exact mode up to ``end``); the state compared with ``ref``."""
    restart(tr)
    if source == "storage":
        shutil.rmtree(cfg.snapshot_dir, ignore_errors=True)   # the node's memory is gone
    t0 = time.perf_counter()
    ckpt = CheckpointManager(cfg, model=tr.model, optimizer=tr.opt)
    t1 = time.perf_counter()
    start = ckpt.restore()
    t2 = time.perf_counter()
    tr.step_no = start - 1
    replay = block(tr, end - start + 1, ckpt) if cfg.exact else {"step": []}
    t3 = time.perf_counter()
    ok, diff = equal_state(tr, ref)
    st = ckpt.status()
    out = {"source": source, "open": t1 - t0, "restore": t2 - t1, "replay": t3 - t2, "replay_steps": replay["step"],
           "start": start, "end": tr.step_no, "identical": ok, "difference": diff, "plt": ckpt.plt(),
           "replayed": (st["exact"] or {}).get("replayed_steps", 0)}
    ckpt.close(keep_snapshots=False, flush=False, raise_errors=False)
    log(f"  recovery from {source}: restore {out['restore']:.2f} s + replay {out['replay']:.2f} s "
        f"({len(replay['step'])} steps), {'identical' if ok else 'DIFFERENT: ' + diff}; load {loadavg()}")
    return out


def run_exact(tr: HFTrainer, p: dict[str, Any], root: Path, shm: Path, log) -> dict[str, Any]:
    cfg = make_cfg("exact", p, root, shm, 0)
    ckpt = CheckpointManager(cfg, model=tr.model, optimizer=tr.opt)
    sched = ckpt.exact.schedule()
    w = sched.window
    warm = block(tr, w * p["warm_windows"], ckpt)            # buffers' first use, first persist
    m = measured(tr, ckpt, w * p["windows"])
    end = tr.step_no                                          # a window ended here
    ref = snapshot_state(tr)
    ckpt.wait(flush=False)                                    # its persist done: storage has it too
    st = ckpt.status()["exact"]
    lw = st["last_window"]
    assert lw["end"] == end, (lw, end)
    full, weights = ckpt.exact._sizes()
    f_bytes = {u: q.nbytes for u, q in full.items()}
    w_bytes = {u: q.nbytes for u, q in weights.items()}
    formula = sched.step_bytes(f_bytes, w_bytes)
    persisted = dir_bytes(Path(cfg.storage) / "data" / f"{end:012d}")
    block(tr, CRASH_AFTER, ckpt)                              # mid-window ...
    ckpt.close(keep_snapshots=True, flush=False, raise_errors=False)   # ... the process dies
    log(f"  exact: W {w}, blocked {m['blocked']*1e3:.1f} ms/step, "
        f"bytes/step mean {statistics.mean(lw['step_bytes'])/MB:.1f} MB")
    rec = [recover(tr, cfg, src, ref, end, log) for src in ("memory", "storage")]
    shutil.rmtree(root / "exact", ignore_errors=True)
    return {"window": w, "k_snapshot": p["k_snapshot"], **m, "step_bytes": lw["step_bytes"],
            "window_bytes": lw["bytes"], "formula_step_bytes": formula, "state_bytes_units": sum(f_bytes.values()),
            "weights_bytes_units": sum(w_bytes.values()), "persisted_window": persisted,
            "windows_complete": st["windows_complete"], "windows_skipped": st["windows_skipped"],
            "windows_persisted": st["windows_persisted"], "recovery": rec, "warm_calls": warm["call"]}


def run_full(tr: HFTrainer, p: dict[str, Any], root: Path, shm: Path, window: int, log) -> dict[str, Any]:
    cfg = make_cfg("full", p, root, shm, window)
    ckpt = CheckpointManager(cfg, model=tr.model, optimizer=tr.opt)
    warm = block(tr, window * p["warm_windows"], ckpt)
    m = measured(tr, ckpt, window * p["windows"])
    end = tr.step_no
    ckpt.wait()                                               # the newest snapshot persisted too
    st = ckpt.status()
    ref = snapshot_state(tr)
    size = dir_bytes(Path(cfg.storage) / "data" / f"{end:012d}")
    ckpt.close(keep_snapshots=True, flush=False, raise_errors=False)
    log(f"  full every step: blocked {m['blocked']*1e3:.1f} ms/step, {size/MB:.1f} MB per checkpoint, "
        f"snapshots skipped {st['snapshots_skipped']}")
    rec = [recover(tr, cfg, src, ref, end, log) for src in ("memory", "storage")]
    shutil.rmtree(root / "full", ignore_errors=True)
    return {**m, "size": size, "snapshots_skipped": st["snapshots_skipped"], "persists_skipped": st["persists_skipped"],
            "recovery": rec, "warm_calls": warm["call"]}


def run_pec(tr: HFTrainer, p: dict[str, Any], root: Path, shm: Path, window: int, log) -> dict[str, Any]:
    cfg = make_cfg("pec", p, root, shm, window)
    ckpt = CheckpointManager(cfg, model=tr.model, optimizer=tr.opt)
    block(tr, 3, ckpt)                                        # the first (full) checkpoint and buffers
    ckpt.wait()
    m = measured(tr, ckpt, window)
    ckpt.wait()
    # the routing its router hooks counted (exact mode books no PLT, so it does not count)
    routing = {layer: list(c) for layer, c in ckpt.policy.tracker.cum.items()}
    routed_steps = 3 + window
    size = dir_bytes(Path(cfg.storage) / "data" / f"{tr.step_no:012d}")
    ckpt.close(flush=False, raise_errors=False)
    shutil.rmtree(root / "pec", ignore_errors=True)
    log(f"  PEC K=1: blocked {m['blocked']*1e3:.1f} ms per checkpoint, {size/MB:.1f} MB per checkpoint")
    return {**m, "size": size, "routing": routing, "routed_steps": routed_steps}


def pec_plt(routing: dict[str, list[int]], steps_seen: int, top_k: int, tokens: int,
            interval: int = PEC_INTERVAL) -> dict[str, Any]:
    """moc's PLT accounting for sequential PEC K=1 every ``interval`` steps (the first
    checkpoint full), per-step routing as measured, one failure after one cycle of E
    checkpoints: the newest checkpoint is restored, each expert from its own version."""
    experts = {layer: len(c) for layer, c in routing.items()}
    e = max(experts.values())
    tr = PLTTracker(experts, top_k)
    per_step = {layer: [c / steps_seen for c in counts] for layer, counts in routing.items()}
    acc = {layer: [0.0] * n for layer, n in experts.items()}
    n_ckpt = 0
    fail = interval * (e + 1)
    for step in range(fail + 1):
        for layer, row in per_step.items():        # integer counts, fractions carried over
            ints = []
            for i, x in enumerate(row):
                acc[layer][i] += x
                ints.append(int(acc[layer][i]))
                acc[layer][i] -= ints[-1]
            tr.record(layer, ints)
        tr.add_tokens(tokens)
        if step % interval == 0:
            for layer, n in experts.items():
                chosen = range(n) if n_ckpt == 0 else [(n_ckpt - 1) % n]
                tr.mark_saved("persist", layer, chosen)
            n_ckpt += 1
    # the failure comes right after the last checkpoint (step ``fail``): everything else
    # resumes from it, each expert from the version it was last saved at
    for layer in experts:
        tr.book_loss("persist", layer, sum(tr.unsaved("persist", layer)))
    lost = tr.lost_tokens() / len(experts) / top_k
    return {"interval": interval, "fail_step": fail, "plt": tr.value(), "lost_tokens_per_layer": lost,
            "lost_steps": lost / tokens}


# --------------------------------------------------------------------------------------
def run(p: dict[str, Any], out: Path, log) -> dict[str, Any]:
    t_all = time.perf_counter()
    load0 = loadavg()
    torch.set_num_threads(p.get("threads") or torch.get_num_threads())
    # Bit-identical replay needs deterministic kernels: with 2 intra-op threads this model's
    # backward (fused experts) gives other float sums on every run, and the replay's check
    # of the window's second step would stop the recovery ("replay diverged").
    torch.use_deterministic_algorithms(True)
    tr = HFTrainer(p)
    state = (tr.P_ne + tr.P_e) * 12
    block(tr, 2)
    log(f"model: {tr.P_e/1e6:.1f} M expert + {tr.P_ne/1e6:.2f} M other params, state {state/GB:.2f} GB; "
        f"load {loadavg()}")
    base: list[float] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-exact-"))
    shm = Path(tempfile.mkdtemp(prefix="bench-exact-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        root = tmp / "ckpt"
        w = W_TARGET
        base += block(tr, w)["step"]
        log(f"baseline: step {statistics.median(base):.2f} s")
        exact = run_exact(tr, p, root, shm, log)
        w = exact["window"]
        tr.opt = torch.optim.Adam(tr.model.parameters(), lr=1e-4)
        base += block(tr, w)["step"]
        full = run_full(tr, p, root, shm, w, log)
        base += block(tr, w)["step"]
        pec = run_pec(tr, p, root, shm, w, log)
        base += block(tr, w)["step"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    plt_pec = pec_plt(pec.pop("routing"), pec.pop("routed_steps"), p["top_k"], int(tr.ids.numel()))
    return {"params": p, "machine": machine(), "load_before": load0, "load_after": loadavg(),
            "seconds": time.perf_counter() - t_all, "model": {"P_e": tr.P_e, "P_ne": tr.P_ne, "state_bytes": state,
                                                               "tokens_per_step": int(tr.ids.numel())},
            "baseline_steps": base, "step": statistics.median(base), "exact": exact, "full": full, "pec": pec,
            "pec_plt": plt_pec}


# --------------------------------------------------------------------------------------
# report
def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summary(r: dict[str, Any]) -> dict[str, Any]:
    """The figures of the table and the targets, from a results dict."""
    step, ex, fu, pe = r["step"], r["exact"], r["full"], r["pec"]
    w = ex["window"]
    full_bytes = fu["size"]
    rec = {x["source"]: x for x in ex["recovery"]}
    frec = {x["source"]: x for x in fu["recovery"]}
    s = {
        "step": step, "window": w, "full_bytes": full_bytes,
        "exact_blocked": ex["blocked"], "full_blocked": fu["blocked"], "pec_blocked": pe["blocked"] / PEC_INTERVAL,
        "exact_plus": _med(ex["steps"]) - step, "full_plus": _med(fu["steps"]) - step,
        "pec_plus": (_med(pe["steps"]) - step) / PEC_INTERVAL,
        "exact_bytes": statistics.mean(ex["step_bytes"]), "exact_bytes_max": max(ex["step_bytes"]),
        "exact_bytes_min": min(ex["step_bytes"]), "pec_bytes": pe["size"] / PEC_INTERVAL,
        "formula_gap": [m - f for m, f in zip(ex["step_bytes"], ex["formula_step_bytes"])],
    }
    # the "W steps" of the recovery target: the replayed steps' own median (they ran under the
    # same outside load as the restores; the baseline blocks ran minutes apart)
    s["replay_step"] = _med([x for e in ex["recovery"] for x in e["replay_steps"]])
    for src in ("memory", "storage"):
        e, f = rec[src], frec[src]
        s[f"exact_recovery_{src}"] = e["restore"] + e["replay"]
        s[f"full_recovery_{src}"] = f["restore"]
        s[f"limit_{src}"] = f["restore"] + w * s["replay_step"]
    base = r["baseline_steps"]
    s["baseline_spread"] = max(base) / max(1e-9, min(base))
    s["identical"] = all(x["identical"] for x in ex["recovery"] + fu["recovery"])
    s["plt_exact"] = max(x["plt"] for x in ex["recovery"])
    return s


def targets(s: dict[str, Any]) -> list[tuple[str, str, str]]:
    step, w = s["step"], s["window"]
    rows = [
        (f"stall per step <= 2% of a step ({fmt_ms(0.02 * step)} ms): loop blocked",
         f"{fmt_ms(s['exact_blocked'])} ms = {100 * s['exact_blocked'] / step:.2f}%",
         "yes" if s["exact_blocked"] <= 0.02 * step else "no"),
        ("the same with the background copies' contention (step time +, CPU)",
         f"{fmt_ms(s['exact_plus'])} ms = {100 * s['exact_plus'] / step:.1f}%",
         f"not measurable: baseline steps differ {s['baseline_spread']:.1f}x (outside load)"
         if s["baseline_spread"] > 1.5 else "yes" if s["exact_plus"] <= 0.02 * step else "no"),
        (f"bytes per step <= 1/3 of a full checkpoint at W = {w}",
         f"{s['exact_bytes']/MB:,.1f} MB = {s['exact_bytes'] / s['full_bytes']:.3f} of {s['full_bytes']/MB:,.1f} MB",
         "yes" if s["exact_bytes"] <= s["full_bytes"] / 3 else "no"),
    ]
    for src in ("memory", "storage"):
        rows.append((f"recovery <= full restore + W steps ({s['replay_step']:.2f} s each), from {src}",
                     f"{s[f'exact_recovery_{src}']:.2f} s vs {s[f'limit_{src}']:.2f} s "
                     f"(ratio {s[f'exact_recovery_{src}'] / s[f'limit_{src}']:.2f})",
                     "yes" if s[f"exact_recovery_{src}"] <= s[f"limit_{src}"] else "no"))
    rows.append(("state after recovery torch.equal to the uninterrupted run's; exact PLT 0",
                 f"{'all identical' if s['identical'] else 'DIFFERENT'}; PLT {s['plt_exact']}",
                 "yes" if s["identical"] and s["plt_exact"] == 0 else "no"))
    return rows


def render(r: dict[str, Any], quick: bool) -> str:
    s = summary(r)
    p, mi, ex, fu, pe, pp = r["params"], r["machine"], r["exact"], r["full"], r["pec"], r["pec_plt"]
    step, w = s["step"], s["window"]
    rec = {x["source"]: x for x in ex["recovery"]}
    frec = {x["source"]: x for x in fu["recovery"]}
    L = ["# Exact mode vs full checkpoints every step vs PEC K=1 every 50 steps", ""]
    L.append(f"Machine: {mi['cpu']}, {mi['cores']} cores, {mi['ram']} RAM, Python {mi['python']}, torch {mi['torch']} "
             f"(CPU, {mi['threads']} intra-op threads); {mi['date']}. Shared with other jobs: load average (1, 5, 15 "
             f"min) {r['load_before']} before, {r['load_after']} after; whole run {r['seconds']:.0f} s.")
    L.append("")
    L.append(f"Rerun: `{'QUICK=1 ' if quick else ''}make bench-exact` (or `python benchmarks/exact/main.py"
             f"{' --quick' if quick else ''}`); `--render results.json` redraws this page and the plot.")
    L.append("")
    mo = r["model"]
    L.append(f"Model: `benchmarks/moc_hf`'s transformers `qwen3_moe` ({p['layers']} layers, hidden {p['dim']}, "
             f"{p['experts']} experts per layer, top-{p['top_k']}, {mo['tokens_per_step']} tokens per step): "
             f"{mo['P_e']/1e6:.1f} M expert + {mo['P_ne']/1e6:.2f} M other parameters, {mo['state_bytes']/GB:.2f} GB "
             f"of fp32 weights + Adam. Step (forward + backward + Adam, no checkpoint, median of "
             f"{len(r['baseline_steps'])} baseline steps around the methods): {step:.2f} s. Exact mode: "
             f"`k_snapshot={ex['k_snapshot']}`, W = {w}.")
    L.append("")
    L.append("| method | loop blocked per step (ms) | step time + per step (ms) | bytes per step (MB) | "
             "persisted (MB) | recovery from memory (s) | recovery from storage (s) | tokens lost per failure |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---|")
    L.append(f"| exact mode, W = {w} | {fmt_ms(s['exact_blocked'])} | {fmt_ms(s['exact_plus'])} | "
             f"{s['exact_bytes']/MB:,.1f} (min {s['exact_bytes_min']/MB:,.1f}, max {s['exact_bytes_max']/MB:,.1f}) | "
             f"{ex['persisted_window']/MB:,.1f} per window | {rec['memory']['restore']:.2f} + replay "
             f"{rec['memory']['replay']:.2f} | {rec['storage']['restore']:.2f} + replay "
             f"{rec['storage']['replay']:.2f} | "
             f"0 (PLT {s['plt_exact']}) |")
    L.append(f"| full checkpoint every step | {fmt_ms(s['full_blocked'])} | {fmt_ms(s['full_plus'])} | "
             f"{s['full_bytes']/MB:,.1f} | {fu['size']/MB:,.1f} every {w} steps | "
             f"{frec['memory']['restore']:.2f} | {frec['storage']['restore']:.2f} | 0 |")
    L.append(f"| PEC K=1 every {PEC_INTERVAL} steps | {fmt_ms(s['pec_blocked'])} | {fmt_ms(s['pec_plus'])} | "
             f"{s['pec_bytes']/MB:,.2f} | {pe['size']/MB:,.1f} every {PEC_INTERVAL} steps | - | - | "
             f"{pp['lost_steps']:,.0f} steps' tokens per layer (PLT {100 * pp['plt']:.1f}% of a "
             f"{pp['fail_step']}-step run) |")
    L.append("")
    L.append("## Targets (ratios measured in this run)")
    L.append("")
    L.append("| target | measured | met |")
    L.append("|---|---|---|")
    for a, b, c in targets(s):
        L.append(f"| {a} | {b} | {c} |")
    L.append("")
    gap = sorted(set(s["formula_gap"]))
    L.append("Reading it:")
    L.append(f"- Bytes per step of the window's steps (MB): "
             f"{', '.join(f'{b/MB:,.1f}' for b in ex['step_bytes'])}; the formula of `docs/exact.md` from the "
             f"tensors' sizes gives the same bytes + {', '.join(str(g) for g in gap)} B per step (the extra state: "
             f"RNG, optimizer hyper-parameters). A window is {ex['window_bytes']/MB:,.1f} MB in memory "
             f"({ex['window_bytes'] / s['full_bytes']:.2f} full checkpoints): exact mode persists "
             f"{ex['persisted_window'] / fu['size']:.2f}x the bytes of one full checkpoint per {w} steps.")
    L.append(f"- Loop blocked = time in `step()` ({fmt_ms(ex['call'])} ms) + the optimizer pre-hook's wait for "
             f"the previous step's copy ({fmt_ms(ex['prehook_wait'])} ms), per step. Step time + also counts the "
             "background copy, checksum and persist threads competing with training for the two shared cores "
             "(noise of a loaded machine: compare it with the spread of the baseline steps, "
             f"{min(r['baseline_steps']):.2f}-{max(r['baseline_steps']):.2f} s).")
    L.append(f"- Recovery: exact = `restore()` + the replay of steps {rec['memory']['start']}-{rec['memory']['end']} "
             f"({len(rec['memory']['replay_steps'])} steps, {_med(rec['memory']['replay_steps']):.2f} s each, median); "
             f"the limit is the full checkpoint's `restore()` + W x that step (the replayed steps ran under the "
             f"same outside load as the restores; with the baseline median, {step:.2f} s, the limit would be "
             f"{frec['memory']['restore'] + w * step:.1f} s from memory). Each recovery's state was compared "
             f"`torch.equal` (every weight, every Adam tensor) with the one saved when the window ended: "
             f"{'identical in all four' if s['identical'] else 'NOT identical'}.")
    L.append(f"- PEC's tokens: moc's PLT accounting over sequential K=1 checkpoints every {PEC_INTERVAL} steps "
             f"with this model's measured routing, a failure at step {pp['fail_step']} (just after a "
             f"checkpoint): each expert comes back from its own version, on average {pp['lost_steps']:,.0f} "
             f"steps old weighted by its tokens ({pp['lost_tokens_per_layer']:,.0f} tokens per layer). Not trained: "
             f"it is accounting, as the simulator's.")
    wc = ex.get("warm_calls") or []
    if wc:
        firsts = [wc[i] for i in range(0, len(wc), w)]
        L.append(f"- Not in the figures above: the first window into each of the three buffers "
                 f"({p['warm_windows']} warm-up windows before the measured ones): `step()` at those windows' first "
                 f"step took {', '.join(f'{x:.2f}' for x in firsts)} s, where the buffer's pages for a whole window "
                 f"are allocated (`posix_fallocate`); a buffer is reused after that.")
    L.append(f"- Full checkpoints every step: snapshots skipped {fu['snapshots_skipped']}, persists skipped "
             f"{fu['persists_skipped']}. Exact: windows complete {ex['windows_complete']}, skipped "
             f"{ex['windows_skipped']}, persisted {ex['windows_persisted']}.")
    L.append("")
    L.append("Plot: `benchmarks/exact/exact.png`.")
    L.append("")
    return "\n".join(L)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summary(r)
    ex = r["exact"]
    w, step = s["window"], s["step"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.4))
    xs = list(range(len(ex["step_bytes"])))
    a.bar(xs, [x / MB for x in ex["step_bytes"]], color="#1f77b4", label="exact: bytes at each step of a window")
    a.axhline(s["full_bytes"] / MB, color="#d62728", label="full checkpoint every step")
    a.axhline(s["full_bytes"] / MB / 3, color="#d62728", ls=":", label="1/3 of a full checkpoint (target)")
    a.axhline(s["exact_bytes"] / MB, color="#1f77b4", ls="--", label="exact: mean per step")
    a.axhline(s["pec_bytes"] / MB, color="#2ca02c", label=f"PEC K=1 every {PEC_INTERVAL}: per step")
    a.set_xlabel("step in the window")
    a.set_ylabel("MB per step")
    a.set_title(f"bytes per step (W = {w})")
    a.legend(fontsize=7)
    names = ["exact", "full every step", f"PEC K=1 / {PEC_INTERVAL}"]
    blocked = [s["exact_blocked"], s["full_blocked"], s["pec_blocked"]]
    plus = [s["exact_plus"], s["full_plus"], s["pec_plus"]]
    y = [0, 1, 2]
    b.barh([v - 0.2 for v in y], [100 * v / step for v in blocked], height=0.4, color="#1f77b4",
           label="loop blocked")
    b.barh([v + 0.2 for v in y], [100 * max(v, 0) / step for v in plus], height=0.4, color="#9ecae1",
           label="step time + (CPU contention)")
    b.axvline(2.0, color="k", ls=":", label="2% target")
    b.set_yticks(y, names)
    b.invert_yaxis()
    b.set_xlabel("% of a step, per step")
    b.set_title(f"stall per step (step {step:.2f} s)")
    b.legend(fontsize=7)
    rec = {x["source"]: x for x in ex["recovery"]}
    frec = {x["source"]: x for x in r["full"]["recovery"]}
    labels, rest, rep, lim = [], [], [], []
    for src in ("memory", "storage"):
        labels += [f"exact\n{src}", f"full\n{src}"]
        rest += [rec[src]["restore"], frec[src]["restore"]]
        rep += [rec[src]["replay"], 0.0]
        lim += [s[f"limit_{src}"], None]
    xs = list(range(len(labels)))
    c.bar(xs, rest, color="#d62728", label="restore()")
    c.bar(xs, rep, bottom=rest, color="#1f77b4", label="replay")
    for x, v in zip(xs, lim):
        if v is not None:
            c.plot([x - 0.4, x + 1.4], [v, v], color="k", ls=":")
    c.plot([], [], color="k", ls=":", label=f"target: full restore + {w} steps")
    c.set_xticks(xs, labels)
    c.set_ylabel("seconds")
    c.set_title("recovery")
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(r: dict[str, Any], out: Path, quick: bool) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(r, indent=1, sort_keys=True))
    text = render(r, quick)
    (out / "results.md").write_text(text)
    plot(r, out / "exact.png")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model (~2 min)")
    ap.add_argument("--windows", type=int, help="measured windows per method (default 2)")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (default 1: the other core runs the background copies, as a GPU's "
                         "copy engine would; on 2 cores shared with other jobs, 2 OpenMP threads made a step 2-4x "
                         "slower)")
    ap.add_argument("--out", type=Path, default=HERE, help="where results.md, results.json and exact.png go")
    ap.add_argument("--render", type=Path, metavar="RESULTS_JSON", help="only redraw the table and the plot")
    args = ap.parse_args(argv)
    if args.render is not None:
        r = json.loads(args.render.read_text())
        print(write(r, args.out, bool(r["params"].get("quick"))))
        return 0
    p = dict(QUICK if args.quick else FULL, quick=args.quick)
    if args.windows is not None:
        if args.windows < 1:
            raise SystemExit(f"--windows must be >= 1, got {args.windows}")
        p["windows"] = args.windows
    if args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    p["threads"] = args.threads
    log = lambda s: print(f"[exact {time.strftime('%H:%M:%S')}] {s}", flush=True)  # noqa: E731
    r = run(p, args.out, log)
    print(write(r, args.out, args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
