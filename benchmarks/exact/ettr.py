"""ETTR (effective training time ratio) against MTBF at cluster scale: ``lazarus simulate``
with full checkpoints, PEC, two-level and exact mode, beside MoEvement's published figure.

    python benchmarks/exact/ettr.py            # 5 MTBFs x 4 modes x 2 systems x 3 seeds, 12 h each (~2 min)
    python benchmarks/exact/ettr.py --quick    # 2 MTBFs, 1 seed, 2 h (seconds)

Writes ``ettr.md``, ``ettr.json`` and ``ettr.png`` beside this file (or under ``--out``).

* Model and cluster: the simulator's ``deepseek-16b`` preset (DeepSeekMoE 16B: 27 MoE
  layers of 64 experts, 16.4 B parameters; 8 nodes of 8 GPUs; every cluster figure is an
  assumption cited in ``lazarus/sim/_params.py``), routing balanced (``--zipf 0``, as an
  auxiliary loss keeps it) so that ETTR measures fault tolerance, not expert skew.
* Failures: one random node every MTBF, replaced at once by a spare (``--fail-every MTBF
  --replace``), for the whole run.
* Checkpoints: ``full`` every N steps, N from Young/Daly (sqrt(2 x save x MTBF), the save
  a blocking write of the whole state); ``pec`` / ``two-level``: MoC every N / 5 steps (the
  simulator's rule); ``exact``: every step, W = 8 (``--checkpoint exact``).
* Systems: ``ds`` (checkpoint-restart: every failure restarts the job from its checkpoint,
  MoEvement's and DeepSpeed's setting), ``lazarus`` (reconfigures in place while an
  expert replica survives; falls back to the checkpoint otherwise), and ``ds`` again with
  the relaunch of a restart cut from 60 s (assumed) to 10 s (processes kept warm).
* ETTR = time spent on steps that count / wall time (the simulator's ``compute`` bucket
  over the simulated time).

MoEvement (arXiv 2412.15411, abstract): "sustaining ETTR >= 0.94 even under frequent
failures (MTBF as low as 10 minutes)", evaluated on MoE models with up to 64 experts; its
paper is not in shared/papers, so only that published figure is compared, not its setup.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from lazarus.sim import SimConfig, SkewSpec, fail_every, preset, simulate  # noqa: E402

MODES = ("full", "pec", "two-level", "exact")
SYSTEMS = ("ds", "lazarus", "ds, relaunch 10 s")
# label -> (simulated system, cost overrides); the last: the restart's relaunch (60 s by
# default, an assumption) cut to 10 s, the sensitivity that matters most for checkpoint-restart
VARIANTS = {"ds": ("ds", {}), "lazarus": ("lazarus", {}), "ds, relaunch 10 s": ("ds", {"restart_s": 10.0})}
MOEVEMENT = {"mtbf_min": 10.0, "ettr": 0.94, "source": "MoEvement, arXiv 2412.15411 (abstract): ETTR >= 0.94 at "
             "an MTBF as low as 10 minutes, MoE models with up to 64 experts"}
FULL = dict(mtbf_min=[5, 10, 20, 40, 80], seeds=[0, 1, 2], hours=12.0)
QUICK = dict(mtbf_min=[10, 40], seeds=[0], hours=2.0)
NODES = 8


def young_daly_steps(save_s: float, mtbf_s: float, step_s: float) -> int:
    return max(1, round(math.sqrt(2 * save_s * mtbf_s) / step_s))


def run(p: dict[str, Any], log) -> dict[str, Any]:
    model, perf = preset("deepseek-16b")
    save = perf.ckpt_call_s + model.state_bytes() / (perf.storage_write_gbps * 1e9)
    rows = []
    for mtbf in p["mtbf_min"]:
        n = young_daly_steps(save, mtbf * 60, model.step_s)
        tuned = perf.with_overrides({"ds_interval_steps": n, "ft_interval_steps": n, "lazarus_interval_steps": n})
        for mode in MODES:
            for label in SYSTEMS:
                system, over = VARIANTS[label]
                ettr, plt, restarts = [], [], []
                for seed in p["seeds"]:
                    span = p["hours"] * 3600
                    cfg = SimConfig(model=model, nodes=NODES, perf=tuned.with_overrides(over), systems=(system,),
                                    checkpoint=mode,
                                    duration_s=span, seed=seed, skew=SkewSpec(zipf_s=0.0, drift=0.0))
                    out = simulate(cfg, fail_every(NODES, mtbf * 60, span, seed=seed, replace=True))
                    r = out.to_dict()["systems"][system]
                    ettr.append(r["ettr"])
                    plt.append(r.get("plt", 0.0))
                    restarts.append(r["counts"]["restarts"] + r["counts"]["fallbacks"])
                rows.append({"mtbf_min": mtbf, "mode": mode, "system": label, "interval_steps": n,
                             "ettr": statistics.mean(ettr), "ettr_min": min(ettr), "ettr_max": max(ettr),
                             "plt": statistics.mean(plt), "rollbacks": statistics.mean(restarts)})
                log(f"MTBF {mtbf:>3} min  {label:<18} {mode:<9} N={n:<4} ETTR {rows[-1]['ettr']:.3f} "
                    f"PLT {100 * rows[-1]['plt']:.2f}%")
    return {"params": p, "model": model.name, "nodes": NODES, "save_s": save, "step_s": model.step_s,
            "exact_window": perf.exact_window_steps, "perf": perf.to_dict(), "rows": rows, "moevement": MOEVEMENT}


def render(r: dict[str, Any]) -> str:
    p = r["params"]
    mtbfs = p["mtbf_min"]
    cell = {(x["system"], x["mode"], x["mtbf_min"]): x for x in r["rows"]}
    L = ["# ETTR against MTBF: full checkpoints, PEC, two-level and exact mode (simulated)", ""]
    L.append(f"`lazarus simulate` on the `{r['model']}` preset ({r['nodes']} nodes, step {r['step_s']:.1f} s, a "
             f"full checkpoint is a {r['save_s']:.0f} s blocking write), one node failing every MTBF and replaced at "
             f"once, {p['hours']:g} h per run, mean of seeds {', '.join(map(str, p['seeds']))} (min-max in "
             f"`ettr.json`); exact mode W = {r['exact_window']}. Rerun: `python benchmarks/exact/ettr.py"
             f"{' --quick' if p.get('quick') else ''}` (part of `make bench-exact`).")
    L.append("")
    L.append("| system | checkpoints | " + " | ".join(f"MTBF {m} min" for m in mtbfs) + f" | PLT at {mtbfs[0]} min |")
    L.append("|---|---|" + "---:|" * len(mtbfs) + "---:|")
    for system in SYSTEMS:
        for mode in MODES:
            xs = [cell[(system, mode, m)] for m in mtbfs]
            plt = xs[0]["plt"]
            L.append(f"| {system} | {mode} | " + " | ".join(f"{x['ettr']:.3f}" for x in xs)
                     + f" | {'-' if mode == 'full' else f'{100 * plt:.2f}%'} |")
    L.append("| MoEvement (published) | sparse-to-dense, replay | " +
             " | ".join("**>= 0.94**" if m == MOEVEMENT["mtbf_min"] else "" for m in mtbfs) + " | 0 |")
    L.append("")
    L.append("Checkpoint interval N (Young/Daly for the full checkpoint; PEC and two-level every N/5): " +
             ", ".join(f"{m} min: {cell[('ds', 'full', m)]['interval_steps']} steps" for m in mtbfs) + ".")
    L.append("")
    L.append("Plot: `benchmarks/exact/ettr.png`.")
    L.append("")
    return "\n".join(L)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    colors = {"full": "#d62728", "pec": "#2ca02c", "two-level": "#9467bd", "exact": "#1f77b4"}
    for system, ls in (("ds", "-"), ("lazarus", "--"), ("ds, relaunch 10 s", ":")):
        for mode in MODES:
            xs = sorted((x for x in r["rows"] if x["system"] == system and x["mode"] == mode),
                        key=lambda x: x["mtbf_min"])
            ax.plot([x["mtbf_min"] for x in xs], [x["ettr"] for x in xs], ls, marker="o", ms=3,
                    color=colors[mode], label=f"{system}, {mode}")
    m = r["moevement"]
    ax.scatter([m["mtbf_min"]], [m["ettr"]], marker="*", s=180, color="k", zorder=5, label="MoEvement (published)")
    ax.set_xscale("log")
    ax.set_xticks(r["params"]["mtbf_min"], [str(x) for x in r["params"]["mtbf_min"]])
    ax.set_xlabel("MTBF (minutes, one node fails and is replaced)")
    ax.set_ylabel("ETTR")
    ax.set_title(f"{r['model']}, {r['nodes']} nodes (simulated)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(r: dict[str, Any], out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "ettr.json").write_text(json.dumps(r, indent=1, sort_keys=True))
    text = render(r)
    (out / "ettr.md").write_text(text)
    plot(r, out / "ettr.png")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 MTBFs, 1 seed, 2 h runs")
    ap.add_argument("--out", type=Path, default=HERE, help="where ettr.md, ettr.json and ettr.png go")
    args = ap.parse_args(argv)
    p = dict(QUICK if args.quick else FULL, quick=args.quick)
    t0 = time.perf_counter()
    r = run(p, lambda s: print(f"[ettr] {s}", flush=True))
    r["seconds"] = time.perf_counter() - t0
    print(write(r, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
