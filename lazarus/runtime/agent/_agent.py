"""The per-node agent: registers with the controller, heartbeats, runs the workers.

One agent per node. It runs ``nproc_per_node`` = G workers (``--nproc-per-node``; one per
local device, ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` set as torchrun sets them), which the
controller sees as one node with G ranks: "the worker" below is that group
(:class:`~._agent_worker.WorkerGroup`). A worker that exits abnormally takes its
siblings down (SIGKILL: their ranks' collectives are broken anyway) and the group is
restarted as one new incarnation, as torchrun restarts a node's workers; the crash-loop
cap counts group restarts. The agent


* connects to the controller and registers (retrying with exponential backoff and jitter
  for up to ``connect_timeout``, saying every few seconds that it is still trying), then
  starts its workers and sends a heartbeat every ``heartbeat_interval``. No worker starts
  before the controller accepted the node: an agent that cannot reach it, or that the
  controller refuses (a wrong secret: the controller answers ``auth_failed``), exits 1
  without having run anything;
* starts the worker command G times, each with one end of a socketpair (``LAZARUS_AGENT_FD``)
  and relays in both directions: once every worker said ``hello`` the node is
  ``worker_ready``; the workers' other messages go up wrapped as ``{"type": "worker", ...}``
  (``progress`` from local rank 0 only, ``done`` once every worker is done); plans and
  ``stop`` go down to every worker;
* watches the worker: an exit is reported (``worker_exit``); an abnormal exit is followed
  by a restart (new incarnation, which rejoins) with exponential backoff, at most
  ``max_restarts`` times within ``restart_window``. Past that the node leaves the job
  and the agent exits 5, naming the worker's last error (from its stderr, which the
  agent relays);
* kills a worker found frozen (stopped) or hung (its training thread blocked after a
  failure plan reached it) and handles it as crashed (:mod:`._watchdog`);
* keeps the node-memory directory (``snapshot_dir``) across worker crashes and removes it
  when it exits normally.

Reaching the controller (one attempt, its pacing, the first registration's retries) is
:class:`~._dial.Dialer`'s; the exit codes are in :mod:`._exit_codes`.

Controller loss: the worker keeps training (its process group does not need the
controller between reconfigurations) while the agent reconnects for up to
``reconnect_timeout``, with exponential backoff and jitter (:class:`~.._backoff.Backoff`,
pauses of at most 1 s) that is reset only once the controller accepted the node again, so
a controller that keeps closing or refusing the connection is not hammered. A refused
secret is logged as such; the agent keeps trying (the controller may be restarted with
the right one). Worker reports meanwhile are queued (the newest ``progress`` and
``routing``, every other message) and sent after the agent registered again with a
``resume`` record (worker incarnation, whether it is alive and ready, the newest plan it
was given, whether it is done), from which a restarted controller rebuilds its view.
Only once the timeout has passed does the agent stop the worker and exit 4.

Clean end: a worker that reported ``done`` is never killed: when the job is done (or the
controller is gone) the agent waits up to ``exit_grace`` for it to exit and then exits
with its status.

Standby (``--standby``, a hot spare): the workers start at once and import, build and warm
up, but the agent connects and registers only on SIGUSR1 (:meth:`Agent.activate`); a
worker ready by then is reported ready with the registration, so the join costs the plan
and the reconfiguration only. SIGTERM or SIGINT while on standby stops the workers and
exits 0 / 130.

Signals: SIGTERM (spot notice) -> ``leaving``; the agent waits for the plan without this
node, lets the worker finish its hand-over and exit, then exits 0 (exit 3 if that takes
longer than ``leave_timeout``). A worker that reported it ``left`` (hand-over done) but is
still running ``stop_timeout`` later (held up at exit by stuck background work, such as a
checkpoint write to hung storage) is stopped, and the agent exits 0. SIGINT -> stop the worker and exit 130.

Exit codes: 0 normal (shutdown, leave, worker finished), 1 controller not reached within
``connect_timeout`` / registration refused (a wrong secret included) / worker failed without
respawn, 3 leave timed out, 4 controller unreachable for
``reconnect_timeout``, 5 crash loop (``max_restarts`` reached), 6 a finished worker still
running after ``exit_grace``, 130 SIGINT; after a finished worker exits: its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from collections import OrderedDict
from typing import Any

from .._config import AgentConfig
from .._netif import socket_env
from .._plan import Plan
from .._wire import (PLAN_MAX_MESSAGE_BYTES, AuthRefusedError, ConnectionClosed, MalformedMessageError, ProtocolError,
                     encode_frame, read_frame, store_address)
from ._probe import parse_targets, unreachable
from ._agent_worker import (RestartPolicy, WorkerGroup, WorkerProcess, describe_exit, exit_status, spawn_worker,
                            worker_env)
from ._dial import RECONNECT_PROGRESS_EVERY, Dialer, Unreachable
from ._exit_codes import (EXIT_CONTROLLER_LOST, EXIT_CRASH_LOOP, EXIT_FAILED, EXIT_GRACE_EXPIRED, EXIT_INTERRUPTED,
                          EXIT_LEAVE_TIMEOUT, EXIT_OK)
from ._watchdog import Watchdog, WatchSettings

__all__ = ["Agent"]

log = logging.getLogger("lazarus.agent")

#: Worker reports of which only the newest matters while the controller is away.
_LATEST_ONLY = ("progress", "routing")
#: Most messages queued while the controller is away (the oldest are dropped beyond).
_MAX_QUEUED = 4096


class Agent:
    """A node agent. ``Agent(config).run()`` blocks until the agent exits; returns its code."""

    def __init__(self, config: AgentConfig) -> None:
        if not isinstance(config, AgentConfig):
            raise ValueError(f"config must be an AgentConfig, got {type(config).__name__}")
        self.config = config
        self.node_id = config.node_id
        self.incarnation = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit: asyncio.Future[int] | None = None
        self._cw: asyncio.StreamWriter | None = None
        self._worker: WorkerGroup | None = None   # the current incarnation of the node's workers
        self._leaving = False
        self._shutdown = False
        self._gave_up: str | None = None     # the crash loop's last error, once given up
        self._lost_since: float | None = None  # monotonic time the controller connection broke
        self._reconnecting = False
        self._queued: list[dict[str, Any]] = []
        self._queued_latest: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._restarts = RestartPolicy(config.max_restarts, config.restart_window, config.respawn_delay)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._activated: asyncio.Event | None = None   # standby: set by activate()
        self._store_host = config.store_host   # where the worker's rendezvous store is reached
        # reaching the controller; its reconnection pacing is reset each time the controller accepts the node
        self._dial = Dialer(config, node_id=self.node_id, register_msg=self._register_msg)
        # gloo / NCCL bind to the interface of that address (unless the user chose one)
        self._socket_env = socket_env(self._store_host, {**os.environ, **config.env}, where=self.node_id)
        if self._socket_env:
            log.info("agent %s step -: workers bind gloo and NCCL to %s (the advertised address %s)", self.node_id,
                     ", ".join(f"{k}={v}" for k, v in self._socket_env.items()), self._store_host)
        # frozen or hung workers are killed, then handled as crashed (_watchdog)
        self._watchdog = Watchdog(WatchSettings(config.stopped_timeout, config.hang_timeout, config.watch_interval),
                                  node_id=self.node_id, report=self._report_from_worker)

    # ------------------------------------------------------------------ public
    def run(self) -> int:
        """Run the agent in a fresh event loop, with SIGTERM/SIGINT handlers."""

        async def main() -> int:
            loop = asyncio.get_running_loop()
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signal.SIGTERM, self.request_leave)
                loop.add_signal_handler(signal.SIGINT, self.request_stop)
                loop.add_signal_handler(signal.SIGUSR1, self.activate)
            return await self.run_async()

        return asyncio.run(main())

    def activate(self) -> None:
        """A standby node registers now (what SIGUSR1 does; a no-op otherwise). Call from
        the agent's loop thread."""
        if self._activated is not None and not self._activated.is_set():
            log.info("agent %s: activated; registering", self.node_id)
            self._activated.set()

    @property
    def _on_standby(self) -> bool:
        return self._activated is not None and not self._activated.is_set()

    def request_leave(self) -> None:
        """Graceful leave (what SIGTERM does). Call from the agent's loop thread."""
        if self._on_standby and self._exit is not None:
            log.info("agent %s: SIGTERM on standby; stopping", self.node_id)
            self._finish(EXIT_OK)
            return
        if self._leaving or self._exit is None or self._exit.done():
            return
        self._leaving = True
        log.info("agent %s: leaving (SIGTERM)", self.node_id)
        self._to_controller({"type": "leaving", "node": self.node_id}, queue=True)
        if self._worker is None or not self._worker.alive:
            self._finish(EXIT_OK)
            return
        self._spawn_task(self._leave_deadline())

    def request_stop(self) -> None:
        """Stop the worker and exit 130 (what SIGINT does)."""
        log.info("agent %s: interrupted", self.node_id)
        self._finish(EXIT_INTERRUPTED)

    async def run_async(self) -> int:
        """The agent's main coroutine; returns the exit code."""
        cfg = self.config
        snapshot_dir = str(cfg.snapshot_dir)   # set by AgentConfig.__post_init__
        self._loop = asyncio.get_running_loop()
        self._exit = exit_future = self._loop.create_future()
        if cfg.standby:
            self._activated = asyncio.Event()
            os.makedirs(snapshot_dir, exist_ok=True)
            await self._start_worker()
            log.info("agent %s: on standby (workers warming up); SIGUSR1 registers the node", self.node_id)
            waiter = asyncio.ensure_future(self._activated.wait())
            await asyncio.wait([waiter, exit_future], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if self._exit.done():
                await self._stop_worker(kill=False)
                shutil.rmtree(snapshot_dir, ignore_errors=True)
                return self._exit.result()
            self._queued.clear()            # worker exits while on standby are no one's business
            self._queued_latest.clear()
        # No worker before the controller accepted the node: one that cannot be reached, or
        # that refuses us, must not leave a worker training on its own.
        reached = await self._dial.reach(exit_future)
        if reached is None:   # gave up, refused, or interrupted meanwhile
            for t in list(self._tasks):
                t.cancel()
            await self._stop_worker(kill=False)   # a standby node's
            return self._exit.result()
        reader, writer, first = reached
        self._cw = writer
        os.makedirs(snapshot_dir, exist_ok=True)
        rc = EXIT_FAILED
        try:
            self._spawn_task(self._read_controller(reader, writer))
            await self._on_controller(first)   # "registered" (or "error": refused)
            self._spawn_task(self._heartbeats())
            grp = self._worker
            if grp is None:
                if not self._exiting:
                    await self._start_worker()
            elif grp.healthy and grp.ready:   # said hello before the registration (or warmed up on standby)
                grp.ready_sent = True
                self._to_controller({"type": "worker_ready", "node": self.node_id, "incarnation": grp.incarnation,
                                     "model": grp.model, "pid": grp.pid, "pids": grp.pids,
                                     "startup": grp.startup, **grp.store_field()})
            rc = await self._exit
        finally:
            for t in list(self._tasks):
                t.cancel()
            await self._stop_worker(kill=False)
            if self._cw is not None:
                with contextlib.suppress(Exception):  # last reports (worker_exit, leaving) go out first
                    await asyncio.wait_for(self._cw.drain(), 2.0)
                with contextlib.suppress(Exception):
                    self._cw.close()
                    await asyncio.wait_for(self._cw.wait_closed(), 2.0)
            if rc == EXIT_OK:
                shutil.rmtree(snapshot_dir, ignore_errors=True)
        if self._gave_up is not None:
            log.error("agent %s: exit %d: the worker crashed %d times within %s (--max-restarts %d, "
                      "--restart-window); last error: %s", self.node_id, rc, cfg.max_restarts + 1,
                      cfg.restart_window, cfg.max_restarts, self._gave_up)
        log.info("agent %s: exit %d", self.node_id, rc)
        return rc

    # ------------------------------------------------------------------ plumbing
    def _spawn_task(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _finish(self, rc: int) -> None:
        if self._exit is not None and not self._exit.done():
            self._exit.set_result(rc)

    @property
    def _exiting(self) -> bool:
        return self._exit is None or self._exit.done()

    def _to_controller(self, msg: dict[str, Any], *, queue: bool = False) -> bool:
        """Send ``msg``; while the controller is away, keep it for later when ``queue``."""
        w = self._cw
        if w is not None and not w.transport.is_closing():
            w.write(encode_frame(self.config.secret, msg))
            return True
        if queue:
            inner = msg.get("msg") if msg.get("type") == "worker" else None
            kind = inner.get("type") if isinstance(inner, dict) else None
            if kind in _LATEST_ONLY:
                self._queued_latest.pop(kind, None)
                self._queued_latest[kind] = msg
            else:
                self._queued.append(msg)
                del self._queued[:-_MAX_QUEUED]
        return False

    def _to_worker(self, msg: dict[str, Any]) -> None:
        """Send ``msg`` to every running worker of the current group."""
        grp = self._worker
        if grp is None:
            return
        frame = encode_frame(self.config.secret, msg)
        for wk in grp.workers:
            if wk.alive and not wk.writer.transport.is_closing():
                wk.writer.write(frame)

    def _register(self, resume: bool = False) -> None:
        self._to_controller(self._register_msg(resume))

    def _register_msg(self, resume: bool = False) -> dict[str, Any]:
        wk = self._worker
        msg: dict[str, Any] = {"type": "register", "node": self.node_id, "slots": self.config.slots,
                               # a worker already running (started before the registration) is
                               # this incarnation; otherwise the next one starts after it
                               "incarnation": (wk.incarnation if wk is not None and (resume or wk.alive)
                                               else self.incarnation + 1),
                               "pid": os.getpid(), "nproc": self.config.nproc_per_node}
        if resume:
            msg["resume"] = {
                "incarnation": wk.incarnation if wk is not None else 0,
                "worker_alive": bool(wk is not None and wk.healthy),
                "worker_ready": bool(wk is not None and wk.healthy and wk.ready),
                "worker_pid": wk.pid if wk is not None else None,
                "worker_pids": wk.pids if wk is not None else [],   # every local rank's
                "model": wk.model if wk is not None else {},
                "plan_generation": wk.plan_generation if wk is not None else 0,
                "generation": wk.generation if wk is not None else None,
                "step": wk.step if wk is not None else None,
                "done": bool(wk is not None and wk.done),
                "leaving": self._leaving,
                **(wk.store_field() if wk is not None else {}),
            }
        return msg

    async def _heartbeats(self) -> None:
        period = self.config.heartbeat_interval.total_seconds()
        while True:
            wk = self._worker
            self._to_controller({"type": "heartbeat", "node": self.node_id,
                                 "worker_alive": bool(wk is not None and wk.healthy),
                                 "step": wk.step if wk is not None else None})
            await asyncio.sleep(period)

    # ------------------------------------------------------------------ controller link
    async def _read_controller(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        secret, limit = self.config.secret, max(self.config.max_message_bytes, PLAN_MAX_MESSAGE_BYTES)
        try:
            while True:
                msg = await read_frame(reader, secret, limit)
                await self._on_controller(msg)
        except (ConnectionClosed, ConnectionError, ProtocolError, OSError) as exc:
            if writer is self._cw:
                self._on_controller_lost(exc)

    def _on_controller_lost(self, exc: BaseException) -> None:
        if self._exiting:
            return
        with contextlib.suppress(Exception):
            if self._cw is not None:
                self._cw.close()
        self._cw = None
        wk = self._worker
        if self._shutdown:   # told the job is over: nothing to reconnect to
            if wk is None or not wk.alive:
                self._finish(EXIT_OK)
            elif wk.done:
                self._await_finished_worker(wk)
            return           # the shutdown deadline is running
        if wk is not None and wk.done and wk.alive:
            # A finished worker runs its own code to the end (exports, digests): never
            # kill it; the watcher exits with its code, the deadline bounds the wait.
            log.info("agent %s: controller gone (%s) after the worker finished; waiting for it to exit",
                     self.node_id, exc)
            self._await_finished_worker(wk)
        timeout = self.config.reconnect_timeout.total_seconds()
        if self._lost_since is None:
            self._lost_since = time.monotonic()
            log.warning("agent %s: lost the controller connection (%s); the worker keeps running, reconnecting "
                        "for up to %.0f s (--reconnect-timeout)", self.node_id, exc, timeout)
        else:   # a connection made while reconnecting broke again (e.g. refused during a restart)
            log.info("agent %s: controller connection broke again (%s); still reconnecting", self.node_id, exc)
        if not self._reconnecting:
            self._reconnecting = True
            self._spawn_task(self._reconnect())

    async def _reconnect(self) -> None:
        """Register again (with the worker's state) until ``reconnect_timeout`` has passed
        since the loss. The pauses back off from attempt to attempt, across connections
        that open but are refused or closed, until the controller accepts the node."""
        assert self._lost_since is not None
        deadline = self._lost_since + self.config.reconnect_timeout.total_seconds()
        ticker = self._spawn_task(self._dial.say_still_trying(
            deadline, "the worker keeps running; still reconnecting to", "--reconnect-timeout",
            RECONNECT_PROGRESS_EVERY))
        refused = False
        try:
            while True:
                if self._exiting:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    self._controller_gone(self._dial.last_failure or "no attempt answered")
                    return
                await asyncio.sleep(min(self._dial.backoff.next_delay().total_seconds(), left))
                if self._exiting:
                    return
                try:
                    reader, writer, first = await self._dial.attempt(True, deadline)
                    break
                except AuthRefusedError:
                    # A controller restarted with another secret: say so once; keep trying in
                    # case it is restarted again with the right one (the worker keeps training).
                    if not refused:
                        refused = True
                        log.error("agent %s: %s. The worker keeps running; still reconnecting until "
                                  "--reconnect-timeout.", self.node_id, self._dial.secret_refused())
                except Unreachable:
                    pass
        finally:
            ticker.cancel()
            self._reconnecting = False
        self._cw = writer
        self._spawn_task(self._read_controller(reader, writer))
        await self._on_controller(first)   # "registered": the queued reports follow
        if not self._exiting:
            log.info("agent %s: reconnected to the controller; registered again with the worker's state",
                     self.node_id)
        # A controller that dies again breaks this connection: the reader then calls
        # _on_controller_lost, which reconnects within a new deadline.

    def _controller_gone(self, reason: str) -> None:
        secs = self.config.reconnect_timeout.total_seconds()
        wk = self._worker
        if wk is not None and wk.done:
            log.error("agent %s: controller unreachable for %.0f s (%s); the worker finished", self.node_id,
                      secs, reason)
            if wk.alive:
                self._await_finished_worker(wk)
            else:
                self._finish(exit_status(wk.returncode or 0))
            return
        log.error("agent %s: controller unreachable for %.0f s (--reconnect-timeout; last error: %s); stopping the "
                  "worker", self.node_id, secs, reason)
        self._finish(EXIT_CONTROLLER_LOST)

    def _flush_queued(self) -> None:
        msgs = self._queued + list(self._queued_latest.values())
        self._queued, self._queued_latest = [], OrderedDict()
        for msg in msgs:
            self._to_controller(msg, queue=True)
        if msgs:
            log.info("agent %s: sent %d report(s) queued while the controller was away", self.node_id, len(msgs))

    async def _on_controller(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "plan":
            self._on_plan(msg)
        elif kind == "registered":
            self._dial.accepted()
            if self._lost_since is not None:
                log.info("agent %s: controller back after %.1f s", self.node_id,
                         time.monotonic() - self._lost_since)
                self._lost_since = None
            self._flush_queued()
            wk = self._worker
            if wk is not None and not wk.alive and wk.done and not self._exiting:
                self._finish(exit_status(wk.returncode or 0))  # its done and exit are delivered now
        elif kind == "shutdown":
            log.info("agent %s: shutdown (%s)", self.node_id, msg.get("reason"))
            self._shutdown = True
            wk = self._worker
            if self._gave_up is not None:
                self._finish(EXIT_CRASH_LOOP)
            elif wk is None or not wk.alive:
                self._finish(EXIT_OK if wk is None or not wk.done else exit_status(wk.returncode or 0))
            elif wk.done:
                # The job is done and this worker said so: tell it, and let it finish its
                # own code (never killed before exit_grace).
                self._to_worker({"type": "stop", "reason": msg.get("reason")})
                self._await_finished_worker(wk)
            else:
                self._to_worker({"type": "stop", "reason": msg.get("reason")})
                self._spawn_task(self._shutdown_deadline(wk))
        elif kind == "evicted":
            log.warning("agent %s: evicted by the controller; restarting the worker as a new member",
                        self.node_id)
            await self._stop_worker(kill=True)
            if self._leaving:
                self._finish(EXIT_OK)
                return
            self._register()
            await self._start_worker()
        elif kind == "error":
            log.error("agent %s: controller refused us: %s", self.node_id, msg.get("reason"))
            self._finish(EXIT_FAILED)
        elif kind == "pong":
            pass
        elif kind == "probe":   # which peers can this node reach? (after a collective error)
            self._spawn_task(self._answer_probe(msg))
        else:
            log.warning("agent %s: ignoring controller message %r", self.node_id, kind)

    async def _answer_probe(self, msg: dict[str, Any]) -> None:
        try:
            targets, timeout = parse_targets(msg, exclude=self.node_id)
        except MalformedMessageError as exc:
            log.error("agent %s step -: dropped a probe from the controller: %s", self.node_id, exc)
            return
        lost = await unreachable(targets, timeout)
        if lost:
            log.warning("agent %s step -: cannot reach %s (probe after a collective error)", self.node_id,
                        ", ".join(lost))
        self._to_controller({"type": "probe_result", "node": self.node_id, "generation": msg.get("generation"),
                             "unreachable": lost})

    def _on_plan(self, msg: dict[str, Any]) -> None:
        """Relay a plan to the workers, as it came (they read it themselves)."""
        try:
            plan = Plan.from_wire(msg)
        except MalformedMessageError as exc:
            log.error("agent %s: dropped a plan from the controller: %s", self.node_id, exc)
            return
        wk = self._worker
        inc = plan.incarnations.get(self.node_id)
        if wk is None or not wk.alive or (inc is not None and inc != wk.incarnation):
            log.info("agent %s: plan %s not for the current worker; dropped", self.node_id, plan.generation)
            return
        if plan.generation > wk.plan_generation:
            wk.plan_generation = plan.generation
        if plan.mode == "immediate" and plan.generation > wk.immediate_generation:
            wk.immediate_generation = plan.generation   # the others left the generation (the watchdog)
        self._to_worker(msg)

    def _await_finished_worker(self, wk: WorkerGroup) -> None:
        """A worker that reported done runs its own code to the end (exports, digests):
        its watcher exits with its code; this bounds the wait by ``exit_grace``."""
        if wk.grace_task is None:
            wk.grace_task = self._spawn_task(self._finished_worker_deadline(wk))

    async def _finished_worker_deadline(self, wk: WorkerGroup) -> None:
        grace = self.config.exit_grace.total_seconds()
        try:
            await asyncio.wait_for(asyncio.shield(wk.wait()), grace)
        except asyncio.TimeoutError:
            log.error("agent %s: the worker reported done %.0f s ago and is still running (--exit-grace); "
                      "stopping it", self.node_id, grace)
            self._finish(EXIT_GRACE_EXPIRED)

    async def _shutdown_deadline(self, wk: WorkerGroup) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(wk.wait()), self.config.stop_timeout.total_seconds())
        except asyncio.TimeoutError:
            log.warning("agent %s: worker ignored stop; killing it", self.node_id)
        self._finish(EXIT_OK)

    async def _left_worker_deadline(self, grp: WorkerGroup) -> None:
        """The workers handed their state over and left: the job needs nothing more from
        them. One still running after ``stop_timeout`` is held up at exit by background
        work that cannot end (a checkpoint write to hung storage): stop it and leave, well
        within the spot notice, instead of waiting out ``leave_timeout``."""
        timeout = self.config.stop_timeout.total_seconds()
        try:
            await asyncio.wait_for(asyncio.shield(grp.wait()), timeout)
            return   # exited by itself: the watcher finishes the leave
        except asyncio.TimeoutError:
            pass
        if grp is not self._worker or self._exiting:
            return
        log.warning("agent %s: the worker handed its state over and left the job, but has not exited %.1f s "
                    "later (background work stuck, e.g. a checkpoint write to unreachable storage); stopping it",
                    self.node_id, timeout)
        await self._stop_worker(kill=False)
        self._finish(EXIT_OK)

    async def _leave_deadline(self) -> None:
        await asyncio.sleep(self.config.leave_timeout.total_seconds())
        log.error("agent %s: hand-over not finished within %.1fs; giving up", self.node_id,
                  self.config.leave_timeout.total_seconds())
        self._finish(EXIT_LEAVE_TIMEOUT)

    # ------------------------------------------------------------------ workers
    async def _start_worker(self) -> None:
        """Start a new incarnation of the node's ``nproc_per_node`` workers."""
        cfg = self.config
        self.incarnation += 1
        inc = self.incarnation
        g = cfg.nproc_per_node
        started: list[tuple[WorkerProcess, asyncio.StreamReader]] = []
        for local_rank in range(g):
            env = worker_env(dict(os.environ, **self._socket_env), cfg.env, node_id=self.node_id,
                             snapshot_dir=str(cfg.snapshot_dir),
                             incarnation=str(inc), secret=cfg.secret.hex(), standby="1" if self._on_standby else "0",
                             store_host=self._store_host,
                             max_message_bytes=str(max(cfg.max_message_bytes, PLAN_MAX_MESSAGE_BYTES)))
            # as torchrun: the worker's place on the node (device selection follows LOCAL_RANK)
            env.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(g))
            try:
                started.append(await spawn_worker(cfg.worker_command, env, inc, local_rank=local_rank))
            except OSError as exc:
                log.error("agent %s: cannot start the worker %r: %s", self.node_id, cfg.worker_command, exc)
                for wk, _ in started:
                    with contextlib.suppress(ProcessLookupError):
                        wk.proc.kill()
                    await wk.proc.wait()
                self._finish(EXIT_FAILED)
                return
        grp = WorkerGroup(inc, [wk for wk, _ in started])
        self._worker = grp
        log.info("agent %s: worker incarnation %d started (pid%s %s)", self.node_id, inc, "s" if g > 1 else "",
                 ", ".join(str(p) for p in grp.pids))
        for wk, reader in started:
            self._spawn_task(self._read_worker(grp, wk, reader))
        self._spawn_task(self._watch_worker(grp))
        self._spawn_task(self._watchdog.run(grp, lambda: grp is self._worker))

    async def _read_worker(self, grp: WorkerGroup, wk: WorkerProcess, reader: asyncio.StreamReader) -> None:
        secret, limit = self.config.secret, self.config.max_message_bytes
        try:
            while True:
                msg = await read_frame(reader, secret, limit)
                if grp is not self._worker:
                    return
                kind = msg["type"]
                if kind == "hello":
                    wk.ready = True
                    model = msg.get("model")
                    wk.model = model if isinstance(model, dict) else {}
                    startup = msg.get("startup")
                    if isinstance(startup, dict):
                        wk.startup = {k: v for k, v in startup.items() if isinstance(k, str)
                                      and isinstance(v, (int, float)) and not isinstance(v, bool)}
                    try:
                        wk.store = store_address(msg.get("store"))
                    except MalformedMessageError as exc:   # plans then use the controller's store
                        log.warning("agent %s: worker %d's hello: %s", self.node_id, wk.local_rank, exc)
                    if grp.ready and not grp.ready_sent and not self._on_standby:
                        grp.ready_sent = True               # the node is ready when all its workers are
                        # not queued: a reconnect's resume record says the worker is ready
                        self._to_controller({"type": "worker_ready", "node": self.node_id,
                                             "incarnation": grp.incarnation, "model": grp.model, "pid": grp.pid,
                                             "pids": grp.pids, "startup": grp.startup, **grp.store_field()})
                    continue
                if kind == "progress" and isinstance(msg.get("step"), int):
                    wk.step = msg["step"]
                if kind in ("progress", "reconfigured") and isinstance(msg.get("generation"), int):
                    wk.generation = msg["generation"]
                if kind == "left":
                    wk.left = True
                    if grp.left and self._leaving and grp.left_task is None:
                        grp.left_task = self._spawn_task(self._left_worker_deadline(grp))
                if kind == "done":
                    wk.done = True
                    if not grp.done:
                        continue      # the node is done once all its workers are
                if kind == "progress" and wk.local_rank != 0:
                    continue          # the node's progress is its local rank 0's
                self._to_controller({"type": "worker", "node": self.node_id, "local_rank": wk.local_rank,
                                     "msg": msg}, queue=True)
        except ProtocolError as exc:
            log.warning("agent %s: bad frame from worker %d local rank %d (%s); closing its channel",
                        self.node_id, wk.incarnation, wk.local_rank, exc)
            wk.writer.close()
        except (ConnectionClosed, ConnectionError, OSError):
            pass

    def _report_from_worker(self, wk: WorkerProcess, msg: dict[str, Any]) -> None:
        """The watchdog's reports go up as the worker's own (``slow_step``)."""
        self._to_controller({"type": "worker", "node": self.node_id, "local_rank": wk.local_rank, "msg": msg},
                            queue=True)

    def _brings_group_down(self, grp: WorkerGroup, wk: WorkerProcess) -> bool:
        """Does ``wk``'s exit end its group? A failure (non-zero status), or any exit of a
        worker that did not finish while the node is neither leaving nor shutting down;
        never the exit of a worker that reported done or was stopped on purpose."""
        if wk.done or grp.killed:
            return False
        return wk.proc.returncode != 0 or not (self._leaving or self._shutdown)

    def _report_exit(self, grp: WorkerGroup, rc: int) -> None:
        self._to_controller({"type": "worker_exit", "node": self.node_id, "returncode": rc,
                             "incarnation": grp.incarnation, "error": None if rc == 0 else grp.last_error()},
                            queue=True)

    async def _wait_group(self, grp: WorkerGroup) -> bool:
        """Until every worker of ``grp`` exited. The first one whose exit brings the group
        down (torchrun's rule) is reported at once (the node's ranks are gone: the
        controller replans without waiting for the rest) and its siblings are SIGKILLed:
        their collectives with it are broken, and the node restarts (or leaves) as a
        whole. Returns whether the exit was reported."""
        waits = {asyncio.ensure_future(w.proc.wait()): w for w in grp.workers}
        pending = set(waits)
        reported = False
        while pending:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(finished, key=lambda f: waits[f].local_rank):
                wk = waits[fut]
                with contextlib.suppress(Exception):
                    wk.writer.close()
                if grp.failed is None and self._brings_group_down(grp, wk):
                    grp.failed = wk
                    siblings = [waits[f] for f in pending if not waits[f].done]
                    for sib in siblings:
                        with contextlib.suppress(ProcessLookupError):
                            sib.proc.kill()
                    if siblings:
                        log.warning("agent %s: worker local rank %d of incarnation %d exited (%s); stopped the "
                                    "node's other %d worker(s)", self.node_id, wk.local_rank, grp.incarnation,
                                    describe_exit(wk.proc.returncode or 0), len(siblings))
                        await wk.stderr_done()   # its last error names the cause
                        self._report_exit(grp, wk.proc.returncode or 0)
                        reported = True
        for w in grp.workers:
            await w.stderr_done()
        return reported

    async def _watch_worker(self, wk: WorkerGroup) -> None:
        reported = await self._wait_group(wk)
        rc = wk.returncode or 0
        log.info("agent %s: worker incarnation %d exited with %d", self.node_id, wk.incarnation, rc)
        if not reported:
            self._report_exit(wk, rc)
        if wk is not self._worker or wk.killed:
            return
        if wk.done:
            if self._cw is None and not self._shutdown:
                log.info("agent %s: the finished worker exited with %d; waiting for the controller to "
                         "deliver its reports", self.node_id, rc)
                return   # exits once registered again (or when the reconnect timeout has passed)
            code = exit_status(rc)
            log.info("agent %s: the finished worker exited with %d; exiting with %d", self.node_id, rc, code)
            self._finish(code)
            return
        if self._leaving or self._shutdown or rc == 0:
            self._finish(EXIT_OK)
            return
        if not self.config.respawn:
            log.error("agent %s: worker failed (%s) and respawn is off; last error: %s", self.node_id,
                      describe_exit(rc), wk.last_error())
            self._finish(EXIT_FAILED)
            return
        delay = self._restarts.next_delay()
        if delay is None:
            await self._give_up(wk)
            return
        log.warning("agent %s: worker incarnation %d failed (%s); restart %d of at most %d within %s in %.2f s",
                    self.node_id, wk.incarnation, wk.last_error(), self._restarts.recent(),
                    self.config.max_restarts, self.config.restart_window, delay)
        await asyncio.sleep(delay)
        if wk is self._worker and not self._exiting and not self._leaving and not self._shutdown:
            await self._start_worker()

    async def _give_up(self, wk: WorkerGroup) -> None:
        """Past ``max_restarts``: the node leaves the job; exit 5 naming the last error."""
        self._gave_up = wk.last_error()
        self._leaving = True
        log.error("agent %s: worker crashed %d times within %s; leaving the job. Last error: %s", self.node_id,
                  self.config.max_restarts + 1, self.config.restart_window, self._gave_up)
        sent = self._to_controller({"type": "leaving", "node": self.node_id, "reason": "crash_loop",
                                    "error": self._gave_up})
        if sent:   # the controller answers with shutdown; don't wait for it forever
            await asyncio.sleep(min(5.0, self.config.leave_timeout.total_seconds()))
        self._finish(EXIT_CRASH_LOOP)

    async def _stop_worker(self, *, kill: bool) -> None:
        """Stop the current workers: SIGKILL (``kill``) or SIGTERM, SIGKILL after stop_timeout."""
        grp = self._worker
        if grp is None or not grp.alive:
            return
        grp.killed = True
        if not kill:
            self._to_worker({"type": "stop", "reason": "agent exiting"})
        running = [wk for wk in grp.workers if wk.alive]
        for wk in running:
            with contextlib.suppress(ProcessLookupError):
                if kill:
                    wk.proc.kill()
                else:
                    wk.proc.terminate()
        try:
            await asyncio.wait_for(asyncio.gather(*(wk.proc.wait() for wk in running)),
                                   self.config.stop_timeout.total_seconds())
        except asyncio.TimeoutError:
            for wk in running:
                with contextlib.suppress(ProcessLookupError):
                    wk.proc.kill()
            for wk in running:
                await wk.proc.wait()
