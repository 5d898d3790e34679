"""The per-node agent: registers with the controller, heartbeats, runs the worker.

One agent per node. It

* connects to the controller (retrying with backoff up to ``connect_timeout``), registers,
  and sends a heartbeat every ``heartbeat_interval``;
* starts the worker command with one end of a socketpair (``LAZARUS_AGENT_FD``) and relays
  in both directions: the worker's ``hello`` becomes ``worker_ready``, its other messages
  go up wrapped as ``{"type": "worker", ...}``, plans and ``stop`` come down;
* watches the worker: an exit is reported (``worker_exit``); an abnormal exit is followed
  by a respawn (new incarnation, which rejoins) unless ``respawn`` is off;
* keeps the node-memory directory (``snapshot_dir``) across worker crashes and removes it
  when it exits normally.

Signals: SIGTERM (spot notice) -> ``leaving``; the agent waits for the plan without this
node, lets the worker finish its hand-over and exit, then exits 0 (exit 3 if that takes
longer than ``leave_timeout``). SIGINT -> stop the worker and exit 130.

If the controller connection drops, the node can no longer be coordinated: the agent
stops its worker and exits 4 (no reconnect; a supervisor may restart it, and it then
joins as a new member).

Exit codes: 0 normal (shutdown, leave, worker finished), 1 cannot connect / registration
refused / worker failed without respawn, 3 leave timed out, 4 controller lost, 130 SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import time
from typing import Any

from ._config import AgentConfig
from ._wire import PLAN_MAX_MESSAGE_BYTES, ConnectionClosed, ProtocolError, encode_frame, read_frame

__all__ = ["Agent"]

log = logging.getLogger("lazarus.agent")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_LEAVE_TIMEOUT = 3
EXIT_CONTROLLER_LOST = 4
EXIT_GRACE_EXPIRED = 6
EXIT_INTERRUPTED = 130


def _exit_status(returncode: int) -> int:
    """A process's exit status as a shell reports it (killed by signal N -> 128 + N)."""
    return returncode if 0 <= returncode < 256 else 128 + (-returncode if returncode < 0 else 1)


class _Worker:
    """One worker incarnation and its channel."""

    def __init__(self, incarnation: int, proc: asyncio.subprocess.Process,
                 writer: asyncio.StreamWriter) -> None:
        self.incarnation = incarnation
        self.proc = proc
        self.writer = writer
        self.ready = False
        self.step: int | None = None
        self.killed = False  # stopped on purpose (evict / shutdown / leave timeout)
        self.done = False    # reported that training finished; never killed after that
        self.grace_task: asyncio.Task[Any] | None = None

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None


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
        self._worker: _Worker | None = None
        self._leaving = False
        self._shutdown = False
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ public
    def run(self) -> int:
        """Run the agent in a fresh event loop, with SIGTERM/SIGINT handlers."""

        async def main() -> int:
            loop = asyncio.get_running_loop()
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signal.SIGTERM, self.request_leave)
                loop.add_signal_handler(signal.SIGINT, self.request_stop)
            return await self.run_async()

        return asyncio.run(main())

    def request_leave(self) -> None:
        """Graceful leave (what SIGTERM does). Call from the agent's loop thread."""
        if self._leaving or self._exit is None or self._exit.done():
            return
        self._leaving = True
        log.info("agent %s: leaving (SIGTERM)", self.node_id)
        self._to_controller({"type": "leaving", "node": self.node_id})
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
        self._loop = asyncio.get_running_loop()
        self._exit = self._loop.create_future()
        try:
            reader, self._cw = await self._connect()
        except OSError as exc:
            log.error("agent %s: cannot reach the controller at %s:%s: %s", self.node_id,
                      cfg.controller_host, cfg.controller_port, exc)
            return EXIT_FAILED
        os.makedirs(cfg.snapshot_dir, exist_ok=True)
        rc = EXIT_FAILED
        try:
            self._register()
            self._spawn_task(self._read_controller(reader))
            self._spawn_task(self._heartbeats())
            await self._start_worker()
            rc = await self._exit
        finally:
            for t in list(self._tasks):
                t.cancel()
            await self._stop_worker(kill=False)
            if self._cw is not None:
                with contextlib.suppress(Exception):  # last reports (worker_exit) go out first
                    await asyncio.wait_for(self._cw.drain(), 2.0)
                with contextlib.suppress(Exception):
                    self._cw.close()
                    await asyncio.wait_for(self._cw.wait_closed(), 2.0)
            if rc == EXIT_OK:
                shutil.rmtree(cfg.snapshot_dir, ignore_errors=True)
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

    def _to_controller(self, msg: dict[str, Any]) -> None:
        w = self._cw
        if w is not None and not w.transport.is_closing():
            w.write(encode_frame(self.config.secret, msg))

    def _to_worker(self, msg: dict[str, Any]) -> None:
        wk = self._worker
        if wk is not None and wk.alive and not wk.writer.transport.is_closing():
            wk.writer.write(encode_frame(self.config.secret, msg))

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        cfg = self.config
        deadline = time.monotonic() + cfg.connect_timeout.total_seconds()
        delay = 0.05
        while True:
            try:
                return await asyncio.open_connection(cfg.controller_host, cfg.controller_port)
            except OSError as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.info("agent %s: controller not reachable yet (%s); retrying in %.2fs",
                         self.node_id, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _register(self) -> None:
        self._to_controller({"type": "register", "node": self.node_id, "slots": self.config.slots,
                             "incarnation": self.incarnation + 1, "pid": os.getpid()})

    async def _heartbeats(self) -> None:
        period = self.config.heartbeat_interval.total_seconds()
        while True:
            wk = self._worker
            self._to_controller({"type": "heartbeat", "node": self.node_id,
                                 "worker_alive": bool(wk is not None and wk.alive),
                                 "step": wk.step if wk is not None else None})
            await asyncio.sleep(period)

    async def _read_controller(self, reader: asyncio.StreamReader) -> None:
        secret, limit = self.config.secret, max(self.config.max_message_bytes, PLAN_MAX_MESSAGE_BYTES)
        try:
            while True:
                msg = await read_frame(reader, secret, limit)
                await self._on_controller(msg)
        except (ConnectionClosed, ConnectionError, ProtocolError, OSError) as exc:
            self._on_controller_lost(exc)

    def _on_controller_lost(self, exc: BaseException) -> None:
        if self._exit is None or self._exit.done():
            return
        wk = self._worker
        if wk is not None and wk.done and wk.alive:
            # A finished worker runs its own code to the end (exports, digests): never
            # kill it; the watcher exits with its code, the deadline bounds the wait.
            log.info("agent %s: controller gone (%s) after the worker finished; waiting for it to exit",
                     self.node_id, exc)
            self._await_finished_worker(wk)
            return
        if self._shutdown:
            if wk is None or not wk.alive:
                self._finish(EXIT_OK)
            return  # the shutdown deadline is running
        log.error("agent %s: lost the controller connection (%s); stopping the worker", self.node_id, exc)
        self._finish(EXIT_CONTROLLER_LOST)

    async def _on_controller(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "plan":
            self._on_plan(msg)
        elif kind == "shutdown":
            log.info("agent %s: shutdown (%s)", self.node_id, msg.get("reason"))
            self._shutdown = True
            wk = self._worker
            if wk is None or not wk.alive:
                self._finish(EXIT_OK)
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
        elif kind in ("registered", "pong"):
            pass
        else:
            log.warning("agent %s: ignoring controller message %r", self.node_id, kind)

    def _on_plan(self, plan: dict[str, Any]) -> None:
        wk = self._worker
        inc = (plan.get("incarnations") or {}).get(self.node_id)
        if wk is None or not wk.alive or (inc is not None and inc != wk.incarnation):
            log.info("agent %s: plan %s not for the current worker; dropped", self.node_id,
                     plan.get("generation"))
            return
        self._to_worker(plan)

    def _await_finished_worker(self, wk: _Worker) -> None:
        """A worker that reported done runs its own code to the end (exports, digests):
        its watcher exits with its code; this bounds the wait by ``exit_grace``."""
        if wk.grace_task is None:
            wk.grace_task = self._spawn_task(self._finished_worker_deadline(wk))

    async def _finished_worker_deadline(self, wk: _Worker) -> None:
        grace = self.config.exit_grace.total_seconds()
        try:
            await asyncio.wait_for(asyncio.shield(wk.proc.wait()), grace)
        except asyncio.TimeoutError:
            log.error("agent %s: the worker reported done %.0f s ago and is still running (--exit-grace); "
                      "stopping it", self.node_id, grace)
            self._finish(EXIT_GRACE_EXPIRED)

    async def _shutdown_deadline(self, wk: _Worker) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(wk.proc.wait()), self.config.stop_timeout.total_seconds())
        except asyncio.TimeoutError:
            log.warning("agent %s: worker ignored stop; killing it", self.node_id)
        self._finish(EXIT_OK)

    async def _leave_deadline(self) -> None:
        await asyncio.sleep(self.config.leave_timeout.total_seconds())
        log.error("agent %s: hand-over not finished within %.1fs; giving up", self.node_id,
                  self.config.leave_timeout.total_seconds())
        self._finish(EXIT_LEAVE_TIMEOUT)

    # ------------------------------------------------------------------ worker
    async def _start_worker(self) -> None:
        cfg = self.config
        self.incarnation += 1
        inc = self.incarnation
        parent, child = socket.socketpair()
        env = dict(os.environ)
        env.update(cfg.env)
        env.update({
            "LAZARUS_AGENT_FD": str(child.fileno()),
            "LAZARUS_NODE_ID": self.node_id,
            "LAZARUS_SNAPSHOT_DIR": str(cfg.snapshot_dir),
            "LAZARUS_INCARNATION": str(inc),
            "LAZARUS_SECRET": cfg.secret.hex(),
            "LAZARUS_MAX_MESSAGE_BYTES": str(max(cfg.max_message_bytes, PLAN_MAX_MESSAGE_BYTES)),
        })
        try:
            proc = await asyncio.create_subprocess_exec(*cfg.worker_command, pass_fds=(child.fileno(),),
                                                        env=env)
        except OSError as exc:
            parent.close()
            log.error("agent %s: cannot start the worker %r: %s", self.node_id, cfg.worker_command, exc)
            self._finish(EXIT_FAILED)
            return
        finally:
            child.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent)
        wk = self._worker = _Worker(inc, proc, writer)
        log.info("agent %s: worker incarnation %d started (pid %d)", self.node_id, inc, proc.pid)
        self._spawn_task(self._read_worker(wk, reader))
        self._spawn_task(self._watch_worker(wk))

    async def _read_worker(self, wk: _Worker, reader: asyncio.StreamReader) -> None:
        secret, limit = self.config.secret, self.config.max_message_bytes
        try:
            while True:
                msg = await read_frame(reader, secret, limit)
                if wk is not self._worker:
                    return
                kind = msg["type"]
                if kind == "hello":
                    wk.ready = True
                    self._to_controller({"type": "worker_ready", "node": self.node_id,
                                         "incarnation": wk.incarnation, "model": msg.get("model") or {},
                                         "pid": wk.proc.pid})
                    continue
                if kind == "progress" and isinstance(msg.get("step"), int):
                    wk.step = msg["step"]
                if kind == "done":
                    wk.done = True
                self._to_controller({"type": "worker", "node": self.node_id, "msg": msg})
        except ProtocolError as exc:
            log.warning("agent %s: bad frame from worker %d (%s); closing its channel",
                        self.node_id, wk.incarnation, exc)
            wk.writer.close()
        except (ConnectionClosed, ConnectionError, OSError):
            pass

    async def _watch_worker(self, wk: _Worker) -> None:
        rc = await wk.proc.wait()
        with contextlib.suppress(Exception):
            wk.writer.close()
        log.info("agent %s: worker incarnation %d exited with %d", self.node_id, wk.incarnation, rc)
        self._to_controller({"type": "worker_exit", "node": self.node_id, "returncode": rc,
                             "incarnation": wk.incarnation})
        if wk is not self._worker or wk.killed:
            return
        if wk.done:
            code = _exit_status(rc)
            log.info("agent %s: the finished worker exited with %d; exiting with %d", self.node_id, rc, code)
            self._finish(code)
            return
        if self._leaving or self._shutdown or rc == 0:
            self._finish(EXIT_OK)
        elif self.config.respawn:
            await asyncio.sleep(self.config.respawn_delay.total_seconds())
            if wk is self._worker and not (self._exit is None or self._exit.done()):
                await self._start_worker()
        else:
            log.error("agent %s: worker failed (exit %d) and respawn is off", self.node_id, rc)
            self._finish(EXIT_FAILED)

    async def _stop_worker(self, *, kill: bool) -> None:
        """Stop the current worker: SIGKILL (``kill``) or SIGTERM, SIGKILL after stop_timeout."""
        wk = self._worker
        if wk is None or not wk.alive:
            return
        wk.killed = True
        with contextlib.suppress(ProcessLookupError):
            if kill:
                wk.proc.kill()
            else:
                self._to_worker({"type": "stop", "reason": "agent exiting"})
                wk.proc.terminate()
        try:
            await asyncio.wait_for(wk.proc.wait(), self.config.stop_timeout.total_seconds())
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                wk.proc.kill()
            await wk.proc.wait()
