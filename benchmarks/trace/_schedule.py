"""A real spot trace as a live schedule: the trace segment ``benchmarks/trace`` replays,
compressed in time and scaled to this machine, as the actions the driver injects.

The conversion is :mod:`lazarus.sim`'s own (``load_trace`` -> ``segment`` with a node cap
-> ``compress`` -> ``spot_kills``), so ``lazarus simulate`` with the flags of
:meth:`TraceSpec.sim_args` replays exactly the events the live systems were given.

Scaling: the job holds at most ``cap`` of the trace's nodes (the Lazarus paper's and
Bamboo's way of replaying a 32-node trace on 10 nodes): the first ``cap`` alive at the
segment's start; a preempted one is replaced by the next node the trace adds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from lazarus.sim import Scenario, compress, load_trace, segment, spot_kills

__all__ = ["Action", "TraceSpec", "actions", "availability"]

#: What an event of the trace becomes: a node arriving is a new agent / replica group /
#: restart member (``join``); a node leaving with a spot notice gets SIGTERM (``term``),
#: one that vanishes (the ``kill_share``) SIGKILL (``kill``).
KINDS = ("join", "term", "kill")


@dataclass(frozen=True)
class TraceSpec:
    """Which part of which trace, and how it is replayed (times in the trace's seconds)."""

    path: str
    start_s: float = 4 * 3600.0
    minutes: float = 60.0
    cap: int = 3
    compress: float = 60.0
    kill_share: float = 0.3
    seed: int = 0

    def __post_init__(self) -> None:
        if not Path(self.path).is_file():
            raise ValueError(f"trace: no such file {self.path!r}")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ValueError(f"trace start must be >= 0 seconds, got {self.start_s!r}")
        if not (math.isfinite(self.minutes) and self.minutes > 0):
            raise ValueError(f"trace minutes must be > 0, got {self.minutes!r}")
        if isinstance(self.cap, bool) or not isinstance(self.cap, int) or not 1 <= self.cap <= 8:
            raise ValueError(f"nodes (the cap on the trace's nodes) must be an integer in [1, 8], got {self.cap!r}")
        if not (math.isfinite(self.compress) and self.compress > 0):
            raise ValueError(f"compress must be > 0, got {self.compress!r}")
        if not 0.0 <= self.kill_share <= 1.0:
            raise ValueError(f"kill share must be in [0, 1], got {self.kill_share!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")

    @property
    def duration_s(self) -> float:
        """Wall seconds of the live replay."""
        return self.minutes * 60.0 / self.compress

    def scenario(self) -> Scenario:
        """The compressed, capped segment with its removals split into notices and kills."""
        seg = segment(load_trace(self.path, seed=self.seed), self.start_s, self.minutes * 60.0, self.cap)
        if not seg.initial:
            raise ValueError(f"trace segment at {self.start_s:g} s of {self.path} starts with no node up; "
                             f"pick another --start")
        return spot_kills(compress(seg, self.compress), self.kill_share, seed=self.seed)

    def sim_args(self) -> list[str]:
        """``lazarus simulate`` flags that rebuild :meth:`scenario` (same seed, same split)."""
        return ["--trace", str(self.path), "--trace-start", f"{self.start_s:g}s", "--trace-minutes",
                f"{self.minutes:g}", "--trace-cap", str(self.cap), "--trace-compress", f"{self.compress:g}",
                "--kill-share", f"{self.kill_share:g}", "--seed", str(self.seed), "--nodes", str(self.cap),
                "--duration", f"{self.duration_s:g}s"]


@dataclass(frozen=True)
class Action:
    """``kind`` (join, term or kill) of ``node`` at ``t`` seconds after the replay starts."""

    t: float
    kind: str
    node: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action.kind must be one of {', '.join(KINDS)}; got {self.kind!r}")


def actions(sc: Scenario) -> list[Action]:
    """The scenario's events as one action per node, in time order."""
    out: list[Action] = []
    for ev in sc.events:
        kind = "join" if ev.kind == "add" else ("term" if ev.notice else "kill")
        out.extend(Action(ev.time_s, kind, n) for n in ev.nodes)
    return out


def availability(sc: Scenario, duration_s: float) -> list[tuple[float, int]]:
    """``(t, nodes available)`` at 0 and after every event up to ``duration_s``."""
    n = len(sc.initial)
    out = [(0.0, n)]
    for ev in sc.events:
        if ev.time_s > duration_s:
            break
        n += len(ev.nodes) if ev.kind == "add" else -len(ev.nodes)
        out.append((ev.time_s, n))
    return out
