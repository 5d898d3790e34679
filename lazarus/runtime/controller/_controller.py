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

Every decision is written to the events file (JSON lines) and logged. The state that
plans depend on is kept in ``state_dir`` (atomically replaced); a controller started
again with the same settings resumes the job (:mod:`._resume`). When every member's
worker reported done, the agents are told and the controller waits (``exit_grace``)
until they have left.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .._config import ControllerConfig
from .._wire import ConnectionClosed, MalformedMessageError, ProtocolError, encode_frame, read_frame
from ._membership import _Node, _req
from ._resume import Resumable

__all__ = ["Controller"]

log = logging.getLogger("lazarus.controller")

_WRITE_BUFFER_LIMIT = 16 << 20


@dataclass(eq=False)
class _Conn:
    writer: asyncio.StreamWriter
    peer: str
    node_id: str | None = None
    closed: bool = False


def _peer(writer: asyncio.StreamWriter) -> str:
    p = writer.get_extra_info("peername")
    if isinstance(p, tuple) and len(p) >= 2:
        return f"{p[0]}:{p[1]}"
    return str(p)


class Controller(Resumable):
    """The job's controller. See the module docstring and DESIGN.md section 5.

    Use ``run()`` (blocking, e.g. from the CLI), ``await serve()`` inside an event loop,
    or ``start_in_thread()`` (tests, notebooks). ``port``/``store_port`` hold the bound
    ports once started (useful with ephemeral ports).
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
        self._nodes: dict[str, _Node] = {}
        self._stopping = False
        self._end_task: asyncio.Task[None] | None = None
        self._init_membership()
        self._init_resume()

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
                server = await asyncio.start_server(self._handle_conn, cfg.host, port)
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
                    epoch=self.epoch, resumed=self._resuming, generation=self.generation,
                    state_dir=str(cfg.state_dir) if cfg.state_dir is not None else None)
        self._save_state(now=True)
        self._start_resume()
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
            for t in (self._failure_timer, self._collective_timer, self._start_timer,
                      self._join_timer, self._leave_timer, self._resume_timer):
                if t is not None:
                    t.cancel()
            if self._save_timer is not None:
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
        self._restore_state(state)
        return state

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
            return sorted(n.node_id for n in self._nodes.values() if not n.dead and not n.conn.closed)

        while connected() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        still = connected()
        self._event("job_end", level=logging.WARNING if still else logging.INFO,
                    waited_s=round(time.monotonic() - t0, 3), still_connected=still)
        assert self._stop is not None
        self._stop.set()

    # ------------------------------------------------------------------ events
    def _event(self, name: str, level: int = logging.INFO, **fields: Any) -> None:
        rec = {"t": time.time(), "event": name, **fields}
        line = json.dumps(rec, separators=(",", ":"), default=str)
        log.log(level, "%s %s", name, json.dumps(fields, default=str))
        path = self.config.events_path
        if path is not None:
            with self._events_lock, open(path, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")

    # ------------------------------------------------------------------ connections
    def _send(self, node_id: str, msg: dict[str, Any]) -> bool:
        node = self._nodes.get(node_id)
        if node is None or node.conn.closed:
            return False
        return self._send_conn(node.conn, msg)

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
        conn.writer.write(encode_frame(self.config.secret, msg))
        return True

    def _close(self, conn: _Conn) -> None:
        if not conn.closed:
            conn.closed = True
            try:
                conn.writer.close()
            except Exception:  # noqa: BLE001
                pass
        self._conns.discard(conn)

    async def _handle_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cfg = self.config
        conn = _Conn(writer, _peer(writer))
        self._conns.add(conn)
        secret, limit = cfg.secret, cfg.max_message_bytes
        try:
            try:
                msg = await asyncio.wait_for(read_frame(reader, secret, limit),
                                             cfg.handshake_timeout.total_seconds())
            except asyncio.TimeoutError:
                self._event("handshake_timeout", level=logging.WARNING, peer=conn.peer,
                            timeout_s=cfg.handshake_timeout.total_seconds())
                return
            if msg["type"] != "register":
                raise MalformedMessageError(f"first message must be 'register', got {msg['type']!r}")
            if not self._on_register(conn, msg):
                return
            while not conn.closed:
                msg = await read_frame(reader, secret, limit)
                self._dispatch(conn, msg)
        except ProtocolError as exc:
            self._event("protocol_error", level=logging.WARNING, peer=conn.peer, node=conn.node_id,
                        error=type(exc).__name__, reason=str(exc))
        except ConnectionClosed as exc:
            if exc.mid_frame:
                self._event("disconnect_mid_frame", level=logging.WARNING, peer=conn.peer,
                            node=conn.node_id, reason=str(exc))
        except (ConnectionError, OSError) as exc:
            self._event("connection_error", level=logging.WARNING, peer=conn.peer, node=conn.node_id,
                        reason=str(exc))
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
        node = self._nodes.get(conn.node_id) if conn.node_id else None
        if node is None or node.conn is not conn or self._stopping:
            return
        del self._nodes[node.node_id]
        if node.dead:
            return
        node.dead = True
        if node.node_id in self._members and node.node_id not in self._done:
            self._declare_failure(node.node_id, "disconnect", peer=conn.peer)
        else:
            self._event("node_left", node=node.node_id, peer=conn.peer)
            self._pending_joins.discard(node.node_id)
            self._pending_leaves.discard(node.node_id)

    async def _watch_heartbeats(self) -> None:
        timeout = self.config.heartbeat_timeout.total_seconds()
        period = min(0.25, timeout / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for node in list(self._nodes.values()):
                if not node.dead and now - node.last_seen > timeout:
                    node.dead = True
                    node.ready = False
                    self._pending_joins.discard(node.node_id)
                    self._pending_leaves.discard(node.node_id)
                    if node.node_id in self._members and node.node_id not in self._done:
                        self._declare_failure(node.node_id, "heartbeat_timeout",
                                              silent_s=round(now - node.last_seen, 3))
                    else:
                        self._event("node_left", node=node.node_id, cause="heartbeat_timeout")

    # ------------------------------------------------------------------ messages
    def _on_register(self, conn: _Conn, msg: dict[str, Any]) -> bool:
        node_id = _req(msg, "node", str)
        slots = _req(msg, "slots", int, optional=True)
        inc = _req(msg, "incarnation", int)
        pid = _req(msg, "pid", int, optional=True)
        nproc = _req(msg, "nproc", int, optional=True) or 1
        if not node_id or (slots is not None and slots < 1) or nproc < 1:
            raise MalformedMessageError("register: bad node id, slots or nproc")
        if conn.node_id is not None and conn.node_id != node_id:
            raise MalformedMessageError(f"register: connection already belongs to node {conn.node_id!r}")
        resume = msg.get("resume")
        if resume is not None and not isinstance(resume, dict):
            raise MalformedMessageError("register: field 'resume' must be an object")
        old = self._nodes.get(node_id)
        if old is not None and old.conn is not conn and not old.dead and not old.conn.closed:
            if resume is None or pid is None or old.pid != pid:
                self._event("register_rejected", level=logging.WARNING, node=node_id, peer=conn.peer,
                            reason="node id already registered and alive")
                self._send_conn(conn, {"type": "error", "reason": f"node id {node_id!r} is already registered"})
                return False
            # the same agent reconnected before its old connection was seen to break
            self._event("connection_replaced", node=node_id, peer=conn.peer, old_peer=old.conn.peer)
        refusal = self._check_nproc(nproc, slots)
        if refusal is not None:
            self._event("register_rejected", level=logging.ERROR, node=node_id, peer=conn.peer, reason=refusal)
            self._send_conn(conn, {"type": "error", "reason": refusal})
            return False
        if old is not None and old.conn is not conn:
            old.conn.node_id = None
            self._close(old.conn)
        if self.gpus_per_node is None:
            self.gpus_per_node = nproc
            self._save_state()
        if resume is not None:
            return self._on_resume(conn, node_id, slots, pid, resume, nproc)
        rejoin = old is not None
        if rejoin and node_id in self._members and not old.dead:  # re-register on a live record
            self._declare_failure(node_id, "reregistered")
        conn.node_id = node_id
        self._nodes[node_id] = _Node(node_id, conn, slots or self.config.slots_per_node, inc, pid,
                                     time.monotonic(), nproc=nproc)
        self._forget_holdings(node_id)
        self._done.discard(node_id)
        self._left.discard(node_id)
        self._event("node_registered", node=node_id, peer=conn.peer, incarnation=inc, pid=pid,
                    slots=slots, nproc=nproc, rejoin=rejoin)
        self._send_conn(conn, {"type": "registered", "node": node_id,
                               "slots": self.config.slots_per_node,
                               "heartbeat_timeout_s": self.config.heartbeat_timeout.total_seconds()})
        if self._finished:
            self._send_conn(conn, {"type": "shutdown", "reason": "done"})
        return True

    def _check_nproc(self, nproc: int, slots: int | None) -> str | None:
        """Why a node running ``nproc`` workers cannot join this job (None: it can).

        Every node of a job runs the same number of workers G (the placement spreads each
        node's c slots over G ranks); the first node to register fixes G. Each worker
        needs a slot: c >= G."""
        job = self.gpus_per_node
        if job is not None and nproc != job:
            return (f"--nproc-per-node {nproc} differs from this job's {job} workers per node "
                    f"(every node must run the same number)")
        c = slots or self.config.slots_per_node
        if c < nproc:
            return (f"{c} slots per node < --nproc-per-node {nproc}: every worker needs at least one expert "
                    f"slot; give --slots >= {nproc} (agent or controller)")
        return None

    def _dispatch(self, conn: _Conn, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        node = self._nodes.get(conn.node_id or "")
        if node is None or node.conn is not conn:
            raise MalformedMessageError("message on a connection without a registered node")
        if msg.get("node", node.node_id) != node.node_id:
            raise MalformedMessageError(f"{kind}: node {msg.get('node')!r} does not match the connection's")
        if kind == "register":
            if node.dead:
                self._on_register(conn, msg)
                return
            raise MalformedMessageError("register: already registered (evicted nodes re-register)")
        node.last_seen = time.monotonic()
        if node.dead:
            if not node.evict_sent:
                node.evict_sent = True
                self._event("evicted", node=node.node_id, peer=conn.peer)
                self._send_conn(conn, {"type": "evicted", "node": node.node_id})
            return
        if kind == "heartbeat":
            step = _req(msg, "step", int, optional=True)
            if step is not None:
                node.step = step
        elif kind == "ping":
            self._send_conn(conn, {"type": "pong", "nonce": msg.get("nonce")})
        elif kind == "worker_ready":
            self._on_worker_ready(node, msg)
        elif kind == "worker_exit":
            self._on_worker_exit(node, msg)
        elif kind == "leaving":
            self._on_leaving(node, msg)
        elif kind == "worker":
            inner = msg.get("msg")
            if not isinstance(inner, dict) or not isinstance(inner.get("type"), str):
                raise MalformedMessageError("worker: field 'msg' must be an object with a string 'type'")
            self._on_worker_msg(node, inner)
        else:
            self._event("unknown_message", level=logging.WARNING, node=node.node_id, type=kind)
