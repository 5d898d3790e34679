"""The Lazarus control plane with real sockets and real processes (no mocks).

Part 1: a controller in a thread, attacked with bad clients while a healthy registered
client keeps working. Part 2: ``lazarus controller`` + ``lazarus agent`` subprocesses
running ``tests/helpers/workers/runtime_fake_worker.py``, with nodes killed, frozen, restarted and
preempted.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from lazarus.runtime import Controller, ControllerConfig
from lazarus.runtime._wire import encode_frame, recv_frame, send_frame

ROOT = Path(__file__).resolve().parents[3]
FAKE_WORKER = ROOT / "tests" / "helpers" / "workers" / "runtime_fake_worker.py"
SECRET = b"control-test-secret-0123456789"
MAX_BYTES = 4096


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def read_events(path: Path) -> list[dict[str, Any]]:
    """The complete lines of the controller's event log (one it is writing right now, not
    yet ended by its newline, is left for the next read; any other bad line fails)."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]   # the last piece is "" or a line being written
    return [json.loads(line) for line in lines if line.strip()]


# ============================================================================ part 1


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Controller, Path]]:
    events = tmp_path_factory.mktemp("ctl") / "events.jsonl"
    cfg = ControllerConfig(secret=SECRET, port=0, store_port=0, heartbeat_timeout=timedelta(seconds=30),
                           handshake_timeout=timedelta(milliseconds=500), max_message_bytes=MAX_BYTES,
                           # every bad client below comes from 127.0.0.1 and must be recorded in full
                           # (the per-address rate limit is test_bad_peer's)
                           events_path=events, protocol_error_interval=timedelta(0))
    ctl = Controller(cfg)
    ctl.start_in_thread()
    yield ctl, events
    ctl.stop()


class Client:
    """A raw, registered control connection (what an agent looks like on the wire)."""

    def __init__(self, port: int, node: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.node = node
        send_frame(self.sock, SECRET, {"type": "register", "node": node, "slots": 2, "incarnation": 1,
                                       "pid": os.getpid()})
        reply = recv_frame(self.sock, SECRET)
        assert reply["type"] == "registered" and reply["node"] == node

    def ping(self, nonce: int) -> None:
        send_frame(self.sock, SECRET, {"type": "heartbeat", "node": self.node, "worker_alive": False,
                                       "step": None})
        send_frame(self.sock, SECRET, {"type": "ping", "node": self.node, "nonce": nonce})
        reply = recv_frame(self.sock, SECRET)
        assert reply == {"type": "pong", "nonce": nonce}

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def healthy(controller: tuple[Controller, Path]) -> Iterator[Client]:
    client = Client(controller[0].port, "healthy")
    yield client
    client.close()


def frame_with(body: bytes, secret: bytes = SECRET) -> bytes:
    import hashlib
    import hmac

    return struct.pack(">I", 32 + len(body)) + hmac.new(secret, body, hashlib.sha256).digest() + body


REGISTER = {"type": "register", "node": "intruder", "slots": 2, "incarnation": 1}

BAD_CLIENTS: dict[str, tuple[bytes, str]] = {
    # name: (bytes sent, event expected)
    "malformed-json": (frame_with(b"{this is not json"), "protocol_error"),
    "not-an-object": (frame_with(b"[1, 2, 3]"), "protocol_error"),
    "missing-type": (frame_with(b'{"node": "x", "slots": 2}'), "protocol_error"),
    "wrong-hmac": (encode_frame(b"not-the-secret-0123456789", REGISTER), "protocol_error"),
    "oversized": (struct.pack(">I", 32 + MAX_BYTES + 1), "protocol_error"),
    "not-register-first": (encode_frame(SECRET, {"type": "heartbeat", "node": "x"}), "protocol_error"),
    "garbage-bytes": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "protocol_error"),
    "mid-frame-eof": (encode_frame(SECRET, REGISTER)[:20], "disconnect_mid_frame"),
}


def assert_closed_by_server(sock: socket.socket, timeout: float) -> float:
    """Wait until the controller closes ``sock``; returns the time it took."""
    t0 = time.monotonic()
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


@pytest.mark.timeout(20)
@pytest.mark.parametrize("case", sorted(BAD_CLIENTS))
def test_bad_client_is_rejected_and_controller_keeps_serving(
    case: str, controller: tuple[Controller, Path], healthy: Client, caplog: pytest.LogCaptureFixture
) -> None:
    ctl, events = controller
    caplog.set_level(logging.WARNING, logger="lazarus.controller")
    data, expected = BAD_CLIENTS[case]
    healthy.ping(1)
    bad = socket.create_connection(("127.0.0.1", ctl.port), timeout=5)
    peer = "%s:%d" % bad.getsockname()
    bad.sendall(data)
    if case == "mid-frame-eof":
        bad.close()
    else:
        took = assert_closed_by_server(bad, 5)
        assert took < 0.45, f"{case}: rejected only after {took:.2f}s (should not wait for the handshake timeout)"
        bad.close()
    ev = wait_for(lambda: [e for e in read_events(events) if e.get("peer") == peer and e["event"] == expected],
                  5, f"{expected} event for {peer}")
    if expected == "protocol_error":
        assert ev[0]["reason"]
    wait_for(lambda: any(peer in r.getMessage() for r in caplog.records), 2, "warning naming the peer")
    healthy.ping(2)  # still served


@pytest.mark.timeout(20)
def test_silent_client_closed_after_handshake_timeout(controller: tuple[Controller, Path], healthy: Client) -> None:
    ctl, events = controller
    silent = socket.create_connection(("127.0.0.1", ctl.port), timeout=5)
    peer = "%s:%d" % silent.getsockname()
    took = assert_closed_by_server(silent, 5)
    silent.close()
    assert 0.4 <= took < 3.0
    wait_for(lambda: [e for e in read_events(events) if e["event"] == "handshake_timeout" and e["peer"] == peer],
             2, "handshake_timeout event")
    healthy.ping(3)


@pytest.mark.timeout(20)
def test_abrupt_disconnects_of_registered_clients(controller: tuple[Controller, Path], healthy: Client) -> None:
    ctl, events = controller
    # a registered client that resets the connection (RST) in the middle of a frame
    c = Client(ctl.port, "resetter")
    frame = encode_frame(SECRET, {"type": "heartbeat", "node": "resetter", "worker_alive": False, "step": 1})
    c.sock.sendall(frame[:7])
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    c.close()
    wait_for(lambda: [e for e in read_events(events) if e["event"] == "node_left" and e["node"] == "resetter"],
             5, "resetter to be dropped")
    # a registered client that sends a forged frame after registering is cut off
    d = Client(ctl.port, "forger")
    d.sock.sendall(encode_frame(b"forged-secret-0123456789", {"type": "heartbeat", "node": "forger"}))
    assert_closed_by_server(d.sock, 5)
    d.close()
    ev = wait_for(lambda: [e for e in read_events(events) if e["event"] == "protocol_error"
                           and e.get("node") == "forger"], 5, "forger rejected")
    assert ev[0]["error"] == "BadMacError"
    # a second connection claiming a live node id is refused
    e = socket.create_connection(("127.0.0.1", ctl.port), timeout=5)
    send_frame(e, SECRET, {"type": "register", "node": "healthy", "slots": 2, "incarnation": 1})
    assert recv_frame(e, SECRET)["type"] == "error"
    e.close()
    healthy.ping(4)


# ============================================================================ part 2

COMMON_CTL = ["--slots", "2", "--min-replicas", "2", "--heartbeat-timeout", "1s", "--failure-grace", "100ms",
              "--join-window", "500ms", "--handshake-timeout", "2s"]


class Cluster:
    """A ``lazarus controller`` subprocess plus ``lazarus agent`` subprocesses (own process groups)."""

    def __init__(self, tmp: Path, ctl_args: list[str] = (), worker_env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.events_path = tmp / "events.jsonl"
        self.secret_file = tmp / "secret"
        self.secret_file.write_bytes(SECRET + b"\n")
        self.worker_env = dict(worker_env or {})
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.ctl_out = open(tmp / "controller.out", "a+")
        self.ctl_cmd = [sys.executable, "-m", "lazarus.cli", "controller", "--port", "0", "--store-port", "0",
                        "--secret-file", str(self.secret_file), "--events", str(self.events_path), "-v",
                        *COMMON_CTL, *ctl_args]
        self.start_controller()

    def start_controller(self) -> None:
        """Start the controller (again: the same command line, so it resumes from its state)."""
        self.ctl = subprocess.Popen(self.ctl_cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.ctl_out,
                                    start_new_session=True)
        line = self.ctl.stdout.readline().decode()
        assert line.startswith("lazarus controller: listening on 127.0.0.1:"), line
        self.port = int(line.split("listening on 127.0.0.1:")[1].split(",")[0])
        self.store_port = int(line.rsplit(":", 1)[1])

    def add_agent(self, node: str, *extra: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"agent-{node}.log", "w")
        env = dict(os.environ, PYTHONPATH=str(ROOT), **self.worker_env)
        env.pop("LAZARUS_SECRET", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "lazarus.cli", "agent", "--controller", f"127.0.0.1:{self.port}",
             "--secret-file", str(self.secret_file), "--node-id", node, "--heartbeat-interval", "100ms",
             "--respawn-delay", "200ms", "--snapshot-dir", str(self.tmp / f"shm-{node}"), "-v", *extra,
             "--", sys.executable, str(FAKE_WORKER)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.agents[node] = proc
        return proc

    def events(self, name: str | None = None, **match: Any) -> list[dict[str, Any]]:
        return [e for e in read_events(self.events_path)
                if (name is None or e["event"] == name) and all(e.get(k) == v for k, v in match.items())]

    def wait_event(self, name: str, timeout: float = 10, **match: Any) -> dict[str, Any]:
        return wait_for(lambda: self.events(name, **match), timeout, f"{name} {match}\n{self.debug()}")[0]

    def wait_plan(self, timeout: float = 10, **match: Any) -> dict[str, Any]:
        return self.wait_event("plan", timeout, **match)

    def debug(self) -> str:
        return "\n".join(json.dumps(e)[:300] for e in read_events(self.events_path)[-15:])

    def kill_group(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        for proc in [*self.agents.values(), self.ctl]:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                self.kill_group(proc, sig)
        for proc in [*self.agents.values(), self.ctl]:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.ctl_out.close()


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(*ctl_args: str, nodes: tuple[str, ...] = ("a", "b", "c"), agent_args: tuple[str, ...] = (),
             **worker_env: str) -> Cluster:
        c = Cluster(tmp_path, list(ctl_args), worker_env)
        made.append(c)
        for n in nodes:
            c.add_agent(n, *agent_args)
        return c

    yield make
    for c in made:
        c.close()


def check_layers(plan: dict[str, Any], slots: int = 2, experts: int = 4) -> None:
    layers = plan["layers"]
    assert sorted(layers) == ["layers.0.moe", "layers.1.moe"]
    for rows in layers.values():
        assert len(rows) == len(plan["members"])
        assert all(1 <= len(r) <= slots for r in rows)
        assert sorted({x for r in rows for x in r}) == list(range(experts))


def started(c: Cluster, members: list[str]) -> dict[str, Any]:
    plan = c.wait_plan(15, reason="start")
    assert plan["members"] == members and plan["mode"] == "immediate" and plan["generation"] == 1
    check_layers(plan)
    for m in members:  # every worker applied the start plan (the controller now knows who holds what)
        c.wait_event("reconfigured", 5, node=m, generation=1)
    return plan


@pytest.mark.timeout(60)
def test_start_then_sigkill_node_gives_failure_plan(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory("--expected-nodes", "3")
    started(c, ["a", "b", "c"])
    t_kill = time.time()
    c.kill_group(c.agents["b"])
    failed = c.wait_event("node_failed", 5, node="b")
    plan = c.wait_plan(5, reason="failure")
    assert failed["cause"] == "disconnect"
    assert failed["t"] - t_kill < 1.0
    assert plan["t"] - t_kill < 1.5
    assert plan["members"] == ["a", "c"] and plan["lost"] == ["b"] and plan["mode"] == "immediate"
    assert plan["generation"] == 2 and plan["detected_at"] == pytest.approx(failed["t"], abs=0.05)
    check_layers(plan)
    assert plan["fetches"]["greedy"] <= plan["fetches"]["identity"]
    rec = c.wait_event("reconfigured", 5, node="a", generation=2)
    assert rec["reconfiguration_s"] >= 0


@pytest.mark.timeout(60)
def test_sigstop_detected_by_heartbeat_then_evicted_and_rejoins(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory("--expected-nodes", "3")
    started(c, ["a", "b", "c"])
    t_stop = time.time()
    c.kill_group(c.agents["c"], signal.SIGSTOP)
    plan = c.wait_plan(5, reason="failure")
    failed = c.events("node_failed", node="c")[0]
    assert failed["cause"] == "heartbeat_timeout"
    assert 0.9 <= failed["t"] - t_stop < 2.5
    assert plan["members"] == ["a", "b"] and plan["lost"] == ["c"]
    c.kill_group(c.agents["c"], signal.SIGCONT)
    c.wait_event("evicted", 5, node="c")
    c.wait_event("node_registered", 5, node="c", rejoin=True, incarnation=2)
    c.wait_event("worker_ready", 5, node="c", incarnation=2)
    join = c.wait_plan(5, reason="join")
    assert join["mode"] == "between_steps" and join["joined"] == ["c"]
    assert join["members"] == ["a", "b", "c"]
    check_layers(join)
    c.kill_group(c.agents["c"])


@pytest.mark.timeout(60)
def test_worker_killed_gives_failure_plan_then_respawned_worker_rejoins(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory("--expected-nodes", "3")
    started(c, ["a", "b", "c"])
    ready = c.events("worker_ready", node="b")[0]
    os.kill(ready["pid"], signal.SIGKILL)
    plan = c.wait_plan(5, reason="failure")
    assert plan["members"] == ["a", "c"] and plan["lost"] == ["b"]
    assert c.events("node_failed", node="b")[0]["cause"] == "worker_exit"
    exit_ev = c.events("worker_exit", node="b")[0]
    assert exit_ev["returncode"] == -signal.SIGKILL
    c.wait_event("reconfigured", 5, node="a", generation=2)
    respawned = c.wait_event("worker_ready", 5, node="b", incarnation=2)
    join = c.wait_plan(5, reason="join")
    assert join["mode"] == "between_steps" and join["joined"] == ["b"]
    assert join["members"] == ["a", "c", "b"]  # survivors keep their order, joiners after
    # nobody else on the way: planned as soon as it is ready, not after the 500 ms window
    assert c.events("join", node="b")[0]["waiting_for"] == []
    assert join["t"] - respawned["t"] < 0.45
    check_layers(join)
    assert c.agents["b"].poll() is None  # the agent itself stayed up


@pytest.mark.timeout(60)
def test_join_window_waits_only_for_nodes_warming_up(cluster_factory: Callable[..., Cluster],
                                                     tmp_path: Path) -> None:
    """Node d registers but its worker says hello only when the test lets it; c is ready
    at once. c's join waits for d (one plan for both), and the window closes as soon as d
    is ready, long before its 10 s."""
    c = cluster_factory("--expected-nodes", "2", "--join-window", "10s", nodes=("a", "b"))
    started(c, ["a", "b"])
    go = tmp_path / "d-hello"
    c.add_agent("d", "--env", f"FAKE_HELLO_WHEN={go}")
    c.wait_event("node_registered", 10, node="d")
    c.add_agent("c")
    c_ready = c.wait_event("worker_ready", 10, node="c")
    assert c.wait_event("join", 5, node="c")["waiting_for"] == ["d"]
    time.sleep(0.5)
    assert not c.events("plan", reason="join")          # c is held for d
    go.touch()
    d_ready = c.wait_event("worker_ready", 10, node="d")
    join = c.wait_plan(5, reason="join")
    assert join["joined"] == ["c", "d"] and join["members"] == ["a", "b", "c", "d"]
    assert join["t"] - d_ready["t"] < 1.0               # until d was ready, not for the 10 s window
    assert join["t"] - c_ready["t"] < 9.0
    assert len(c.events("plan", reason="join")) == 1
    check_layers(join)


@pytest.mark.timeout(60)
def test_sigterm_is_a_graceful_leave(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory("--expected-nodes", "3")
    started(c, ["a", "b", "c"])
    c.agents["c"].send_signal(signal.SIGTERM)  # the agent only, like a spot notice
    plan = c.wait_plan(5, reason="leave")
    assert plan["mode"] == "between_steps" and plan["leaving"] == ["c"] and plan["members"] == ["a", "b"]
    check_layers(plan)
    assert c.agents["c"].wait(timeout=10) == 0
    assert not (c.tmp / "shm-c").exists()  # node memory removed on a normal exit
    left = c.wait_event("node_left", 5, node="c")
    assert left["t"] >= plan["t"]
    assert not c.events("node_failed")
    assert c.agents["a"].poll() is None and c.agents["b"].poll() is None


@pytest.mark.timeout(60)
def test_sigterm_leave_is_not_held_up_by_stuck_background_work(cluster_factory: Callable[..., Cluster]) -> None:
    """A spot notice while a checkpoint write hangs (issue 28): the worker hands over and
    reports ``left``, but a thread stuck on storage keeps its process from exiting. The
    agent stops it after --stop-timeout and exits 0 long before --leave-timeout, instead of
    giving up with exit 3."""
    c = cluster_factory("--expected-nodes", "3", agent_args=("--stop-timeout", "1s", "--leave-timeout", "40s"),
                        FAKE_LEFT_STUCK_S="300")
    started(c, ["a", "b", "c"])
    t0 = time.monotonic()
    c.agents["c"].send_signal(signal.SIGTERM)
    plan = c.wait_plan(5, reason="leave")
    assert plan["leaving"] == ["c"] and plan["members"] == ["a", "b"]
    assert c.agents["c"].wait(timeout=30) == 0
    assert time.monotonic() - t0 < 25, "the agent waited for the stuck worker instead of stopping it"
    log = (c.tmp / "agent-c.log").read_text()
    assert "handed its state over and left the job, but has not exited" in log
    left = c.wait_event("worker_message", 5, node="c")
    assert left["msg"]["type"] == "left"
    assert c.wait_event("node_left", 5, node="c")["t"] >= plan["t"]
    assert not c.events("node_failed")
    assert c.agents["a"].poll() is None and c.agents["b"].poll() is None


@pytest.mark.timeout(60)
def test_collective_error_replans_same_members_and_rebalance(
    cluster_factory: Callable[..., Cluster], tmp_path: Path
) -> None:
    control = tmp_path / "control"
    control.mkdir()
    c = cluster_factory("--expected-nodes", "3", "--rebalance-every", "20", nodes=("a", "b", "c"),
                        FAKE_CONTROL_DIR=str(control))
    started(c, ["a", "b", "c"])
    # rank 0 reports skewed routing ((e+1)^3): the first rebalance check moves replicas
    reb = c.wait_plan(10, reason="rebalance")
    assert reb["mode"] == "between_steps" and reb["members"] == ["a", "b", "c"]
    check_layers(reb)
    c.wait_event("reconfigured", 5, node="a", generation=reb["generation"])
    (control / "b").write_text("collective_error")
    plan = c.wait_plan(5, reason="collective_error")
    assert plan["members"] == ["a", "b", "c"] and plan["mode"] == "immediate" and plan["lost"] == []
    assert plan["generation"] == reb["generation"] + 1
    assert not c.events("node_failed")


@pytest.mark.timeout(60)
def test_done_shuts_everything_down(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory("--expected-nodes", "2", nodes=("a", "b"), FAKE_STEPS="15")
    started(c, ["a", "b"])
    c.wait_event("done", 10)
    assert c.ctl.wait(timeout=10) == 0
    for proc in c.agents.values():
        assert proc.wait(timeout=10) == 0


@pytest.mark.timeout(60)
def test_clean_end_waits_for_finished_workers_and_exits_with_their_status(
    cluster_factory: Callable[..., Cluster], tmp_path: Path,
) -> None:
    """After done, workers run their own code (an export) for 3 s: nobody is killed, the
    agents exit with the workers' status, and the controller waits for the agents."""
    control = tmp_path / "control"
    control.mkdir()
    c = cluster_factory("--expected-nodes", "2", nodes=("a", "b"), FAKE_STEPS="10", FAKE_LINGER_S="3",
                        FAKE_EXIT_CODE="7", FAKE_CONTROL_DIR=str(control))
    started(c, ["a", "b"])
    done = c.wait_event("done", 10)
    assert c.ctl.wait(timeout=30) == 0
    t_ctl_exit = time.time()
    for node in ("a", "b"):
        assert c.agents[node].wait(timeout=10) == 7      # the worker's own status
        finished = float((control / f"{node}.finished").read_text())
        assert finished - done["t"] >= 2.9               # it ran its code to the end
        assert finished <= t_ctl_exit                    # the controller waited for it
    end = c.wait_event("job_end", 5)
    assert end["still_connected"] == [] and end["waited_s"] >= 2.9
    assert not c.events("node_failed")
    exits = c.events("worker_exit")
    assert sorted(e["node"] for e in exits) == ["a", "b"] and {e["returncode"] for e in exits} == {7}


@pytest.mark.timeout(60)
def test_finished_worker_is_stopped_only_after_exit_grace(tmp_path: Path) -> None:
    c = Cluster(tmp_path, ["--expected-nodes", "2", "--exit-grace", "20s"], {"FAKE_STEPS": "5", "FAKE_LINGER_S": "60"})
    try:
        for node in ("a", "b"):
            c.add_agent(node, "--exit-grace", "2s")
        started(c, ["a", "b"])
        done = c.wait_event("done", 10)
        for node in ("a", "b"):
            assert c.agents[node].wait(timeout=20) == 6     # EXIT_GRACE_EXPIRED
            assert "still running (--exit-grace)" in (tmp_path / f"agent-{node}.log").read_text()
        assert time.time() - done["t"] >= 1.9
        assert c.ctl.wait(timeout=10) == 0
        assert c.wait_event("job_end", 5)["still_connected"] == []
    finally:
        c.close()


@pytest.mark.timeout(30)
def test_cli_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "lazarus.cli", *args], capture_output=True, text=True,
                              cwd=ROOT, timeout=30, env=env)

    env = {k: v for k, v in os.environ.items() if k != "LAZARUS_SECRET"}
    r = run("controller", "--port", "0", env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "lazarus controller: error: --secret-file" in r.stderr
    short = tmp_path / "short"
    short.write_text("tiny")
    r = run("controller", "--secret-file", str(short))
    assert r.returncode == 2 and "at least 16 bytes" in r.stderr
    good = tmp_path / "good"
    good.write_bytes(SECRET)
    r = run("controller", "--secret-file", str(good), "--heartbeat-timeout", "soon")
    assert r.returncode == 2 and "--heartbeat-timeout" in r.stderr
    r = run("controller", "--secret-file", str(good), "--slots", "0")
    assert r.returncode == 2 and "--slots" in r.stderr
    bad_state = tmp_path / "state"
    bad_state.mkdir()
    (bad_state / "state.json").write_text("{torn")
    r = run("controller", "--secret-file", str(good), "--port", "0", "--store-port", "0", "--state-dir", str(bad_state))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "--state-dir:" in r.stderr and "is not JSON" in r.stderr
    r = run("controller", "--secret-file", str(good), "--state-dir", str(good))
    assert r.returncode == 2 and "--state-dir" in r.stderr and "is a file" in r.stderr
    r = run("controller", "--secret-file", str(good), "--exit-grace", "0s")
    assert r.returncode == 2 and "--exit-grace" in r.stderr
    r = run("agent", "--controller", "127.0.0.1:1", "--secret-file", str(good), "--exit-grace", "x", "--", "true")
    assert r.returncode == 2 and "--exit-grace" in r.stderr
    r = run("agent", "--controller", "nohostport", "--secret-file", str(good), "--", "true")
    assert r.returncode == 2 and "--controller" in r.stderr
    r = run("agent", "--controller", "127.0.0.1:1", "--secret-file", str(good))
    assert r.returncode == 2 and "WORKER_COMMAND" in r.stderr


def process_alive(pid: int) -> bool:
    """True for a running (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.timeout(60)
def test_controller_gone_for_good_agents_keep_workers_until_reconnect_timeout(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory("--expected-nodes", "3", agent_args=("--reconnect-timeout", "3s"))
    started(c, ["a", "b", "c"])
    workers = {e["node"]: e["pid"] for e in c.events("worker_ready")}
    # an agent killed on its own: its worker notices the lost channel and exits by itself
    os.kill(c.agents["c"].pid, signal.SIGKILL)
    wait_for(lambda: not process_alive(workers["c"]), 5, "orphaned worker of c to exit")
    plan = c.wait_plan(5, reason="failure")
    assert plan["members"] == ["a", "b"]
    # the controller dies for good: the workers keep running while their agents try to
    # reconnect; once --reconnect-timeout has passed the agents stop them and exit 4
    t_kill = time.time()
    c.kill_group(c.ctl)
    time.sleep(1.5)
    for n in ("a", "b"):
        assert c.agents[n].poll() is None and process_alive(workers[n])
    for n in ("a", "b"):
        assert c.agents[n].wait(timeout=15) == 4
        assert time.time() - t_kill >= 2.9
        assert not process_alive(workers[n])
        assert "--reconnect-timeout" in (c.tmp / f"agent-{n}.log").read_text()


def saved_state(c: Cluster) -> dict[str, Any]:
    return json.loads((c.tmp / "events.state" / "state.json").read_text())


def progress_steps(c: Cluster) -> int:
    """Rank 0's last reported step, as the controller saved it (within a second)."""
    return saved_state(c)["last_step"] or 0


@pytest.mark.timeout(60)
def test_controller_restart_resumes_the_job_without_touching_the_workers(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory("--expected-nodes", "3", "--resume-grace", "5s")
    plan = started(c, ["a", "b", "c"])
    workers = {e["node"]: e["pid"] for e in c.events("worker_ready")}
    state = saved_state(c)
    assert state["generation"] == 1 and state["members"] == ["a", "b", "c"] and state["epoch"] == 1
    port, store_port = c.port, c.store_port
    c.kill_group(c.ctl)
    c.ctl.wait(timeout=10)
    time.sleep(1.0)                       # away for a while: agents retry, workers go on
    for n in ("a", "b", "c"):
        assert c.agents[n].poll() is None and process_alive(workers[n])
    c.start_controller()                  # the same command line (--port 0 --store-port 0)
    assert (c.port, c.store_port) == (port, store_port)   # the job's ports, from the state
    started_ev = [e for e in c.events("controller_started") if e.get("resumed")]
    assert len(started_ev) == 1 and started_ev[0]["epoch"] == 2 and started_ev[0]["generation"] == 1
    resumed = c.wait_event("resumed", 10)
    assert sorted(resumed["back"]) == ["a", "b", "c"] and resumed["missing"] == [] and resumed["lost"] == []
    for n in ("a", "b", "c"):
        ev = c.events("node_resumed", node=n)[0]
        assert ev["same_worker"] and ev["member"] and ev["worker_alive"]
        assert process_alive(workers[n])  # never restarted
    assert not c.events("node_failed") and len(c.events("plan")) == 1
    # the job goes on under the new controller: progress is counted, and a failure
    # gets a plan whose store is the new one (epoch 2)
    before = progress_steps(c)
    wait_for(lambda: progress_steps(c) > before + 5, 10, "progress reports to the new controller")
    c.kill_group(c.agents["b"])
    fail = c.wait_plan(10, reason="failure")
    assert fail["members"] == ["a", "c"] and fail["generation"] == plan["generation"] + 1
    state = saved_state(c)
    assert state["generation"] == 2 and state["members"] == ["a", "c"] and state["epoch"] == 2
    assert state["plan"]["store"] == {"host": "127.0.0.1", "port": store_port, "epoch": 2}


@pytest.mark.timeout(60)
def test_failure_while_the_controller_is_away_is_handled_when_it_returns(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory("--expected-nodes", "3", "--resume-grace", "3s")
    started(c, ["a", "b", "c"])
    c.kill_group(c.ctl)
    c.ctl.wait(timeout=10)
    c.kill_group(c.agents["b"])           # a whole node dies while nobody watches
    c.agents["b"].wait(timeout=10)
    time.sleep(0.5)
    t_back = time.time()
    c.start_controller()
    resumed = c.wait_event("resumed", 10)
    assert resumed["missing"] == ["b"] and resumed["lost"] == ["b"] and sorted(resumed["back"]) == ["a", "c"]
    assert resumed["t"] - t_back >= 2.5   # b had --resume-grace to come back
    failed = c.events("node_failed", node="b")[0]
    assert failed["cause"] == "not_back_after_restart"
    plan = c.wait_plan(5, reason="failure")
    assert plan["members"] == ["a", "c"] and plan["lost"] == ["b"] and plan["generation"] == 2
    assert saved_state(c)["plan"]["store"]["epoch"] == 2
    c.wait_event("reconfigured", 5, node="a", generation=2)


@pytest.mark.timeout(60)
def test_worker_crash_while_the_controller_is_away_is_handled_when_it_returns(
    cluster_factory: Callable[..., Cluster],
) -> None:
    """Reports queued by the agent (the crash, the respawned worker) reach the new
    controller: a failure plan without b, then b's new worker joins."""
    c = cluster_factory("--expected-nodes", "3", "--resume-grace", "5s")
    started(c, ["a", "b", "c"])
    old_b = c.events("worker_ready", node="b")[0]["pid"]
    c.kill_group(c.ctl)
    c.ctl.wait(timeout=10)
    os.kill(old_b, signal.SIGKILL)
    wait_for(lambda: "worker incarnation 2 started" in (c.tmp / "agent-b.log").read_text(), 10, "b's respawn")
    c.start_controller()
    resumed = c.wait_event("resumed", 10)
    assert sorted(resumed["back"]) == ["a", "b", "c"] and resumed["lost"] == ["b"]
    ev = c.events("node_resumed", node="b")[0]
    assert ev["incarnation"] == 2 and ev["planned_incarnation"] == 1 and not ev["same_worker"]
    assert c.events("node_failed", node="b")[0]["cause"] == "worker_lost_while_away"
    assert c.wait_event("worker_exit", 5, node="b", incarnation=1)["returncode"] == -signal.SIGKILL
    plan = c.wait_plan(5, reason="failure")
    assert plan["members"] == ["a", "c"] and plan["lost"] == ["b"]
    join = c.wait_plan(10, reason="join")
    assert join["members"] == ["a", "c", "b"] and saved_state(c)["plan"]["incarnations"]["b"] == 2
    c.wait_event("reconfigured", 5, node="a", generation=join["generation"])


@pytest.mark.timeout(90)
def test_crash_loop_is_capped_then_the_node_leaves_naming_the_error(
    cluster_factory: Callable[..., Cluster],
) -> None:
    """c's worker raises at its 3rd step in every incarnation: restarted twice with a
    doubling pause, then the node leaves, the agent exits 5 naming the error, and the
    job goes on without it."""
    c = cluster_factory("--expected-nodes", "3", nodes=("a", "b"))
    c.add_agent("c", "--env", "FAKE_CRASH_AT_STEP=3", "--max-restarts", "2", "--restart-window", "1m",
                "--respawn-delay", "300ms")
    started(c, ["a", "b", "c"])
    assert c.agents["c"].wait(timeout=60) == 5
    log_c = (c.tmp / "agent-c.log").read_text()
    assert "RuntimeError: injected crash at step 3 on node c" in log_c      # relayed stderr
    assert "crashed 3 times" in log_c and "last error: exit 1: RuntimeError: injected crash at step 3" in log_c
    leave = c.wait_event("leave", 5, node="c")
    assert leave["reason"] == "crash_loop" and "RuntimeError: injected crash at step 3" in leave["error"]
    exits = [e for e in c.events("worker_exit", node="c") if not e.get("stale")]
    assert [e["incarnation"] for e in exits] == [1, 2, 3]
    assert all(e["returncode"] == 1 and "injected crash" in e["error"] for e in exits)
    # exponential backoff: the k-th restart waits 0.3 s * 2**k
    readies = {e["incarnation"]: e["t"] for e in c.events("worker_ready", node="c")}
    assert sorted(readies) == [1, 2, 3]
    assert readies[2] - exits[0]["t"] >= 0.3 and readies[3] - exits[1]["t"] >= 0.6
    # the others keep training without c: the controller replans once c has left (the plan
    # may be written just after the leave event)
    after = wait_for(lambda: [p for p in c.events("plan") if p["t"] >= leave["t"] and "c" not in p["members"]],
                     20, f"a plan without c after its leave\n{c.debug()}")
    assert sorted(after[-1]["members"]) == ["a", "b"]
    assert "c" not in c.events("plan")[-1]["members"]
    assert c.agents["a"].poll() is None and c.agents["b"].poll() is None
    assert not c.events("node_failed", node="a") and not c.events("node_failed", node="b")


@pytest.mark.timeout(20)
def test_agent_channel_api() -> None:
    from lazarus.runtime import AgentChannel

    agent_end, worker_end = socket.socketpair()
    lost: list[AgentChannel] = []
    ch = AgentChannel(worker_end, SECRET, node_id="n0", snapshot_dir="/tmp/x", incarnation=3,
                      on_agent_lost=lost.append)
    assert (ch.node_id, ch.snapshot_dir, ch.incarnation) == ("n0", "/tmp/x", 3)
    assert ch.latest_plan() is None and not ch.stop_requested
    ch.hello({"layers": {"l": 4}, "top_k": 2})
    hello = recv_frame(agent_end, SECRET)
    assert hello["type"] == "hello" and hello["model"] == {"layers": {"l": 4}, "top_k": 2}
    with pytest.raises(TimeoutError):
        ch.wait_plan(0, timeout=0.1)
    send_frame(agent_end, SECRET, {"type": "plan", "generation": 2, "members": ["n0"]})
    assert ch.wait_plan(0, timeout=5)["generation"] == 2
    send_frame(agent_end, SECRET, {"type": "plan", "generation": 1, "members": []})  # stale: ignored
    send_frame(agent_end, SECRET, {"type": "stop", "reason": "done"})
    wait_for(lambda: ch.stop_requested, 5, "stop")
    assert ch.latest_plan()["generation"] == 2
    ch.send({"type": "progress", "step": 1})
    assert recv_frame(agent_end, SECRET)["step"] == 1
    agent_end.close()
    wait_for(lambda: lost, 5, "on_agent_lost")
    with pytest.raises(ConnectionError):
        ch.wait_plan(2, timeout=5)
    with pytest.raises(ConnectionError):
        ch.send({"type": "progress", "step": 2})
    ch.close()
    env = {k: v for k, v in os.environ.items()}
    os.environ.pop("LAZARUS_AGENT_FD", None)
    try:
        assert AgentChannel.from_env() is None
    finally:
        os.environ.clear()
        os.environ.update(env)
