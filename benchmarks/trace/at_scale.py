"""The simulator's cluster-scale settings with the per-event costs this runtime measured
(issue 41 item 3), beside the same runs with the Lazarus paper's assumptions.

The measured costs are the ones ``benchmarks/trace/main.py`` wrote to ``sim_config.json``
(CPU figures of a live replay on this machine): for each system its detection of a SIGKILL
and of a spot notice, its reconfiguration, what a join costs the members and how long it
takes, the checkpoint-restart job's restart. Everything else (model, step time, bandwidths,
checkpoint sizes) stays the preset's. The paper's assumptions: 15 s detection for every
departure (no notices), 10 s NCCL rebuild, 60 s restart, a 2-minute join window.

Settings: GPT-L on 10 nodes, one node failing every 5 minutes for 30 minutes (Fig. 6) and
every 40 minutes for 4 hours (Fig. 7); the P3 trace from 50 to 130 minutes capped at 10
nodes (Fig. 9), its departures split like the live bench's (``--kill-share``) for the
measured costs; MoEvement's setting: DeepSeekMoE 16B on 8 nodes, one node replaced every
10 minutes, Lazarus with exact mode against checkpoint-restart.

Run: ``python benchmarks/trace/at_scale.py [--config benchmarks/trace/sim_config.json]
[--quick]``; writes ``at_scale.md`` beside this file.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from lazarus.sim import SimConfig, SkewSpec, fail_every, load_trace, preset, segment, simulate, spot_kills  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces"
if not TRACES.is_dir():
    TRACES = Path("/work/shared/traces")
#: The per-event costs taken from the live replay; the rest stays the preset's.
MEASURED = ("detect_s", "notice_detect_s", "reconfig_s", "join_reconfig_s", "restart_s", "join_window_s",
            "save_before_scale")
LABEL = {"ds": "checkpoint-restart (DS)", "dsft": "replicated EP (DS(FT); torchft's costs)", "lazarus": "Lazarus"}


def measured(path: Path) -> dict[str, dict[str, Any]]:
    cfg = json.loads(path.read_text())
    return {name: {"perf": {k: v for k, v in over["perf"].items() if k in MEASURED}}
            for name, over in cfg["systems"].items()}


def _young_daly(model: Any, perf: Any, mtbf_s: float) -> int:
    save = perf.ckpt_call_s + model.state_bytes() / (perf.storage_write_gbps * 1e9)
    return max(1, round(math.sqrt(2 * save * mtbf_s) / model.step_s))


def scenarios(quick: bool, kill_share: float) -> list[dict[str, Any]]:
    p3 = segment(load_trace(TRACES / "aws-p3-32nodes.csv", seed=0), 50 * 60, 80 * 60, 10)
    out = [
        {"key": "fig6", "what": "GPT-L, 10 nodes, a node fails every 5 min, 30 min", "model": "gpt-l",
         "scenario": fail_every(10, 300, 1800, seed=0), "duration": 1800.0, "scale": 1, "checkpoint": "full"},
        {"key": "fig7", "what": "GPT-L, 10 nodes, a node fails every 40 min, 4 h", "model": "gpt-l",
         "scenario": fail_every(10, 2400, (2 if quick else 4) * 3600, seed=0),
         "duration": (2 if quick else 4) * 3600.0, "scale": 4, "checkpoint": "full"},
        {"key": "fig9", "what": f"GPT-L, P3 trace 50-130 min, cap 10 (departures: {kill_share:g} SIGKILL, "
                                f"the rest spot notices)", "model": "gpt-l",
         "scenario": spot_kills(p3, kill_share, seed=0), "duration": 4800.0, "scale": 1, "checkpoint": "full"},
    ]
    hours = 2.0 if quick else 6.0
    for mode in ("exact", "full"):
        out.append({"key": f"moevement-{mode}", "what": f"DeepSeekMoE 16B, 8 nodes, a node replaced every 10 min, "
                                                       f"{hours:g} h, {mode} checkpoints",
                    "model": "deepseek-16b", "scenario": fail_every(8, 600, hours * 3600, seed=0, replace=True),
                    "duration": hours * 3600, "scale": 0, "checkpoint": mode, "systems": ("ds", "lazarus")})
    return out


def run(sc: dict[str, Any], over: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    model, perf = preset(sc["model"])
    if sc["scale"]:
        s = sc["scale"]
        perf = perf.with_overrides({"ds_interval_steps": perf.ds_interval_steps * s,
                                    "ft_interval_steps": perf.ft_interval_steps * s,
                                    "lazarus_interval_steps": perf.lazarus_interval_steps * s})
    else:   # MoEvement's setting: Young/Daly interval for all (as benchmarks/exact/ettr.py)
        n = _young_daly(model, perf, 600.0)
        perf = perf.with_overrides({"ds_interval_steps": n, "ft_interval_steps": n, "lazarus_interval_steps": n})
    if over is None:
        # the paper's model has no spot notices: a notice costs the same detection as a kill
        perf = perf.with_overrides({"notice_detect_s": perf.detect_s})
    nodes = len(sc["scenario"].initial)
    cfg = SimConfig(model=model, nodes=nodes, perf=perf, systems=sc.get("systems", ("ds", "dsft", "lazarus")),
                    checkpoint=sc["checkpoint"], duration_s=sc["duration"], seed=0,
                    skew=SkewSpec() if sc["model"] != "deepseek-16b" else SkewSpec(zipf_s=0.0, drift=0.0),
                    system_overrides=over or {})
    return simulate(cfg, sc["scenario"]).to_dict()["systems"]


def render(rows: list[dict[str, Any]], costs: dict[str, dict[str, Any]], cfg_path: Path, elapsed: float) -> str:
    lines = ["# The simulator at cluster scale: the paper's assumed costs vs this runtime's measured ones", "",
             f"Command: `python benchmarks/trace/at_scale.py --config {cfg_path}`; {elapsed:.0f} s; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", "",
             "Measured per-event costs (CPU, from the live replay's `sim_config.json`; everything else is the "
             "preset's):", ""]
    for name, over in costs.items():
        lines.append(f"- {LABEL[name]}: " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(over["perf"].items())))
    lines += ["", "| setting | system | ETTR, paper's costs | ETTR, measured costs | samples, paper's | "
                  "samples, measured | x DS, paper's | x DS, measured |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for name in r["paper"]:
            a, b = r["paper"][name], r["measured"][name]
            ra = a["samples"] / r["paper"]["ds"]["samples"] if r["paper"]["ds"]["samples"] else float("nan")
            rb = b["samples"] / r["measured"]["ds"]["samples"] if r["measured"]["ds"]["samples"] else float("nan")
            lines.append(f"| {r['what']} | {LABEL[name]} | {a['ettr']:.3f} | {b['ettr']:.3f} | {a['samples']:,.0f} | "
                         f"{b['samples']:,.0f} | {ra:.2f}x | {rb:.2f}x |")
    lines += ["", "Where the time goes (seconds: compute / checkpoint / restart / reconfiguration / lost / idle):", "",
              "| setting | system | paper's costs | measured costs |", "|---|---|---|---|"]
    keys = ("compute", "checkpoint", "restart", "reconfiguration", "lost", "idle")
    for r in rows:
        for name in r["paper"]:
            cells = [" / ".join(f"{r[v][name]['breakdown'][k]:.0f}" for k in keys) for v in ("paper", "measured")]
            lines.append(f"| {r['what']} | {LABEL[name]} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/trace/at_scale.py", description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(HERE / "sim_config.json"), help="the live replay's sim_config.json")
    p.add_argument("--kill-share", type=float, default=0.3, help="share of the P3 trace's departures that are "
                                                                 "SIGKILLs with the measured costs (default 0.3)")
    p.add_argument("--quick", action="store_true", help="shorter runs (2 h instead of 4-6 h)")
    p.add_argument("--out", default=str(HERE / "at_scale.md"))
    args = p.parse_args(argv)
    cfg_path = Path(args.config)
    if not cfg_path.is_file():
        p.error(f"--config: no such file {cfg_path} (run benchmarks/trace/main.py first)")
    costs = measured(cfg_path)
    t0 = time.time()
    rows = []
    for sc in scenarios(args.quick, args.kill_share):
        systems = sc.get("systems", ("ds", "dsft", "lazarus"))
        over = {k: v for k, v in costs.items() if k in systems}
        rows.append({"what": sc["what"], "paper": run(sc, None), "measured": run(sc, over)})
        print(f"{sc['key']}: " + ", ".join(f"{n} ETTR {rows[-1]['paper'][n]['ettr']:.3f} -> "
                                           f"{rows[-1]['measured'][n]['ettr']:.3f}" for n in rows[-1]["paper"]),
              flush=True)
    text = render(rows, costs, cfg_path, time.time() - t0)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
