"""Worker side of the agent connection (used inside the training process).

The agent starts the worker with one end of a socketpair whose descriptor is in
``LAZARUS_AGENT_FD``. :class:`AgentChannel` wraps it with blocking sockets and a
background reader thread (a training loop has no event loop), so that the trainer can

* announce itself (``hello``) with its model's shape,
* send reports (``progress``, ``routing``, ``reconfigured``, ``collective_error``, ``done``)
  from any thread,
* pick up the newest plan at a step boundary (``latest_plan``) or block for the next one
  after a failure (``wait_plan``),
* notice a ``stop`` request (``stop_requested``).

A worker without its agent cannot be coordinated any more: when the connection is lost
the channel calls ``on_agent_lost`` (default: log and ``os._exit(70)``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .._wire import DEFAULT_MAX_MESSAGE_BYTES, ConnectionClosed, ProtocolError, recv_frame, send_frame

__all__ = ["AgentChannel", "EXIT_AGENT_LOST"]

log = logging.getLogger("lazarus.channel")

#: Exit status of a worker whose agent went away (default ``on_agent_lost``).
EXIT_AGENT_LOST = 70


def _default_agent_lost(channel: AgentChannel) -> None:
    log.error("lazarus worker on node %s: agent connection lost; exiting", channel.node_id)
    logging.shutdown()
    os._exit(EXIT_AGENT_LOST)


class AgentChannel:
    """Blocking, thread-safe connection from a worker to its node agent."""

    def __init__(
        self,
        sock: socket.socket,
        secret: bytes,
        *,
        node_id: str,
        snapshot_dir: str | None = None,
        incarnation: int = 1,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        on_agent_lost: Callable[[AgentChannel], None] | None = _default_agent_lost,
        local_rank: int = 0,
        local_world_size: int = 1,
        store_host: str | None = None,
    ) -> None:
        if isinstance(local_world_size, bool) or not isinstance(local_world_size, int) or local_world_size < 1:
            raise ValueError(f"local_world_size must be an integer >= 1, got {local_world_size!r}")
        if isinstance(local_rank, bool) or not isinstance(local_rank, int) or not 0 <= local_rank < local_world_size:
            raise ValueError(f"local_rank must be an integer in [0, {local_world_size}), got {local_rank!r}")
        self.node_id = node_id
        self.local_rank = local_rank              # this worker among its node's (LOCAL_RANK)
        self.local_world_size = local_world_size  # workers on the node (LOCAL_WORLD_SIZE)
        self.snapshot_dir = snapshot_dir
        self.incarnation = incarnation
        #: the address other nodes reach this one at (the agent's ``advertise_host``); None:
        #: this worker hosts no rendezvous store and plans use the controller's
        self.store_host = store_host
        self.on_agent_lost = on_agent_lost
        self._sock = sock
        self._secret = secret
        self._max = max_message_bytes
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._plan: dict[str, Any] | None = None
        self._plan_generation = 0   # the generation of _plan (0: none yet)
        self._stop = False
        self._stop_reason: str | None = None
        self._lost = False
        self._closed = False
        self._reader = threading.Thread(target=self._read_loop, name="lazarus-agent-channel", daemon=True)
        self._reader.start()

    @classmethod
    def from_env(
        cls, on_agent_lost: Callable[[AgentChannel], None] | None = _default_agent_lost
    ) -> AgentChannel | None:
        """The channel set up by ``lazarus agent``, or None when not started by an agent."""
        fd = os.environ.get("LAZARUS_AGENT_FD")
        if not fd:
            return None
        try:
            sock = socket.socket(fileno=int(fd))
        except (ValueError, OSError) as exc:
            raise ValueError(f"LAZARUS_AGENT_FD={fd!r} is not an open socket descriptor: {exc}") from None
        secret_hex = os.environ.get("LAZARUS_SECRET", "")
        try:
            secret = bytes.fromhex(secret_hex)
        except ValueError:
            raise ValueError("LAZARUS_SECRET must be the hex of the shared secret") from None
        try:
            local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        except ValueError:
            raise ValueError(f"LOCAL_RANK={os.environ.get('LOCAL_RANK')!r} and LOCAL_WORLD_SIZE="
                             f"{os.environ.get('LOCAL_WORLD_SIZE')!r} must be integers") from None
        return cls(
            sock, secret, local_rank=local_rank, local_world_size=local_world,
            node_id=os.environ.get("LAZARUS_NODE_ID", socket.gethostname()),
            snapshot_dir=os.environ.get("LAZARUS_SNAPSHOT_DIR"),
            store_host=os.environ.get("LAZARUS_STORE_HOST") or None,
            incarnation=int(os.environ.get("LAZARUS_INCARNATION", "1")),
            max_message_bytes=int(os.environ.get("LAZARUS_MAX_MESSAGE_BYTES", DEFAULT_MAX_MESSAGE_BYTES)),
            on_agent_lost=on_agent_lost,
        )

    # ------------------------------------------------------------------ sending
    def send(self, msg: dict[str, Any]) -> None:
        """Send one message (a dict with a string ``type``); thread-safe."""
        if self._lost or self._closed:
            raise ConnectionError("the agent channel is closed")
        with self._send_lock:
            try:
                send_frame(self._sock, self._secret, msg)
            except OSError as exc:
                raise ConnectionError(f"agent channel: send failed: {exc}") from None

    def hello(self, model_info: dict[str, Any], startup: dict[str, float] | None = None,
              store: dict[str, Any] | None = None) -> None:
        """Announce the worker; ``model_info`` = ``{"layers": {name: E}, "top_k": k}``;
        ``startup``: when (epoch seconds) its start-up phases ended (``process``,
        ``imported``, ``warm``, ``probed``), relayed to the controller's events; ``store``:
        ``{"host", "port"}`` of the rendezvous store this worker hosts (plans whose first
        member is this node form their group on it)."""
        msg = {"type": "hello", "model": model_info, "pid": os.getpid(), "incarnation": self.incarnation,
               "local_rank": self.local_rank}
        if startup:
            msg["startup"] = {k: round(float(v), 4) for k, v in startup.items()}
        if store is not None:
            msg["store"] = {"host": str(store["host"]), "port": int(store["port"])}
        self.send(msg)

    # ------------------------------------------------------------------ plans
    def latest_plan(self) -> dict[str, Any] | None:
        """The newest plan received (highest generation), or None."""
        with self._cond:
            return self._plan

    def wait_plan(self, newer_than: int, timeout: float | None = None) -> dict[str, Any]:
        """Block until a plan with ``generation > newer_than`` is here; return it.

        Raises:
            TimeoutError: none arrived within ``timeout`` seconds.
            ConnectionError: the agent is gone (or ``close()`` was called).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._plan is not None and self._plan_generation > newer_than:
                    return self._plan
                if self._lost or self._closed:
                    raise ConnectionError("the agent channel is closed")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no plan newer than generation {newer_than} within {timeout}s")
                self._cond.wait(left)

    @property
    def stop_requested(self) -> bool:
        """True once the agent asked the worker to stop (job done, or the agent is exiting)."""
        return self._stop

    @property
    def connected(self) -> bool:
        return not (self._lost or self._closed)

    def close(self) -> None:
        """Close the connection (the reader thread ends; no ``on_agent_lost`` call)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def __enter__(self) -> AgentChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ reader
    def _read_loop(self) -> None:
        while True:
            try:
                msg = recv_frame(self._sock, self._secret, self._max)
            except (ConnectionClosed, OSError, ProtocolError) as exc:
                if self._closed:
                    return
                if isinstance(exc, ProtocolError):
                    log.error("agent channel: bad frame from the agent: %s", exc)
                break
            kind = msg["type"]
            with self._cond:
                if kind == "plan":
                    gen = msg.get("generation")
                    if isinstance(gen, int) and (self._plan is None or gen > self._plan_generation):
                        self._plan, self._plan_generation = msg, gen
                elif kind == "stop":
                    self._stop = True
                    self._stop_reason = msg.get("reason")
                self._cond.notify_all()
        with self._cond:
            self._lost = True
            self._cond.notify_all()
        if self.on_agent_lost is not None and not self._closed:
            self.on_agent_lost(self)
