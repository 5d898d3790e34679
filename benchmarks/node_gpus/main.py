"""Experts moved between the GPUs of one node over a real spot trace: stable deal vs round robin.

Run ``python benchmarks/node_gpus/main.py`` (``make bench-node-gpus``; about a minute).
Writes ``results.md`` and ``moves.png`` next to this file and prints the table.

Workload: the AWS P3 spot trace in ``../shared/traces/aws-p3-32nodes.csv`` (up to 32
nodes over ~11 h, one node added or removed per row) replayed through the controller's
planner (:func:`lazarus.runtime.controller._planner.compute_plan`): 8 GPUs per node, 4 MoE layers of
64 experts, c = 16 slots per node (2 per GPU), f = 2, Zipf loads (s = 1, a different hot
set per layer). Every membership change is one plan; survivors keep what the last plan gave
them, joiners hold nothing. Events that leave fewer than 4 nodes (64 experts need 64 slots)
are skipped, as the controller would stall.

For every plan it counts, per layer and node, the expert copies a GPU must receive:

* **network**: copies its node does not hold (the planner's node-level fetches,
  identical for both deals);
* **same node**: copies its node holds on another of its GPUs. With the stable deal
  (:func:`lazarus.planning.deal_gpus`, what the controller sends) and with the plain
  round-robin deal of the same node rows (what plans did before), measured on the same plans.

Each same-node move is an expert's weights and optimizer state crossing NVLink/PCIe and a
rebuild of that GPU's fused expert tensors during the reconfiguration.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from lazarus.planning import same_node_moves  # noqa: E402
from lazarus.runtime.controller._planner import LayerSpec, applied_holdings, compute_plan  # noqa: E402
from lazarus.sim import load_trace  # noqa: E402

TRACE = next((p for p in (ROOT.parent / "shared" / "traces" / "aws-p3-32nodes.csv",
                           Path("/work/shared/traces/aws-p3-32nodes.csv")) if p.exists()),
             ROOT.parent / "shared" / "traces" / "aws-p3-32nodes.csv")


def zipf_loads(layers: int, experts: int) -> dict[str, list[float]]:
    """Zipf loads, a different hot set per layer (a fixed stride permutation)."""
    out = {}
    for li in range(layers):
        stride = 2 * li + 1          # odd: a permutation of range(experts) when experts is a power of two
        out[f"layer{li}"] = [1.0 / (((e * stride + 7 * li) % experts) + 1) for e in range(experts)]
    return out


def replay(trace: Path, *, gpus: int, layers: int, experts: int, slots: int, f: int) -> dict:
    scen = load_trace(trace)
    specs = [LayerSpec(f"layer{i}", experts) for i in range(layers)]
    loads = zipf_loads(layers, experts)
    min_nodes = -(-experts // slots)
    alive: list[str] = list(scen.initial)
    holdings: dict[str, dict[str, list[int]]] = {}
    gpu_holdings: dict[str, dict[str, list[list[int]]]] = {}
    members: list[str] = []
    rows = []
    plan_ms = []
    for ev in scen.events:
        alive = alive + [n for n in ev.nodes if n not in alive] if ev.kind == "add" \
            else [n for n in alive if n not in ev.nodes]
        for n in ev.nodes:
            if ev.kind == "add":
                holdings.pop(n, None)
                gpu_holdings.pop(n, None)
        if len(alive) < min_nodes:
            continue
        new_members = [m for m in members if m in alive] + [n for n in alive if n not in members]
        t0 = time.perf_counter()
        res = compute_plan(new_members, holdings, specs, loads, slots, f, gpus, gpu_holdings)
        t1 = time.perf_counter()
        compute_plan(new_members, holdings, specs, loads, slots, f, gpus, None)   # round-robin deal only
        plan_ms.append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
        rr = res.gpu_moves_round_robin
        # recount the stable deal's moves from the split itself (not the planner's own tally)
        stable = sum(same_node_moves(res.gpus[s.name][i], gpu_holdings[m][s.name])
                     for s in specs for i, m in enumerate(new_members) if m in gpu_holdings)
        assert stable == res.gpu_moves
        rows.append({"t_s": ev.time_s, "kind": ev.kind, "nodes": len(new_members),
                     "network": res.fetches_greedy, "stable": stable, "round_robin": rr})
        members = new_members
        holdings, gpu_holdings = applied_holdings(members, res.layers, res.gpus)
    return {"rows": rows, "plan_ms": plan_ms}


def table(out: dict) -> list[str]:
    rows = out["rows"]
    removed = [r for r in rows if r["kind"] == "remove"]
    added = [r for r in rows if r["kind"] == "add"]
    lines = ["| plans | network fetches | same-node moves, round robin | same-node moves, stable deal | ratio |",
             "|---|---:|---:|---:|---:|"]
    for name, sel in (("node removed", removed), ("node added", added), ("all", rows)):
        if not sel:
            continue
        net = sum(r["network"] for r in sel)
        rr = sum(r["round_robin"] for r in sel)
        st = sum(r["stable"] for r in sel)
        ratio = f"{st / rr:.3f}" if rr else "-"
        lines.append(f"| {name} ({len(sel)}) | {net:,} | {rr:,} | {st:,} | {ratio} |")
    per = sorted(r["round_robin"] - r["stable"] for r in rows)
    lines += ["", f"Per plan, round robin minus stable: min {per[0]}, median {per[len(per) // 2]}, max {per[-1]} "
              f"(never negative: the deal falls back to round robin when that moves fewer)."
              if per else ""]
    if out["plan_ms"]:
        stable = sorted(a for a, _ in out["plan_ms"])
        plain = sorted(b for _, b in out["plan_ms"])
        mid = len(stable) // 2
        lines += ["", f"Planning time per plan (`compute_plan`, all {len(stable)} plans): median {stable[mid]:.1f} ms "
                  f"with the stable deal (its tally of both deals included), {plain[mid]:.1f} ms with the "
                  f"round-robin deal alone; max {stable[-1]:.1f} / {plain[-1]:.1f} ms."]
    return lines


def plot(out: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = out["rows"]
    t = [r["t_s"] / 3600 for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    for key, label in (("round_robin", "same node, round robin"), ("stable", "same node, stable deal"),
                       ("network", "network fetches (both)")):
        acc, total = [], 0
        for r in rows:
            total += r[key]
            acc.append(total)
        ax.step(t, acc, where="post", label=label)
    ax.set_xlabel("trace time (h)")
    ax.set_ylabel("expert copies moved (cumulative)")
    ax.set_title("AWS P3 spot trace, 8 GPUs per node, 4 x 64 experts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--min-replicas", type=int, default=2)
    args = ap.parse_args()
    out = replay(args.trace, gpus=args.gpus, layers=args.layers, experts=args.experts, slots=args.slots,
                 f=args.min_replicas)
    body = table(out)
    head = ["# Same-node expert moves: stable GPU deal vs round robin", "",
            f"Trace `{args.trace.name}`, {args.gpus} GPUs per node, {args.layers} layers x {args.experts} experts, "
            f"c = {args.slots} slots per node, f = {args.min_replicas}, Zipf loads. "
            f"{len(out['rows'])} plans.", ""]
    foot = ["", f"Machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}; "
            f"{_dt.date.today().isoformat()}. Rerun: `python benchmarks/node_gpus/main.py`."]
    if plot(out, HERE / "moves.png"):
        foot += ["", "Plot: `benchmarks/node_gpus/moves.png`."]
    text = "\n".join(head + body + foot) + "\n"
    (HERE / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
