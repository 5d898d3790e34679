"""A real AWS spot trace replayed live: Lazarus vs checkpoint-restart vs torchft, and
``lazarus simulate`` checked against what the runtime did on the same events.

A segment of a real trace (``aws-p3-32nodes.csv`` by default, 4 h in, 60 minutes; or
``aws-g4dn-12nodes.csv``) is compressed in time (60x: a trace hour in a wall minute) and
scaled to this machine (the job holds at most ``--nodes`` of the trace's nodes: 3 by
default). An instance leaving is a spot notice (SIGTERM) or, for ``--kill-share`` of them
(seeded), a SIGKILL; an instance arriving is a new node: a Lazarus agent started cold, a
torchft replica group, a member the checkpoint-restart job restarts with.

The systems are :mod:`benchmarks.peers`'s arms at their best settings: Lazarus (controller,
agents, workers of the demo's MoE GPT; MoC snapshots every 10 steps), torchrun-style
checkpoint-restart (DCP every N steps, N by Young/Daly from the trace's mean time between
interruptions), torchft (Lighthouse with a 1 s heartbeat timeout, the shortest process
group timeout its steps allow: 1 s; ``torchft-readme``: its README's settings, 5 s).

Measured per system (see ``_measure``): committed tokens, goodput, ETTR (useful training
time / wall time), time lost per event by kind. Then the bench writes a ``lazarus simulate
--config`` with the per-event costs it measured, runs the simulator on the same compressed,
capped trace and prints predicted against measured ETTR and goodput ratios (target: within
10%).

Run: ``make bench-trace`` or ``python benchmarks/trace/main.py [--quick] [--json]
[--trace FILE] [--start 4h] [--minutes 60] [--nodes 3] [--compress 60] [--kill-share 0.3]
[--systems lazarus,ckpt,torchft]``. Writes ``results.md``, ``timeline.png`` and
``sim_config.json`` beside this file (``--out DIR``: there).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "peers"))
sys.path.insert(0, str(ROOT))

from _arms import TORCHFT_PG_TIMEOUT_S, CkptRestartArm, LazarusArm, TorchftArm  # noqa: E402
from _common import ModelSpec  # noqa: E402
from _measure import SIM_SYSTEM, measure, sim_config  # noqa: E402
from _schedule import TraceSpec, actions, availability  # noqa: E402

SYSTEMS = ("lazarus", "ckpt", "torchft", "torchft-readme")
LABEL = {"lazarus": "Lazarus", "ckpt": "checkpoint-restart (DCP, Young/Daly)",
         "torchft": f"torchft (tuned: {TORCHFT_PG_TIMEOUT_S['tuned']:g} s PG timeout)",
         "torchft-readme": f"torchft (README: {TORCHFT_PG_TIMEOUT_S['readme']:g} s PG timeout)"}
TRACES = ROOT.parent / "shared" / "traces"
if not TRACES.is_dir():
    TRACES = Path("/work/shared/traces")
STEPS = 10 ** 7          # the replay ends the run, not a step count


def _duration(text: str) -> float:
    from lazarus.sim import parse_duration

    return 0.0 if text.strip() in ("0", "0s") else parse_duration(text, "--start")


def make_arm(system: str, work: Path, spec: ModelSpec, initial: int, mtbf_s: float) -> Any:
    if system == "lazarus":
        # cold agents (a new spot instance starts from nothing); every node may hold every
        # expert (slots = experts), so one node alone can train
        ctrl = ["--slots", str(spec.experts), "--min-replicas", "2", "--expected-nodes", str(initial),
                "--heartbeat-timeout", "2s", "--join-window", "500ms"]
        return LazarusArm(work, spec, STEPS, spare=None, controller=ctrl)
    if system == "ckpt":
        return CkptRestartArm(work, spec, STEPS, None, mtbf_s=mtbf_s, max_restarts=10 ** 6)
    if system == "torchft":
        return TorchftArm(work, spec, STEPS, "tuned")
    if system == "torchft-readme":
        return TorchftArm(work, spec, STEPS, "readme")
    raise ValueError(f"system must be one of {', '.join(SYSTEMS)}; got {system!r}")


def _world(arm: Any) -> int:
    steps = [r for r in arm.records() if r.get("kind") == "step"]
    return int(max(steps, key=lambda r: r["t"]).get("world", 0)) if steps else 0


def _sleep_until(t: float) -> None:
    while True:
        d = t - time.time()
        if d <= 0:
            return
        time.sleep(min(d, 0.05))


def run_system(system: str, work: Path, spec: ModelSpec, trace: TraceSpec, *, startup_timeout: float = 180.0,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Replay ``trace`` on one system: start its first nodes, wait until they all train,
    then inject each action at its compressed time; stop at the replay's end."""
    sc = trace.scenario()
    acts = actions(sc)
    duration = trace.duration_s
    interruptions = len({a.t for a in acts}) or 1
    arm = make_arm(system, work, spec, len(sc.initial), mtbf_s=duration / interruptions)
    events: list[dict[str, Any]] = []
    try:
        arm.start(list(sc.initial))
        deadline = time.monotonic() + startup_timeout
        while _world(arm) < len(sc.initial):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{system}: its {len(sc.initial)} first nodes did not train within "
                                   f"{startup_timeout:.0f} s; see {work}")
            time.sleep(0.05)
        t0 = time.time()
        for a in acts:
            _sleep_until(t0 + a.t)
            try:
                t = getattr(arm, a.kind)(a.node)
            except (ProcessLookupError, KeyError) as exc:
                log(f"  {system}: {a.kind} {a.node} at {a.t:.1f} s: not injected ({exc!r})")
                continue
            events.append({"t": t, "kind": a.kind, "node": a.node})
            log(f"  {system}: {time.time() - t0:5.1f} s: {a.kind} {a.node}")
        _sleep_until(t0 + duration)
        t_end = time.time()
        records = arm.records()
        joined = joined_at(arm, records, [a.node for a in acts if a.kind == "join"])
    finally:
        arm.stop()
    raw = {"records": records, "events": events, "t0": t0, "t_end": t_end, "joined": joined,
           "interval": (arm.interval() or {}) if isinstance(arm, CkptRestartArm) else None,
           "restarts": len(arm.restarts) if isinstance(arm, CkptRestartArm) else None}
    (work / "raw.json").write_text(json.dumps(raw))
    return analyse(system, raw, spec)


def joined_at(arm: Any, records: list[dict[str, Any]], nodes: Sequence[str]) -> dict[str, float]:
    """When each joiner began training: Lazarus's controller says (the join plan's event);
    torchft's and checkpoint-restart's workers log their steps with their node: the first one
    began a step before it was committed (the job's typical step, taken off in ``measure``)."""
    out: dict[str, float] = {}
    if isinstance(arm, LazarusArm):
        for ev in arm.events():
            if ev.get("event") == "plan":
                for n in ev.get("joined") or ():
                    if n in nodes:
                        out.setdefault(n, float(ev["t"]))
        return out
    for r in sorted((r for r in records if r.get("kind") == "step"), key=lambda r: r["t"]):
        if r.get("node") in nodes:
            out.setdefault(r["node"], float(r["t"]) - 1e-6)
    return out


def analyse(system: str, raw: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    """The figures of one system from its raw replay (records, injected events, t0, end)."""
    res = measure(raw["records"], raw["events"], raw["t0"], raw["t_end"], spec.tokens_per_step,
                  joined=raw.get("joined"))
    res.update(system=system, label=LABEL[system], events_injected=len(raw["events"]), raw=raw)
    if raw.get("interval") is not None:
        res["interval"] = raw["interval"]
        res["restarts"] = raw["restarts"]
    return res


# -- the simulator, checked ----------------------------------------------------------------
def model_sizes(spec: ModelSpec) -> tuple[float, float]:
    """(parameters of one expert of one layer, non-expert parameters) of the bench's model."""
    model, _, _ = spec.build()
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    per = experts / (spec.experts * spec.layers) if experts else 2.0 * spec.d_model * spec.d_hidden
    return float(per), float(max(0, total - experts))


def simulate(results: dict[str, dict[str, Any]], trace: TraceSpec, spec: ModelSpec, out: Path) -> dict[str, Any]:
    """Write the measured costs as ``sim_config.json``, run ``lazarus simulate`` on the same
    trace, return its systems' figures and the command."""
    per, non_expert = model_sizes(spec)
    cfg = sim_config(results, experts=spec.experts, layers=spec.layers, expert_params=per,
                     non_expert_params=non_expert, batch=spec.batch_size, nodes=trace.cap)
    path = out / "sim_config.json"
    path.write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    systems = sorted({SIM_SYSTEM[s] for s in results})
    cmd = [sys.executable, "-m", "lazarus.cli", "simulate", "--model", "gpt-s", "--config", str(path),
           "--systems", ",".join(systems), *trace.sim_args(), "--json"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"lazarus simulate failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    shown = ["lazarus", "simulate", *(os.path.relpath(a, ROOT) if a == str(path) and path.is_relative_to(ROOT) else a
                                      for a in cmd[4:-1])]
    return {"systems": json.loads(proc.stdout)["systems"], "command": shlex.join(shown), "config": cfg}


def compare(results: dict[str, dict[str, Any]], sim: dict[str, Any]) -> list[dict[str, Any]]:
    """Predicted against measured: each system's ETTR, and goodput ratios between systems."""
    rows = []
    for s, r in results.items():
        p = sim["systems"].get(SIM_SYSTEM[s])
        if p is None:
            continue
        rows.append({"what": f"ETTR {s}", "measured": r["ettr"], "predicted": p["ettr"]})
    names = list(results)
    for a in names:
        for b in names:
            if a == b or a != "lazarus":
                continue
            pa, pb = sim["systems"].get(SIM_SYSTEM[a]), sim["systems"].get(SIM_SYSTEM[b])
            if not pa or not pb or not results[b]["tokens"] or not pb["samples"]:
                continue
            rows.append({"what": f"goodput {a} / {b}", "measured": results[a]["tokens"] / results[b]["tokens"],
                         "predicted": pa["samples"] / pb["samples"]})
    for row in rows:
        row["error"] = row["predicted"] / row["measured"] - 1 if row["measured"] else None
    return rows


# -- output ---------------------------------------------------------------------------------
def _f(x: Any, nd: int = 2) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def tables(results: dict[str, dict[str, Any]], cmp: list[dict[str, Any]] | None) -> str:
    lines = ["| system | committed tokens | goodput (tokens/s) | ETTR | wall (s) | steps | checkpoint saves (s) "
             "| lost per kill (s) | lost per notice (s) | lost per join (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s, r in results.items():
        k = r["by_kind"]
        cells = [_f((k.get(x) or {}).get("mean_lost_s")) + (f" (n={k[x]['n']})" if x in k else "")
                 for x in ("kill", "term", "join")]
        lines.append(f"| {r['label']} | {r['tokens']:,} | {_f(r['goodput'], 0)} | {r['ettr']:.3f} | "
                     f"{r['wall_s']:.1f} | {r['steps']} | {_f(r['checkpoint_s'])} | " + " | ".join(cells) + " |")
    lines += ["", "Per event: time lost until the next event / event -> next new step (s):", "",
              "| event | at (s) | " + " | ".join(results) + " |", "|---|---:|" + "---:|" * len(results)]
    first = next(iter(results.values()))
    for i, e in enumerate(first["per_event"]):
        cells = []
        for r in results.values():
            pe = r["per_event"][i] if i < len(r["per_event"]) else None
            ok = pe and pe["node"] == e["node"]
            cells.append(f"{_f(pe['lost_s'])} / {_f(pe['recovery_s'])}" if ok else "-")
        lines.append(f"| {e['kind']} {e['node']} | {e['at_s']:.1f} | " + " | ".join(cells) + " |")
    if cmp:
        lines += ["", "| predicted vs measured | measured | lazarus simulate | error | within 10% |",
                  "|---|---:|---:|---:|---|"]
        for row in cmp:
            err = "-" if row["error"] is None else f"{100 * row['error']:+.1f}%"
            ok = "-" if row["error"] is None else ("yes" if abs(row["error"]) <= 0.10 else "no")
            lines.append(f"| {row['what']} | {row['measured']:.3f} | {row['predicted']:.3f} | {err} | {ok} |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], avail: list[tuple[float, int]], duration: float, path: Path,
         tokens_per_step: int) -> None:
    from moc._optional import import_optional

    matplotlib = import_optional("matplotlib", "the benchmark's timeline")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.1 * len(results) + 0.6), sharex=True, squeeze=False)
    xs = [t for t, _ in avail] + [duration]
    ys = [n for _, n in avail] + [avail[-1][1]]
    colors = {"kill": "tab:red", "term": "tab:orange", "join": "tab:green"}
    for ax, (s, r) in zip(axes[:, 0], results.items()):
        ax.step(xs, ys, where="post", color="0.6", lw=2.0, label="nodes available")
        prog = r["progress"]
        if prog:
            ax.step([p[0] for p in prog], [p[2] for p in prog], where="post", color="tab:blue", lw=1.0,
                    label="nodes training")
        ax.set_ylim(0, max(ys) + 1)
        ax.set_ylabel("nodes", fontsize=8)
        ax2 = ax.twinx()
        win = 1.0
        ts = [p[0] for p in prog]
        grid = [i * 0.25 for i in range(int(duration / 0.25) + 1)]
        rate = [sum(1 for t in ts if g - win < t <= g) * tokens_per_step / win for g in grid]
        ax2.plot(grid, rate, color="tab:purple", lw=0.8, label="tokens/s (1 s window)")
        ax2.set_ylabel("tokens/s", fontsize=8)
        for e in r["per_event"]:
            ax.axvline(e["at_s"], color=colors[e["kind"]], ls="--", lw=0.7)
        ax.set_title(f"{r['label']}: ETTR {r['ettr']:.3f}, goodput {r['goodput']:,.0f} tokens/s", fontsize=9,
                     loc="left")
        if ax is axes[0, 0]:
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = ax2.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower left")
    axes[-1, 0].set_xlabel("seconds of the replay (red: SIGKILL, orange: spot notice, green: node joins)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/trace/main.py", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a 30-minute trace segment (30 s per system; ~3 minutes)")
    p.add_argument("--trace", default=str(TRACES / "aws-p3-32nodes.csv"),
                   help="trace CSV (default: shared/traces/aws-p3-32nodes.csv; or aws-g4dn-12nodes.csv)")
    p.add_argument("--start", default="4h", help="segment start in the trace's time (default 4h)")
    p.add_argument("--minutes", type=float, default=None, help="segment length, trace minutes (default 60; 30 quick)")
    p.add_argument("--nodes", type=int, default=3, help="the most trace nodes the job holds (default 3)")
    p.add_argument("--compress", type=float, default=60.0, help="time compression (default 60: a trace hour "
                                                                "in a wall minute)")
    p.add_argument("--kill-share", type=float, default=0.3,
                   help="share of the departures that are SIGKILLs (seeded); the rest get a spot notice (SIGTERM)")
    p.add_argument("--trace-seed", type=int, default=0, help="seed of which nodes leave and which are killed")
    p.add_argument("--systems", default="lazarus,ckpt,torchft",
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (default lazarus,ckpt,torchft)")
    p.add_argument("--no-sim", action="store_true", help="skip the simulator check")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--out", default=str(HERE), help="where results.md, timeline.png, sim_config.json go")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--raw", default=None, metavar="FILE",
                   help="analyse the raw replays saved in FILE (raw.json of an earlier run, same trace flags) "
                        "instead of running the systems")
    ModelSpec.add_arguments(p)
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            p.error(f"--systems: {s!r} is not one of {', '.join(SYSTEMS)}")
    try:
        trace = TraceSpec(args.trace, _duration(args.start), args.minutes or (30.0 if args.quick else 60.0),
                          args.nodes, args.compress, args.kill_share, args.trace_seed)
        sc = trace.scenario()
    except ValueError as exc:
        p.error(str(exc))
    spec = ModelSpec.from_args(args)
    for pkg in ("lazarus", "moc", "storage_backends", "examples", "benchmarks"):
        compileall.compile_dir(str(ROOT / pkg), quiet=2, workers=0)
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    acts = actions(sc)
    log(f"trace {Path(trace.path).name} from {trace.start_s / 3600:g} h, {trace.minutes:g} min at {trace.compress:g}x "
        f"= {trace.duration_s:.0f} s, at most {trace.cap} nodes: starts with {len(sc.initial)}, "
        f"{len(acts)} actions: " + ", ".join(f"{a.t:.0f}s {a.kind} {a.node}" for a in acts))
    work = Path(tempfile.mkdtemp(prefix="trace-bench-"))
    results: dict[str, dict[str, Any]] = {}
    t_all = time.time()
    try:
        if args.raw:
            saved = json.loads(Path(args.raw).read_text())
            results = {s: analyse(s, saved[s], spec) for s in systems if s in saved}
        for s in systems:
            if s in results:
                continue
            t_sys = time.time()
            log(f"{s}:")
            results[s] = run_system(s, work / s, spec, trace, log=log)
            results[s]["bench_wall_s"] = round(time.time() - t_sys, 1)
    finally:
        if args.keep:
            log(f"logs in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "raw.json").write_text(json.dumps({s: r["raw"] for s, r in results.items()}))
    sim = None if args.no_sim else simulate(results, trace, spec, out)
    cmp = compare(results, sim) if sim else None
    elapsed = time.time() - t_all
    rerun = "python benchmarks/trace/main.py " + shlex.join(list(argv if argv is not None else sys.argv[1:]))
    notes = [f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; command: `{rerun.strip()}`; "
             f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; "
             f"Python {platform.python_version()}; {elapsed:.0f} s in all.",
             f"Trace {Path(trace.path).name}, from {trace.start_s / 3600:g} h for {trace.minutes:g} trace minutes, "
             f"compressed {trace.compress:g}x to {trace.duration_s:.0f} s, at most {trace.cap} nodes (starts with "
             f"{len(sc.initial)}); {len(acts)} actions, kill share {trace.kill_share:g}, seed {trace.seed}.",
             f"Model: {spec.layers} MoE layers of {spec.experts} experts (d_model {spec.d_model}), global batch "
             f"{spec.batch_size} x {spec.seq_len} tokens whatever the nodes (strong scaling on 2 shared cores).",
             "ETTR = useful time / wall time: a new step away from any event counts its own time, one during "
             "an event's disruption (until training again; a join until the joiner trains) its world's mean "
             "undisturbed step; lost per event = the span from an event to the next that is not useful, "
             "checkpoint saves excepted; recovery = the event to the next new step."]
    for s, r in results.items():
        typ = ", ".join(f"{w} nodes {t * 1000:.0f} ms" for w, t in sorted(r["typical_step_s"].items()))
        extra = ""
        if r.get("interval"):
            iv = r["interval"]
            extra = (f"; Young/Daly N = {iv.get('every')} steps (DCP save {iv.get('save_s', 0):.3f} s, MTBF "
                     f"{iv.get('mtbf_steps', 0):.0f} steps), {r.get('restarts')} restarts")
        notes.append(f"{s}: typical step {typ}; baseline (before the first event) lost {r['baseline_lost_s']:.2f} s "
                     f"of {r['baseline_span_s']:.1f} s{extra}.")
    if sim:
        notes.append(f"Simulator: `{sim['command']}` (config written beside this file: sim_config.json; "
                     f"lazarus = Lazarus, ds = checkpoint-restart, dsft = torchft).")
        for name, over in sim["config"]["systems"].items():
            notes.append(f"measured costs given to the simulator, {name}: " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(over["perf"].items())))
    text = tables(results, cmp) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    (out / "results.md").write_text("# benchmarks/trace results\n\n" + text)
    try:
        plot(results, availability(sc, trace.duration_s), trace.duration_s, out / "timeline.png",
             spec.tokens_per_step)
    except ImportError as exc:
        log(f"no plot: {exc}")
    if args.json:
        slim = {s: {k: v for k, v in r.items() if k not in ("progress", "raw")} for s, r in results.items()}
        print(json.dumps({"results": slim, "compare": cmp, "sim_command": sim and sim["command"]}, indent=1,
                         default=str))
    else:
        print()
        print(text)
        print(f"wrote {out / 'results.md'}, {out / 'timeline.png'}" + (", sim_config.json" if sim else ""))
        print(f"rerun: make bench-trace (QUICK=1) or {rerun.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
