"""``lazarus simulate``: command line of the failure simulator."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from ._api import apply_overrides, load_overrides, parse_duration, simulate
from ._config import CHECKPOINT_MODES, SYSTEMS, SimConfig, SkewSpec
from ._params import PRESETS, preset
from ._traces import Scenario, bamboo, compress, fail_every, load_trace, segment, spot_kills


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate DS, DS(FT) and Lazarus training under node failures and joins",
        description=(
            "Discrete-event simulation of MoE training on a cluster that loses and gains "
            "nodes: checkpoint-restart expert parallelism (ds), fault-tolerant EP (dsft) and "
            "Lazarus (lazarus). Failures come from --fail-every, --trace or "
            "--preempt-prob/--alloc-prob. Costs come from the model preset and --config."
        ),
    )
    p.add_argument("--model", default="gpt-l", help=f"preset: {', '.join(sorted(PRESETS))} (default gpt-l)")
    p.add_argument("--nodes", type=int, default=None, help="cluster size (default 10; trace: its capped size)")
    p.add_argument("--slots", type=int, default=None, help="expert replica slots per node (default: preset)")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--duration", default=None, help="simulated time, e.g. 30m, 2h, 90s (default 30m)")
    stop.add_argument("--target-samples", type=float, default=None,
                      help="run until this many samples are trained and report the JCT")
    p.add_argument("--horizon", default=None,
                   help="give up on a JCT run after this long (default: 30x the failure-free time)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--fail-every", default=None, help="one random node fails every T until half are left")
    src.add_argument("--trace", default=None, help="CSV (ms,num_nodes or seconds,num_nodes) or JSON-lines trace")
    src.add_argument("--preempt-prob", type=float, default=None, help="per-node preemption probability per hour")
    p.add_argument("--alloc-prob", type=float, default=None,
                   help="per-missing-node allocation probability per hour (with --preempt-prob; default 0.5)")
    p.add_argument("--replace", action="store_true",
                   help="with --fail-every: a spare replaces each failed node at once (the MTBF setting of ETTR)")
    p.add_argument("--min-alive", type=int, default=None,
                   help="with --fail-every: stop failing at this many nodes (default half)")
    p.add_argument("--trace-start", default="0", help="trace segment start (e.g. 50m; default 0)")
    p.add_argument("--trace-minutes", type=float, default=None,
                   help="trace segment length in minutes (default: to the end)")
    p.add_argument("--trace-cap", type=int, default=None, help="use at most this many of the trace's nodes")
    p.add_argument("--trace-compress", type=float, default=None,
                   help="divide the trace segment's times by this (60: an hour of the trace in a minute; "
                        "to compare with a live replay, benchmarks/trace)")
    p.add_argument("--kill-share", type=float, default=None,
                   help="with --trace: split removals per node; this share (seeded) vanish without notice "
                        "(detect_s), the rest are spot notices (notice_detect_s). Default: all without notice")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of ds,dsft,lazarus (default all)")
    p.add_argument("--checkpoint", default="full", choices=CHECKPOINT_MODES,
                   help="full checkpoints, MoC partial (pec), MoC two-level, or MoC exact mode (a scheduled "
                        "part of the state every step, replay of the window on recovery, no PLT) (default full)")
    p.add_argument("--zipf", type=float, default=1.0, help="synthetic routing skew exponent (default 1.0)")
    p.add_argument("--drift", type=float, default=0.3, help="log-normal drift of loads per epoch (default 0.3)")
    p.add_argument("--routing-trace", default=None, help="JSON lines {step, layer, counts} instead of Zipf")
    p.add_argument("--config", default=None, help="JSON/TOML file overriding perf (and model/skew) parameters")
    p.add_argument("--seed", type=int, default=0, help="seed of failures, node choice and skew (default 0)")
    p.add_argument("--png", default=None, help="write a timeline PNG here")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=run_cli)


def _systems(text: str) -> tuple[str, ...]:
    names = tuple(s.strip().lower() for s in text.split(",") if s.strip())
    bad = [s for s in names if s not in SYSTEMS]
    if not names or bad:
        raise ValueError(f"--systems must be a comma list of {','.join(SYSTEMS)}, got {text!r}")
    return names


def build(args: argparse.Namespace) -> tuple[SimConfig, Scenario]:
    """The config and scenario a parsed command line asks for."""
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    model, perf = preset(args.model)
    skew = SkewSpec(zipf_s=args.zipf, drift=args.drift)
    per_system: dict[str, dict[str, Any]] = {}
    if args.config:
        over = load_overrides(args.config)
        model, perf, skew = apply_overrides(model, perf, skew, over)
        per_system = over.get("systems", {})
    if args.slots is not None:
        if args.slots < 1:
            raise ValueError(f"--slots must be >= 1, got {args.slots}")
        model = replace(model, slots_per_node=args.slots)
    if args.nodes is not None and args.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
    if args.alloc_prob is not None and args.preempt_prob is None:
        raise ValueError("--alloc-prob needs --preempt-prob")
    if (args.trace_compress is not None or args.kill_share is not None) and not args.trace:
        raise ValueError("--trace-compress and --kill-share need --trace")
    if args.replace and not args.fail_every:
        raise ValueError("--replace needs --fail-every")
    systems = _systems(args.systems)
    nodes = args.nodes or 10
    duration = None
    target = args.target_samples
    if target is not None and target <= 0:
        raise ValueError(f"--target-samples must be > 0, got {target}")
    if target is None:
        duration = parse_duration(args.duration or "30m", "--duration")
    ideal = (target or 0) / (nodes * model.samples_per_node_step) * model.step_s
    horizon = parse_duration(args.horizon, "--horizon") if args.horizon else max(30 * ideal, 3600.0)
    span = duration if duration is not None else horizon
    if args.trace:
        start = parse_duration(args.trace_start, "--trace-start") if args.trace_start not in ("0", "0s") else 0.0
        minutes = None if args.trace_minutes is None else args.trace_minutes * 60.0
        if minutes is not None and minutes <= 0:
            raise ValueError(f"--trace-minutes must be > 0, got {args.trace_minutes}")
        scenario = segment(load_trace(args.trace, seed=args.seed), start, minutes, args.trace_cap)
        if args.trace_compress is not None:
            scenario = compress(scenario, args.trace_compress)
        if args.kill_share is not None:
            scenario = spot_kills(scenario, args.kill_share, seed=args.seed)
        nodes = args.nodes or max(1, scenario.max_nodes())
    elif args.fail_every:
        every = parse_duration(args.fail_every, "--fail-every")
        scenario = fail_every(nodes, every, span, min_alive=args.min_alive, seed=args.seed, replace=args.replace)
    elif args.preempt_prob is not None:
        alloc = 0.5 if args.alloc_prob is None else args.alloc_prob
        scenario = bamboo(nodes, args.preempt_prob, alloc, span, seed=args.seed)
    else:
        scenario = Scenario(tuple(f"n{i}" for i in range(nodes)), [], name="no-failures")
    perf = perf.with_overrides({"min_replicas": min(perf.min_replicas, nodes)})
    cfg = SimConfig(model=model, nodes=nodes, perf=perf, systems=systems, checkpoint=args.checkpoint,
                    duration_s=duration, target_samples=target,
                    horizon_s=horizon if target is not None else None, seed=args.seed, skew=skew,
                    system_overrides=per_system)
    return cfg, scenario


def _table(out: dict[str, Any]) -> str:
    rows = [f"model {out['model']}, checkpoints {out['checkpoint']}, scenario {out['scenario']['name']} "
            f"({out['scenario']['initial_nodes']} nodes at start, {out['scenario']['events']} events)"]
    head = ["system", "samples", "jct_s", "compute", "checkpoint", "restart", "reconfig", "lost", "idle", "ettr"]
    rows.append("  ".join(f"{h:>10}" for h in head))
    base = out["systems"].get("ds", {}).get("samples")
    for name, r in out["systems"].items():
        b = r["breakdown"]
        jct = "-" if r["jct_s"] is None else f"{r['jct_s']:.0f}"
        cells = [name, f"{r['samples']:.0f}", jct] + [f"{b[k]:.0f}" for k in
                 ("compute", "checkpoint", "restart", "reconfiguration", "lost", "idle")] + [f"{r['ettr']:.3f}"]
        line = "  ".join(f"{c:>10}" for c in cells)
        if base:
            line += f"   {r['samples'] / base:.2f}x DS"
        rows.append(line)
    return "\n".join(rows)


def run_cli(args: argparse.Namespace) -> int:
    cfg, scenario = build(args)
    result = simulate(cfg, scenario, routing_trace=args.routing_trace)
    out = result.to_dict()
    if args.png:
        from ._plot import plot_timelines

        plot_timelines(result.timelines(), args.png, title=f"{cfg.model.name}: {scenario.name}")
    print(json.dumps(out, indent=2, sort_keys=True) if args.json else _table(out))
    return 0
