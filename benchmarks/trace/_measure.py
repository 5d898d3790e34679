"""What ``benchmarks/trace`` measures in a replay, and the simulator config made from it.

From a system's metrics lines (:mod:`benchmarks.peers._common`'s format) between the
replay's start ``t0`` and its end:

- *the final state's lineage*: the last commit, the last commit of the step before it that
  came before it, and so on: the steps the model at the end holds. A commit a roll back
  later discarded is not in it (a job that lost every replica and started again holds only
  what it trained since), and of a step trained twice only the second is. Committed tokens
  = the lineage's steps since ``t0`` x tokens per step (what the simulator counts: its roll
  backs discard the compute they undo); goodput = committed tokens / wall seconds.
- *progress*: the commits of steps never committed before (a restart's redone steps are
  not progress): an event's recovery runs to the first of them.
- *typical step* at each world size: the mean gap between consecutive commits of
  that world (one step apart, same incarnation) away from any event (from an event until
  the job is back to new steps, for a join until the joiner trains) and any save: the
  step as this (shared, loaded) machine runs it; *useful time* = each lineage commit's own
  step time away from disruptions (the machine's background load moves it), its world's
  typical step inside one; ETTR = useful time / wall time (the simulator's compute /
  simulated time).
- *time lost per event*: the wall time from an event to the next one (or the end) that is
  not useful (counted by progress: a roll back's discarded steps are the event's), less the
  checkpoint saves in it (booked as checkpoint time); events at the
  same instant share their span equally. The span before the first event is the baseline.

:func:`sim_config` turns these into ``lazarus simulate --config`` sections, one per
simulated system (``lazarus`` = Lazarus, ``ds`` = checkpoint-restart, ``dsft`` = torchft:
replicas that reconfigure in place): the measured step time per node count; for Lazarus
and torchft each event kind's mean lost time less the half step the simulator drops with
the interrupted step (a join's includes what the joiner's start-up, importing torch, takes
from the members on these two shared cores), and the join window from the joins; for
checkpoint-restart the restart (recovery less the steps redone, which the simulator's roll
back books itself), the Young/Daly interval and the save.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import fields
from typing import Any, Sequence

from lazarus.runtime import ControllerConfig

__all__ = ["progress", "lineage", "typical_steps", "measure", "sim_config", "SIM_SYSTEM"]

#: How long the live Lazarus arm's last members under notice wait for a joiner to hand over
#: to: the controller's default ``--handover-wait`` (the simulator's ``notice_period_s``).
HANDOVER_WAIT_S: float = {f.name: f.default for f in fields(ControllerConfig)}["handover_wait"].total_seconds()

#: The simulator's system for each live arm.
SIM_SYSTEM = {"lazarus": "lazarus", "ckpt": "ds", "torchft": "dsft", "torchft-readme": "dsft"}


def _commits(records: list[dict[str, Any]], same_s: float = 2.0) -> list[tuple[float, int, int, int]]:
    """``(t, step, world, run)`` of each commit, by time: the ranks' lines of one step (of one
    incarnation) within ``same_s`` of its first are one commit; the same step committed again
    later (a job that lost its state and trained it again, with or without a ``run`` field) is
    another commit."""
    lines: dict[tuple[int, int], list[tuple[float, int]]] = {}
    for r in records:
        if r.get("kind") == "step":
            lines.setdefault((int(r["step"]), int(r.get("run", 0))), []).append((float(r["t"]), int(r.get("world", 0))))
    out = []
    for (step, run), xs in lines.items():
        xs.sort()
        first = None
        for t, w in xs:
            if first is None or t - first > same_s:
                first = t
                out.append((t, step, w, run))
    return sorted(out)


def progress(records: list[dict[str, Any]], t0: float, t_end: float) -> tuple[int, list[tuple[float, int, int, int]]]:
    """``(highest step committed by t0, the progress commits in (t0, t_end])``."""
    high = -1
    out = []
    for c in _commits(records):
        if c[0] <= t0:
            high = max(high, c[1])
        elif c[0] <= t_end and c[1] > high:
            out.append(c)
            high = c[1]
    base = max((c[1] for c in _commits(records) if c[0] <= t0), default=-1)
    return base, out


def lineage(records: list[dict[str, Any]], t0: float, t_end: float) -> tuple[int, list[tuple[float, int, int, int]]]:
    """``(the lineage's step at t0, its commits in (t0, t_end])``: the final state's lineage
    (see the module docstring). Where it begins after ``t0`` (the job lost everything it
    held then), its step at ``t0`` is the one before its first."""
    commits = [c for c in _commits(records) if c[0] <= t_end]
    if not commits:
        return -1, []
    by_step: dict[int, list[tuple[float, int, int, int]]] = {}
    for c in commits:
        by_step.setdefault(c[1], []).append(c)   # in time order
    chain = [commits[-1]]
    while True:
        before = [c for c in by_step.get(chain[-1][1] - 1, ()) if c[0] < chain[-1][0]]
        if not before:
            break
        chain.append(before[-1])
    chain.reverse()
    held = [c for c in chain if c[0] <= t0]
    base = held[-1][1] if held else chain[0][1] - 1
    return base, [c for c in chain if c[0] > t0]


def typical_steps(prog: Sequence[tuple[float, int, int, int]],
                  disrupted: Sequence[tuple[float, float]] = ()) -> dict[int, float]:
    """World size -> its typical step (seconds): the mean gap between consecutive progress
    commits (one step apart, same world and incarnation) outside the ``disrupted`` spans (an
    event until its recovery, a save); a world seen only inside them: its best five steps in
    a row there (what it sustained with the least else running)."""
    steady: dict[int, list[float]] = {}
    every: dict[int, list[float]] = {}
    for a, b in zip(prog, prog[1:]):
        if b[1] == a[1] + 1 and b[2] == a[2] and b[3] == a[3]:
            every.setdefault(b[2], []).append(b[0] - a[0])
            if not any(lo < b[0] and a[0] < hi for lo, hi in disrupted):
                steady.setdefault(b[2], []).append(b[0] - a[0])
    out = {}
    for w, g in every.items():
        if len(steady.get(w, ())) >= 3:
            out[w] = statistics.fmean(steady[w])
        elif len(g) >= 3 or len(every) == 1:
            # seen only while something else ran on the cores: the best 5 steps in a row
            k = min(5, len(g))
            out[w] = min(statistics.fmean(g[i:i + k]) for i in range(len(g) - k + 1))
    return out


def _typical_at(typ: dict[int, float], w: int) -> float:
    if w in typ:
        return typ[w]
    if not typ:
        raise ValueError("no typical step: fewer than two consecutive steps committed in the replay")
    return typ[min(typ, key=lambda k: (abs(k - w), k))]


def measure(records: list[dict[str, Any]], events: list[dict[str, Any]], t0: float, t_end: float,
            tokens_per_step: int, joined: dict[str, float] | None = None) -> dict[str, Any]:
    """The figures of one system's replay; ``events``: ``{"t", "kind", "node"}`` injected;
    ``joined``: node -> when a joiner began training (where the system says so)."""
    joined = joined or {}
    _, fresh = progress(records, t0, t_end)
    base, prog = lineage(records, t0, t_end)
    commits = _commits(records)
    # one save per checkpoint (every rank writes a line; keep one per step and run)
    seen: dict[tuple[int, int], float] = {}
    for r in records:
        if r.get("kind") == "saved" and t0 < float(r["t"]) <= t_end:
            key = (int(r["step"]), int(r.get("run", 0)))
            seen[key] = max(seen.get(key, 0.0), float(r["seconds"]))
    save_t = {key: min(float(r["t"]) for r in records if r.get("kind") == "saved"
                       and (int(r["step"]), int(r.get("run", 0))) == key) for key in seen}
    saves = sorted((save_t[k], s) for k, s in seen.items())
    # what each event disrupts: until the job is back to new steps, and for a join until the
    # joiner trains (its start-up shares the cores); a save
    disrupted = [(t - s, t) for t, s in saves]
    for e in events:
        # training again: the second commit after it (a step in flight may commit just after)
        after = [c[0] for c in commits if c[0] > e["t"]][:2]
        back = after[-1] if len(after) == 2 else t_end
        if e["kind"] == "join" and e["node"] in joined:
            back = max(back, next((c[0] for c in commits if c[0] > joined[e["node"]]), back))
        elif e["kind"] == "join":
            w = next((c[2] for c in reversed(commits) if c[0] < e["t"]), 0)
            back = max(back, next((c[0] for c in commits if c[0] >= e["t"] and c[2] > w), back))
        disrupted.append((e["t"], back))
    # every step trained counts for the step time, redone ones too (a job that lost its state
    # trains it again at its normal speed)
    typ = typical_steps([c for c in commits if t0 < c[0] <= t_end], disrupted)
    if not typ:
        # too few steps in the replay itself (a job restarting all along): its steps before it
        typ = typical_steps(progress(records, float("-inf"), t_end)[1])
    wall = t_end - t0
    # a new step away from any disruption counts its own duration (the machine's load moves
    # the step time; the simulator gets the mean); one inside a disruption its world's step
    inside = sorted(c for c in commits if t0 < c[0] <= t_end)
    prev_of = {c: p for p, c in zip(inside, inside[1:])}

    def useful_of(seq: Sequence[tuple[float, int, int, int]]) -> list[tuple[float, float]]:
        out = []
        for c in seq:
            p = prev_of.get(c)
            ok = p is not None and c[1] == p[1] + 1 and c[2] == p[2] and c[3] == p[3] and not any(
                lo < c[0] and p[0] < hi for lo, hi in disrupted)
            out.append((c[0], c[0] - p[0] if ok and p is not None else _typical_at(typ, c[2])))
        return out

    # ETTR counts the final state's steps; an event's lost time counts until new progress (a
    # roll back's discarded steps are booked to the event that discards them, as the redone
    # steps after it)
    useful, fresh_useful = useful_of(prog), useful_of(fresh)
    # time lost per event: spans between event instants
    times = sorted({e["t"] for e in events})
    bounds = [t0] + [t for t in times if t0 <= t <= t_end] + [t_end]
    spans = []
    for lo, hi in zip(bounds, bounds[1:]):
        use = sum(u for t, u in fresh_useful if lo < t <= hi)
        ck = sum(s for t, s in saves if lo < t <= hi)
        redone = sum(1 for c in commits if lo < c[0] <= hi) - sum(1 for c in fresh if lo < c[0] <= hi)
        spans.append({"lo": lo, "hi": hi, "lost_s": max(0.0, (hi - lo) - use - ck), "checkpoint_s": ck,
                      "redone": redone})
    per_event = []
    for e in events:
        span = next((s for s in spans[1:] if abs(s["lo"] - e["t"]) < 1e-9), None)
        if span is None:
            continue
        share = sum(1 for x in events if abs(x["t"] - e["t"]) < 1e-9)
        row = {**e, "at_s": round(e["t"] - t0, 3), "lost_s": span["lost_s"] / share,
               "span_s": span["hi"] - span["lo"]}
        # recovery: the event to the first progress commit after it (the steps redone on the way)
        back = next((c for c in fresh if c[0] > e["t"]), None)
        row["recovery_s"] = None if back is None else back[0] - e["t"]
        row["redone"] = sum(1 for c in commits if e["t"] < c[0] < (back[0] if back else t_end)) - sum(
            1 for c in fresh if e["t"] < c[0] < (back[0] if back else t_end))
        row["overlapped"] = back is None or back[0] > span["hi"]   # another event came first
        row["left_s"] = t_end - e["t"]
        if e["kind"] == "join":
            # the joiner's world: its first commit (where the system says when the joiner began
            # training; else the first commit of a larger world before the next event); the
            # members paused at the commit before it (stall: that gap less the new world's step)
            before = [c for c in commits if c[0] < e["t"]]
            w = before[-1][2] if before else 0
            if e["node"] in joined:
                i = next((i for i, c in enumerate(commits) if c[0] > joined[e["node"]]), None)
            else:
                i = next((i for i, c in enumerate(commits) if e["t"] <= c[0] <= span["hi"] and c[2] > w), None)
            if i is not None and i > 0 and commits[i - 1][0] >= e["t"] - 60:
                first, prev = commits[i], commits[i - 1]
                row["join_to_world_s"] = first[0] - e["t"]
                row["join_pause_at_s"] = max(0.0, prev[0] - e["t"])
                row["join_stall_s"] = max(0.0, first[0] - prev[0] - _typical_at(typ, first[2]))
                # all the members lost to it: the window's time not useful, the stall included
                used = sum(u for t, u in fresh_useful if e["t"] < t <= first[0])
                row["join_loss_s"] = max(0.0, first[0] - e["t"] - used)
        per_event.append(row)
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in ("kill", "term", "join"):
        xs = [p["lost_s"] for p in per_event if p["kind"] == kind]
        if xs:
            by_kind[kind] = {"n": len(xs), "mean_lost_s": statistics.fmean(xs), "max_lost_s": max(xs)}
    steps = max(0, prog[-1][1] - base) if prog else 0
    tokens = steps * tokens_per_step
    useful_s = sum(u for _, u in useful)
    return {"wall_s": wall, "steps": steps, "tokens": tokens,
            "goodput": tokens / wall if wall > 0 else 0.0, "useful_s": useful_s,
            "ettr": useful_s / wall if wall > 0 else 0.0, "typical_step_s": typ,
            "checkpoint_s": sum(s for _, s in saves), "baseline_lost_s": spans[0]["lost_s"] if spans else 0.0,
            "baseline_span_s": (spans[0]["hi"] - spans[0]["lo"]) if spans else 0.0,
            "per_event": per_event, "by_kind": by_kind, "save_s": [s for _, s in saves],

            "progress": [[c[0] - t0, c[1], c[2]] for c in prog]}


def _mean(xs: Sequence[float], default: float = 0.0) -> float:
    return statistics.fmean(xs) if xs else default


def sim_config(results: dict[str, dict[str, Any]], *, experts: int, layers: int, expert_params: float,
               non_expert_params: float, batch: int, nodes: int) -> dict[str, Any]:
    """The ``lazarus simulate --config`` of a replay: the bench's model, and per simulated
    system the costs its live arm measured (see the module docstring)."""
    model = {"name": "bench-trace", "num_experts": experts, "moe_layers": layers, "expert_params": expert_params,
             "non_expert_params": non_expert_params, "bytes_per_param": 12.0, "gpus_per_node": 1,
             "slots_per_node": experts, "samples_per_node_step": batch / nodes, "ref_nodes": nodes,
             "expert_fraction": 0.0, "comm_per_doubling": 0.0, "fixed_batch": True, "top_k": 1, "sim_layers": 0}
    # Shared: no imbalance, no periodic rebalance, state moves inside the measured reconfigurations.
    perf = {"transfer_gbps": 1e6, "storage_read_gbps": 1e6, "storage_write_gbps": 1e6, "memory_read_gbps": 1e6,
            "snapshot_gbps": 1e6, "ckpt_call_s": 0.0, "dispatch_overhead": 0.0, "rebalance_s": 0.0,
            "rebalance_every_steps": 10 ** 9, "skew_epoch_steps": 10 ** 9, "min_replicas": min(2, nodes),
            "ds_interval_steps": 10 ** 9, "ft_interval_steps": 10 ** 9, "lazarus_interval_steps": 10 ** 9,
            "moc_interval_divisor": 1, "restart_s": 0.0, "detect_s": 0.0, "notice_detect_s": 0.0,
            "reconfig_s": 0.0, "join_window_s": 0.0, "dynamic_k": False}
    systems: dict[str, Any] = {}
    for arm, res in results.items():
        name = SIM_SYSTEM[arm]
        if name in systems:
            continue
        typ = {int(w): float(x) for w, x in res["typical_step_s"].items()}
        ref = typ.get(nodes) or statistics.fmean(typ.values())
        ev = res["per_event"]

        def recovered(kinds: tuple[str, ...], clean: bool) -> list[float]:
            """Recovery times of the events of these kinds less the steps redone on the way
            (the simulator books a roll back itself) (``clean``: only those back before the
            next event, unless none was); an event never recovered from counts with the time
            it had left (a lower bound), when no event of its kinds recovered."""
            xs = [e for e in ev if e["kind"] in kinds and e.get("recovery_s") is not None]
            if clean:
                xs = [e for e in xs if not e["overlapped"]] or xs
            if xs:
                return [e["recovery_s"] - e["redone"] * ref for e in xs]
            return [e["left_s"] for e in ev if e["kind"] in kinds]

        p: dict[str, Any] = {}
        if name == "ds":
            # every event restarts the job from its newest checkpoint: recovery = the restart,
            # the redone steps (the simulator's roll back books them) and one new step
            kinds = ("kill", "term", "join")
            xs = [e for e in ev if e.get("recovery_s") is not None]
            xs = [e for e in xs if not e["overlapped"]] or xs
            rest = [e["recovery_s"] - (e["redone"] + 1) * ref for e in xs] or [
                x - ref for x in recovered(kinds, True)]
            p.update(restart_s=max(0.0, _mean(rest)), save_before_scale=False,
                     ds_interval_steps=int(res.get("interval", {}).get("every") or 10 ** 9),
                     ckpt_call_s=_mean(res.get("save_s", [])))
        else:
            # a join: the members train on until the joiner is ready (the join window, from
            # the joins no departure disturbed), then stall once
            joins = [e for e in ev if e["kind"] == "join" and e.get("join_loss_s") is not None]
            # (only joins with no departure before the joiner trained, nor one still being
            # recovered from when it came, unless none was)
            joins = [e for e in joins if not any(
                x["kind"] != "join" and (e["t"] <= x["t"] <= e["t"] + e["join_to_world_s"]
                                         or x["t"] <= e["t"] <= x["t"] + (x.get("recovery_s") or math.inf))
                for x in ev)] or joins
            p.update(join_window_s=_mean([e["join_pause_at_s"] for e in joins]), reconfig_s=0.0)
            # each kind of event: the time the job lost after it until the next event (the
            # bench's "lost per event"; what the joiner's start-up takes from the members on
            # these shared cores included) less the half step the simulator drops with the
            # step it interrupts; booked as the join's stall, the kill's and the notice's
            # detection (reconfig_s 0: it is inside them)
            for kinds, field in ((("join",), "join_reconfig_s"), (("kill",), "detect_s"),
                                 (("term",), "notice_detect_s")):
                xs = [e["lost_s"] for e in ev if e["kind"] in kinds]
                p[field] = max(0.0, _mean(xs, 0.5 * ref) - 0.5 * ref)
            if name == "lazarus":
                # the last members under notice wait for a starting joiner as long as the
                # controller's --handover-wait (the live arm runs its default)
                p.update(lazarus_interval_steps=10, notice_period_s=HANDOVER_WAIT_S)
        systems[name] = {"perf": p, "model": {"step_s": ref, "step_s_by_nodes": sorted([w, x] for w, x in typ.items())},
                         "checkpoint": "two-level" if name == "lazarus" else "full"}
    return {"model": model, "perf": perf, "systems": systems}
