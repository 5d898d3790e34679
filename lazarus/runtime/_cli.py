"""``lazarus controller`` and ``lazarus agent`` subcommands.

Shared by both processes' command lines, so it lives beside the configs it fills
(:mod:`._config`): each subcommand imports only its own process's package
(:mod:`.controller` or :mod:`.agent`) when it runs."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from ._config import AgentConfig, ControllerConfig, parse_duration, parse_host_port

__all__ = ["register_agent", "register_controller"]


def _duration(name: str):
    def parse(text: str):
        try:
            return parse_duration(text, name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = "duration"
    return parse


def _duration_or_off(name: str):
    """A duration, or ``off`` (None)."""
    def parse(text: str):
        if str(text).strip().lower() == "off":
            return None
        try:
            return parse_duration(text, name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{exc}, or off") from None

    parse.__name__ = "duration"
    return parse


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {text!r}")
        return value

    parse.__name__ = "positive integer"
    return parse


def _add_duration(p: argparse.ArgumentParser, flag: str, default: str, help: str) -> None:
    """Add ``flag``: a duration (500ms, 3s, 2m; a bad one is refused naming ``flag``)."""
    p.add_argument(flag, type=_duration(flag), default=default, help=help)


def _add_duration_or_off(p: argparse.ArgumentParser, flag: str, default: str, help: str) -> None:
    """Add ``flag``: a duration, or ``off`` (None)."""
    p.add_argument(flag, type=_duration_or_off(flag), default=default, help=help)


#: the help of the options both processes take, as each process reads them
_SHARED_HELP = {
    "controller": {
        "secret": "file holding the shared secret (>= 16 bytes); default: env LAZARUS_SECRET",
        "advertise": "store address written into plans (default: --host, or the hostname for 0.0.0.0)",
        "exit_grace": "once the job is done, wait this long for the agents to leave (default 5m)",
        "verbose": "log every event to stderr",
    },
    "agent": {
        "secret": "file holding the shared secret; default: env LAZARUS_SECRET",
        "advertise": ("address other nodes reach this one at (the rendezvous store its worker hosts); "
                      "default: this machine's address on the route to the controller"),
        "exit_grace": ("a worker that reported done is never killed: wait this long for it to exit, "
                       "then exit with its status (default 5m)"),
        "verbose": "log to stderr",
    },
}


def _add_shared(p: argparse.ArgumentParser, process: str) -> None:
    """The options of both ``lazarus controller`` and ``lazarus agent``: the shared secret,
    the address the others reach this process at, the wait at the job's end, logging."""
    text = _SHARED_HELP[process]
    p.add_argument("--secret-file", metavar="PATH", default=None, help=text["secret"])
    p.add_argument("--advertise-host", default=None, help=text["advertise"])
    _add_duration(p, "--exit-grace", "5m", text["exit_grace"])
    p.add_argument("-v", "--verbose", action="store_true", help=text["verbose"])


def _read_secret(path: str | None, option: str = "--secret-file") -> tuple[bytes, str]:
    """The secret from ``path`` (surrounding whitespace stripped) or env LAZARUS_SECRET,
    and where it came from (for the message when a peer's secret does not match)."""
    if path:
        try:
            data = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"{option}: cannot read {path}: {exc.strerror}") from None
        where = f"{option} {path}"
    else:
        env = os.environ.get("LAZARUS_SECRET")
        if env is None:
            raise ValueError(f"{option} PATH or the environment variable LAZARUS_SECRET is required")
        data = env.strip().encode("utf-8")
        where = "LAZARUS_SECRET"
    if len(data) < 16:
        raise ValueError(f"{where}: the secret must be at least 16 bytes, got {len(data)}")
    return data, where


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


def _config_error(exc: ValueError, options: dict[str, str]) -> ValueError:
    """Name the CLI option in a config error (``heartbeat_timeout must ...`` -> ``--heartbeat-timeout``)."""
    text = str(exc)
    for field, opt in options.items():
        if text.startswith(field + " "):
            return ValueError(f"{opt}: {text}")
    return exc


# ----------------------------------------------------------------------------- controller


def register_controller(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "controller",
        help="run the job's controller (membership, failure detection, plans, rendezvous store)",
        description=(
            "Run the Lazarus controller: agents register with it, it detects node failures "
            "(disconnects, missed heartbeats, worker exits, collective errors), computes "
            "replica allocations and MRO placements, sends plans to the agents, and hosts the "
            "TCPStore the workers rendezvous on. Its state is kept in --state-dir: run the same "
            "command again after a crash and it resumes the job. Durations accept 500ms, 3s, 2m."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=29400, help="control port (default 29400; 0 = any)")
    p.add_argument("--store-port", type=int, default=29401, help="TCPStore port (default 29401; 0 = any)")
    p.add_argument("--slots", type=int, default=2, help="expert replica slots per node c (default 2)")
    p.add_argument("--min-replicas", type=int, default=2, help="fault-tolerance threshold f (default 2)")
    _add_duration(p, "--heartbeat-timeout", "3s",
                  help="silence before a node is declared dead (default 3s)")
    _add_duration(p, "--failure-grace", "200ms",
                  help="window coalescing simultaneous failures (default 200ms)")
    _add_duration(p, "--join-window", "2s",
                  help="joins are batched this long (default 2s)")
    _add_duration(p, "--handshake-timeout", "5s",
                  help="first frame must arrive within this (default 5s)")
    p.add_argument("--max-message-bytes", type=int, default=1 << 20, help="largest message body (default 1 MiB)")
    p.add_argument("--expected-nodes", type=int, default=None,
                   help="wait for this many ready nodes before the first plan")
    p.add_argument("--min-nodes", type=int, default=1, help="fewest members a plan may have (default 1)")
    p.add_argument("--rebalance-every", type=int, default=0, help="steps between rebalance checks (0 = off)")
    p.add_argument("--rebalance-min-gain", type=float, default=0.05,
                   help="relative max-load improvement needed to rebalance (default 0.05)")
    p.add_argument("--events", metavar="FILE", default=None, help="append JSON-lines events here")
    p.add_argument("--state-dir", metavar="DIR", default=None,
                   help="keep the controller's state here (atomically replaced), so that the same command "
                        "run again resumes the job (default: beside --events, events.jsonl -> events.state)")
    _add_duration(p, "--resume-grace", "10s",
                  help="after a restart, members not reconnected within this are handled as failed "
                       "(default 10s)")
    _add_duration(p, "--resume-broken-grace", "3s",
                  help="after a restart, once a member that is back reports a broken collective, members "
                       "still missing this long after the controller serves again are handled as failed "
                       "(default 3s; at most --resume-grace)")
    p.add_argument("--flap-limit", type=int, default=3,
                   help="a node dropped this many times within --flap-window (its agent the same process) "
                        "is flapping: it joins again only after --flap-hold-down without a drop (default 3)")
    _add_duration(p, "--flap-window", "10m", help="how far back drops count for --flap-limit (default 10m)")
    _add_duration(p, "--flap-hold-down", "60s",
                  help="how long a flapping node must stay connected without a drop before it joins again "
                       "(default 60s; 0 = off)")
    _add_duration(p, "--handover-wait", "30s",
                  help="when every member is leaving (SIGTERM) while a node is still starting, train on this "
                       "long at most for it to be ready and hand the state to it (default 30s; 0 = off)")
    p.add_argument("--keep-running", action="store_true", help="do not exit when the job is done")
    _add_duration(p, "--protocol-error-interval", "10s",
                  help="repeated protocol errors from one address (a wrong secret, garbage) are logged once per "
                       "this interval, then as one line with a count (default 10s; 0 = every one)")
    _add_shared(p, "controller")
    p.set_defaults(handler=_run_controller)


_CONTROLLER_OPTIONS = {
    "host": "--host", "port": "--port", "store_port": "--store-port", "slots_per_node": "--slots",
    "min_replicas": "--min-replicas", "heartbeat_timeout": "--heartbeat-timeout",
    "failure_grace": "--failure-grace", "join_window": "--join-window",
    "handshake_timeout": "--handshake-timeout", "max_message_bytes": "--max-message-bytes",
    "expected_nodes": "--expected-nodes", "min_nodes": "--min-nodes",
    "rebalance_every": "--rebalance-every", "rebalance_min_gain": "--rebalance-min-gain",
    "secret": "--secret-file", "exit_grace": "--exit-grace", "state_dir": "--state-dir",
    "resume_grace": "--resume-grace", "resume_broken_grace": "--resume-broken-grace",
    "protocol_error_interval": "--protocol-error-interval", "flap_limit": "--flap-limit",
    "flap_window": "--flap-window", "flap_hold_down": "--flap-hold-down", "handover_wait": "--handover-wait",
}


def _run_controller(args: argparse.Namespace) -> int:
    from .controller._controller import Controller

    secret, source = _read_secret(args.secret_file)
    try:
        cfg = ControllerConfig(
            secret=secret, secret_source=source, protocol_error_interval=args.protocol_error_interval,
            host=args.host, port=args.port, store_port=args.store_port,
            slots_per_node=args.slots, min_replicas=args.min_replicas,
            heartbeat_timeout=args.heartbeat_timeout, failure_grace=args.failure_grace,
            join_window=args.join_window, handshake_timeout=args.handshake_timeout,
            max_message_bytes=args.max_message_bytes, expected_nodes=args.expected_nodes,
            min_nodes=args.min_nodes, rebalance_every=args.rebalance_every,
            rebalance_min_gain=args.rebalance_min_gain, events_path=args.events,
            exit_when_done=not args.keep_running, advertise_host=args.advertise_host,
            exit_grace=args.exit_grace, state_dir=args.state_dir, resume_grace=args.resume_grace,
            resume_broken_grace=args.resume_broken_grace, flap_limit=args.flap_limit,
            flap_window=args.flap_window, flap_hold_down=args.flap_hold_down, handover_wait=args.handover_wait,
        )
    except ValueError as exc:
        raise _config_error(exc, _CONTROLLER_OPTIONS) from None
    _setup_logging(args.verbose)

    def ready(c: Controller) -> None:
        print(f"lazarus controller: listening on {cfg.host}:{c.port}, store on {cfg.host}:{c.store_port}",
              flush=True)

    try:
        return Controller(cfg, on_ready=ready).run()
    except ValueError as exc:
        text = str(exc)
        if text.startswith("state_dir: "):
            raise ValueError("--state-dir: " + text[len("state_dir: "):]) from None
        raise
    except OSError as exc:
        text = str(exc)
        if text.startswith("store_port: "):
            raise ValueError("--store-port: " + text[len("store_port: "):]) from None
        raise ValueError(f"--port: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or text}") from None


# ----------------------------------------------------------------------------- agent


def register_agent(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "agent",
        help="run a node agent that registers with the controller and runs the worker",
        description=(
            "Run a Lazarus node agent: it registers with the controller, heartbeats, starts "
            "WORKER_COMMAND (after --) with a channel to the agent (--nproc-per-node times, one per "
            "local GPU), relays plans and reports, "
            "and restarts a crashed worker as a new member (capped by --max-restarts). If the "
            "controller goes away the worker keeps training while the agent reconnects. "
            "SIGTERM = graceful leave."
        ),
    )
    p.add_argument("--controller", required=True, metavar="HOST:PORT", help="controller address")
    p.add_argument("--node-id", default=None, help="unique node name (default hostname-pid)")
    p.add_argument("--slots", type=int, default=None,
                   help="replica slots of this node, all its workers together (default: controller's)")
    p.add_argument("--nproc-per-node", type=_positive_int("--nproc-per-node"), default=1, metavar="G",
                   help="workers to run on this node, one per local GPU (LOCAL_RANK 0..G-1, LOCAL_WORLD_SIZE=G, "
                        "device cuda:LOCAL_RANK with ElasticConfig(device='auto')); the node's slots are spread "
                        "over them and its failure removes all G ranks; one worker failing restarts all G "
                        "(default 1)")
    _add_duration(p, "--heartbeat-interval", "500ms",
                  help="time between heartbeats (default 500ms)")
    p.add_argument("--snapshot-dir", default=None,
                   help="node-memory directory (default /dev/shm/lazarus-<job>/<node-id>)")
    p.add_argument("--job", default="job", help="job name used in the default snapshot dir")
    p.add_argument("--no-respawn", action="store_true", help="do not restart a crashed worker")
    _add_duration(p, "--respawn-delay", "1s",
                  help="pause before restarting a crashed worker (default 1s)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of a crashing worker allowed within --restart-window; past that the node "
                        "leaves the job and the agent exits 5 naming the worker's last error (default 5)")
    _add_duration(p, "--restart-window", "10m",
                  help="the sliding window --max-restarts counts in (default 10m); the pause before a "
                       "restart doubles from --respawn-delay with every restart in it (at most 60s)")
    _add_duration(p, "--connect-timeout", "30s",
                  help="give up reaching the controller after this and exit 1 (default 30s); the worker starts "
                       "only once the controller accepted the node, and the agent says every 5s that it is "
                       "still trying")
    _add_duration(p, "--reconnect-timeout", "5m",
                  help="when the controller goes away, the worker keeps training while the agent "
                       "reconnects for this long; then it stops the worker and exits 4 (default 5m)")
    _add_duration(p, "--leave-timeout", "60s",
                  help="after SIGTERM, wait this long for the hand-over (default 60s)")
    _add_duration(p, "--stop-timeout", "10s",
                  help="a stopped worker, or one that left the job, may take this long to exit before it "
                       "is killed (default 10s)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment variable for the worker (repeatable)")
    p.add_argument("--standby", action="store_true",
                   help="hot spare: start the worker now (imports, model code, warm-up) but register with the "
                        "controller only on SIGUSR1, so that the node joins with nothing left to load")
    _add_duration_or_off(p, "--stopped-timeout", "500ms",
                         help="a worker stopped this long (process state T: SIGSTOP) is killed and handled as "
                              "crashed, so its peers need not wait out their collective timeout (default 500ms; "
                              "off: never)")
    _add_duration_or_off(p, "--hang-timeout", "5s",
                         help="a worker whose training thread is blocked in a step of an older generation this "
                              "long after a newer plan reached it is killed and handled as crashed (default 5s; "
                              "off: never)")
    _add_duration(p, "--watch-interval", "100ms",
                  help="how often the hang watchdog looks at the workers (default 100ms)")
    _add_shared(p, "agent")
    p.add_argument("worker_command", nargs=argparse.REMAINDER, metavar="-- WORKER_COMMAND ...",
                   help="the training command to run")
    p.set_defaults(handler=_run_agent)


_AGENT_OPTIONS = {
    "node_id": "--node-id", "slots": "--slots", "nproc_per_node": "--nproc-per-node",
    "heartbeat_interval": "--heartbeat-interval",
    "respawn_delay": "--respawn-delay", "connect_timeout": "--connect-timeout",
    "max_restarts": "--max-restarts", "restart_window": "--restart-window",
    "reconnect_timeout": "--reconnect-timeout",
    "leave_timeout": "--leave-timeout", "stop_timeout": "--stop-timeout", "exit_grace": "--exit-grace",
    "job": "--job", "advertise_host": "--advertise-host", "stopped_timeout": "--stopped-timeout",
    "hang_timeout": "--hang-timeout", "watch_interval": "--watch-interval",
    "controller_port": "--controller", "controller_host": "--controller", "worker_command": "WORKER_COMMAND",
}


def _run_agent(args: argparse.Namespace) -> int:
    from .agent._agent import Agent

    cmd = list(args.worker_command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ValueError("WORKER_COMMAND is missing: give it after --, e.g. -- python train.py")
    host, port = parse_host_port(args.controller, "--controller")
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env must be KEY=VALUE, got {item!r}")
        env[key] = value
    secret, source = _read_secret(args.secret_file)
    kwargs = {}
    if args.node_id is not None:
        kwargs["node_id"] = args.node_id
    try:
        cfg = AgentConfig(
            secret=secret, secret_source=source, worker_command=cmd, controller_host=host, controller_port=port,
            slots=args.slots, nproc_per_node=args.nproc_per_node, heartbeat_interval=args.heartbeat_interval,
            snapshot_dir=args.snapshot_dir, job=args.job, respawn=not args.no_respawn,
            respawn_delay=args.respawn_delay, connect_timeout=args.connect_timeout,
            max_restarts=args.max_restarts, restart_window=args.restart_window,
            reconnect_timeout=args.reconnect_timeout,
            leave_timeout=args.leave_timeout, stop_timeout=args.stop_timeout, exit_grace=args.exit_grace,
            env=env, standby=args.standby, advertise_host=args.advertise_host,
            stopped_timeout=args.stopped_timeout, hang_timeout=args.hang_timeout, watch_interval=args.watch_interval,
            **kwargs,
        )
    except ValueError as exc:
        raise _config_error(exc, _AGENT_OPTIONS) from None
    _setup_logging(args.verbose)
    return Agent(cfg).run()
