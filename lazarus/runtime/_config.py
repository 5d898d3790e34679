"""Configuration of the controller and the agents, validated at construction.

Every timeout is a :class:`datetime.timedelta`; :func:`parse_duration` turns the CLI's
``500ms`` / ``3s`` / ``2m`` / ``1h`` spellings into one.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from ._wire import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["AgentConfig", "ControllerConfig", "parse_duration", "parse_host_port"]

MIN_SECRET_BYTES = 16
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str, name: str = "duration") -> timedelta:
    """``"500ms"`` -> 0.5 s, ``"3s"``, ``"2m"``, ``"1h"``; a bare number means seconds."""
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"{name} must be a duration like 500ms, 3s or 2m, got {text!r}")
    return timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])


def parse_host_port(text: str, name: str = "address") -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` for IPv6) -> ``(host, port)``."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{name} must be HOST:PORT with a port in [1, 65535], got {text!r}")
    return host.strip("[]"), int(port)


def _check_td(name: str, value: object, *, positive: bool = True, lo: timedelta | None = None) -> None:
    if not isinstance(value, timedelta):
        raise ValueError(f"{name} must be a datetime.timedelta, got {type(value).__name__}")
    low = lo if lo is not None else timedelta(0)
    if value < low or (positive and value <= timedelta(0)):
        bound = f">= {low.total_seconds()}s" if lo is not None else ("> 0s" if positive else ">= 0s")
        raise ValueError(f"{name} must be {bound}, got {value.total_seconds()}s")


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an integer {rng}, got {value!r}")


def _check_secret(value: object) -> bytes:
    if isinstance(value, str):
        value = value.encode("utf-8")
    if not isinstance(value, (bytes, bytearray)) or len(value) < MIN_SECRET_BYTES:
        n = len(value) if isinstance(value, (bytes, bytearray)) else "no"
        raise ValueError(f"secret must be at least {MIN_SECRET_BYTES} bytes, got {n} bytes")
    return bytes(value)


@dataclass
class ControllerConfig:
    """Settings of :class:`~lazarus.runtime.Controller`.

    Attributes:
        host: address the controller and the store bind to (127.0.0.1 by default; use the
            node's cluster address or ``0.0.0.0`` for several hosts).
        port: control port (0 = ephemeral; read ``Controller.port`` after start).
        store_port: port of the rendezvous ``TCPStore`` (0 = ephemeral).
        secret: shared HMAC key, >= 16 bytes.
        slots_per_node: c, expert replica slots per node.
        min_replicas: f, the fault-tolerance threshold (lowered when slots are short).
        heartbeat_timeout: silence after which a node is declared dead.
        failure_grace: failures (and collective errors) within this window are coalesced
            into one plan.
        join_window: joins are batched for this long before a between-steps plan.
        handshake_timeout: a connection must send its first frame within this time.
        max_message_bytes: largest accepted message body.
        rebalance_every: steps between rebalance checks (0 = off).
        rebalance_min_gain: relative drop of the predicted max per-replica load needed to
            issue a rebalance plan, in [0, 1].
        min_nodes: fewest members a plan may have.
        expected_nodes: wait for this many ready nodes before the first plan (None: start
            ``join_window`` after the first ready node).
        events_path: JSON-lines event log (None: log lines only).
        exit_when_done: stop serving once every member's worker reported ``done`` and the
            agents, told so, have left (or ``exit_grace`` has passed).
        exit_grace: after the job is done, how long to wait for the agents to leave (each
            waits for its finished worker to exit, up to its own ``exit_grace``).
        advertise_host: store address written into plans (default: ``host``, or the
            machine's hostname when ``host`` is a wildcard address).
        store_timeout: timeout of the hosted TCPStore's operations.
        routing_window: routing reports summed into the load estimate.
        state_dir: where the controller keeps its state (generation, members, plans,
            routing history), replaced atomically on every change, so that a controller
            started again with the same settings resumes the job. Default: beside
            ``events_path`` (``events.jsonl`` -> ``events.state/``); None without events.
        resume_grace: after a restart, how long the members of the saved plan have to
            reconnect; those that have not are handled as failed.
        resume_broken_grace: after a restart, once a member that is back reports a broken
            collective of the current generation (training has stopped: a member died while
            the controller was away), the members still missing have this long from the
            moment the controller serves again (an agent alive reconnects within about 1 s,
            its backoff's cap), not the whole ``resume_grace``. At most ``resume_grace``.
        protocol_error_interval: repeated protocol errors (a wrong secret, garbage, a
            silent connection) of connections that have not registered are logged once per
            peer address per interval: the first in full, then one line with the count of
            the others (0: every one in full).
        secret_source: where the secret came from (``--secret-file PATH`` or
            ``LAZARUS_SECRET``), named when a peer's secret does not match.
        flap_limit: a node dropped (heartbeat timeout or lost connection, its agent the
            same process) this many times within ``flap_window`` is flapping: its next join
            waits for ``flap_hold_down`` without a drop. In [1, 1000].
        flap_window: how far back drops are counted for ``flap_limit``; in [1 s, 1 day].
        flap_hold_down: how long a flapping node must stay connected without a drop before
            it joins again (every drop starts it over); in [0, 1 h], 0 turns it off.
        handover_wait: when every member is leaving (spot notices) while another node is
            on its way in (registered, its worker still starting), the leaving members train
            on for up to this long, until the joiner is ready, and hand their state to it (a
            join plan, then the leave plan), instead of leaving with nobody to take their
            experts (the job would start again from checkpoints, rolled back, PLT booked).
            Keep it below the agents' ``leave_timeout`` and the notice your provider gives
            (AWS: 2 minutes); in [0, 10 min], 0 turns it off.
    """

    secret: bytes
    host: str = "127.0.0.1"
    port: int = 29400
    store_port: int = 29401
    slots_per_node: int = 2
    min_replicas: int = 2
    heartbeat_timeout: timedelta = timedelta(seconds=3)
    failure_grace: timedelta = timedelta(milliseconds=200)
    join_window: timedelta = timedelta(seconds=2)
    handshake_timeout: timedelta = timedelta(seconds=5)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    rebalance_every: int = 0
    rebalance_min_gain: float = 0.05
    min_nodes: int = 1
    expected_nodes: int | None = None
    events_path: str | os.PathLike[str] | None = None
    exit_when_done: bool = True
    exit_grace: timedelta = timedelta(minutes=5)
    advertise_host: str | None = None
    store_timeout: timedelta = timedelta(minutes=5)
    routing_window: int = 8
    state_dir: str | os.PathLike[str] | None = None
    resume_grace: timedelta = timedelta(seconds=10)
    resume_broken_grace: timedelta = timedelta(seconds=3)
    protocol_error_interval: timedelta = timedelta(seconds=10)
    secret_source: str | None = None
    flap_limit: int = 3
    flap_window: timedelta = timedelta(minutes=10)
    flap_hold_down: timedelta = timedelta(seconds=60)
    handover_wait: timedelta = timedelta(seconds=30)

    def __post_init__(self) -> None:
        self.secret = _check_secret(self.secret)
        _check_td("handover_wait", self.handover_wait, positive=False)
        if self.handover_wait > timedelta(minutes=10):
            raise ValueError(f"handover_wait must be <= 600s, got {self.handover_wait.total_seconds()}s")
        _check_int("flap_limit", self.flap_limit, 1, 1000)
        _check_td("flap_window", self.flap_window, lo=timedelta(seconds=1))
        if self.flap_window > timedelta(days=1):
            raise ValueError(f"flap_window must be <= 1 day, got {self.flap_window.total_seconds()}s")
        _check_td("flap_hold_down", self.flap_hold_down, positive=False)
        if self.flap_hold_down > timedelta(hours=1):
            raise ValueError(f"flap_hold_down must be <= 3600s, got {self.flap_hold_down.total_seconds()}s")
        _check_td("protocol_error_interval", self.protocol_error_interval, positive=False)
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty address string, got {self.host!r}")
        _check_int("port", self.port, 0, 65535)
        _check_int("store_port", self.store_port, 0, 65535)
        if self.port and self.port == self.store_port:
            raise ValueError(f"store_port must differ from port, both are {self.port}")
        _check_int("slots_per_node", self.slots_per_node, 1)
        _check_int("min_replicas", self.min_replicas, 1)
        _check_td("heartbeat_timeout", self.heartbeat_timeout, lo=timedelta(milliseconds=50))
        _check_td("failure_grace", self.failure_grace, positive=False)
        _check_td("join_window", self.join_window, positive=False)
        _check_td("handshake_timeout", self.handshake_timeout)
        _check_td("store_timeout", self.store_timeout)
        _check_td("exit_grace", self.exit_grace)
        _check_int("max_message_bytes", self.max_message_bytes, 256, 1 << 30)
        _check_int("rebalance_every", self.rebalance_every, 0)
        if isinstance(self.rebalance_min_gain, bool) or not isinstance(self.rebalance_min_gain, (int, float)) \
                or not 0.0 <= self.rebalance_min_gain <= 1.0:
            raise ValueError(f"rebalance_min_gain must be a number in [0, 1], got {self.rebalance_min_gain!r}")
        _check_int("min_nodes", self.min_nodes, 1)
        if self.expected_nodes is not None:
            _check_int("expected_nodes", self.expected_nodes, max(1, self.min_nodes))
        _check_int("routing_window", self.routing_window, 1)
        _check_td("resume_grace", self.resume_grace)
        _check_td("resume_broken_grace", self.resume_broken_grace)
        if self.state_dir is None and self.events_path is not None:
            self.state_dir = Path(self.events_path).with_suffix(".state")
        if self.state_dir is not None:
            if not str(self.state_dir):
                raise ValueError("state_dir must be a directory path or None, got ''")
            self.state_dir = Path(self.state_dir)
            if self.state_dir.exists() and not self.state_dir.is_dir():
                raise ValueError(f"state_dir must be a directory, {str(self.state_dir)!r} is a file")

    @property
    def store_host(self) -> str:
        """The store address workers connect to."""
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            return socket.gethostname()
        return self.host


def _default_node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class AgentConfig:
    """Settings of :class:`~lazarus.runtime.Agent`.

    Attributes:
        secret: the controller's shared secret (>= 16 bytes).
        worker_command: argv of the training process (started once per incarnation).
        controller_host / controller_port: where the controller listens.
        node_id: unique name of this node (default ``hostname-pid``).
        slots: replica slots this node offers, all its workers together (None: the
            controller's ``slots_per_node``); at least ``nproc_per_node``.
        nproc_per_node: G, workers (ranks, one per local GPU) this node runs; each gets
            ``LOCAL_RANK`` in ``[0, G)`` and ``LOCAL_WORLD_SIZE = G``. The node's slots are
            spread over them; a node failure removes its G ranks together. Every node of
            a job runs the same G (the controller refuses a node with another).
        heartbeat_interval: time between heartbeats (well below the controller's timeout).
        snapshot_dir: node-memory directory for the workers' snapshots (default
            ``/dev/shm/lazarus-<job>/<node_id>``); created at start, removed on a normal exit.
        job: job name used in the default snapshot_dir.
        respawn: restart a worker that exits abnormally (the new incarnation rejoins).
        respawn_delay: pause before the first restart; it doubles with every restart within
            ``restart_window`` (at most 60 s).
        max_restarts: restarts allowed within ``restart_window``; at the next crash the node
            leaves the job and the agent exits 5 naming the worker's last error.
        restart_window: the sliding window ``max_restarts`` counts in.
        reconnect_timeout: when the controller connection breaks, keep the worker running
            and reconnect for this long before stopping it and exiting 4.
        env: extra environment variables for the worker.
        connect_timeout: give up connecting to the controller after this long.
        leave_timeout: after SIGTERM, how long to wait for the hand-over before giving up.
        stop_timeout: how long a stopped worker may take to exit before it is killed.
        exit_grace: how long a worker that reported done may take to exit (its code after
            ``trainer.run()``: exports, evaluations) once the job is done or the controller
            is gone; it is never killed before. The agent then exits with its status.
        max_message_bytes: largest accepted message body.
        standby: a hot spare: start the workers at once and let them import, build and warm
            up, but register with the controller only when told (SIGUSR1, or
            :meth:`Agent.activate`); the node then joins with nothing left to load.
        advertise_host: the address other nodes reach this node at: its first worker hosts
            the rendezvous store of every generation in which the node is the first member
            (so a group forms without the controller). Default: this machine's address on
            the route to the controller (``127.0.0.1`` for a controller on loopback).
        secret_source: where the secret came from (``--secret-file PATH`` or
            ``LAZARUS_SECRET``), named when the controller refuses it.
        stopped_timeout: a worker stopped this long (process state ``T``: SIGSTOP, SIGTSTP)
            is killed and handled as crashed, so its peers need not wait out their
            ``collective_timeout`` (None: never). See :mod:`lazarus.runtime.agent._watchdog`.
        hang_timeout: a worker whose training thread is blocked (no progress beat, under a
            tenth of a core) in a step of an older generation this long after a newer plan
            reached it is killed and handled as crashed (None: never).
        watch_interval: how often the watchdog looks at the workers (``/proc`` and their
            progress beat); at most ``stopped_timeout``.
    """

    secret: bytes
    worker_command: list[str]
    controller_host: str = "127.0.0.1"
    controller_port: int = 29400
    node_id: str = field(default_factory=_default_node_id)
    slots: int | None = None
    nproc_per_node: int = 1
    heartbeat_interval: timedelta = timedelta(milliseconds=500)
    snapshot_dir: str | os.PathLike[str] | None = None
    job: str = "job"
    respawn: bool = True
    respawn_delay: timedelta = timedelta(seconds=1)
    max_restarts: int = 5
    restart_window: timedelta = timedelta(minutes=10)
    reconnect_timeout: timedelta = timedelta(minutes=5)
    env: dict[str, str] = field(default_factory=dict)
    connect_timeout: timedelta = timedelta(seconds=30)
    leave_timeout: timedelta = timedelta(seconds=60)
    stop_timeout: timedelta = timedelta(seconds=10)
    exit_grace: timedelta = timedelta(minutes=5)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    standby: bool = False
    advertise_host: str | None = None
    secret_source: str | None = None
    stopped_timeout: timedelta | None = timedelta(milliseconds=500)
    hang_timeout: timedelta | None = timedelta(seconds=5)
    watch_interval: timedelta = timedelta(milliseconds=100)

    def __post_init__(self) -> None:
        self.secret = _check_secret(self.secret)
        self._check_watchdog()
        if self.advertise_host is not None and (not isinstance(self.advertise_host, str)
                                                or not self.advertise_host.strip()):
            raise ValueError(f"advertise_host must be a non-empty address or None, got {self.advertise_host!r}")
        if not isinstance(self.standby, bool):
            raise ValueError(f"standby must be True or False, got {self.standby!r}")
        if isinstance(self.worker_command, str) or not self.worker_command \
                or not all(isinstance(a, str) for a in self.worker_command):
            raise ValueError("worker_command must be a non-empty list of strings (the worker's argv)")
        self.worker_command = list(self.worker_command)
        if not isinstance(self.controller_host, str) or not self.controller_host:
            raise ValueError(f"controller_host must be a non-empty address, got {self.controller_host!r}")
        _check_int("controller_port", self.controller_port, 1, 65535)
        if not isinstance(self.node_id, str) or not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,128}", self.node_id):
            raise ValueError(
                f"node_id must be 1-128 characters from [A-Za-z0-9_.:@-], got {self.node_id!r}"
            )
        _check_int("nproc_per_node", self.nproc_per_node, 1, 1024)
        if self.slots is not None:
            _check_int("slots", self.slots, 1)
            if self.slots < self.nproc_per_node:
                raise ValueError(f"slots ({self.slots}) must be >= nproc_per_node ({self.nproc_per_node}): "
                                 f"every worker needs at least one expert slot")
        _check_td("heartbeat_interval", self.heartbeat_interval, lo=timedelta(milliseconds=10))
        _check_td("respawn_delay", self.respawn_delay, positive=False)
        _check_int("max_restarts", self.max_restarts, 0)
        _check_td("restart_window", self.restart_window)
        _check_td("reconnect_timeout", self.reconnect_timeout)
        _check_td("connect_timeout", self.connect_timeout)
        _check_td("leave_timeout", self.leave_timeout)
        _check_td("stop_timeout", self.stop_timeout)
        _check_td("exit_grace", self.exit_grace)
        _check_int("max_message_bytes", self.max_message_bytes, 256, 1 << 30)
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", str(self.job)):
            raise ValueError(f"job must be 1-64 characters from [A-Za-z0-9_.-], got {self.job!r}")
        if not isinstance(self.env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            raise ValueError("env must be a dict of str -> str")
        if self.snapshot_dir is None:
            base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
            self.snapshot_dir = str(base / f"lazarus-{self.job}" / self.node_id)
        self.snapshot_dir = str(self.snapshot_dir)

    def _check_watchdog(self) -> None:
        for name in ("stopped_timeout", "hang_timeout"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, timedelta) or value <= timedelta(0)):
                got = f"{value.total_seconds()}s" if isinstance(value, timedelta) else repr(value)
                raise ValueError(f"{name} must be a positive datetime.timedelta or None (off), got {got}")
        _check_td("watch_interval", self.watch_interval, lo=timedelta(milliseconds=10))
        if self.stopped_timeout is not None and self.watch_interval > self.stopped_timeout:
            raise ValueError(f"watch_interval ({self.watch_interval.total_seconds()}s) must not exceed "
                             f"stopped_timeout ({self.stopped_timeout.total_seconds()}s)")

    @property
    def store_host(self) -> str:
        """The address this node's workers advertise for the store they host."""
        return self.advertise_host or route_address(self.controller_host, self.controller_port)


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host:port`` (a UDP ``connect`` picks the
    interface and sends nothing); the hostname when no route is known."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()
