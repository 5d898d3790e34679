"""The controller with many agents (issue 43 item 6; ``make bench-control`` measures it).

A controller in a thread, real sockets: a blocked event loop does not make it take every
node for silent; a thousand-agent registration storm finds the listen queue long enough;
a plan goes to every member encoded once.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from lazarus.runtime import Controller, ControllerConfig
from lazarus.runtime._wire import recv_frame, send_frame
from lazarus.runtime.controller import _controller

SECRET = b"controller-scale-secret-0123456789"


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[tuple[Controller, Path]]:
    events = tmp_path / "events.jsonl"
    cfg = ControllerConfig(secret=SECRET, port=0, store_port=0, heartbeat_timeout=timedelta(seconds=1),
                           events_path=events, expected_nodes=8)
    ctl = Controller(cfg)
    ctl.start_in_thread()
    yield ctl, events
    ctl.stop()


def _register(port: int, node: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    send_frame(sock, SECRET, {"type": "register", "node": node, "slots": 2, "incarnation": 1,
                              "pid": os.getpid(), "nproc": 1})
    assert recv_frame(sock, SECRET)["type"] == "registered"
    return sock


def test_blocked_loop_does_not_take_heartbeating_nodes_for_silent(controller: tuple[Controller, Path]) -> None:
    """The loop blocked for longer than the heartbeat timeout (a plan computed for a large
    cluster does that) while the node kept sending heartbeats: the node is alive. Before
    the fix, the watchdog's round ran before the heartbeats queued meanwhile were read,
    and declared it dead."""
    ctl, events = controller
    sock = _register(ctl.port or 0, "n0")
    stop, beating = threading.Event(), threading.Event()
    beating.set()

    def beat() -> None:   # every 0.05 s while ``beating``
        while not stop.is_set():
            if beating.wait(0.05):
                send_frame(sock, SECRET, {"type": "heartbeat", "node": "n0", "worker_alive": True, "step": None})
                time.sleep(0.05)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        time.sleep(0.5)
        loop = ctl._loop
        assert loop is not None

        def long_block() -> None:
            beating.set()            # heartbeats again, piling up in the socket meanwhile
            time.sleep(2.5)          # > heartbeat_timeout

        def short_block() -> None:
            time.sleep(0.4)          # a gap in the heartbeats (< the timeout); the watchdog's
            loop.call_at(0, long_block)   # timer falls due, and runs right after the long block

        beating.clear()
        time.sleep(0.1)              # the last heartbeat was read
        loop.call_soon_threadsafe(short_block)
        time.sleep(4.0)
    finally:
        stop.set()
        beating.set()
        beater.join(5)
    ev = _events(events)
    gone = [e for e in ev if e["event"] in ("node_left", "node_failed") and e.get("node") == "n0"]
    assert not gone, f"a node that kept sending heartbeats was taken for silent: {gone}"
    assert any(e["event"] == "controller_blocked" and e["blocked_s"] >= 2.0 for e in ev), \
        [e["event"] for e in ev]
    sock.close()


def test_registration_storm_finds_room_in_the_listen_queue(controller: tuple[Controller, Path]) -> None:
    """600 agents connect while the controller's loop is busy (as when a thousand register
    at once): the kernel completes every handshake without waiting for accept(). With
    asyncio's default backlog (100) the others' SYNs are dropped and retried a second
    later or more."""
    ctl, _ = controller
    assert ctl._loop is not None
    ctl._loop.call_soon_threadsafe(time.sleep, 2.0)
    time.sleep(0.2)
    sel = selectors.DefaultSelector()
    socks = []
    for _ in range(600):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", ctl.port or 0))
        sel.register(s, selectors.EVENT_WRITE)
        socks.append(s)
    connected = 0
    deadline = time.monotonic() + 0.8      # the loop is still blocked: only the kernel answers
    while connected < len(socks) and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.05):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            sel.unregister(s)
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                connected += 1
    for s in socks:
        s.close()
    sel.close()
    assert connected == len(socks), f"only {connected} of {len(socks)} connections completed within 0.8 s"


def test_a_plan_is_encoded_once_for_all_members(controller: tuple[Controller, Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Encoding a plan (JSON + HMAC) per member made sending it O(N x plan size), and a
    plan grows with N: 1,024 members took seconds. Every member gets the same frame."""
    ctl, _ = controller
    encoded: list[str] = []
    real = _controller.encode_frame

    def counting(secret: bytes, msg: dict[str, Any]) -> bytes:
        encoded.append(msg["type"])
        return real(secret, msg)

    monkeypatch.setattr(_controller, "encode_frame", counting)
    socks = [_register(ctl.port or 0, f"n{i}") for i in range(8)]
    for i, s in enumerate(socks):
        send_frame(s, SECRET, {"type": "worker_ready", "node": f"n{i}", "incarnation": 1,
                               "model": {"layers": {"moe.0": 8}, "top_k": 2}, "pid": os.getpid()})
    frames = []
    for s in socks:
        msg = recv_frame(s, SECRET, 1 << 20)
        assert msg["type"] == "plan" and len(msg["members"]) == 8
        frames.append(json.dumps(msg, sort_keys=True))
        s.close()
    assert len(set(frames)) == 1
    assert encoded.count("plan") == 1, encoded


def test_stats_request_reports_handling_times_and_loop_lag(controller: tuple[Controller, Path]) -> None:
    ctl, _ = controller
    sock = _register(ctl.port or 0, "n0")
    for _ in range(5):
        send_frame(sock, SECRET, {"type": "heartbeat", "node": "n0", "worker_alive": True, "step": None})
    time.sleep(0.6)   # two rounds of the heartbeat watchdog: loop lag samples
    send_frame(sock, SECRET, {"type": "stats", "node": "n0", "reset": True})
    st = recv_frame(sock, SECRET)
    assert st["type"] == "stats" and st["messages"] == 5
    assert 0 <= st["handle_ms_p50"] <= st["handle_ms_p99"] <= st["handle_ms_max"] < 1000
    assert st["lag_samples"] >= 2 and 0 <= st["loop_lag_ms_p99"] < 1000
    send_frame(sock, SECRET, {"type": "stats", "node": "n0"})
    again = recv_frame(sock, SECRET)
    assert again["messages"] == 1 and again["lag_samples"] <= 1   # since the reset: the first request
    sock.close()


def test_coalesced_state_writes_leave_the_loop_and_stay_ordered(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A coalesced state write (routing, steps) is fsynced by a thread: a slow disk does not
    hold the event loop (every agent's messages) for it. A write due at once (a plan) after
    it waits for it and wins: the file never goes back to an older state."""
    from lazarus.runtime.controller import _state
    from lazarus.runtime.controller._resume import StateSaver

    real_fsync = _state.os.fsync

    def slow_fsync(fd: int) -> None:   # a busy disk
        time.sleep(0.5)
        real_fsync(fd)

    monkeypatch.setattr(_state.os, "fsync", slow_fsync)
    due: list[Any] = []
    state = {"generation": 1}
    saver = StateSaver(tmp_path, lambda: dict(state), call_later=lambda d, cb, *a: due.append((cb, a)) or _Timer(),
                       on_error=lambda exc: pytest.fail(f"state write failed: {exc}"))
    saver.save()                    # coalesced: a timer
    assert saver.pending and len(due) == 1
    cb, args = due.pop()
    t0 = time.monotonic()
    cb(*args)                       # the timer fires on the loop
    assert time.monotonic() - t0 < 0.3, "the loop waited for the coalesced write's fsync"
    state["generation"] = 2
    saver.save(now=True)            # a plan: written before it returns, after the older write
    assert json.loads((tmp_path / _state.STATE_FILE).read_text())["generation"] == 2
    for writer in [t for t in threading.enumerate() if t.name == "lazarus-state"]:
        writer.join(10)             # the coalesced write has ended: nothing older lands later
        assert not writer.is_alive()
    assert json.loads((tmp_path / _state.STATE_FILE).read_text())["generation"] == 2


class _Timer:
    def cancel(self) -> None:
        pass


def test_the_controller_process_freezes_what_it_imported_out_of_the_gc(tmp_path: Path) -> None:
    """``lazarus controller`` (its own process): what exists once it serves (torch's
    modules: ~170,000 objects) is frozen out of the cyclic GC, whose full collections
    walked it all with the loop blocked (100-240 ms at 1,024 agents, measured)."""
    import subprocess
    import sys

    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "lazarus.cli", "controller", "--port", "0", "--store-port", "0",
                             "--secret-file", str(secret)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        port = int(line.split("listening on 127.0.0.1:")[1].split(",")[0])
        sock = _register(port, "n0")
        send_frame(sock, SECRET, {"type": "stats", "node": "n0"})
        st = recv_frame(sock, SECRET)
        assert st["type"] == "stats" and st["gc_frozen"] > 50_000, st
        sock.close()
    finally:
        proc.terminate()
        proc.wait(30)
