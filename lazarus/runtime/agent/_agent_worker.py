"""The agent's side of its worker processes: starting them, relaying their stderr (and
keeping the tail to name the last error), the group of a node's workers, and the restart
policy that caps crash loops.

A node runs G workers (``--nproc-per-node``, one per local device), one
:class:`WorkerProcess` each, held together by a :class:`WorkerGroup`: they start together
(one incarnation), are ready when all said hello, done when all reported done, and fail
together (torchrun's rule: one worker down, the node's others are stopped and the whole
group restarts as a new incarnation). Membership stays per node.

A worker is started with one end of a socketpair in ``LAZARUS_AGENT_FD`` (see
:mod:`lazarus.runtime.worker._channel`). Its stderr goes through the agent, which copies it to its own stderr
unchanged and keeps the last :data:`STDERR_TAIL_BYTES`, so that an agent giving up on a
crash loop can say *why* the worker keeps dying (``RuntimeError: CUDA out of memory``)
rather than only *that* it does.
"""

from __future__ import annotations

import asyncio
import collections
import re
import signal
import socket
import sys
import time
from datetime import timedelta
from typing import Any, BinaryIO

from .._beat import PROGRESS_FD_ENV, BeatRegion

__all__ = ["RestartPolicy", "WorkerGroup", "WorkerProcess", "describe_exit", "exit_status", "last_error_line",
           "spawn_worker", "worker_env"]

#: Bytes of a worker's stderr kept to name its last error.
STDERR_TAIL_BYTES = 16 << 10
#: Longest pause between two restarts of a crashing worker.
MAX_RESTART_DELAY = timedelta(seconds=60)

_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure|Fault)\b.*)$")


def exit_status(returncode: int) -> int:
    """A process's exit status as a shell reports it (killed by signal N -> 128 + N)."""
    if 0 <= returncode < 256:
        return returncode
    return 128 + (-returncode if returncode < 0 else 1)


def describe_exit(returncode: int) -> str:
    """``exit 1`` / ``killed by SIGKILL``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


def last_error_line(tail: bytes) -> str | None:
    """The last line of ``tail`` that names an exception (``ValueError: ...``), else its
    last non-empty line, else None."""
    lines = [ln.strip() for ln in tail.decode("utf-8", "replace").splitlines() if ln.strip()]
    for line in reversed(lines):
        m = _ERROR_LINE.match(line)
        if m:
            return m.group(1)[:500]
    return lines[-1][:500] if lines else None


class WorkerProcess:
    """One worker incarnation: its process, its channel and what it reported."""

    def __init__(self, incarnation: int, proc: asyncio.subprocess.Process, writer: asyncio.StreamWriter,
                 local_rank: int = 0, beat: BeatRegion | None = None, spawned: float | None = None) -> None:
        self.incarnation = incarnation
        self.local_rank = local_rank
        self.proc = proc
        self.writer = writer
        self.started = time.monotonic()
        # when the agent started the process: taken before the fork (the process's own start
        # time, from /proc, must not come before it), else now
        self.spawned = time.time() if spawned is None else spawned
        self.startup: dict[str, float] = {}  # the worker's start-up phases, from its hello
        self.ready = False                  # said hello
        self.model: dict[str, Any] = {}     # from its hello
        self.store: dict[str, Any] | None = None   # the rendezvous store it hosts, from its hello
        self.step: int | None = None        # last progress report
        self.generation: int | None = None  # generation of its last progress / reconfigured report
        self.plan_generation = 0            # newest plan relayed to it
        self.killed = False                 # stopped on purpose (evict / shutdown / leave timeout)
        self.done = False                   # reported that training finished; never killed after that
        self.left = False                   # handed its state over and left the job (a leave plan)
        self.grace_task: asyncio.Task[Any] | None = None
        self.beat = beat                    # its progress beat (the hang watchdog reads it)
        self.watchdog_reason: str | None = None   # why the hang watchdog killed it
        self._tail = bytearray()
        self._stderr_task: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self) -> bytes:
        return bytes(self._tail)

    def last_error(self) -> str:
        """What the worker last said went wrong, with how it ended."""
        rc = self.proc.returncode
        how = describe_exit(rc) if rc is not None else "running"
        if self.watchdog_reason is not None:
            how = f"{how} by the agent's watchdog ({self.watchdog_reason})"
        line = last_error_line(self.stderr_tail())
        return f"{how}: {line}" if line else how

    async def stderr_done(self, timeout: float = 2.0) -> None:
        """Wait (bounded) until the stderr relay has read everything the worker wrote."""
        if self._stderr_task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._stderr_task), timeout)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the tail is best effort
                pass

    async def _relay_stderr(self, stream: asyncio.StreamReader, sink: BinaryIO) -> None:
        while True:
            try:
                chunk = await stream.read(1 << 16)
            except (ConnectionError, OSError):
                return
            if not chunk:
                return
            try:
                sink.write(chunk)
                sink.flush()
            except (OSError, ValueError):
                pass  # the agent's own stderr is gone; keep the tail anyway
            self._tail += chunk
            if len(self._tail) > STDERR_TAIL_BYTES:
                del self._tail[: len(self._tail) - STDERR_TAIL_BYTES]


async def spawn_worker(command: list[str], env: dict[str, str], incarnation: int,
                       stderr_sink: BinaryIO | None = None, local_rank: int = 0,
                       ) -> tuple[WorkerProcess, asyncio.StreamReader]:
    """Start ``command`` with a channel to the agent (``LAZARUS_AGENT_FD`` is added to
    ``env``) and a progress beat region (``LAZARUS_PROGRESS_FD``). Returns the worker and
    the agent's reader of its channel.

    Raises:
        OSError: the command cannot be started.
    """
    parent, child = socket.socketpair()
    beat = BeatRegion()
    assert beat.fd is not None
    env = dict(env, LAZARUS_AGENT_FD=str(child.fileno()), **{PROGRESS_FD_ENV: str(beat.fd)})
    spawned = time.time()
    try:
        proc = await asyncio.create_subprocess_exec(*command, pass_fds=(child.fileno(), beat.fd), env=env,
                                                    stderr=asyncio.subprocess.PIPE)
    except OSError:
        parent.close()
        beat.close()
        raise
    finally:
        child.close()
        beat.release_fd()
    reader, writer = await asyncio.open_unix_connection(sock=parent)
    wk = WorkerProcess(incarnation, proc, writer, local_rank, beat, spawned=spawned)
    assert proc.stderr is not None
    sink = stderr_sink if stderr_sink is not None else sys.stderr.buffer
    wk._stderr_task = asyncio.ensure_future(wk._relay_stderr(proc.stderr, sink))
    return wk, reader


class WorkerGroup:
    """One incarnation of a node's workers, ``workers[i]`` being local rank ``i``.

    What the agent reports about "the worker" is about the group: ready when every worker
    said hello, done when every worker reported done, its step and model are local rank
    0's, its exit status is the one of the worker whose exit brought it down (``failed``),
    else the first non-zero status in local-rank order, else 0.
    """

    def __init__(self, incarnation: int, workers: list[WorkerProcess]) -> None:
        if not workers:
            raise ValueError("a worker group needs at least one worker")
        self.incarnation = incarnation
        self.workers = workers
        self.plan_generation = 0            # newest plan relayed to it
        self.immediate_generation = 0       # newest immediate plan (a failure's) relayed to it
        self.killed = False                 # stopped on purpose (evict / shutdown / leave timeout)
        self.ready_sent = False             # worker_ready reported for this incarnation
        self.failed: WorkerProcess | None = None   # the worker whose exit took the group down
        self.grace_task: asyncio.Task[Any] | None = None
        self.left_task: asyncio.Task[Any] | None = None   # bounds the exit of workers that left

    def __len__(self) -> int:
        return len(self.workers)

    @property
    def alive(self) -> bool:
        """Some worker still runs."""
        return any(w.alive for w in self.workers)

    @property
    def healthy(self) -> bool:
        """Every worker runs and none brought the group down."""
        return self.failed is None and all(w.alive for w in self.workers)

    @property
    def ready(self) -> bool:
        return all(w.ready for w in self.workers)

    @property
    def done(self) -> bool:
        return all(w.done for w in self.workers)

    @property
    def left(self) -> bool:
        """Every worker handed its state over and left the job."""
        return all(w.left for w in self.workers)

    @property
    def model(self) -> dict[str, Any]:
        return self.workers[0].model

    @property
    def startup(self) -> dict[str, float]:
        """Local rank 0's start-up phases (epoch seconds): ``spawned`` by the agent, then
        the ones its hello reported (``process``, ``imported``, ``warm``, ``probed``)."""
        w = self.workers[0]
        return {"spawned": round(w.spawned, 4), **w.startup}

    def store_field(self) -> dict[str, Any]:
        """``{"store": address}`` of the rendezvous store local rank 0 hosts (its hello
        said where), for the controller's messages; empty when it hosts none."""
        store = self.workers[0].store
        return {"store": store} if store is not None else {}

    @property
    def pid(self) -> int:
        return self.workers[0].pid

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    @property
    def step(self) -> int | None:
        return self.workers[0].step

    @property
    def generation(self) -> int | None:
        return self.workers[0].generation

    def _culprit(self) -> WorkerProcess | None:
        if self.failed is not None:
            return self.failed
        return next((w for w in self.workers if w.proc.returncode not in (None, 0)), None)

    @property
    def returncode(self) -> int | None:
        """None while a worker runs; then the group's status (see the class docstring)."""
        if self.alive:
            return None
        w = self._culprit()
        return w.proc.returncode if w is not None else 0

    def last_error(self) -> str:
        """What went wrong, naming the local rank when the node runs several workers."""
        w = self._culprit() or self.workers[0]
        return w.last_error() if len(self.workers) == 1 else f"local rank {w.local_rank}: {w.last_error()}"

    async def wait(self) -> int:
        """Until every worker exited; the group's status."""
        for w in self.workers:
            await w.proc.wait()
        rc = self.returncode
        return 0 if rc is None else rc


class RestartPolicy:
    """At most ``max_restarts`` restarts within any ``window``; the k-th restart in the
    window waits ``base_delay * 2**k`` (at most :data:`MAX_RESTART_DELAY`).

    ``next_delay()`` records a restart and returns its delay, or None once the cap is
    reached (the crash loop is given up).
    """

    def __init__(self, max_restarts: int, window: timedelta, base_delay: timedelta,
                 clock: Any = time.monotonic) -> None:
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
        self.max_restarts = max_restarts
        self.window = window.total_seconds()
        self.base = base_delay.total_seconds()
        self._clock = clock
        self._times: collections.deque[float] = collections.deque()

    def recent(self) -> int:
        """Restarts within the window ending now."""
        now = self._clock()
        while self._times and now - self._times[0] > self.window:
            self._times.popleft()
        return len(self._times)

    def next_delay(self) -> float | None:
        n = self.recent()
        if n >= self.max_restarts:
            return None
        self._times.append(self._clock())
        return min(self.base * (2 ** n), MAX_RESTART_DELAY.total_seconds())


def worker_env(base: dict[str, str], extra: dict[str, str], **lazarus: str) -> dict[str, str]:
    """The worker's environment: the agent's, ``extra`` (``--env``), then ``LAZARUS_*``."""
    env = dict(base)
    env.update(extra)
    env.update({f"LAZARUS_{k.upper()}": v for k, v in lazarus.items()})
    return env

