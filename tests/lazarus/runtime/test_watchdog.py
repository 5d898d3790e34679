"""The agent's hang watchdog (:mod:`lazarus.runtime.agent._watchdog`) and the progress
beat it reads (:mod:`lazarus.runtime._beat`, :mod:`lazarus.runtime.worker._progress`), on
real worker processes started the agent's way (:func:`spawn_worker`): one SIGSTOPped,
one whose training thread blocks, one that computes, one that sleeps between beats.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time
from datetime import timedelta
from typing import Any

import pytest

from lazarus.runtime import AgentConfig
from lazarus.runtime._beat import PHASE_IDLE, PHASE_STEP, BeatRegion
from lazarus.runtime.agent._agent_worker import WorkerGroup, spawn_worker
from lazarus.runtime.agent._watchdog import WatchSettings, Watchdog, proc_state
from lazarus.runtime.worker._progress import ProgressBeat

# A worker: beats steps 0..4 on generation 1 (20 ms each), then does MODE in step 5:
# "block" (a deadlock), "compute" (a busy loop), "sleep" (a long sleep) or "train" (more steps).
_WORKER = textwrap.dedent("""
    import sys, threading, time
    from lazarus.runtime.worker._progress import ProgressBeat
    beat = ProgressBeat.from_env()
    mode = sys.argv[1]
    for step in range(5):
        beat.step(step, 1)
        time.sleep(0.02)
    beat.step(5, 1)
    print("in step 5", file=sys.stderr, flush=True)
    if mode == "block":
        lock = threading.Lock(); lock.acquire(); lock.acquire()
    elif mode == "compute":
        t = time.monotonic()
        while time.monotonic() - t < 30:
            pass
    elif mode == "sleep":
        time.sleep(float(sys.argv[2]))
        beat.step(6, 1)
        time.sleep(30)
    else:
        time.sleep(30)
""")


async def _start(mode: str, *args: str) -> tuple[WorkerGroup, Any]:
    env = dict(os.environ)
    wk, _reader = await spawn_worker([sys.executable, "-c", _WORKER, mode, *args], env, 1)
    grp = WorkerGroup(1, [wk])
    deadline = time.monotonic() + 60
    while (b := wk.beat.read()) is None or b.step < 5:   # imported and in step 5
        assert wk.alive and time.monotonic() < deadline, wk.last_error()
        await asyncio.sleep(0.02)
    return grp, wk


async def _watch(grp: WorkerGroup, settings: WatchSettings, seconds: float,
                 reports: list[dict[str, Any]] | None = None) -> float | None:
    """Run the watchdog on ``grp`` for up to ``seconds``; when its worker died, how long after the start."""
    dog = Watchdog(settings, node_id="n0", report=lambda wk, msg: (reports if reports is not None else []).append(msg))
    t0 = time.monotonic()
    task = asyncio.ensure_future(dog.run(grp, lambda: True))
    try:
        await asyncio.wait_for(grp.wait(), seconds)
        return time.monotonic() - t0
    except asyncio.TimeoutError:
        return None
    finally:
        task.cancel()
        for wk in grp.workers:
            if wk.alive:
                os.kill(wk.pid, signal.SIGCONT)
                wk.proc.kill()
                await wk.proc.wait()


_FAST = WatchSettings(stopped_timeout=timedelta(milliseconds=300), hang_timeout=timedelta(seconds=1),
                      interval=timedelta(milliseconds=20))


def test_the_beat_region_carries_the_training_threads_beats_between_processes() -> None:
    region = BeatRegion()
    assert region.read() is None                        # nobody beat yet
    fd = os.dup(region.fd)                              # what the worker inherits
    region.release_fd()
    beat = ProgressBeat(fd)
    for step in range(4):
        beat.step(step, 3)
        time.sleep(0.01)
    b = region.read()
    assert b is not None and (b.phase, b.step, b.generation) == (PHASE_STEP, 3, 3)
    assert b.tid == __import__("threading").get_native_id() and b.seq % 2 == 0
    assert 0.005 < b.typical_ns / 1e9 < 0.5             # steps 1 and 2 timed (step 0, a warm-up, not)
    beat.idle(4, 3)
    b = region.read()
    assert b is not None and b.phase == PHASE_IDLE and b.typical_ns == 0
    region.close()


def test_a_beat_costs_microseconds() -> None:
    region = BeatRegion()
    beat = ProgressBeat(os.dup(region.fd))
    n = 20000
    t = time.perf_counter()
    for step in range(n):
        beat.step(step, 1)
    per = (time.perf_counter() - t) / n
    print(f"\none beat: {per * 1e6:.2f} us")
    assert per < 50e-6, per   # ~2 us on a quiet core; generous for a loaded machine
    region.close()


def test_a_sigstopped_worker_is_killed_after_stopped_timeout() -> None:
    async def main() -> None:
        grp, wk = await _start("train")
        os.kill(wk.pid, signal.SIGSTOP)
        t = time.monotonic()
        while proc_state(wk.pid) != "T":
            await asyncio.sleep(0.005)
        died = await _watch(grp, _FAST, 10)
        assert died is not None, "the stopped worker was not killed"
        print(f"\nstopped worker killed {time.monotonic() - t:.2f} s after SIGSTOP")
        assert 0.3 <= died < 3.0
        assert wk.proc.returncode == -signal.SIGKILL
        assert wk.watchdog_reason is not None and "stopped" in wk.watchdog_reason
        assert "watchdog" in wk.last_error() and "SIGKILL" in wk.last_error()

    asyncio.run(main())


def test_a_worker_stopped_briefly_is_not_killed() -> None:
    async def main() -> None:
        grp, wk = await _start("train")
        os.kill(wk.pid, signal.SIGSTOP)
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, os.kill, wk.pid, signal.SIGCONT)
        assert await _watch(grp, _FAST, 1.5) is None and wk.watchdog_reason is None

    asyncio.run(main())


@pytest.mark.parametrize("plan_generation", [2, 1])
def test_a_blocked_training_thread_is_killed_only_once_a_newer_failure_plan_reached_it(plan_generation: int) -> None:
    async def main() -> None:
        grp, wk = await _start("block")
        grp.immediate_generation = plan_generation   # 1: the generation it trains on (nobody moved on)
        died = await _watch(grp, _FAST, 3.0)
        if plan_generation == 1:
            assert died is None and wk.watchdog_reason is None
        else:
            assert died is not None and 1.0 <= died < 2.5, died
            assert wk.watchdog_reason is not None and "hung" in wk.watchdog_reason
            assert "step 5 of generation 1" in wk.watchdog_reason

    asyncio.run(main())


def test_a_training_thread_that_computes_is_not_killed() -> None:
    async def main() -> None:
        grp, wk = await _start("compute")
        grp.immediate_generation = 2
        assert await _watch(grp, _FAST, 2.5) is None and wk.watchdog_reason is None

    asyncio.run(main())


def test_a_slow_step_is_reported_and_not_killed() -> None:
    async def main() -> None:
        grp, wk = await _start("sleep", "1.6")
        reports: list[dict[str, Any]] = []
        assert await _watch(grp, _FAST, 2.5, reports) is None and wk.watchdog_reason is None
        assert [(r["type"], r["step"]) for r in reports] == [("slow_step", 5)], reports
        assert reports[0]["seconds"] >= 1.6 and reports[0]["typical_s"] < 0.5

    asyncio.run(main())


def test_watchdog_settings_are_checked_naming_the_field() -> None:
    base: dict[str, Any] = {"secret": b"s" * 16, "worker_command": ["python"]}
    cfg = AgentConfig(**base)
    assert cfg.stopped_timeout == timedelta(milliseconds=500) and cfg.hang_timeout == timedelta(seconds=5)
    assert AgentConfig(**base, stopped_timeout=None, hang_timeout=None).stopped_timeout is None
    with pytest.raises(ValueError, match=r"stopped_timeout must be a positive .*timedelta or None \(off\), got 0.0s"):
        AgentConfig(**base, stopped_timeout=timedelta(0))
    with pytest.raises(ValueError, match=r"hang_timeout must be a positive datetime.timedelta or None .*got 5"):
        AgentConfig(**base, hang_timeout=5)
    with pytest.raises(ValueError, match=r"watch_interval \(1.0s\) must not exceed stopped_timeout \(0.5s\)"):
        AgentConfig(**base, watch_interval=timedelta(seconds=1))
    with pytest.raises(ValueError, match=r"watch_interval must be >= 0.01s"):
        AgentConfig(**base, watch_interval=timedelta(milliseconds=1))


def test_time_the_agent_itself_was_stopped_is_no_evidence() -> None:
    # A stopped node (agent and worker SIGSTOPped together, then SIGCONTed together): the
    # agent's first look after waking must not count its own absence as the worker's stop.
    async def main() -> None:
        grp, wk = await _start("train")
        now = [100.0]
        dog = Watchdog(_FAST, node_id="n0", report=lambda wk, msg: None, clock=lambda: now[0])
        os.kill(wk.pid, signal.SIGSTOP)
        while proc_state(wk.pid) != "T":
            await asyncio.sleep(0.005)
        try:
            dog.check(grp)                 # sees it stopped
            now[0] += 30.0                 # the agent was away 30 s
            dog.check(grp)
            assert wk.watchdog_reason is None and wk.alive
            for _ in range(20):            # watched without a gap: killed after stopped_timeout (0.3 s)
                now[0] += 0.02
                dog.check(grp)
            assert wk.watchdog_reason is not None and "stopped" in wk.watchdog_reason
            assert await asyncio.wait_for(wk.proc.wait(), 10) == -signal.SIGKILL
        finally:
            if wk.alive:
                wk.proc.kill()
                await wk.proc.wait()

    asyncio.run(main())


def test_checks_turned_off_kill_nothing() -> None:
    async def main() -> None:
        grp, wk = await _start("block")
        grp.immediate_generation = 2
        os.kill(wk.pid, signal.SIGSTOP)
        off = WatchSettings(stopped_timeout=None, hang_timeout=None, interval=timedelta(milliseconds=20))
        assert await _watch(grp, off, 1.5) is None and wk.watchdog_reason is None

    asyncio.run(main())


@pytest.mark.parametrize(("args", "message"), [
    (["--stopped-timeout", "0"], "--stopped-timeout: stopped_timeout must be a positive datetime.timedelta or None"),
    (["--hang-timeout", "soon"], "--hang-timeout must be a duration like 500ms, 3s or 2m, got 'soon', or off"),
    (["--watch-interval", "2s"], "--watch-interval: watch_interval (2.0s) must not exceed stopped_timeout (0.5s)"),
])
def test_agent_cli_watchdog_options_are_checked_naming_the_option(args: list[str], message: str) -> None:
    import subprocess

    env = dict(os.environ, LAZARUS_SECRET="s" * 32)
    r = subprocess.run([sys.executable, "-m", "lazarus.cli", "agent", "--controller", "127.0.0.1:9", *args, "--",
                        "true"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
