"""Recovery benchmark: kill -> training resumed on 4 gloo nodes (the paper reports 20-40 s
on NCCL), experts transferred by the greedy node mapping vs the identity mapping, and the
recovery probability of the placements the controller used.

A real job (controller, 4 agents, the MoE GPT worker) on this machine. Each trial SIGKILLs
one node (agent + worker), waits until the survivors train again, then lets a fresh node
join so the next trial starts from 4 nodes again. A second scenario freezes a node
(SIGSTOP) instead: detection then rests on the heartbeat timeout.

Run: ``python benchmarks/runtime/main.py [--trials 5]`` (about 3 minutes on 2 cores).
Writes ``results.md`` and ``recovery.png`` beside this file and prints the table.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.local_cluster import LocalCluster  # noqa: E402

HERE = Path(__file__).resolve().parent


def _trial_cluster(work: Path, steps: int) -> LocalCluster:
    worker = ["--steps", str(steps), "--storage", str(work / "store"), "--interval", "10", "--k-snapshot", "2",
              "--k-persist", "1", "--collective-timeout", "5s", "--report-every", "10"]
    controller = ["--slots", "4", "--min-replicas", "2", "--expected-nodes", "4", "--heartbeat-timeout", "2s",
                  "--join-window", "1s"]
    return LocalCluster(work / "job", worker_args=worker, controller_args=controller,
                        agent_args=["--heartbeat-interval", "250ms"])


def run(trials: int, freeze: bool) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="lazarus-bench-"))
    out = []
    try:
        with _trial_cluster(work, steps=100000) as c:
            nodes = ["n0", "n1", "n2", "n3"]
            c.start(nodes)
            c.wait_step(20, timeout=240)
            extra = 0
            for i in range(trials):
                victim = nodes[-1]
                before = len(c.reconfigurations())
                t0 = c.freeze_node(victim) if freeze else c.kill_node(victim)
                rec = c.wait_for(lambda: [r for r in c.reconfigurations()[before:]
                                          if r["reason"] in ("failure", "collective_error")], 120, "recovery")[0]
                failed = next(e for e in c.events() if e.get("event") == "node_failed" and e.get("node") == victim
                              and e["t"] >= t0)
                plan = next(e for e in c.events()
                            if e.get("event") == "plan" and e.get("generation") == rec["generation"])
                rp = plan.get("recovery_probability") or {}
                out.append({"trial": i, "detect_s": failed["t"] - t0, "resume_s": rec["t_resumed"] - t0,
                            "reconf_s": rec["t_resumed"] - failed["t"], "greedy": plan["fetches"]["greedy"],
                            "identity": plan["fetches"]["identity"], "moved": rec["moved"],
                            "recovery_p": min(rp.values()) if rp else float("nan"), "world": rec["world_size"]})
                print(f"  trial {i}: {'freeze' if freeze else 'kill'} {victim} -> resumed in "
                      f"{out[-1]['resume_s']:.2f} s on {rec['world_size']} nodes; fetches greedy "
                      f"{out[-1]['greedy']} vs identity {out[-1]['identity']}", flush=True)
                if freeze:
                    c.kill_node(victim)
                extra += 1
                newcomer = f"j{extra}"
                nodes = nodes[:-1]
                before = len(c.reconfigurations())
                c.add_node(newcomer)
                c.wait_for(lambda: [r for r in c.reconfigurations()[before:] if r["reason"] == "join"], 120, "join")
                nodes = [newcomer] + nodes
                c.wait_step(c.current_step() + 10, timeout=120)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _summary(rows: list[dict], key: str) -> str:
    vals = [r[key] for r in rows]
    return f"{statistics.mean(vals):.2f} / {statistics.median(vals):.2f} / {max(vals):.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args()
    print("kills:", flush=True)
    kills = run(args.trials, freeze=False)
    print("freezes:", flush=True)
    freezes = run(max(2, args.trials // 2), freeze=True)
    lines = [
        "# Recovery on 4 gloo nodes (`make bench-runtime`)",
        "",
        f"Machine: {_cpu()}, {os.cpu_count()} cores, torch {torch.__version__}, Python "
        f"{platform.python_version()}; controller, 4 agents and 4 training workers (1 torch thread each) on "
        "this one host, gloo over loopback. Model: MoE GPT, 4 MoE layers x 8 experts, c = 4 slots per node, "
        "f = 2; collective timeout 5 s, heartbeat timeout 2 s.",
        "",
        "| fault | trials | detection s (mean / median / max) | failure -> training s | kill -> training s "
        "| fetches greedy / identity (mean) | recovery probability after (min over layers, mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows in (("SIGKILL node", kills), ("SIGSTOP node (heartbeat 2 s)", freezes)):
        lines.append(
            f"| {name} | {len(rows)} | {_summary(rows, 'detect_s')} | {_summary(rows, 'reconf_s')} | "
            f"{_summary(rows, 'resume_s')} | {statistics.mean(r['greedy'] for r in rows):.1f} / "
            f"{statistics.mean(r['identity'] for r in rows):.1f} | "
            f"{statistics.mean(r['recovery_p'] for r in rows):.3f} |")
    lines += ["", "The paper reports 20-40 s from failure to training on NCCL for GPT-S/M/L. Fetches: expert "
              "states the node mapping makes survivors receive (greedy as planned vs keeping each survivor at "
              "its old plan index). Rerun: `python benchmarks/runtime/main.py`."]
    text = "\n".join(lines) + "\n"
    (HERE / "results.md").write_text(text)
    print(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.bar([f"kill {r['trial']}" for r in kills], [r["resume_s"] for r in kills], color="tab:blue")
        ax.bar([f"stop {r['trial']}" for r in freezes], [r["resume_s"] for r in freezes], color="tab:orange")
        ax.set_ylabel("fault -> training resumed (s)")
        ax.set_title("Lazarus recovery on 4 gloo CPU nodes")
        fig.tight_layout()
        fig.savefig(HERE / "recovery.png", dpi=110)
        print(f"wrote {HERE / 'recovery.png'}")
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
