"""``make demo``: a Lazarus job on 4 worker nodes (processes on this machine) that loses a
node its peers can absorb, then a node holding the only replica of some expert (moc
fallback), then gains a node; training never restarts.

The node that joins, n4, is a hot spare (``lazarus agent --standby``) started with the
others: its worker imports and warms up while the job trains, and it registers when the
demo calls it in (SIGUSR1). The demo then waits for it to train, whatever the machine's
load (it never races the end of the job), and prints where the join's time went.

Prints a per-event table (detection time, reconfiguration time, experts moved, where
they came from, PLT, steps rolled back), the join's figures, the training loss, and writes
a PNG of throughput and node count over time. Rerun: ``python -m examples.lazarus_demo --dir runs/lazarus-demo``.

``--lost-experts replay``: moc in exact mode (``MoCConfig(exact=True)``, a window of 4
steps captured every step, every window persisted) and ``ElasticConfig(lost_experts=
"replay")``: the second failure rolls the job back to the newest committed window's first
step and replays it instead of booking PLT; the table's last column says how many steps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .local_cluster import LocalCluster


def _singleton_holder(plan: dict[str, Any]) -> tuple[str, list[str]]:
    """The member holding the most experts that have no other replica."""
    best, best_units = None, []
    for i, node in enumerate(plan["members"]):
        units = []
        for layer, slots in plan["layers"].items():
            for e in set(slots[i]):
                if sum(1 for s in slots if e in s) == 1:
                    units.append(f"{layer}/{e}")
        if len(units) > len(best_units):
            best, best_units = node, units
    if best is None:
        raise RuntimeError("no expert has a single replica; cannot stage the moc-fallback event")
    return best, best_units


def run(workdir: Path, steps: int, quick: bool, lost_experts: str = "restore") -> int:
    if workdir.exists():
        shutil.rmtree(workdir)
    if lost_experts == "replay":   # exact windows of 4 steps (8 experts, 2 per step), every one persisted
        ckpt = ["--exact", "--k-snapshot", "2", "--persist-every", "1", "--lost-experts", "replay"]
    else:
        ckpt = ["--interval", "10", "--k-snapshot", "2", "--k-persist", "1", "--persist-every", "2"]
    worker = ["--steps", str(steps), "--storage", str(workdir / "store"), *ckpt, "--collective-timeout", "5s",
              "--report-every", "10", "--digests", str(workdir / "digest-{node}.json")]
    if quick:
        worker += ["--layers", "2", "--d-model", "32", "--d-hidden", "64", "--batch-size", "8", "--seq-len", "32"]
    controller = ["--slots", "4", "--min-replicas", "2", "--expected-nodes", "4", "--heartbeat-timeout", "2s",
                  "--join-window", "1s"]
    marks = [steps // 5, 2 * steps // 5, 3 * steps // 5]
    t_start = time.time()
    timeline: list[dict[str, Any]] = []
    with LocalCluster(workdir / "job", worker_args=worker, controller_args=controller,
                      agent_args=["--heartbeat-interval", "250ms"]) as c:
        print(f"lazarus demo: controller + 4 agents, training {steps} steps of a byte-level MoE GPT on the "
              f"Python stdlib sources, lost experts: {lost_experts} (logs in {c.dir})", flush=True)
        c.start(["n0", "n1", "n2", "n3"])
        c.add_node("n4", standby=True)   # the joiner: warms up now, joins when called in
        c.wait_step(marks[0], timeout=240)
        victim = "n3"
        timeline.append({"event": f"SIGKILL node {victim} (peers hold replicas)", "node": victim,
                         "step": c.current_step(), "t": c.kill_node(victim)})
        print(f"  step {timeline[-1]['step']}: {timeline[-1]['event']}", flush=True)
        c.wait_for(lambda: len(c.reconfigurations()) >= 2, 60, "recovery from the first failure")
        c.wait_step(marks[1], timeout=240)
        victim, singles = _singleton_holder(c.latest_plan())
        timeline.append({"event": f"SIGKILL node {victim} (only replica of {len(singles)} experts)", "node": victim,
                         "step": c.current_step(), "t": c.kill_node(victim)})
        print(f"  step {timeline[-1]['step']}: {timeline[-1]['event']}", flush=True)
        c.wait_for(lambda: len(c.reconfigurations()) >= 3, 60, "recovery from the second failure")
        c.wait_step(marks[2], timeout=240)
        step = c.current_step()
        timeline.append({"event": "node n4 joins", "node": "n4", "step": step, "t": c.activate("n4")})
        print(f"  step {timeline[-1]['step']}: {timeline[-1]['event']} (hot spare called in)", flush=True)
        c.wait_for(lambda: any(r.get("reason") == "join" for r in c.reconfigurations()), 120, "node n4 training")
        rc = c.wait(timeout=600)
        events, metrics = c.events(), c.metrics()
    elapsed = time.time() - t_start
    _report(workdir, timeline, events, metrics, elapsed)
    return 0 if rc == 0 else 1


def _report(workdir: Path, timeline: list[dict], events: list[dict], metrics: list[dict], elapsed: float) -> None:
    recs = [m for m in metrics if m.get("kind") == "reconfigured" and m.get("reason") != "start"]
    steps = sorted((m for m in metrics if m.get("kind") == "step"), key=lambda m: m["t"])
    rows = []
    for ev in timeline:
        if ev["node"] == "n4":
            seen = next((e["t"] for e in events if e.get("event") == "worker_ready" and e.get("node") == "n4"), None)
            rec = next((r for r in recs if r["reason"] == "join"), None)
            detected = seen
        else:
            detected = next((e["t"] for e in events if e.get("event") == "node_failed" and e.get("node") == ev["node"]
                             and e["t"] >= ev["t"]), None)
            rec = next((r for r in recs if r["reason"] in ("failure", "collective_error") and r["t_resumed"] > ev["t"]),
                       None)
        detect_s = (detected - ev["t"]) if detected else None
        reconf_s = (rec["t_resumed"] - detected) if rec and detected else None
        src = rec["sources"] if rec else {}
        rows.append([ev["event"], ev["step"], _f(detect_s), _f(reconf_s),
                     _f(rec["t_resumed"] - ev["t"]) if rec else "-",
                     rec["moved"] if rec else "-",
                     f"peer {src.get('peer', 0)} / memory {src.get('memory', 0)} / storage {src.get('storage', 0)}",
                     f"{100 * rec['plt']:.2f}%" if rec else "-", rec["world_size"] if rec else "-",
                     rollback_cell(rec)])
    head = ["event", "step", "detect s", "reconf s", "kill->train s", "experts moved", "source (experts)", "PLT",
            "nodes", "rolled back"]
    print()
    print(_table(head, rows))
    print()
    join = next((ev for ev in timeline if ev["node"] == "n4"), None)
    if join is not None:
        print(join_figures(join["t"], "n4", events, metrics))
        print()
    losses = [(m["step"], m["loss"]) for m in steps]
    if losses:
        marks = sorted({0, *range(0, losses[-1][0] + 1, max(1, losses[-1][0] // 6)), losses[-1][0]})
        by_step = dict(losses)
        print("loss: " + "  ".join(f"step {s}: {by_step[s]:.3f}" for s in marks if s in by_step))
    plans = [e for e in events if e.get("event") == "plan" and e.get("reason") != "start"]
    for p in plans:
        rp = p.get("recovery_probability") or {}
        print(f"plan gen {p['generation']} ({p['reason']}, {len(p['members'])} nodes): fetches greedy "
              f"{p['fetches']['greedy']} vs identity {p['fetches']['identity']}; recovery probability under one "
              f"more failure {min(rp.values()) if rp else float('nan'):.3f}")
    png = workdir / "lazarus_demo.png"
    try:
        _plot(png, steps, timeline)
        print(f"wrote {png}")
    except ImportError:
        print("matplotlib missing: no plot")
    (workdir / "summary.json").write_text(json.dumps({"rows": rows, "elapsed_s": elapsed}, indent=1))
    print(f"demo finished in {elapsed:.0f} s")


def rollback_cell(rec: dict[str, Any] | None) -> str:
    """The table's "rolled back" cell of a reconfiguration record: the steps trained again
    (``lost_experts="replay"``), the window replayed and the rollback's own time; "-" when
    there was no rollback."""
    rb = (rec or {}).get("rollback")
    if not rb:
        return "-"
    a, b = rb["window"]
    return f"{rb['steps']} steps to {rb['to_step']} (window {a}-{b}, {rb['source']}, {rb['seconds']:.2f} s)"


def join_figures(t_called: float, node: str, events: list[dict], metrics: list[dict]) -> str:
    """Where a join's time went, from the moment the node was called in: registered,
    ready, join plan issued, reconfiguration done, first step trained with it; and the
    longest the members went without a step meanwhile."""
    def first(pred) -> float | None:
        return next((e["t"] for e in events if e.get("t", 0) >= t_called and pred(e)), None)

    marks = {
        "registered": first(lambda e: e.get("event") == "node_registered" and e.get("node") == node),
        "ready": first(lambda e: e.get("event") == "worker_ready" and e.get("node") == node),
        "plan": first(lambda e: e.get("event") == "plan" and node in (e.get("joined") or [])),
    }
    rec = next((m for m in metrics if m.get("kind") == "reconfigured" and m.get("reason") == "join"
                and m["t_resumed"] >= t_called), None)
    steps = sorted((m for m in metrics if m.get("kind") == "step"), key=lambda m: m["t"])
    trained = next((m for m in steps if m["t"] >= t_called and node in (rec or {}).get("members", [])
                    and m["generation"] >= (rec or {}).get("generation", 1 << 30)), None)
    parts = [f"{k} +{v - t_called:.2f} s" for k, v in marks.items() if v is not None]
    if rec:
        parts.append(f"reconfigured +{rec['t_resumed'] - t_called:.2f} s ("
                     + ", ".join(f"{k} {v:.2f}" for k, v in rec.get("timings", {}).items()) + ")")
    if trained:
        parts.append(f"first step with it +{trained['t'] - t_called:.2f} s")
    around = [m["t"] for m in steps if t_called - 2 <= m["t"] <= (trained or {"t": t_called + 5})["t"]]
    gaps = [b - a for a, b in zip(around, around[1:])]
    usual = sorted(b["t"] - a["t"] for a, b in zip(steps, steps[1:]))
    typical = usual[len(usual) // 2] if usual else 0.0
    line = f"join of {node} (called in at t=0): " + ", ".join(parts) if parts else f"join of {node}: not seen"
    if gaps:
        line += f"; members' longest step gap meanwhile {max(gaps):.2f} s (a step takes {typical:.2f} s)"
    pauses = [m for m in metrics if m.get("kind") == "member_pause" and rec and m.get("generation") == rec["generation"]
              and m.get("node") != node and m.get("typical_step_s", 0) > 0]
    if pauses:   # each member's own account: its gap less its median step, in its steps
        worst = max(pauses, key=lambda m: m["stall_s"] / m["typical_step_s"])
        line += (f"; each member's own stall at most {worst['stall_s']:.2f} s = "
                 f"{worst['stall_s'] / worst['typical_step_s']:.1f} of its steps")
        waited = max((m for m in pauses if m.get("wait_s") is not None),
                     key=lambda m: m["wait_s"] / m["typical_step_s"], default=None)
        if waited is not None:   # last step's end -> training again
            line += (f", not training at most {waited['wait_s']:.2f} s = "
                     f"{waited['wait_s'] / waited['typical_step_s']:.1f} of its steps")
    return line


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _table(head: list[str], rows: list[list[Any]]) -> str:
    cells = [head] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _plot(path: Path, steps: list[dict], timeline: list[dict]) -> None:
    from moc._optional import import_optional

    matplotlib = import_optional("matplotlib", "the demo's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = steps[0]["t"]
    ts = [m["t"] - t0 for m in steps]
    window = 10
    rate_t, rate = [], []
    for i in range(window, len(steps)):
        dt = steps[i]["t"] - steps[i - window]["t"]
        if dt > 0:
            rate_t.append(ts[i])
            rate.append(window / dt)
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 7.6), sharex=True)
    ax1.plot(rate_t, rate, color="tab:blue")
    ax1.set_ylabel("steps / s")
    ax1.ticklabel_format(axis="y", useOffset=False)
    ax2.step(ts, [m["world"] for m in steps], where="post", color="tab:green")
    ax2.set_ylabel("nodes training")
    ax2.set_ylim(0, 5)
    ax3.plot(ts, [m["loss"] for m in steps], color="tab:red", lw=0.8)
    ax3.set_ylabel("loss")
    ax3.set_xlabel("seconds since the first step")
    for ev in timeline:
        for ax in (ax1, ax2, ax3):
            ax.axvline(ev["t"] - t0, color="gray", ls="--", lw=0.8)
        # above the plot (x in data, y in axes units), never on the curve
        ax1.annotate(ev["event"].split(" (")[0], (ev["t"] - t0, 1.02), xycoords=("data", "axes fraction"),
                     fontsize=7, rotation=45, va="bottom", ha="left", annotation_clip=False)
    fig.suptitle("Lazarus on 4 CPU nodes: throughput, membership and loss")
    fig.text(0.5, 0.01, "The nodes share this machine's cores: with fewer processes each one gets more CPU, so "
             "steps/s can rise after a node leaves.\nOn separate hosts throughput follows the nodes training.",
             ha="center", va="bottom", fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.lazarus_demo", description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="runs/lazarus-demo", help="work directory (recreated)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--quick", action="store_true", help="a smaller model (for smoke tests)")
    p.add_argument("--lost-experts", choices=("restore", "replay"), default="restore",
                   help="when a node with the only replica of some experts dies: restore them from moc and book "
                        "PLT (default), or roll back and replay an exact window (moc exact mode, PLT 0)")
    args = p.parse_args(argv)
    if args.steps < 50:
        p.error("--steps must be >= 50 (three events are staged along the run)")
    return run(Path(args.dir), args.steps, args.quick, args.lost_experts)


if __name__ == "__main__":
    sys.exit(main())
