"""Lazarus side by side with what a user would pick instead: torchft (its Lighthouse and
Manager, README settings and tuned) and torchrun-style checkpoint-restart (DCP every N
steps, N from Young/Daly), on the same MoE model, the same seeded data and the same
failures.

torchft's groups wait ``TORCHFT_PG_TIMEOUT_S`` for a dead peer inside a collective: 5 s
with its README's settings (torchft's ``train_ddp.py``), 1 s tuned (the shortest this
model's steps allow; what a SIGKILL costs the survivors).

Every system runs 4 local nodes on gloo and gets the same schedule: SIGKILL of node n3 at
20% of the steps, a replacement node n4 joining at 35% (the next fault waits until it
trains), SIGTERM of node n1 (a spot notice) at 85%. Lazarus's n4 is a hot spare
(``lazarus agent --standby``, warm since the start; ``lazarus-cold`` starts it at the join);
torchft's is a new replica group process and checkpoint-restart's a restart of the job on
the nodes there are. Per system and
fault: time from the fault to the next committed step that is new progress, steps redone or
discarded, steps/s before and after; per system: goodput (committed tokens per second).

Run: ``make bench-peers`` or ``python benchmarks/peers/main.py [--quick] [--json]
[--systems lazarus,torchft-readme,torchft-tuned,ckpt]``. Writes ``results.md`` and
``timeline.png`` beside this file (with ``--out DIR``: there) and prints the table;
``--json`` prints the rows as JSON instead.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from _arms import CkptRestartArm, LazarusArm, TorchftArm  # noqa: E402
from _common import Fault, ModelSpec, analyse  # noqa: E402

SYSTEMS = ("lazarus", "torchft-readme", "torchft-tuned", "ckpt", "lazarus-cold")
NODES = ["n0", "n1", "n2", "n3"]


def make_arm(system: str, work: Path, spec: ModelSpec, steps: int, mtbf_steps: float) -> Any:
    if system == "lazarus":
        return LazarusArm(work, spec, steps, spare="n4")
    if system == "lazarus-cold":
        return LazarusArm(work, spec, steps, spare=None)
    if system.startswith("torchft-"):
        return TorchftArm(work, spec, steps, system.split("-", 1)[1])
    if system == "ckpt":
        return CkptRestartArm(work, spec, steps, mtbf_steps)
    raise ValueError(f"system must be one of {', '.join(SYSTEMS)}; got {system!r}")


def _wait(pred: Callable[[], Any], timeout: float, what: str, arm: Any) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise TimeoutError(f"{arm.name}: timed out after {timeout:.0f} s waiting for {what}; see {arm.work}")


def _world_now(arm: Any) -> int:
    """The world size of the newest committed step (0 before any)."""
    steps = [r for r in arm.records() if r.get("kind") == "step"]
    return int(max(steps, key=lambda r: r["t"]).get("world", 0)) if steps else 0


def _world_at_least(arm: Any, n: int, since: float) -> bool:
    return any(r.get("kind") == "step" and r["t"] >= since and int(r.get("world", 0)) >= n for r in arm.records())


def schedule(steps: int, faults: Sequence[str]) -> list[tuple[str, str, int]]:
    """``(kind, node, at step)`` of the failure schedule (a subset of kill, join, term)."""
    plan = {"kill": ("n3", round(0.20 * steps)), "join": ("n4", round(0.35 * steps)),
            "term": ("n1", round(0.85 * steps))}
    for f in faults:
        if f not in plan:
            raise ValueError(f"fault must be one of kill, join, term; got {f!r}")
    return [(k, *plan[k]) for k in ("kill", "join", "term") if k in faults]


def run_system(system: str, work: Path, spec: ModelSpec, steps: int, faults: Sequence[str], *,
               nodes: Sequence[str] = tuple(NODES), step_timeout: float = 240.0, join_timeout: float = 120.0,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run one system on ``nodes`` through the schedule (the kill and the SIGTERM hit the
    last and the second node); its :func:`_common.analyse` result, with the join's figures
    and the raw records."""
    nodes = list(nodes)
    if len(nodes) < 3:
        raise ValueError(f"nodes: at least 3 (a kill and a SIGTERM leave one survivor each), got {nodes}")
    plan = [(k, {"kill": nodes[-1], "term": nodes[1]}.get(k, n), at) for k, n, at in schedule(steps, faults)]
    n_faults = max(1, len(plan))
    arm = make_arm(system, work, spec, steps, mtbf_steps=steps / n_faults)
    injected: list[Fault] = []
    joins: dict[str, Any] = {}
    join_world: dict[float, int] = {}   # a join's time -> the world size that includes its node
    t0 = time.time()
    try:
        arm.start(nodes)
        _wait(lambda: _world_at_least(arm, len(nodes), t0), step_timeout, f"all {len(nodes)} nodes training", arm)
        for kind, node, at in plan:
            _wait(lambda: arm.step() >= min(at, steps - 1), step_timeout, f"step {at}", arm)
            cur = arm.step()
            world_before = _world_now(arm)
            if cur >= steps - 1:
                log(f"  {arm.name}: the run ended before {kind} {node} (step {at}) was due; not injected")
                continue
            t = getattr(arm, kind)(node)
            injected.append(Fault(kind, node, t, cur))
            log(f"  {arm.name}: step {cur}: {kind} {node}")
            if kind == "join":
                # the next fault waits until the joiner trains (never racing it), or the run ends
                join_world[t] = world_before + 1
                _wait(lambda: _world_at_least(arm, world_before + 1, t) or arm.step() >= steps - 1, join_timeout,
                      f"node {node} training", arm)
        arm.finish(timeout=step_timeout * 2)
    finally:
        arm.stop()
    records = arm.records()
    res = analyse(arm.name, records, injected, spec.tokens_per_step)
    res["faults"] = [f.__dict__ for f in injected]
    for f in injected:
        if f.kind == "join":
            first = min((r["t"] for r in records if r.get("kind") == "step" and r["t"] >= f.t
                         and int(r.get("world", 0)) >= join_world[f.t]), default=None)
            joins = {"join_to_train_s": None if first is None else round(first - f.t, 3)}
            joins.update(_join_detail(arm, f, first))
    res["join"] = joins
    if isinstance(arm, CkptRestartArm):
        res["interval"] = arm.interval()
        res["restarts"] = arm.restarts
    return res


def _worst(pauses: list[dict[str, Any]], key: str) -> tuple[float | None, float | None]:
    """The longest ``key`` of the members' pause records, in seconds and in each member's
    own typical steps (None where no record has it)."""
    have = [m for m in pauses if m.get(key) is not None]
    steps = [m[key] / m["typical_step_s"] for m in have if m["typical_step_s"] > 0]
    return (max(m[key] for m in have) if have else None), (round(max(steps), 2) if steps else None)


def _join_detail(arm: Any, f: Fault, first: float | None) -> dict[str, Any]:
    """Where a join's time goes, from what each system records; and the longest the
    existing members went between two commits while it joined, less a normal step."""
    out: dict[str, Any] = {}
    commits = sorted({(r["t"], r["step"]) for r in arm.records() if r.get("kind") == "step"})
    if first is not None:
        inside = [t for t, _ in commits if f.t - 5 <= t <= first]
        gaps = [b - a for a, b in zip(inside, inside[1:])]
        steps = [b - a for (a, _), (b, _) in zip(commits, commits[1:])]
        typical = sorted(steps)[len(steps) // 2] if steps else 0.0
        out["members_longest_gap_s"] = round(max(gaps), 3) if gaps else None
        out["members_stall_s"] = round(max(0.0, max(gaps) - typical), 3) if gaps else None
    if isinstance(arm, LazarusArm):
        ev = arm.events()
        node = f.node

        def at(pred: Callable[[dict], bool]) -> float | None:
            return next((e["t"] - f.t for e in ev if pred(e) and e.get("t", 0) >= f.t), None)

        ready = next((e for e in ev if e.get("event") == "worker_ready" and e.get("node") == node
                      and e.get("t", 0) >= f.t), None)
        # the joiner's start-up phases (negative: done before a hot spare was called in)
        for phase, t in ((ready or {}).get("startup") or {}).items():
            out[f"worker_{phase}_s"] = round(t - f.t, 3)
        out["registered_s"] = _r(at(lambda e: e.get("event") == "node_registered" and e.get("node") == node))
        out["worker_ready_s"] = _r(at(lambda e: e.get("event") == "worker_ready" and e.get("node") == node))
        out["plan_s"] = _r(at(lambda e: e.get("event") == "plan" and node in (e.get("joined") or [])))
        rec = next((m for m in arm.cluster.metrics() if m.get("kind") == "reconfigured" and m.get("reason") == "join"
                    and m["t_resumed"] >= f.t), None)
        if rec:
            out["resumed_s"] = round(rec["t_resumed"] - f.t, 3)
            out["reconfigure_timings"] = {k: round(v, 3) for k, v in rec.get("timings", {}).items()}
            # each member's own account of the join (its lost time, less its typical step)
            pauses = [m for m in arm.cluster.metrics() if m.get("kind") == "member_pause"
                      and m.get("generation") == rec["generation"] and m.get("node") != node]
            if pauses:
                out["member_stall_s"] = {m["node"]: m["stall_s"] for m in sorted(pauses, key=lambda m: m["node"])}
                out["member_typical_step_s"] = max(m["typical_step_s"] for m in pauses)
                out["member_reconfigure_s"] = max(m["reconfigure_s"] for m in pauses)
                # the join's cost to the members in their own steps (target: at most 1): their stall, and
                # the time they did not train (last step's end -> training again)
                for key in ("stall", "wait"):
                    out[f"member_{key}_max_s"], out[f"member_{key}_steps"] = _worst(pauses, f"{key}_s")
    else:
        start = next((r for r in arm.records() if r.get("kind") == "start" and r["t"] >= f.t), None)
        ready = next((r for r in arm.records() if r.get("kind") == "ready" and r["t"] >= f.t), None)
        if start:
            out["process_started_s"] = round(start["t_process"] - f.t, 3)
        if ready:
            out["built_s"] = round(ready["t"] - f.t, 3)
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


#: A join's phases in time order: (label, key of the join's figures).
JOIN_PHASES = (("agent started (cold) / called in (hot spare)", None),
               ("worker process spawned by the agent", "worker_spawned_s"),
               ("worker process running", "worker_process_s"),
               ("imports done (torch, lazarus, the example)", "worker_imported_s"),
               ("warm-up done (torch.optim's dynamo import, gc freeze)", "worker_warm_s"),
               ("storage probed, hello sent", "worker_probed_s"),
               ("node registered at the controller", "registered_s"),
               ("worker ready at the controller", "worker_ready_s"),
               ("join plan issued", "plan_s"),
               ("reconfigured (joiner built, state from peers, moc manager)", "resumed_s"),
               ("first step trained by the joiner's world", "join_to_train_s"))


def phase_table(results: list[dict[str, Any]]) -> str:
    """Where each Lazarus arm's join went, seconds since the agent started (cold) or the
    spare was called in (hot); negative: done before."""
    laz = [r for r in results if r["system"].startswith("lazarus") and r.get("join")]
    if not laz:
        return ""
    lines = ["| join phase | " + " | ".join(r["system"] for r in laz) + " |", "|---|" + "---:|" * len(laz)]
    for label, key in JOIN_PHASES:
        cells = ["0.00" if key is None else _f(r["join"].get(key)) for r in laz]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for key in ("retire", "rendezvous", "migrate", "install", "joiners", "moc"):
        cells = [_f((r["join"].get("reconfigure_timings") or {}).get(key), 3) for r in laz]
        lines.append(f"| reconfiguration: {key} (rank 0) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- output ---------------------------------------------------------------------------------
def _f(x: Any, nd: int = 2) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def table(results: list[dict[str, Any]]) -> str:
    head = ["system", "fault", "at step", "fault -> next new step (s)", "steps redone / discarded",
            "steps/s before", "steps/s after"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results:
        for r in res["rows"]:
            lines.append(f"| {res['system']} | {r['fault']} | {r['step']} | {_f(r['time_lost_s'])} | "
                         f"{r['redone']} / {r['discarded']} | {_f(r['steps_per_s_before'], 1)} | "
                         f"{_f(r['steps_per_s_after'], 1)} |")
    lines += ["", "| system | goodput (tokens/s) | steps | seconds (first to last commit) | join: start -> "
              "training (s) | members' longest stall while it joined (s) | each member's own stall, in its steps "
              "| each member's own wait (not training), in its steps |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        j = res.get("join") or {}
        lines.append(f"| {res['system']} | {_f(res['goodput'], 0)} | {res['steps']} | {_f(res['seconds'], 1)} | "
                     f"{_f(j.get('join_to_train_s'))} | {_f(j.get('members_stall_s'))} | "
                     f"{_f(j.get('member_stall_steps'))} | {_f(j.get('member_wait_steps'))} |")
    return "\n".join(lines)


def target_notes(results: list[dict[str, Any]]) -> list[str]:
    """Issue 27's targets, as ratios of this run's figures: Lazarus's time lost per failure
    against tuned torchft's (target <= 0.5), its goodput the highest, a cold join no slower
    than torchft's rejoin, and the members' stall while a node joins (target <= 1 step)."""
    by = {r["system"]: r for r in results}   # by the arms' names: "torchft (tuned)", "lazarus (cold join)"
    out = []
    laz, ft = by.get("lazarus"), by.get("torchft (tuned)")
    if laz and ft:
        for fault in ("kill", "term"):
            a = next((row["time_lost_s"] for row in laz["rows"] if row["fault"].startswith(fault)), None)
            b = next((row["time_lost_s"] for row in ft["rows"] if row["fault"].startswith(fault)), None)
            if a is not None and b:
                out.append(f"target: {fault}: Lazarus loses {a:.2f} s, tuned torchft {b:.2f} s: ratio {a / b:.2f} "
                           f"(target <= 0.5)")
    if results:
        best = max(results, key=lambda r: r["goodput"])
        out.append(f"target: highest goodput: {best['system']} ({best['goodput']:,.0f} tokens/s)")
    cold = (by.get("lazarus (cold join)") or {}).get("join") or {}
    for name in ("torchft (tuned)", "torchft (readme)"):
        other = (by.get(name) or {}).get("join") or {}
        if cold.get("join_to_train_s") is not None and other.get("join_to_train_s") is not None:
            out.append(f"target: cold join, agent start -> first step: {cold['join_to_train_s']:.2f} s against "
                       f"{name}'s new replica group {other['join_to_train_s']:.2f} s (target: <= 3 s and no slower)")
    for name in ("lazarus", "lazarus (cold join)"):
        j = (by.get(name) or {}).get("join") or {}
        if j.get("member_stall_steps") is not None:
            out.append(f"target: {name}: members' longest own stall while the node joined "
                       f"{j['member_stall_max_s']:.3f} s "
                       f"= {j['member_stall_steps']:.2f} of their steps (target <= 1; it counts a first step in "
                       f"the larger world slower than their steps before it too)")
        if j.get("member_wait_steps") is not None:
            out.append(f"target: {name}: members' longest own wait (last step's end -> training again) "
                       f"{j['member_wait_max_s']:.3f} s = {j['member_wait_steps']:.2f} of their steps (target <= 1)")
    return out


def json_rows(results: list[dict[str, Any]]) -> dict[str, Any]:
    return {"rows": [{"system": r["system"], "fault": row["fault"], "time_lost_s": row["time_lost_s"],
                      "steps_lost": row["steps_lost"]} for r in results for row in r["rows"]],
            "goodput": {r["system"]: r["goodput"] for r in results},
            "join_to_train_s": {r["system"]: (r.get("join") or {}).get("join_to_train_s") for r in results}}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    from moc._optional import import_optional

    matplotlib = import_optional("matplotlib", "the benchmark's timeline")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 1.9 * len(results) + 0.6), sharex=True, squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        commits = res["commits"]
        t0 = commits[0][0]
        ts = [c[0] - t0 for c in commits]
        w = 5
        rate_t = [ts[i] for i in range(w, len(ts)) if ts[i] > ts[i - w]]
        rate = [w / (ts[i] - ts[i - w]) for i in range(w, len(ts)) if ts[i] > ts[i - w]]
        ax.plot(rate_t, rate, lw=1.0, color="tab:blue")
        ax.set_ylabel("steps/s", fontsize=8)
        ax.set_title(f"{res['system']}: goodput {_f(res['goodput'], 0)} tokens/s", fontsize=9, loc="left")
        for f in res["faults"]:
            ax.axvline(f["t"] - t0, color={"kill": "tab:red", "join": "tab:green", "term": "tab:orange"}[f["kind"]],
                       ls="--", lw=0.9)
            ax.annotate(f"{f['kind']} {f['node']}", (f["t"] - t0, ax.get_ylim()[1]), fontsize=7, va="top",
                        ha="left", rotation=90)
    axes[-1, 0].set_xlabel("seconds since the system's first committed step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/peers/main.py", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="fewer steps (120: about 2 minutes for the four systems on 2 quiet cores)")
    p.add_argument("--steps", type=int, default=None, help="steps per system (default 300, 120 with --quick)")
    p.add_argument("--systems", default=",".join(SYSTEMS[:4]),
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (default: the first four; lazarus-cold "
                        f"starts the joiner's agent at the join instead of calling in a hot spare)")
    p.add_argument("--faults", default="kill,join,term", help="comma-separated subset of kill,join,term")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--out", default=str(HERE), help="where results.md and timeline.png go")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    ModelSpec.add_arguments(p)
    args = p.parse_args(argv)
    # Every process it starts imports the project: from bytecode, as an installed wheel does
    # (an editable install under PYTHONDONTWRITEBYTECODE would compile it again in each).
    for pkg in ("lazarus", "moc", "storage_backends", "examples", "benchmarks"):
        compileall.compile_dir(str(ROOT / pkg), quiet=2, workers=0)
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            p.error(f"--systems: {s!r} is not one of {', '.join(SYSTEMS)}")
    steps = args.steps or (120 if args.quick else 300)
    if steps < 20:
        p.error("--steps must be >= 20 (three events are staged along the run)")
    faults = [f for f in args.faults.split(",") if f]
    spec = ModelSpec.from_args(args)
    work = Path(tempfile.mkdtemp(prefix="peers-bench-"))
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    results = []
    t_all = time.time()
    try:
        for s in systems:
            log(f"{s}: {steps} steps, faults {faults}")
            t_sys = time.time()
            results.append(run_system(s, work / s, spec, steps, faults, log=log))
            results[-1]["wall_s"] = round(time.time() - t_sys, 1)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"logs in {work}")
    elapsed = time.time() - t_all
    if args.json:
        print(json.dumps(json_rows(results), indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = table(results)
    phases = phase_table(results)
    if phases:
        md += "\n\n" + phases
    ck = next((r for r in results if r.get("interval")), None)
    notes = [f"{steps} steps per system, global batch {spec.batch_size} x {spec.seq_len} tokens, "
             f"{spec.layers} MoE layers of {spec.experts} experts (d_model {spec.d_model}); "
             f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; "
             f"Python {platform.python_version()}; {elapsed:.0f} s in all ("
             + ", ".join(f"{r['system']} {r['wall_s']:.0f} s" for r in results) + ")."]
    if ck:
        iv = ck["interval"]
        notes.append(f"checkpoint-restart: Young/Daly N = {iv['every']} steps (DCP save {iv['save_s']:.3f} s, "
                     f"step {iv['step_s']:.3f} s, MTBF {iv['mtbf_steps']:.0f} steps).")
    notes += target_notes(results)
    for r in results:
        if r.get("join"):
            notes.append(f"{r['system']} join: " + ", ".join(f"{k} {v}" for k, v in r["join"].items()))
    text = "\n".join([md, ""] + [f"- {n}" for n in notes]) + "\n"
    (out / "results.md").write_text("# benchmarks/peers results\n\n" + text)
    try:
        plot(results, out / "timeline.png")
    except ImportError as exc:
        log(f"no plot: {exc}")
    if not args.json:
        print()
        print(text)
        print(f"wrote {out / 'results.md'} and {out / 'timeline.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
