"""The Lazarus controller: membership, failure detection and plans (asyncio).

One process per job. It hosts the rendezvous ``TCPStore`` the workers build their
process groups on (a fresh key prefix per generation), accepts agent connections, and
turns what it learns (registrations, heartbeats, worker exits, relayed worker messages)
into *plans*: which nodes are members, in which rank order, and which experts each rank
holds per MoE layer.

Failure plans are immediate (the survivors are blocked in a broken collective and wait
for them); joins, graceful leaves and rebalances are applied between steps. At most one
between-steps plan is in flight; the next kind waits until it was applied (a
``reconfigured`` report for its generation) or superseded by a failure plan.

Every decision is written to the events file (JSON lines) and logged. Errors of
connections that have not registered (anyone who reaches the port can open one) are
rate-limited per peer address (``protocol_error_interval``): the first in full, then one
``protocol_errors_repeated`` line per interval with a count. A first frame whose MAC does
not match is answered with the fixed, unauthenticated ``auth_failed`` frame
(:data:`~.._wire.AUTH_FAILED_FRAME`) before the connection is closed, so that the agent
can say its secret is wrong. The state that
plans depend on is kept in ``state_dir`` (atomically replaced); a controller started
again with the same settings resumes the job (:mod:`._resume`). When every member's
worker reported done, the agents are told and the controller waits (``exit_grace``)
until they have left.

The controller is made of parts: it keeps the sockets (``node id -> connection``) and
the loop, and owns a :class:`~._membership.Membership` (the view of the cluster, the plan
logic and the timers, without sockets), a :class:`~._resume.Resume` (a restarted
controller waiting for its members) and a :class:`~._resume.StateSaver`. Those talk to
the outside through one :class:`~._port.Port` the controller gives them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .._backoff import RepeatLimiter
from .._config import ControllerConfig
from .._wire import (AUTH_FAILED_FRAME, BadMacError, ConnectionClosed, MalformedMessageError,
                     ProtocolError, encode_frame, read_frame)
from ._membership import Membership
from ._port import Port, msg_field
from ._resume import Resume, ResumeRecord, StateSaver

__all__ = ["Controller"]

log = logging.getLogger("lazarus.controller")

_WRITE_BUFFER_LIMIT = 16 << 20
#: After the auth_failed refusal: how long to wait for the peer to read it and close, and
#: how much of what it still sends to read meanwhile (closing a socket with unread data
#: resets the connection, which can destroy the refusal before the peer read it).
_REFUSAL_LINGER_S = 1.0
_REFUSAL_DISCARD_BYTES = 1 << 16
#: Connections the kernel queues before the controller accepts them (capped by the OS's
#: net.core.somaxconn): a thousand agents registering at once must not find it full
#: (asyncio's default of 100 makes the others' SYNs wait for retransmission, 1 s and more).
_LISTEN_BACKLOG = 4096


class _Timings:
    """How long the controller takes to handle the agents' messages, and how late its loop
    runs (what a message that arrives meanwhile waits): the newest samples, for a
    ``stats`` request (``make bench-control``). Two clock reads per message."""

    def __init__(self) -> None:
        self.messages = 0
        self.handle: deque[float] = deque(maxlen=8192)
        self.lag: deque[float] = deque(maxlen=1024)

    def reset(self) -> None:
        self.messages = 0
        self.handle.clear()
        self.lag.clear()

    def snapshot(self) -> dict[str, Any]:
        def pct(values: deque[float], q: float) -> float | None:
            if not values:
                return None
            s = sorted(values)
            return round(1000 * s[min(len(s) - 1, int(q / 100 * len(s)))], 3)

        return {"messages": self.messages, "handle_ms_p50": pct(self.handle, 50),
                "handle_ms_p99": pct(self.handle, 99), "handle_ms_max": pct(self.handle, 100),
                "loop_lag_ms_p50": pct(self.lag, 50), "loop_lag_ms_p99": pct(self.lag, 99),
                "loop_lag_ms_max": pct(self.lag, 100), "lag_samples": len(self.lag),
                "gc_frozen": gc.get_freeze_count()}


@dataclass(eq=False)
class _Conn:
    writer: asyncio.StreamWriter
    peer: str
    host: str                   # the peer's address without the port (what errors are counted by)
    node_id: str | None = None
    closed: bool = False


def _peer(writer: asyncio.StreamWriter) -> tuple[str, str]:
    """``("host:port", "host")`` of the connection's peer."""
    p = writer.get_extra_info("peername")
    if isinstance(p, tuple) and len(p) >= 2:
        return f"{p[0]}:{p[1]}", str(p[0])
    return str(p), str(p)


class Controller:
    """The job's controller. See the module docstring and DESIGN.md section 5.

    Use ``run()`` (blocking, e.g. from the CLI), ``await serve()`` inside an event loop,
    or ``start_in_thread()`` (tests, notebooks). ``port``/``store_port`` hold the bound
    ports once started (useful with ephemeral ports); ``plan``, ``members``,
    ``generation`` and ``gpus_per_node`` the newest plan's view (read-only).
    """

    def __init__(self, config: ControllerConfig, *, on_ready: Callable[[Controller], None] | None = None) -> None:
        if not isinstance(config, ControllerConfig):
            raise ValueError(f"config must be a ControllerConfig, got {type(config).__name__}")
        self.config = config
        self.port: int | None = None
        self.store_port: int | None = None
        self._on_ready = on_ready
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._events_lock = threading.Lock()
        self._store: Any = None
        self._conns: set[_Conn] = set()
        self._links: dict[str, _Conn] = {}   # node id -> its connection (the nodes of the membership)
        self._stopping = False
        self._end_task: asyncio.Task[None] | None = None
        self.epoch = 1
        # errors of unregistered connections, per peer address (see the module docstring)
        self._repeats = RepeatLimiter(config.protocol_error_interval)
        self._repeat_kinds: dict[str, Counter[str]] = {}
        self._repeat_timer: asyncio.TimerHandle | None = None
        # the newest message sent and its frame: a plan goes to every member as the same
        # object, encoded (JSON + HMAC) once, not once per member
        self._last_sent: tuple[dict[str, Any], bytes] | None = None
        self._timings = _Timings()
        self._freeze_gc = False    # run(): the process is the controller's own
        port = Port(send=self._send, event=self._event, save_state=self._save_state, call_later=self._call_later,
                    call_soon=self._call_soon, time=self._time, connected=self._connected,
                    own_store=self._own_store, end_job=self._end_job,
                    collective_while_resuming=self._on_collective_while_resuming)
        self._membership = Membership(config, port)
        self._resume = Resume(config, self._membership, port)
        self._saver = StateSaver(config.state_dir, self._state_dict, call_later=self._call_later,
                                 on_error=self._on_state_error)

    # ------------------------------------------------------------------ the view (read-only)
    @property
    def members(self) -> list[str]:
        """Members of the newest plan, in rank order."""
        return self._membership.members

    @property
    def plan(self) -> dict[str, Any] | None:
        """The newest plan message (:meth:`Plan.to_wire`)."""
        plan = self._membership.plan
        return None if plan is None else plan.to_wire()

    @property
    def generation(self) -> int:
        """The newest plan's generation (0 before the first)."""
        return self._membership.generation

    @property
    def gpus_per_node(self) -> int | None:
        """Workers per node of this job (fixed by the first node to register; None before)."""
        return self._membership.gpus_per_node

    # ------------------------------------------------------------------ lifecycle
    async def serve(self) -> None:
        """Run until :meth:`stop` (or until done with ``exit_when_done``). With a saved
        state of an unfinished job in ``state_dir``, resume it (see :mod:`._resume`)."""
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            state = self._load_state()
            port, store_port = cfg.port, cfg.store_port
            if state is not None:   # the same ports as before (0 means "any" only the first time)
                port = port or int(state["port"])
                store_port = store_port or int(state["store_port"])
            self._store = self._host_store(store_port, fallback=state is not None and not cfg.store_port)
            self.store_port = int(self._store.port)
            try:
                server = await asyncio.start_server(self._handle_conn, cfg.host, port, backlog=_LISTEN_BACKLOG)
            except OSError as exc:
                if port != cfg.port:
                    raise OSError(exc.errno, f"cannot listen again on port {port} of the job being resumed "
                                             f"({exc.strerror})") from None
                raise
        except BaseException as exc:
            self._start_error = exc
            self._ready.set()
            raise
        self.port = int(server.sockets[0].getsockname()[1])
        self._event("controller_started", host=cfg.host, port=self.port, store_port=self.store_port,
                    epoch=self.epoch, resumed=self._membership.resuming, generation=self.generation,
                    state_dir=str(cfg.state_dir) if cfg.state_dir is not None else None)
        self._save_state(now=True)
        self._resume.start(self.epoch)
        if self._freeze_gc:
            # What exists now (torch's modules above all: hundreds of thousands of objects)
            # lives as long as the process: out of the cyclic GC's sight. Each full collection
            # walked them all, 100-240 ms with the loop blocked, every agent's messages waiting.
            gc.freeze()
        self._ready.set()
        if self._on_ready is not None:
            self._on_ready(self)
        watchdog = asyncio.create_task(self._watch_heartbeats())
        try:
            await self._stop.wait()
        finally:
            self._stopping = True
            watchdog.cancel()
            server.close()
            for conn in list(self._conns):
                self._close(conn)
            try:
                await asyncio.wait_for(server.wait_closed(), 2.0)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001
                pass
            self._membership.cancel_timers()
            self._resume.cancel()
            if self._repeat_timer is not None:
                self._repeat_timer.cancel()
            self._flush_repeats(everything=True)
            if self._saver.pending:
                self._save_state(now=True)
            self._event("controller_stopped", generation=self.generation)
            self._store = None

    def _load_state(self) -> dict[str, Any] | None:
        """The saved state of an unfinished job to resume, or None (fresh start)."""
        if self.config.state_dir is None:
            return None
        from ._state import read_state

        state = read_state(self.config.state_dir)
        if state is None:
            return None
        if state["finished"] or not state["generation"]:
            log.info("state in %s is of a %s job; starting a new one", self.config.state_dir,
                     "finished" if state["finished"] else "never started")
            self.epoch = int(state["epoch"]) + 1
            return None
        self.epoch = int(state["epoch"]) + 1
        self._resume.restore(state)
        return state

    # ------------------------------------------------------------------ state
    def _state_dict(self) -> dict[str, Any]:
        """The state file's content (:mod:`._state`): the controller's ports and epoch,
        and the membership's view."""
        return {"epoch": self.epoch, "port": int(self.port or 0), "store_port": int(self.store_port or 0),
                **self._membership.state(), "saved_at": time.time()}

    def _save_state(self, now: bool = False) -> None:
        """Persist the state: at once (plans, done), or coalesced within a second."""
        if self._loop is None:
            return
        self._saver.save(now)

    def _on_state_error(self, exc: OSError) -> None:
        self._event("state_write_failed", level=logging.ERROR, state_dir=str(self.config.state_dir),
                    error=str(exc))

    def _on_collective_while_resuming(self, current: bool) -> None:
        self._resume.on_collective(current)

    # ------------------------------------------------------------------ the loop
    def _call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> asyncio.TimerHandle:
        assert self._loop is not None
        return self._loop.call_later(delay, callback, *args)

    def _call_soon(self, callback: Callable[[], None]) -> asyncio.Handle:
        assert self._loop is not None
        return self._loop.call_soon(callback)

    def _time(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def _own_store(self) -> dict[str, Any]:
        """The address of the rendezvous store this controller hosts."""
        return {"host": self.config.store_host, "port": self.store_port, "epoch": self.epoch}

    def _host_store(self, port: int, fallback: bool) -> Any:
        """The rendezvous TCPStore (a fresh one after a restart: the old one died with us)."""
        import torch.distributed as dist

        cfg = self.config
        try:
            return dist.TCPStore(cfg.host, port, is_master=True, wait_for_workers=False,
                                 timeout=cfg.store_timeout)
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/DistNetworkError
            if fallback:  # plans carry the store's address: any free port will do
                log.warning("store port %d of the resumed job is taken (%s); using another", port, exc)
                return self._host_store(0, fallback=False)
            raise OSError(f"store_port: cannot host the TCPStore on {cfg.host}:{port}: {exc}") from None

    def run(self) -> int:
        """Blocking: serve until stopped (SIGINT/SIGTERM stop it too). Returns 0."""
        import signal

        self._freeze_gc = True

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.add_signal_handler(sig, self.stop)
                except (NotImplementedError, RuntimeError):
                    pass
            await self.serve()

        asyncio.run(main())
        return 0

    def start_in_thread(self, timeout: timedelta = timedelta(seconds=60)) -> tuple[int, int]:
        """Serve in a daemon thread; returns ``(port, store_port)`` once listening (raises
        ``TimeoutError`` when it is not within ``timeout``)."""
        if not isinstance(timeout, timedelta):
            raise TypeError(f"start_in_thread: timeout must be a datetime.timedelta, got {timeout!r}")
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve_quiet()),
                                        name="lazarus-controller", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout.total_seconds()):
            raise TimeoutError(f"controller did not start within {timeout}")
        if self._start_error is not None:
            raise self._start_error
        assert self.port is not None and self.store_port is not None
        return self.port, self.store_port

    async def _serve_quiet(self) -> None:
        try:
            await self.serve()
        except BaseException:  # noqa: BLE001 - reported through start_in_thread
            if not self._ready.is_set():
                self._ready.set()

    def stop(self, join: bool = True) -> None:
        """Stop serving (thread-safe). Joins the thread started by ``start_in_thread``."""
        loop, ev = self._loop, self._stop
        if loop is not None and ev is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:
                pass
        if join and self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def _end_job(self) -> None:
        self._end_task = asyncio.ensure_future(self._stop_when_agents_left())

    async def _stop_when_agents_left(self) -> None:
        """After ``done``: every agent waits for its finished worker to exit (exports,
        digests), then disconnects. Stop once none is connected, or after ``exit_grace``."""
        t0 = time.monotonic()
        deadline = t0 + self.config.exit_grace.total_seconds()

        def connected() -> list[str]:
            return sorted(n.node_id for n in self._membership.nodes.values()
                          if not n.dead and self._connected(n.node_id))

        while connected() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        still = connected()
        self._event("job_end", level=logging.WARNING if still else logging.INFO,
                    waited_s=round(time.monotonic() - t0, 3), still_connected=still)
        assert self._stop is not None
        self._stop.set()

    # ------------------------------------------------------------------ events
    def _event(self, name: str, level: int = logging.INFO, message: str | None = None, **fields: Any) -> None:
        """Record an event: a JSON line in the events file, and a log line (``message``
        when given, else the name and the fields)."""
        rec = {"t": time.time(), "event": name, **fields}
        line = json.dumps(rec, separators=(",", ":"), default=str)
        if message is None:
            log.log(level, "%s %s", name, json.dumps(fields, default=str))
        else:
            log.log(level, "%s: %s", name, message)
        path = self.config.events_path
        if path is not None:
            with self._events_lock, open(path, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")

    # ------------------------------------------------------------------ connections
    def _connected(self, node_id: str) -> bool:
        conn = self._links.get(node_id)
        return conn is not None and not conn.closed

    def _send(self, node_id: str, msg: dict[str, Any]) -> bool:
        conn = self._links.get(node_id)
        if conn is None or conn.closed:
            return False
        return self._send_conn(conn, msg)

    def _send_conn(self, conn: _Conn, msg: dict[str, Any]) -> bool:
        if conn.closed:
            return False
        transport = conn.writer.transport
        if transport.is_closing():
            return False
        if transport.get_write_buffer_size() > _WRITE_BUFFER_LIMIT:
            self._event("send_buffer_full", level=logging.WARNING, peer=conn.peer, node=conn.node_id)
            self._close(conn)
            return False
        last = self._last_sent
        if last is not None and last[0] is msg:
            frame = last[1]
        else:
            frame = encode_frame(self.config.secret, msg)
            self._last_sent = (msg, frame)
        conn.writer.write(frame)
        return True

    def _close(self, conn: _Conn) -> None:
        if not conn.closed:
            conn.closed = True
            try:
                conn.writer.close()
            except Exception:  # noqa: BLE001
                pass
        self._conns.discard(conn)

    # ------------------------------------------------------------------ errors of peers
    def _peer_error(self, conn: _Conn, name: str, message: str | None = None, **fields: Any) -> None:
        """A connection's error. Those of connections that have not registered are
        counted per peer address: one in full per ``protocol_error_interval``, then a
        count (:meth:`_flush_repeats`); a registered node's are always recorded."""
        if conn.node_id is None and not self._repeats.hit(conn.host):
            self._repeat_kinds.setdefault(conn.host, Counter())[str(fields.get("error") or name)] += 1
            return
        self._event(name, level=logging.WARNING, message=message, peer=conn.peer, node=conn.node_id, **fields)
        if conn.node_id is None and self._repeat_timer is None and self._repeats.interval > 0 \
                and self._loop is not None:
            self._repeat_timer = self._loop.call_later(self._repeats.interval, self._flush_repeats)

    def _flush_repeats(self, everything: bool = False) -> None:
        """One line per peer address whose interval ended, with the count of the errors
        not logged; again every interval while some address is being counted."""
        self._repeat_timer = None
        for host, (count, secs) in self._repeats.flush(everything).items():
            kinds = dict(self._repeat_kinds.pop(host, Counter()).most_common())
            what = ", ".join(f"{k} x{n}" for k, n in kinds.items())
            self._event("protocol_errors_repeated", level=logging.WARNING, host=host, count=count,
                        seconds=round(secs, 1), kinds=kinds,
                        message=f"... {count} more from {host} in the last {secs:.0f} s ({what}); one line per "
                                f"address every {self._repeats.interval:g} s (--protocol-error-interval)")
        if len(self._repeats) and not everything and self._loop is not None and not self._loop.is_closed():
            self._repeat_timer = self._loop.call_later(self._repeats.interval, self._flush_repeats)

    def _wrong_secret(self, conn: _Conn, exc: BadMacError) -> None:
        src = self.config.secret_source
        self._peer_error(
            conn, "protocol_error", error=type(exc).__name__, reason=str(exc), refused="auth_failed",
            message=f"the first frame from {conn.peer} has a wrong HMAC: the peer's shared secret is not this "
                    f"controller's{f' (from {src})' if src else ''}. Answered auth_failed and closed; an agent "
                    f"exits saying so. Give the controller and every agent the same secret: --secret-file PATH "
                    f"or the environment variable LAZARUS_SECRET")

    async def _refuse(self, conn: _Conn, reader: asyncio.StreamReader) -> None:
        """Send the fixed auth_failed frame, end our side, and give the peer a moment to
        read it and close (what it still sends is read and dropped, within bounds)."""
        with contextlib.suppress(Exception):
            conn.writer.write(AUTH_FAILED_FRAME)
            conn.writer.write_eof()

            async def drain_peer() -> None:
                left = _REFUSAL_DISCARD_BYTES
                while left > 0:
                    chunk = await reader.read(min(left, 4096))
                    if not chunk:
                        return
                    left -= len(chunk)

            await asyncio.wait_for(asyncio.gather(conn.writer.drain(), drain_peer()), _REFUSAL_LINGER_S)

    async def _handle_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cfg = self.config
        conn = _Conn(writer, *_peer(writer))
        self._conns.add(conn)
        secret, limit = cfg.secret, cfg.max_message_bytes
        try:
            try:
                msg = await asyncio.wait_for(read_frame(reader, secret, limit),
                                             cfg.handshake_timeout.total_seconds())
            except asyncio.TimeoutError:
                self._peer_error(conn, "handshake_timeout", timeout_s=cfg.handshake_timeout.total_seconds())
                return
            except BadMacError as exc:
                self._wrong_secret(conn, exc)
                await self._refuse(conn, reader)
                return
            if msg["type"] != "register":
                raise MalformedMessageError(f"first message must be 'register', got {msg['type']!r}")
            if not self._on_register(conn, msg):
                return
            timings = self._timings
            while not conn.closed:
                msg = await read_frame(reader, secret, limit)
                t0 = time.perf_counter()
                self._dispatch(conn, msg)
                timings.messages += 1
                timings.handle.append(time.perf_counter() - t0)
        except ProtocolError as exc:
            self._peer_error(conn, "protocol_error", error=type(exc).__name__, reason=str(exc))
        except ConnectionClosed as exc:
            if exc.mid_frame:
                self._peer_error(conn, "disconnect_mid_frame", reason=str(exc))
        except (ConnectionError, OSError) as exc:
            self._peer_error(conn, "connection_error", reason=str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug must not take the controller down
            log.exception("internal error while serving %s", conn.peer)
            self._event("internal_error", level=logging.ERROR, peer=conn.peer, node=conn.node_id,
                        reason=f"{type(exc).__name__}: {exc}")
        finally:
            was_open = not conn.closed
            self._close(conn)
            if was_open or conn.node_id is not None:
                self._on_conn_closed(conn)

    def _on_conn_closed(self, conn: _Conn) -> None:
        node_id = conn.node_id
        if node_id is None or node_id not in self._membership.nodes or self._links.get(node_id) is not conn \
                or self._stopping:
            return
        del self._links[node_id]
        self._membership.node_gone(node_id, conn.peer)

    async def _watch_heartbeats(self) -> None:
        """Every ``period``: nodes silent for longer than the heartbeat timeout are dead.

        A round that wakes up late (by more than ``period``) is skipped: the event loop was
        blocked meanwhile (a large plan being computed, a slow disk), so what the nodes sent
        in that time is still unread in the sockets, and this round would run before it is
        read and take everyone for silent. Skipping stops once the rounds have been late
        for a whole ``heartbeat_timeout`` (a controller that never catches up still detects
        silent nodes, a timeout later)."""
        timeout = self.config.heartbeat_timeout.total_seconds()
        period = min(0.25, timeout / 4)
        late_since: float | None = None
        while True:
            due = time.monotonic() + period
            await asyncio.sleep(period)
            now = time.monotonic()
            self._timings.lag.append(max(0.0, now - due))
            if now - due > period:
                if late_since is None:
                    late_since = now
                    self._event("controller_blocked", level=logging.WARNING, blocked_s=round(now - due, 3),
                                message=f"the event loop was blocked for {now - due:.2f} s; heartbeats that "
                                        f"came meanwhile are read before any node is taken for silent")
                if now - late_since < timeout:
                    continue
            else:
                late_since = None
            self._membership.check_heartbeats(now, timeout)

    # ------------------------------------------------------------------ messages
    def _on_register(self, conn: _Conn, msg: dict[str, Any]) -> bool:
        m = self._membership
        node_id = msg_field(msg, "node", str)
        slots = msg_field(msg, "slots", int, optional=True)
        inc = msg_field(msg, "incarnation", int)
        pid = msg_field(msg, "pid", int, optional=True)
        nproc = msg_field(msg, "nproc", int, optional=True) or 1
        if not node_id or (slots is not None and slots < 1) or nproc < 1:
            raise MalformedMessageError("register: bad node id, slots or nproc")
        if conn.node_id is not None and conn.node_id != node_id:
            raise MalformedMessageError(f"register: connection already belongs to node {conn.node_id!r}")
        resume = msg.get("resume")
        if resume is not None and not isinstance(resume, dict):
            raise MalformedMessageError("register: field 'resume' must be an object")
        old = m.nodes.get(node_id)
        old_conn = self._links.get(node_id)
        if old is not None and old_conn is not None and old_conn is not conn and not old.dead \
                and not old_conn.closed:
            if resume is None or pid is None or old.pid != pid:
                self._event("register_rejected", level=logging.WARNING, node=node_id, peer=conn.peer,
                            reason="node id already registered and alive")
                self._send_conn(conn, {"type": "error", "reason": f"node id {node_id!r} is already registered"})
                return False
            # the same agent reconnected before its old connection was seen to break
            self._event("connection_replaced", node=node_id, peer=conn.peer, old_peer=old_conn.peer)
        refusal = m.refusal(nproc, slots)
        if refusal is not None:
            self._event("register_rejected", level=logging.ERROR, node=node_id, peer=conn.peer, reason=refusal)
            self._send_conn(conn, {"type": "error", "reason": refusal})
            return False
        if old_conn is not None and old_conn is not conn:
            old_conn.node_id = None
            self._close(old_conn)
        if m.gpus_per_node is None:
            m.gpus_per_node = nproc
            self._save_state()
        if resume is not None:
            record = ResumeRecord.from_msg(resume)
            node, record = self._resume.admit(node_id, conn.peer, slots, pid, record, nproc)
            self._link(conn, node_id)
            self._resume.on_back(node, record)
            return True
        self._link(conn, node_id)
        m.register(node_id, conn.peer, slots=slots, incarnation=inc, pid=pid, nproc=nproc)
        self._send_conn(conn, {"type": "registered", "node": node_id,
                               "slots": self.config.slots_per_node,
                               "heartbeat_timeout_s": self.config.heartbeat_timeout.total_seconds()})
        if m.finished:
            self._send_conn(conn, {"type": "shutdown", "reason": "done"})
        return True

    def _link(self, conn: _Conn, node_id: str) -> None:
        """``conn`` is ``node_id``'s connection from now on (its record follows at once)."""
        conn.node_id = node_id
        self._links[node_id] = conn

    def _dispatch(self, conn: _Conn, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        node = self._membership.nodes.get(conn.node_id or "")
        if node is None or self._links.get(node.node_id) is not conn:
            raise MalformedMessageError("message on a connection without a registered node")
        if msg.get("node", node.node_id) != node.node_id:
            raise MalformedMessageError(f"{kind}: node {msg.get('node')!r} does not match the connection's")
        if kind == "register":
            if node.dead:
                self._on_register(conn, msg)
                return
            raise MalformedMessageError("register: already registered (evicted nodes re-register)")
        if kind == "stats":   # diagnostics (make bench-control): message handling times, loop lag
            self._send_conn(conn, {"type": "stats", **self._timings.snapshot()})
            if msg.get("reset") is True:
                self._timings.reset()
            return
        self._membership.on_message(node.node_id, msg)
