"""Cluster availability: trace loaders, segment/cap, and synthetic failure generators.

Accepted trace files:

- CSV ``ms,num_nodes``: each row is the node count right after one node was added or
  removed (the P3 trace); CSV ``seconds,num_nodes``: a step function of the count (the
  g4dn trace). The header's first column names the unit (``ms`` or ``seconds``/``s``).
- JSON lines, one event per line: ``[ms, "add"|"remove", {"nodes": ["a", "b"]}]``.

Count-only traces do not say *which* node left; a seeded RNG picks one of the alive nodes,
so that node identities (and hence which replicas die) are reproducible.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Event:
    """``nodes`` were added or removed at ``time_s`` seconds of simulated time.

    ``notice``: a removal announced beforehand (a spot interruption notice, SIGTERM): the
    job learns of it without waiting for a timeout (``PerfParams.notice_detect_s``); False:
    the nodes vanished (SIGKILL, a crash) and the job pays ``PerfParams.detect_s``."""

    time_s: float
    kind: str  # "add" | "remove"
    nodes: tuple[str, ...]
    notice: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("add", "remove"):
            raise ValueError(f"Event.kind must be 'add' or 'remove', got {self.kind!r}")
        if self.notice and self.kind != "remove":
            raise ValueError(f"Event.notice applies to removals only, got kind {self.kind!r}")
        if not math.isfinite(self.time_s) or self.time_s < 0:
            raise ValueError(f"Event.time_s must be a finite number >= 0, got {self.time_s!r}")


@dataclass
class Scenario:
    """Nodes alive at time 0 plus the later membership events (sorted by time)."""

    initial: tuple[str, ...]
    events: list[Event] = field(default_factory=list)
    name: str = ""

    def max_nodes(self) -> int:
        alive, best = set(self.initial), len(self.initial)
        for ev in self.events:
            alive = alive | set(ev.nodes) if ev.kind == "add" else alive - set(ev.nodes)
            best = max(best, len(alive))
        return best


def _counts_to_events(points: list[tuple[float, int]], seed: int) -> list[Event]:
    rng = random.Random(seed)
    alive: list[str] = []
    made = 0
    out: list[Event] = []
    for t, count in points:
        if count > len(alive):
            new = [f"n{made + i}" for i in range(count - len(alive))]
            made += len(new)
            alive.extend(new)
            out.append(Event(t, "add", tuple(new)))
        elif count < len(alive):
            gone = rng.sample(alive, len(alive) - count)
            alive = [n for n in alive if n not in gone]
            out.append(Event(t, "remove", tuple(sorted(gone))))
    return out


def _load_csv(path: Path, text: str, seed: int) -> list[Event]:
    rows = list(csv.reader(text.splitlines()))
    if not rows:
        raise ValueError(f"{path}: empty trace")
    head = [c.strip().lower() for c in rows[0]]
    if len(head) != 2 or head[1] != "num_nodes" or head[0] not in ("ms", "seconds", "s"):
        raise ValueError(f"{path}:1: expected a header 'ms,num_nodes' or 'seconds,num_nodes', got {rows[0]}")
    scale = 1e-3 if head[0] == "ms" else 1.0
    points: list[tuple[float, int]] = []
    for i, row in enumerate(rows[1:], start=2):
        if not any(c.strip() for c in row):
            continue
        try:
            t, n = float(row[0]) * scale, int(row[1])
        except (ValueError, IndexError):
            raise ValueError(f"{path}:{i}: expected '<time>,<num_nodes>', got {','.join(row)!r}") from None
        if n < 0 or t < 0 or (points and t < points[-1][0]):
            raise ValueError(f"{path}:{i}: times must be non-decreasing and counts >= 0, got {','.join(row)!r}")
        points.append((t, n))
    return _counts_to_events(points, seed)


def _load_jsonl(path: Path, text: str) -> list[Event]:
    out: list[Event] = []
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            ms, kind, body = item
            nodes = body["nodes"]
            if not isinstance(nodes, list) or not all(isinstance(n, (str, int)) for n in nodes):
                raise TypeError
            notice = body.get("notice", False)
            if not isinstance(notice, bool):
                raise TypeError
            ev = Event(float(ms) / 1000.0, kind, tuple(str(n) for n in nodes), notice)
        except (json.JSONDecodeError, ValueError, TypeError, KeyError) as exc:
            why = exc if isinstance(exc, ValueError) and "Event" in str(exc) else "expected"
            raise ValueError(
                f"{path}:{i}: {why}: [ms, \"add\"|\"remove\", {{\"nodes\": [...], \"notice\": bool}}], "
                f"got {line.strip()[:80]!r}"
            ) from None
        if out and ev.time_s < out[-1].time_s:
            raise ValueError(f"{path}:{i}: event times must be non-decreasing")
        out.append(ev)
    return out


def load_trace(path: str | Path, *, seed: int = 0) -> Scenario:
    """Read a CSV (either shape) or JSON-lines trace; every event kept, time 0 = file's 0."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"--trace: cannot read {p}: {exc.strerror}") from None
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    events = _load_jsonl(p, text) if first.lstrip().startswith("[") else _load_csv(p, text, seed)
    return Scenario((), events, name=p.name)


def segment(trace: Scenario, start_s: float = 0.0, duration_s: float | None = None,
            cap: int | None = None) -> Scenario:
    """The part of ``trace`` in ``[start_s, start_s + duration_s)``, shifted to time 0.

    With ``cap``, the job holds at most ``cap`` of the trace's nodes: the first ``cap``
    alive at ``start_s``; when one of them is preempted, the next node the trace *adds*
    takes its place (nodes that were already up elsewhere do not), so preemptions of the
    job's nodes shrink it until the market gives a node back.
    """
    if start_s < 0:
        raise ValueError(f"--trace-start must be >= 0, got {start_s}")
    if cap is not None and cap < 1:
        raise ValueError(f"--trace-cap must be >= 1, got {cap}")
    if duration_s is not None and duration_s <= 0:
        raise ValueError(f"--trace-minutes must be > 0, got {duration_s / 60:g}")
    limit = math.inf if cap is None else cap
    end = math.inf if duration_s is None else start_s + duration_s
    members: list[str] = list(trace.initial)[: int(min(limit, len(trace.initial)))]
    out: list[Event] = []
    started = False
    initial: tuple[str, ...] = ()
    for ev in trace.events:
        if ev.time_s >= end:
            break
        if not started and ev.time_s >= start_s:
            started, initial = True, tuple(members)
        if ev.kind == "add":
            room = int(min(limit - len(members), len(ev.nodes)))
            joined = [n for n in ev.nodes if n not in members][:room]
            members.extend(joined)
            if started and joined:
                out.append(Event(ev.time_s - start_s, "add", tuple(joined)))
        else:
            gone = [n for n in ev.nodes if n in members]
            members = [n for n in members if n not in ev.nodes]
            if started and gone:
                out.append(Event(ev.time_s - start_s, "remove", tuple(gone), ev.notice))
    if not started:
        initial = tuple(members)
    return Scenario(initial, out, name=trace.name)


def compress(trace: Scenario, factor: float) -> Scenario:
    """``trace`` with every time divided by ``factor`` (60: an hour of the trace in a minute),
    to replay a real trace on a live job in minutes."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) \
            or factor <= 0:
        raise ValueError(f"--trace-compress must be a number > 0, got {factor!r}")
    return Scenario(trace.initial, [Event(ev.time_s / factor, ev.kind, ev.nodes, ev.notice) for ev in trace.events],
                    name=trace.name if factor == 1 else f"{trace.name} /{factor:g}")


def spot_kills(trace: Scenario, kill_share: float, *, seed: int = 0) -> Scenario:
    """Split every removal into one event per node and draw, seeded, which are SIGKILLs
    (``kill_share`` of them, rounded; a crash or a lost notice) and which are spot notices
    (the rest, ``notice=True``). The same seed gives the same split; additions are kept."""
    if isinstance(kill_share, bool) or not isinstance(kill_share, (int, float)) or not 0.0 <= kill_share <= 1.0:
        raise ValueError(f"--kill-share must be in [0, 1], got {kill_share!r}")
    out: list[Event] = []
    for ev in trace.events:
        if ev.kind == "add":
            out.append(ev)
        else:
            out.extend(Event(ev.time_s, "remove", (n,)) for n in ev.nodes)
    removes = [i for i, ev in enumerate(out) if ev.kind == "remove"]
    kills = set(random.Random(seed).sample(removes, round(kill_share * len(removes))))
    out = [Event(ev.time_s, ev.kind, ev.nodes, ev.kind == "remove" and i not in kills) for i, ev in enumerate(out)]
    return Scenario(trace.initial, out, name=trace.name)


def fail_every(nodes: int, every_s: float, duration_s: float, *, min_alive: int | None = None,
               seed: int = 0, replace: bool = False) -> Scenario:
    """One random node fails every ``every_s`` seconds until ``min_alive`` remain
    (default: half the nodes, the paper's section 6.2 setup).

    ``replace``: a spare takes each failed node's place at the same moment (the cluster
    keeps its size; failures go on for the whole ``duration_s``): the MTBF setting of
    ETTR comparisons, where the job's own recovery is what is measured."""
    if every_s <= 0:
        raise ValueError(f"--fail-every must be > 0, got {every_s}")
    keep = max(1, -(-nodes // 2)) if min_alive is None else min_alive
    rng = random.Random(seed)
    alive = [f"n{i}" for i in range(nodes)]
    out: list[Event] = []
    made = nodes
    t = every_s
    while t < duration_s and (replace or len(alive) > keep):
        victim = rng.choice(alive)
        alive.remove(victim)
        out.append(Event(t, "remove", (victim,)))
        if replace:
            alive.append(f"n{made}")
            out.append(Event(t, "add", (f"n{made}",)))
            made += 1
        t += every_s
    name = f"fail-every-{every_s:g}s" + ("-replaced" if replace else "")
    return Scenario(tuple(f"n{i}" for i in range(nodes)), out, name=name)


def bamboo(nodes: int, preempt_prob: float, alloc_prob: float, horizon_s: float, *,
           seed: int = 0) -> Scenario:
    """Bamboo-style churn: every alive node is preempted with probability ``preempt_prob``
    per hour and every missing node (up to ``nodes``) allocated with ``alloc_prob`` per
    hour, as independent exponential clocks."""
    for name, p in (("--preempt-prob", preempt_prob), ("--alloc-prob", alloc_prob)):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {p}")
    lam = -math.log1p(-preempt_prob) / 3600.0
    mu = -math.log1p(-alloc_prob) / 3600.0
    rng = random.Random(seed)
    alive = [f"n{i}" for i in range(nodes)]
    made = nodes
    out: list[Event] = []
    t = 0.0
    while True:
        rate = len(alive) * lam + (nodes - len(alive)) * mu
        if rate <= 0:
            break
        t += rng.expovariate(rate)
        if t >= horizon_s:
            break
        if rng.random() * rate < len(alive) * lam:
            victim = alive.pop(rng.randrange(len(alive)))
            out.append(Event(t, "remove", (victim,)))
        else:
            alive.append(f"n{made}")
            out.append(Event(t, "add", (f"n{made}",)))
            made += 1
    return Scenario(tuple(f"n{i}" for i in range(nodes)), out, name="bamboo")
