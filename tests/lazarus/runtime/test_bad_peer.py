"""The agent and the controller on a bad peer, with real processes and real sockets.

A wrong secret is named on both sides (the controller answers ``auth_failed``, the agent
exits 1 within seconds saying so, and no worker starts); repeated errors from one address
are logged once per interval with a count; an agent that cannot reach the controller says
so every few seconds, never starts its worker, and exits 1 after ``--connect-timeout``;
one that lost its controller backs off (exponentially, with jitter) instead of hammering a
controller that refuses it. Plus the :class:`Backoff` and :class:`RepeatLimiter` units,
driven by a seeded random source and a fake clock.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from lazarus.runtime._backoff import Backoff, RepeatLimiter
from lazarus.runtime._wire import AUTH_FAILED_FRAME, AuthRefusedError, encode_frame, recv_frame

ROOT = Path(__file__).resolve().parents[3]
FAKE_WORKER = ROOT / "tests" / "helpers" / "workers" / "runtime_fake_worker.py"
SECRET = b"bad-peer-test-secret-0123456789"
WRONG = b"not-the-controller-secret-98765"


# ============================================================================ units


def test_backoff_grows_exponentially_to_its_cap_with_seeded_jitter() -> None:
    b = Backoff(initial=timedelta(milliseconds=100), maximum=timedelta(seconds=1), multiplier=2.0, jitter=0.5,
                rng=random.Random(42))
    twin = random.Random(42)
    ceilings = [0.0, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    got = [b.next_delay() for _ in ceilings]
    assert all(isinstance(d, timedelta) for d in got)
    assert got[0] == timedelta(0)          # attempt 0 goes at once (draws nothing)
    for d, top in zip(got[1:], ceilings[1:]):
        expected = top * (1 - 0.5 * twin.random())
        assert d.total_seconds() == pytest.approx(expected, abs=1e-6)
        assert top * 0.5 - 1e-9 <= d.total_seconds() <= top + 1e-9
    assert b.attempts == len(ceilings)
    # the same seed gives the same pauses; another seed spreads them (agents do not retry in lock-step)
    again = Backoff(rng=random.Random(42))
    assert [again.next_delay() for _ in ceilings] == got
    other = Backoff(rng=random.Random(43))
    assert [other.next_delay() for _ in ceilings][1:] != got[1:]
    # reset: the next attempt is attempt 0 again
    b.reset()
    assert b.attempts == 0 and b.next_delay() == timedelta(0)
    assert b.next_delay() <= timedelta(milliseconds=100)


def test_backoff_without_jitter_is_exact_and_huge_attempts_stay_capped() -> None:
    b = Backoff(initial=timedelta(seconds=0.5), maximum=timedelta(seconds=4), multiplier=3.0, jitter=0.0)
    assert [b.next_delay().total_seconds() for _ in range(5)] == [0.0, 0.5, 1.5, 4.0, 4.0]
    assert b.ceiling(10_000) == timedelta(seconds=4)


@pytest.mark.parametrize("kwargs, field", [
    ({"initial": 0.1}, "initial"),
    ({"maximum": timedelta(seconds=-1)}, "maximum"),
    ({"initial": timedelta(seconds=2), "maximum": timedelta(seconds=1)}, "maximum"),
    ({"multiplier": 0.5}, "multiplier"),
    ({"jitter": 1.5}, "jitter"),
    ({"jitter": True}, "jitter"),
])
def test_backoff_bad_settings_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"Backoff: {field} "):
        Backoff(**kwargs)


def test_repeat_limiter_one_line_per_key_per_interval_with_a_count() -> None:
    now = [100.0]
    lim = RepeatLimiter(timedelta(seconds=10), clock=lambda: now[0])
    assert lim.hit("192.0.2.7") is True             # the first in full
    assert [lim.hit("192.0.2.7") for _ in range(412)] == [False] * 412
    assert lim.hit("198.51.100.1") is True          # another address has its own interval
    now[0] += 9.9
    assert lim.flush() == {}                        # not ended yet
    now[0] += 0.1
    assert lim.flush() == {"192.0.2.7": (412, pytest.approx(10.0))}
    assert lim.flush() == {}                        # reopened: nothing due right after
    # the quiet address is forgotten: its next error is logged in full again; the busy
    # one stays counted (a peer that keeps failing gets one summary line per interval)
    assert lim.hit("198.51.100.1") is True
    assert lim.hit("192.0.2.7") is False
    now[0] += 10
    assert lim.flush() == {"192.0.2.7": (1, pytest.approx(10.0))}
    now[0] += 10
    assert lim.flush() == {}
    assert len(lim) == 0
    assert lim.hit("192.0.2.7") is True
    # 0 means every occurrence in full
    every = RepeatLimiter(timedelta(0), clock=lambda: now[0])
    assert all(every.hit("x") for _ in range(5)) and every.flush() == {}
    with pytest.raises(ValueError, match="interval must be"):
        RepeatLimiter(10)  # type: ignore[arg-type]


def test_auth_failed_frame_is_fixed_and_recognised_without_the_secret() -> None:
    """The refusal carries nothing about the secret: the same bytes for every secret,
    recognised by an agent with any secret, and nothing an honest MAC would produce."""
    from lazarus.runtime._wire import decode_payload

    assert len(AUTH_FAILED_FRAME) == 58 and AUTH_FAILED_FRAME[4:36] == bytes(32)
    for secret in (SECRET, WRONG, b"x" * 64):
        with pytest.raises(AuthRefusedError, match="refused our HMAC"):
            decode_payload(secret, AUTH_FAILED_FRAME[4:])


# ============================================================================ processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


class Job:
    """``lazarus controller`` and ``lazarus agent`` subprocesses in ``tmp`` (own sessions,
    SIGKILLed at the end)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.secret_file = tmp / "secret"
        self.secret_file.write_bytes(SECRET + b"\n")
        self.wrong_file = tmp / "wrong-secret"
        self.wrong_file.write_bytes(WRONG + b"\n")
        self.port = 0

    def controller(self, *extra: str, port: int = 0, name: str = "controller",
                   secret_file: Path | None = None) -> subprocess.Popen[bytes]:
        err = open(self.tmp / f"{name}.err", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "lazarus.cli", "controller", "--port", str(port), "--store-port", "0",
             "--secret-file", str(secret_file or self.secret_file), "--events", str(self.tmp / f"{name}.jsonl"),
             "--heartbeat-timeout", "5s", *extra],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=err, env=self.env(), start_new_session=True)
        self.procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("lazarus controller: listening on 127.0.0.1:"), line
        self.port = int(line.split("listening on 127.0.0.1:")[1].split(",")[0])
        return proc

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "LAZARUS_SECRET"}
        return dict(env, PYTHONPATH=str(ROOT), **extra)

    def agent(self, node: str, *extra: str, secret: Path | None = None, port: int | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """An agent running the fake worker, which notes every start in ``started-<node>``."""
        log = open(self.tmp / f"agent-{node}.log", "w")
        secret_args = ["--secret-file", str(secret or self.secret_file)] if (env or {}).get("LAZARUS_SECRET") \
            is None else []
        proc = subprocess.Popen(
            [sys.executable, "-m", "lazarus.cli", "agent", "--controller", f"127.0.0.1:{port or self.port}",
             *secret_args, "--node-id", node, "--snapshot-dir", str(self.tmp / f"shm-{node}"),
             "--heartbeat-interval", "200ms", "-v", *extra, "--", sys.executable, str(FAKE_WORKER)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=self.env(FAKE_STARTED_FILE=str(self.tmp / f"started-{node}"), **(env or {})))
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.tmp / name
        return path.read_text() if path.exists() else ""

    def events(self, name: str = "controller") -> list[dict[str, Any]]:
        path = self.tmp / f"{name}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]

    def worker_starts(self, node: str) -> list[float]:
        return [float(t) for t in self.log(f"started-{node}").split()]

    def close(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    j = Job(tmp_path)
    yield j
    j.close()


@pytest.mark.timeout(90)
def test_wrong_secret_is_named_on_both_sides_and_the_agent_exits_at_once(job: Job) -> None:
    job.controller("--protocol-error-interval", "3s")
    # one agent with the wrong secret in a file, one with it in LAZARUS_SECRET
    t0 = time.monotonic()
    by_file = job.agent("a", secret=job.wrong_file)
    rc = by_file.wait(timeout=20)
    took = time.monotonic() - t0
    text = job.log("agent-a.log")
    assert rc == 1, text
    assert took < 10, f"the agent with the wrong secret exited only after {took:.1f} s"
    assert "refused this agent's secret (HMAC mismatch)" in text, text
    assert "--secret-file PATH, or the environment variable LAZARUS_SECRET" in text
    assert f"this agent's came from --secret-file {job.wrong_file}" in text
    assert "No worker was started" in text and "lost the controller connection" not in text
    assert job.worker_starts("a") == []
    by_env = job.agent("b", env={"LAZARUS_SECRET": WRONG.decode()})
    assert by_env.wait(timeout=20) == 1
    assert "this agent's came from LAZARUS_SECRET" in job.log("agent-b.log")
    assert job.worker_starts("b") == []
    # the controller names it too, once per address per interval; the other is counted
    first = wait_for(lambda: [e for e in job.events() if e["event"] == "protocol_error"], 5, "protocol_error")
    assert len(first) == 1 and first[0]["error"] == "BadMacError" and first[0]["refused"] == "auth_failed"
    err = job.log("controller.err")
    assert "has a wrong HMAC: the peer's shared secret is not this controller's" in err
    assert f"(from --secret-file {job.secret_file})" in err
    summary = wait_for(lambda: [e for e in job.events() if e["event"] == "protocol_errors_repeated"], 10,
                       "the summary of the counted error")
    assert summary[0]["host"] == "127.0.0.1" and summary[0]["count"] == 1
    assert summary[0]["kinds"] == {"BadMacError": 1}
    wait_for(lambda: "... 1 more from 127.0.0.1 in the last 3 s" in job.log("controller.err"), 5, "summary line")
    mismatch_lines = [ln for ln in job.log("controller.err").splitlines() if "HMAC" in ln or "more from" in ln]
    assert len(mismatch_lines) <= 3, mismatch_lines
    # the controller is unharmed: an agent with the right secret registers and runs its worker
    good = job.agent("c")
    wait_for(lambda: [e for e in job.events() if e["event"] == "worker_ready" and e.get("node") == "c"], 30,
             "the good agent's worker")
    assert good.poll() is None and len(job.worker_starts("c")) == 1


@pytest.mark.timeout(90)
def test_repeated_bad_frames_from_one_address_are_logged_once_per_interval_with_a_count(job: Job) -> None:
    """An older agent (or anything else) hammering the port with a wrong secret: every
    connection is refused with the fixed auth_failed frame, and the log gets one line per
    interval with a count, not one per connection."""
    job.controller("--protocol-error-interval", "1s")
    n, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < 3.0:
        with socket.create_connection(("127.0.0.1", job.port), timeout=5) as s:
            s.sendall(encode_frame(WRONG, {"type": "register", "node": "old", "slots": 2, "incarnation": 1}))
            with pytest.raises(AuthRefusedError):
                recv_frame(s, WRONG)
        n += 1
    assert n >= 20, f"only {n} connections in 3 s"
    # a frame that is not a frame at all is counted with them (by kind)
    with socket.create_connection(("127.0.0.1", job.port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(100) == b""
    n_total = n + 1

    def accounted() -> int:
        ev = job.events()
        full = [e for e in ev if e["event"] == "protocol_error" and e["peer"].startswith("127.0.0.1:")]
        return len(full) + sum(e["count"] for e in ev if e["event"] == "protocol_errors_repeated")

    wait_for(lambda: accounted() == n_total, 10, f"all {n_total} errors accounted for")
    ev = job.events()
    full = [e for e in ev if e["event"] == "protocol_error"]
    summaries = [e for e in ev if e["event"] == "protocol_errors_repeated"]
    elapsed = time.monotonic() - t0
    # one full line, then one summary per interval while it goes on (+1: the interval timer)
    assert len(full) + len(summaries) <= elapsed / 1.0 + 2, (len(full), len(summaries), elapsed)
    assert len(full) <= 2
    assert sum(s["kinds"].get("FrameTooLargeError", 0) for s in summaries) \
        + sum(e["error"] == "FrameTooLargeError" for e in full) == 1
    lines = job.log("controller.err").splitlines()
    assert len(lines) <= len(full) + len(summaries)
    assert any("more from 127.0.0.1 in the last 1 s (BadMacError x" in ln for ln in lines), lines


@pytest.mark.timeout(60)
def test_no_controller_agent_says_it_is_trying_never_starts_the_worker_and_exits_1(job: Job) -> None:
    port = free_port()   # nothing listens there
    t0 = time.monotonic()
    agent = job.agent("a", "--connect-timeout", "8s", port=port)
    rc = agent.wait(timeout=30)
    took = time.monotonic() - t0
    text = job.log("agent-a.log")
    assert rc == 1, text
    assert 8 <= took < 16, f"exited after {took:.1f} s with --connect-timeout 8s"
    assert job.worker_starts("a") == [], "the worker started although the controller was never reached"
    assert "worker incarnation" not in text
    assert f"cannot reach the controller at 127.0.0.1:{port} yet" in text
    progress = [ln for ln in text.splitlines() if "still trying to reach the controller" in ln]
    assert len(progress) >= 1, text   # every 5 s
    assert f"127.0.0.1:{port}" in progress[0] and "attempts so far" in progress[0]
    assert "s left of --connect-timeout" in progress[0] and "Connect call failed" in progress[0]
    gave_up = [ln for ln in text.splitlines() if "gave up reaching the controller" in ln]
    assert len(gave_up) == 1 and "(--connect-timeout)" in gave_up[0] and "No worker was started" in gave_up[0]
    # the attempts back off: a handful in 8 s, not a tight loop
    n = int(gave_up[0].split(" attempt")[0].rsplit(" ", 1)[1])
    assert 5 <= n <= 20, gave_up[0]


@pytest.mark.timeout(90)
def test_worker_starts_only_once_the_controller_accepted_the_node(job: Job) -> None:
    port = free_port()
    agent = job.agent("a", "--connect-timeout", "60s", port=port)
    # the controller comes only once the agent has said it is still trying (every 5 s)
    wait_for(lambda: "still trying to reach" in job.log("agent-a.log"), 30, "the agent's progress line")
    assert agent.poll() is None and job.worker_starts("a") == []
    t_ctl = time.time()
    job.controller(port=port)
    wait_for(lambda: [e for e in job.events() if e["event"] == "worker_ready" and e.get("node") == "a"], 30,
             "the worker to start and say hello")
    starts = job.worker_starts("a")
    assert len(starts) == 1 and starts[0] >= t_ctl
    text = job.log("agent-a.log")
    assert f"cannot reach the controller at 127.0.0.1:{port} yet" in text and "still trying to reach" in text


@pytest.mark.timeout(120)
def test_reconnects_back_off_against_a_controller_that_refuses_the_secret(job: Job) -> None:
    """The controller comes back with another secret: the agent, whose worker keeps
    running, says the secret is refused and retries with growing pauses (at most 1 s,
    with jitter), not thousands of times a minute; the first controller back with the
    right secret takes it back."""
    port = free_port()
    first = job.controller(port=port, name="first")
    agent = job.agent("a", "--reconnect-timeout", "60s")
    wait_for(lambda: [e for e in job.events("first") if e["event"] == "worker_ready"], 30, "worker ready")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    wrong = job.controller("--protocol-error-interval", "0", port=port, name="wrong", secret_file=job.wrong_file)
    t_wrong = time.monotonic()
    time.sleep(6)
    refusals = [e for e in job.events("wrong") if e["event"] == "protocol_error"]
    window = time.monotonic() - t_wrong
    assert refusals and all(e["refused"] == "auth_failed" for e in refusals)
    # attempts at 0, 0.1, 0.2, 0.4, 0.8 s and then every 0.5-1 s: at most ~12 in 6 s
    assert len(refusals) <= 5 + window / 0.5, f"{len(refusals)} attempts in {window:.1f} s"
    ts = [e["t"] for e in refusals]
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    assert gaps and max(gaps) <= 1.5 and sum(g >= 0.45 for g in gaps) >= len(gaps) // 2, gaps
    text = job.log("agent-a.log")
    assert text.count("refused this agent's secret (HMAC mismatch)") == 1, text
    assert "The worker keeps running" in text
    assert agent.poll() is None and len(job.worker_starts("a")) == 1
    # the controller restarted with the right secret (its state: the job resumes) takes it back
    os.killpg(wrong.pid, signal.SIGKILL)
    wrong.wait(timeout=10)
    job.controller(port=port, name="first")
    wait_for(lambda: [e for e in job.events("first") if e["event"] == "node_resumed" and e["node"] == "a"], 20,
             "the agent back with its running worker")
    assert agent.poll() is None and len(job.worker_starts("a")) == 1


@pytest.mark.timeout(60)
def test_a_peer_that_closes_every_registration_is_not_hammered(job: Job) -> None:
    """What a controller older than the agent does on a wrong secret (and what anything
    else on that port may do): accept, read the registration, close. Each such connection
    counts as a failed attempt, so the pauses grow; the agent exits 1 after
    --connect-timeout hinting at the secret, and never starts its worker."""
    import threading

    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    seen: list[float] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                seen.append(time.monotonic())
                conn.settimeout(2)
                try:
                    conn.recv(65536)
                except OSError:
                    pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        agent = job.agent("a", "--connect-timeout", "5s", port=int(srv.getsockname()[1]))
        assert agent.wait(timeout=30) == 1
    finally:
        stop.set()
        t.join(timeout=5)
        srv.close()
    text = job.log("agent-a.log")
    assert job.worker_starts("a") == [] and "worker incarnation" not in text
    assert 3 <= len(seen) <= 15, f"{len(seen)} connections in 5 s"
    gave_up = [ln for ln in text.splitlines() if "gave up reaching the controller" in ln]
    assert len(gave_up) == 1, text
    assert "closed the connection without answering the registration" in gave_up[0]
    assert "Does it have this agent's secret (--secret-file PATH or LAZARUS_SECRET" in gave_up[0]
