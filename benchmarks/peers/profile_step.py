"""Where a training step's time goes, per system of ``benchmarks/peers``: one worker of each
arm sampled by ``py-spy`` (wall clock, idle waits included) in steady state, its main
thread's samples sorted into what the step spends them on.

The peers bench found Lazarus's step rate on its 4-node MoE GPT at 5-7 steps/s against
tuned torchft's 9-11 on this 2-core machine; this says where the difference goes. Each
system runs alone (4 nodes, the bench's model, data and settings, no faults); after
``--warmup`` steps the worker of node n1 is sampled for ``--seconds``.

Needs ``py-spy`` (``pip install py-spy``; it is not a dependency of the library) and
permission to trace the workers (same user, ptrace allowed).

Rerun: ``python benchmarks/peers/profile_step.py`` (about 2 minutes); ``--systems lazarus``
for one. Writes ``benchmarks/peers/profile.md``.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from _common import ModelSpec  # noqa: E402
from main import NODES, make_arm  # noqa: E402

#: (category, test on the main thread's frames, innermost last): the first that matches wins.
CATEGORIES: list[tuple[str, Any]] = [
    ("moc checkpoint (snapshot, persist)", lambda fr: any("moc/" in f for f in fr)),
    ("dispatch all-to-all (tokens out and back, forward and backward)",
     lambda fr: any("_AllToAll" in f or "all_to_all_uneven" in f for f in fr)),
    ("routing counts all-gather", lambda fr: any("all_gather_rows" in f for f in fr)),
    ("expert replica gradient sync", lambda fr: any("sync_moe_gradients" in f for f in fr)),
    ("step agreement all-reduce (plans), reports", lambda fr: any("_after_step" in f for f in fr)),
    ("gradient all-reduce (dense; torchft: the whole model)",
     lambda fr: any("_sync_gradients" in f or "comm_hook" in f or "allreduce" in f.lower() or "all_reduce" in f
                    for f in fr) and not any("_clip_gradients" in f for f in fr)),
    ("gradient clip (its norm all-reduce)", lambda fr: any("_clip_gradients" in f or "clip_grad" in f for f in fr)),
    ("optimizer step", lambda fr: any("Optimizer" in f or "adam" in f.lower() for f in fr)),
    ("backward compute", lambda fr: any("backward" in f for f in fr)),
    ("forward compute", lambda fr: any(".forward" in f or "loss_fn" in f for f in fr)),
    ("torchft manager (quorum, commit)", lambda fr: any("torchft/" in f for f in fr)),
    ("data, metrics, the loop itself", lambda fr: True),
]


def _pyspy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("profile_step.py needs py-spy: pip install py-spy")
    return found


def _worker_pid(arm: Any, node: str) -> int:
    if hasattr(arm, "cluster"):
        pids = arm.cluster.worker_pids(node)
        return next(iter(pids.values()))
    return arm.procs[node].pid


def profile(system: str, work: Path, spec: ModelSpec, warmup: int, seconds: float, rate: int) -> dict[str, Any]:
    arm = make_arm(system, work, spec, steps=100_000, mtbf_steps=1e9)
    try:
        arm.start(NODES)
        deadline = time.monotonic() + 300
        while arm.step() < warmup:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{system}: not at step {warmup} within 300 s; see {work}")
            time.sleep(0.1)
        pid = _worker_pid(arm, "n1")
        raw = work / "n1.raw"
        s0, t0 = arm.step(), time.time()
        subprocess.run([_pyspy(), "record", "-p", str(pid), "-d", str(int(seconds)), "-r", str(rate), "--idle",
                "-f", "raw", "-o", str(raw), "--nonblocking"], check=True, capture_output=True)
        s1, t1 = arm.step(), time.time()
    finally:
        arm.stop()
    shares: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if not frames[0].startswith(("_run_module_as_main", "<module>")):
            continue   # other threads (moc's writers, the plan watcher) run beside the step
        shares[next(name for name, test in CATEGORIES if test(frames))] += int(n)
    total = sum(shares.values())
    steps_s = (s1 - s0) / (t1 - t0)
    return {"system": system, "steps_s": steps_s, "samples": total,
            "ms_per_step": {k: 1000.0 * v / total / steps_s for k, v in shares.items()} if total and steps_s else {}}


def table(results: Sequence[dict[str, Any]]) -> str:
    cats = [c for c, _ in CATEGORIES]
    head = "| where the step's time goes | " + " | ".join(f"{r['system']} (ms per step)" for r in results) + " |"
    lines = [head, "|---" * (1 + len(results)) + "|"]
    for c in cats:
        vals = [r["ms_per_step"].get(c, 0.0) for r in results]
        if any(v >= 0.05 for v in vals):
            lines.append(f"| {c} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")
    lines.append("| **step (1 / steps per s)** | " + " | ".join(f"**{1000 / r['steps_s']:.1f}**" for r in results)
                 + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--systems", default="lazarus,torchft-tuned", help="comma list of the bench's systems")
    p.add_argument("--warmup", type=int, default=40, help="steps before sampling (default 40)")
    p.add_argument("--seconds", type=float, default=12.0, help="seconds of sampling per system (default 12)")
    p.add_argument("--rate", type=int, default=200, help="samples per second (default 200)")
    p.add_argument("--out", default=str(HERE / "profile.md"), help="where the table goes ('' = nowhere)")
    ModelSpec.add_arguments(p)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.seconds < 1 or args.rate < 1:
        p.error("--warmup, --seconds and --rate must be >= 1")
    spec = ModelSpec.from_args(args)
    _pyspy()
    results = []
    with tempfile.TemporaryDirectory(prefix="peers-profile-") as tmp:
        for system in [s for s in args.systems.split(",") if s]:
            work = Path(tmp) / system
            work.mkdir()
            results.append(profile(system, work, spec, args.warmup, args.seconds, args.rate))
    text = (f"Step profile, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, load "
            f"{os.getloadavg()[0]:.1f} at the end: node n1's worker sampled {args.seconds:g} s at {args.rate}/s "
            f"(py-spy, wall clock) after step {args.warmup}; each system alone on the machine.\n\n{table(results)}\n\n"
            f"Rerun: `python benchmarks/peers/profile_step.py --systems {args.systems}`.\n")
    print(text)
    if args.out:
        Path(args.out).write_text("# Where the step goes (benchmarks/peers/profile_step.py)\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
