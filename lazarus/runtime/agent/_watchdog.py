"""The agent's hang watchdog: finds a worker that is frozen or hung without waiting out
the collective timeout, and has it handled as a crash.

A worker whose agent lives keeps heartbeating "alive" even when it trains no more; its
peers then block in a collective until ``collective_timeout`` and, if it never comes
back, re-form with it again and again (it is alive, so it is planned again; the
rendezvous waits for it in vain). The watchdog looks at every worker every
``watch_interval`` (two small reads: ``/proc/<pid>/stat`` and the worker's progress beat,
:mod:`lazarus.runtime._beat`) and kills (SIGKILL) a worker that is

* **stopped** — process state ``T`` (SIGSTOP, SIGTSTP) for ``stopped_timeout`` (default
  0.5 s). Unambiguous: a stopped process runs nothing, however slow its step; acted on
  fast. (A debugger's stop, state ``t``, is left alone.)
* **hung** — its training thread made no progress since a failure plan (an immediate
  one) reached it: its peers left its generation (they failed a collective with it, or
  another member failed) and wait for it at the next rendezvous, while it is still in a
  step of the older generation, for ``hang_timeout`` (default 5 s), and that thread used
  under a tenth of a core meanwhile and was seen runnable at under a tenth of the looks
  (blocked: a deadlock, a read from hung storage; a thread that computes on a loaded
  machine gets little CPU but is runnable). Without
  this, a hung worker is planned again and again (it is alive) and every rendezvous
  waits for it in vain. A slow step is none of these: it keeps its thread busy (compute,
  a first step's compile), or it ends; while nobody failed, the peers wait for it in
  their collective up to their ``collective_timeout``, which this does not shorten.

The kill is the agent's ordinary crash path: the exit is reported (its error names the
watchdog's reason), the node's other workers are stopped, the controller plans without
the node and the agent restarts its workers, which rejoin. A killed worker cannot write
anything after it, whatever wakes it later.

Steps much slower than the worker's typical step (``SLOW_FACTOR`` times, at least
``SLOW_MIN``) are reported to the controller (``slow_step``), never acted on; the ranks
that waited for a straggler in a collective report their step as slow too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .._beat import PHASE_STEP, Beat
from ._agent_worker import WorkerGroup, WorkerProcess

__all__ = ["SLOW_FACTOR", "SLOW_MIN", "WatchSettings", "Watchdog", "proc_state", "thread_cpu"]

log = logging.getLogger("lazarus.agent")

#: a step this many times the worker's typical step (and at least SLOW_MIN) is reported as slow
SLOW_FACTOR = 5.0
SLOW_MIN = timedelta(seconds=1)
#: a training thread that used less than this share of a core, and was seen runnable (state R:
#: running, or waiting for a core on a loaded machine) at less than this share of the looks,
#: while no progress was made, is blocked
IDLE_CPU_SHARE = 0.1
_TICK = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


def proc_state(pid: int, proc: str = "/proc") -> str | None:
    """The state letter of process ``pid`` (``R``, ``S``, ``D``, ``T``, ``t``, ``Z``...);
    None when it is gone or unreadable."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            data = f.read()
        return data[data.rindex(b")") + 2:][:1].decode() or None
    except (OSError, ValueError):
        return None


def thread_cpu(pid: int, tid: int, proc: str = "/proc") -> tuple[str, float] | None:
    """Thread ``tid`` of process ``pid``: its state letter and the CPU time (user +
    system, seconds) it used; None when unknown."""
    try:
        with open(f"{proc}/{pid}/task/{tid}/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2:].split()
        return fields[0].decode(), (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class WatchSettings:
    """The watchdog's part of :class:`~lazarus.runtime.AgentConfig` (None: that check off)."""

    stopped_timeout: timedelta | None = timedelta(milliseconds=500)
    hang_timeout: timedelta | None = timedelta(seconds=5)
    interval: timedelta = timedelta(milliseconds=100)


class _Seen:
    """What the watchdog remembers of one worker between two looks."""

    def __init__(self) -> None:
        self.stopped_since: float | None = None
        self.plan_generation = 0          # newest plan relayed to it that the watchdog saw
        self.plan_at: float | None = None   # when (monotonic)
        self.cpu_at_plan: float | None = None
        self.looks = 0                      # looks at the training thread since the plan
        self.runnable = 0                   # of which it was runnable (R)
        self.beat: Beat | None = None       # last consistent beat
        self.busy_logged = -1               # plan generation for which "still computing" was logged


class Watchdog:
    """Watches one node's workers: kills (SIGKILL) each one found frozen or hung, naming
    why in its ``watchdog_reason``; ``report`` is called with each ``slow_step`` report."""

    def __init__(self, settings: WatchSettings, *, node_id: str,
                 report: Callable[[WorkerProcess, dict[str, Any]], None],
                 clock: Callable[[], float] = time.monotonic, proc: str = "/proc") -> None:
        self.settings = settings
        self.node_id = node_id
        self._report = report
        self._clock = clock
        self._proc = proc
        self._seen: dict[int, _Seen] = {}
        self._last_look: float | None = None

    async def run(self, grp: WorkerGroup, current: Callable[[], bool]) -> None:
        """Look at ``grp``'s workers every ``interval`` while ``current()`` and some runs."""
        s = self.settings
        try:
            if s.stopped_timeout is None and s.hang_timeout is None:
                await grp.wait()   # nothing to watch; the beats are released at the end
            while grp.alive and current():
                self.check(grp)
                await asyncio.sleep(s.interval.total_seconds())
        finally:
            for wk in grp.workers:
                self._seen.pop(id(wk), None)
                if wk.beat is not None and not wk.alive:
                    wk.beat.close()

    def check(self, grp: WorkerGroup) -> None:
        """One look at every worker of ``grp``."""
        now = self._clock()
        # A long gap since the last look: the agent itself was stopped or starved (a stopped
        # node's agent and worker are woken together). Time it did not watch is no evidence.
        gap = None if self._last_look is None else now - self._last_look
        self._last_look = now
        if gap is not None and gap > 5 * self.settings.interval.total_seconds() + 0.5:
            for seen in self._seen.values():
                seen.stopped_since = None
                seen.plan_generation = 0   # a plan's wait is timed afresh from the next look
        for wk in grp.workers:
            if not wk.alive or wk.done or wk.left or wk.watchdog_reason is not None or grp.killed:
                continue
            seen = self._seen.setdefault(id(wk), _Seen())
            reason = self._stopped(wk, seen, now) or self._hung(wk, grp, seen, now)
            if reason is not None:
                self._kill(wk, reason)

    # ------------------------------------------------------------------ the checks
    def _stopped(self, wk: WorkerProcess, seen: _Seen, now: float) -> str | None:
        limit = self.settings.stopped_timeout
        if limit is None:
            return None
        if proc_state(wk.pid, self._proc) != "T":
            seen.stopped_since = None
            return None
        if seen.stopped_since is None:
            seen.stopped_since = now
        stopped = now - seen.stopped_since
        if stopped < limit.total_seconds():
            return None
        return (f"frozen: stopped (process state T, SIGSTOP) for {stopped:.1f} s (stopped_timeout "
                f"{limit.total_seconds():g} s)")

    def _hung(self, wk: WorkerProcess, grp: WorkerGroup, seen: _Seen, now: float) -> str | None:
        beat = wk.beat.read() if wk.beat is not None else None
        if beat is None:   # no beat (yet), or the worker is writing it: look again next time
            return None
        self._slow_steps(wk, seen, beat)
        seen.beat = beat
        thread = thread_cpu(wk.pid, beat.tid, self._proc) if beat.tid else None
        if grp.immediate_generation > seen.plan_generation:
            seen.plan_generation, seen.plan_at = grp.immediate_generation, now
            seen.cpu_at_plan = thread[1] if thread is not None else None
            seen.looks = seen.runnable = 0
        limit = self.settings.hang_timeout
        if limit is None or seen.plan_at is None or beat.phase != PHASE_STEP:
            return None
        if beat.generation >= seen.plan_generation or beat.t_ns / 1e9 >= seen.plan_at:
            return None   # on the newest plan, or it made progress since the plan reached it
        if thread is None or seen.cpu_at_plan is None:
            return None
        seen.looks += 1
        seen.runnable += thread[0] == "R"
        waited = now - seen.plan_at
        if waited < limit.total_seconds():
            return None
        used = thread[1] - seen.cpu_at_plan
        if used >= IDLE_CPU_SHARE * waited or seen.runnable >= IDLE_CPU_SHARE * seen.looks:
            if seen.busy_logged != seen.plan_generation:
                seen.busy_logged = seen.plan_generation
                log.warning("agent %s: worker local rank %d is still in step %d of generation %d, %.1f s after plan "
                            "%d reached it, but its training thread computes (%.1f s of CPU, runnable at %d of %d "
                            "looks): a slow step, not a hang", self.node_id, wk.local_rank, beat.step,
                            beat.generation, waited, seen.plan_generation, used, seen.runnable, seen.looks)
            return None
        return (f"hung: its training thread made no progress in step {beat.step} of generation {beat.generation} "
                f"for {waited:.1f} s after plan {seen.plan_generation} reached it (hang_timeout "
                f"{limit.total_seconds():g} s), used {used:.2f} s of CPU meanwhile and was runnable at {seen.runnable} "
                f"of {seen.looks} looks (blocked)")

    def _slow_steps(self, wk: WorkerProcess, seen: _Seen, beat: Beat) -> None:
        """Report a step that took ``SLOW_FACTOR`` times the typical one (a straggler),
        once its next beat came (a look every ``interval`` may see several steps at once:
        ``SLOW_MIN`` is well above it)."""
        prev = seen.beat
        if prev is None or beat.seq == prev.seq or prev.phase != PHASE_STEP or prev.typical_ns <= 0:
            return
        took = (beat.t_ns - prev.t_ns) / 1e9
        typical = prev.typical_ns / 1e9
        if took <= max(SLOW_MIN.total_seconds(), SLOW_FACTOR * typical):
            return
        self._report(wk, {"type": "slow_step", "step": prev.step, "generation": prev.generation,
                          "seconds": round(took, 3), "typical_s": round(typical, 4), "local_rank": wk.local_rank})
        log.warning("agent %s: worker local rank %d step %d: took %.2f s, %.0fx its typical %.3f s (a slow step, "
                    "not a hang)", self.node_id, wk.local_rank, prev.step, took, took / typical, typical)

    def _kill(self, wk: WorkerProcess, reason: str) -> None:
        wk.watchdog_reason = reason
        step = self._seen.get(id(wk))
        at = step.beat.step if step is not None and step.beat is not None else None
        log.error("agent %s: worker local rank %d (pid %d) step %s: %s; killing it (SIGKILL), the node is handled "
                  "as after a crash", self.node_id, wk.local_rank, wk.pid, "-" if at is None else at, reason)
        with contextlib.suppress(ProcessLookupError):
            wk.proc.kill()
