"""``make soak-matrix``: the soak (``benchmarks/soak/main.py``) for N seeds x M minutes, idle
and with CPU-bound load beside it, summarised in one table.

Each run is a separate ``main.py`` process (its own work directory under ``--dir``, its
record as JSON beside it). The table has one row per run: seed, load, faults by kind,
survived, time lost median / max per kind, steps lost, the longest time without a
checkpoint reaching storage, and every check; then time lost
per kind over all runs against the issue-28 targets (node or worker kill <= 2 s, also during
a join, a reconfiguration or two within the grace, controller kill 0 steps and <= 2 s, storage
outage 0 s). It is printed and written to ``benchmarks/soak/matrix.md``.

Rerun: ``make soak-matrix`` (10 seeds x 10 minutes x {idle, --load 2}: 20 soaks of 12-18
minutes each, calibration and the final checks included: 4-5 hours on 2 cores), or
``python benchmarks/soak/matrix.py --seeds 7,8 --minutes 3 --loads 0,2``.
Exit status 0 when every run passed every check, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from _soak_faults import KINDS, TARGETS, target_met  # noqa: E402

SHORT = {"kill_node": "kn", "kill_worker": "kw", "kill_controller": "kc", "freeze_node": "fz", "freeze_worker": "fw",
         "spot_notice": "sp",
         "join": "j", "storage_outage": "so", "slow_storage": "ss", "shm_full": "shm", "kill_during_join": "kdj",
         "kill_during_reconfig": "kdr", "kill_controller_away": "kca", "kill_two_in_grace": "k2",
         "spot_notice_persist_hung": "sph", "partition": "pt", "cut_controller": "cc", "cut_peers": "cp",
         "cut_peers_in": "cpi", "cut_peers_out": "cpo", "cut_storage": "cs", "flap": "fl"}
#: the checks in the order main.py lists them, by the start of their text
CHECKS = (("job finished", "finished"), ("no worker died", "no crash"), ("moc verify", "verify"),
          ("replicas identical", "replicas"), ("loss down", "loss"), ("every fault accounted", "accounted"),
          ("sane state sizes", "world"))


def _seeds(text: str) -> list[int]:
    """``"10"`` -> seeds 0..9; ``"7,8,12"`` -> those seeds."""
    if "," in text:
        return [int(s) for s in text.split(",") if s.strip()]
    n = int(text)
    if n < 1:
        raise ValueError(f"--seeds must be a count >= 1 or a comma list of seeds, got {text!r}")
    return list(range(n))


def command(seed: int, load: int, minutes: float, out: Path, kinds: str | None, network: str) -> list[str]:
    """The ``main.py`` command line of one run (its record: ``out`` + ``.json``)."""
    cmd = [sys.executable, str(HERE / "main.py"), "--seed", str(seed), "--load", str(load), "--minutes", str(minutes),
           "--dir", str(out), "--results", "", "--json", str(out.with_suffix(".json")), "--network", network]
    if kinds:
        cmd += ["--kinds", kinds]
    return cmd


def run_one(seed: int, load: int, minutes: float, workdir: Path, kinds: str | None,
            network: str = "loopback") -> dict[str, Any]:
    out = workdir / f"seed{seed}-load{load}"
    record = out.with_suffix(".json")
    cmd = command(seed, load, minutes, out, kinds, network)
    t0 = time.time()
    commit = _commit()   # the code the run starts on (edits made while it runs do not count)
    samples: list[float] = []
    done = threading.Event()

    def sample() -> None:   # the machine's 1-minute load average while the soak runs, every 5 s
        while not done.wait(5.0):
            samples.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample, name="loadavg", daemon=True)
    sampler.start()
    with open(out.with_suffix(".log"), "w") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        try:
            child.wait()
        except BaseException:   # SIGTERM / Ctrl-C of the matrix: the soak cleans up, then we go
            child.terminate()
            child.wait(timeout=120)
            raise
        r = child
    done.set()
    sampler.join()
    if not record.exists():
        return {"seed": seed, "load": load, "rc": r.returncode, "error": f"no record (exit {r.returncode}); see "
                f"{out.with_suffix('.log')}", "total_s": time.time() - t0}
    rec = json.loads(record.read_text())
    rec.update(rc=r.returncode, commit=commit)
    if samples:   # what the machine carried, the soak's own processes and --load included
        rec["host_load"] = {"mean": statistics.fmean(samples), "max": max(samples)}
    record.write_text(json.dumps(rec))   # --collect then knows which code each run tested
    return rec


def _commit() -> str:
    """The checked-out commit (short), ``+dirty`` with uncommitted changes to tracked files."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _fmt(lost: list[float]) -> str:
    return f"{statistics.median(lost):.1f}/{max(lost):.1f}" if lost else "-"


def row(rec: dict[str, Any]) -> str:
    if "error" in rec:
        return f"| {rec['seed']} | {rec['load']} | - | - | - | - | - | - | **{rec['error']}** |"
    faults = rec["faults"]
    kinds = {}
    for f in faults:
        kinds.setdefault(f["kind"], []).append(f)
    counts = " ".join(f"{SHORT.get(k, k)} {len(v)}" for k, v in kinds.items())
    lost = "; ".join(f"{SHORT.get(k, k)} {_fmt([f['time_lost'] for f in v if f['time_lost'] is not None])}"
                     for k, v in kinds.items())
    steps = sum(f["steps_lost"] or 0 for f in faults)
    survived = f"{sum(f['accounted'] for f in faults)}/{len(faults)}"
    failed = [short for start, short in CHECKS for c in rec["checks"]
              if c["name"].startswith(start) and not c["passed"]]
    checks = "all pass" if not failed else "**fail: " + ", ".join(failed) + "**"
    if rec.get("targets_missed"):
        checks += "; targets missed: " + ", ".join(SHORT.get(k, k) for k in rec["targets_missed"])
    nocommit = f"{rec['commit_gap_s']:.0f} s / {rec['commit_gap_steps']}" if "commit_gap_s" in rec else "-"
    host = rec.get("host_load")
    host = f"{host['mean']:.1f} / {host['max']:.1f}" if host else "-"
    return (f"| {rec['seed']} | {rec['load']} | {host} | {counts} | {survived} | {lost} | {steps} | {nocommit} | "
            f"{checks} |")


def per_kind(records: list[dict[str, Any]]) -> list[str]:
    out = ["| fault | load | injected | survived | time lost median / max (s) | steps lost | target | met |",
           "|---|---|---|---|---|---|---|---|"]
    for kind in KINDS:
        for load in sorted({r["load"] for r in records}):
            fs = [(f, r["step_s"]) for r in records if r["load"] == load and "error" not in r
                  for f in r["faults"] if f["kind"] == kind]
            if not fs:
                continue
            lost = [f["time_lost"] for f, _ in fs if f["time_lost"] is not None]
            steps = sum(f["steps_lost"] or 0 for f, _ in fs)
            step_s = statistics.median(s for _, s in fs)
            met = target_met(kind, lost, steps, step_s)
            target = "-" if kind not in TARGETS else (f"<= {TARGETS[kind][0]:g} s" + (
                "" if TARGETS[kind][1] is None else f", {TARGETS[kind][1]} steps"))
            out.append(f"| `{kind}` | {load} | {len(fs)} | {sum(f['accounted'] for f, _ in fs)} | "
                       f"{_fmt(lost).replace('/', ' / ')} | {steps} | {target} | "
                       f"{ {None: '-', True: 'yes', False: '**no**'}[met]} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="10", help="a count N (seeds 0..N-1, default 10) or a comma list of seeds")
    ap.add_argument("--minutes", type=float, default=10.0, help="minutes of faults per run (default 10)")
    ap.add_argument("--loads", default="0,2", help="comma list of --load values (busy processes; default 0,2)")
    ap.add_argument("--kinds", default=None, help="passed to main.py --kinds (default: every kind)")
    ap.add_argument("--network", choices=("loopback", "netns"), default="loopback",
                    help="passed to main.py --network (netns: every host in its own namespace, the network's "
                         "faults added; needs root and nft)")
    ap.add_argument("--dir", default=None, help="work directory (default runs/soak-matrix[-netns])")
    ap.add_argument("--results", default=None,
                    help="where to write the tables ('' = nowhere; default benchmarks/soak/matrix.md, or "
                         "matrix-netns-runs.md with --network netns)")
    ap.add_argument("--collect", action="store_true",
                    help="run nothing: make the tables from the records of earlier runs in --dir")
    args = ap.parse_args(argv)
    try:
        seeds = _seeds(args.seeds)
        loads = [int(x) for x in args.loads.split(",") if x.strip()]
    except ValueError as exc:
        ap.error(f"--seeds / --loads: {exc}")
    if args.minutes <= 0:
        ap.error(f"--minutes must be > 0, got {args.minutes}")
    if not loads or any(x < 0 for x in loads):
        ap.error(f"--loads must be a comma list of integers >= 0, got {args.loads!r}")
    netns = args.network == "netns"
    default_dir = ROOT / "runs" / ("soak-matrix-netns" if netns else "soak-matrix")
    workdir = Path(args.dir) if args.dir is not None else default_dir
    if args.results is None:
        args.results = str(HERE / ("matrix-netns-runs.md" if netns else "matrix.md"))
    workdir.mkdir(parents=True, exist_ok=True)
    records = []
    for seed in seeds:
        for load in loads:
            if args.collect:
                path = workdir / f"seed{seed}-load{load}.json"
                rec = json.loads(path.read_text()) if path.exists() else {
                    "seed": seed, "load": load, "error": f"no record {path}"}
                records.append(rec)
                continue
            rec = run_one(seed, load, args.minutes, workdir, args.kinds, args.network)
            records.append(rec)
            print(row(rec), flush=True)
    legend = ", ".join(f"{v} = {k}" for k, v in SHORT.items())
    lines = [
        f"Soak matrix: seeds {','.join(map(str, seeds))} x {args.minutes:g} min of faults x load "
        f"{','.join(map(str, loads))} ({len(records)} runs, "
        f"{sum(r.get('total_s', 0) for r in records) / 3600:.1f} h of soak); "
        f"{os.cpu_count()} cores; code: {', '.join(sorted({str(r.get('commit', 'not recorded')) for r in records}))}.",
        "",
        "| seed | load | host load avg mean / max | faults by kind | survived | time lost median/max per kind (s) | "
        "steps lost | longest without a commit (time / steps) | checks |",
        "|---|---|---|---|---|---|---|---|---|",
        *[row(r) for r in records],
        "",
        f"Kinds: {legend}. Load: the number of busy processes beside the soak (`--load`); host load avg: the "
        "machine's 1-minute load average sampled every 5 s during the run (the soak's own processes included).",
        "",
        *per_kind(records),
        "",
        f"Rerun: `python benchmarks/soak/matrix.py --seeds {args.seeds} --minutes {args.minutes:g} --loads "
        f"{args.loads}`; each run's log, JSON record and work directory under `{workdir}`.",
    ]
    print("\n".join(lines))
    if args.results:
        Path(args.results).write_text("# make soak-matrix\n\n" + "\n".join(lines) + "\n")
    failed = [r for r in records if "error" in r or not all(c["passed"] for c in r["checks"])]
    return 1 if failed else 0


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
