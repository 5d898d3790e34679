"""examples.netns_cluster's network on its own, with plain TCP connects between hosts: each
fault cuts exactly what it says (one host, one direction), heal undoes it, a flap goes down
and up, and nothing is left behind (namespaces of a dead run are found and removed).
Needs root, ``ip netns`` and nftables; skips, saying which is missing, elsewhere."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta

import pytest

from examples.netns_cluster import PREFIX, NetnsNetwork, unavailable

_WHY = unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"needs network namespaces: {_WHY}")

PORT = 7070
_SERVER = ("import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
           f"s.bind(('0.0.0.0', {PORT})); s.listen(64)\n"
           "while True: s.accept()[0].close()")
_CLIENT = ("import socket, sys\nfor a in sys.argv[1:]:\n"
           f"    try: socket.create_connection((a, {PORT}), timeout=0.4).close(); print('ok', end=' ')\n"
           "    except OSError: print('no', end=' ')")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.timeout(120)
def test_faults_cut_what_they_say_and_heal_undoes_them() -> None:
    with NetnsNetwork() as net:
        hosts = ["controller", "a", "b", "c"]
        for h in hosts:
            net.add_host(h)
        servers = [subprocess.Popen(net.wrap(h, [sys.executable, "-c", _SERVER])) for h in hosts]
        try:
            def reach(src: str) -> dict[str, bool]:
                dst = [h for h in hosts if h != src]
                out = net.run(src, [sys.executable, "-c", _CLIENT, *[net.address(h) for h in dst]],
                              capture_output=True, text=True, timeout=30).stdout.split()
                return dict(zip(dst, [x == "ok" for x in out]))

            time.sleep(0.5)
            assert all(reach("a").values()) and all(reach("b").values())
            net.partition("a")
            assert not any(reach("a").values()) and reach("b") == {"controller": True, "a": False, "c": True}
            net.heal("a")
            net.cut("a", "controller")
            assert reach("a") == {"controller": False, "b": True, "c": True}
            assert reach("controller") == {"a": False, "b": True, "c": True}
            net.heal("a")
            net.cut("a", "peers")
            assert reach("a") == {"controller": True, "b": False, "c": False}
            net.heal("a")
            net.cut("a", "b", direction="out")     # a's packets to b vanish: no connect either way
            assert reach("a")["b"] is False and reach("a")["c"] is True and reach("b")["a"] is False
            net.heal("a")
            assert all(reach("a").values())
            net.flap("a", timedelta(seconds=0.8))
            seen = set()
            for _ in range(8):
                seen.add(reach("b")["a"])
                time.sleep(0.3)
            assert seen == {True, False}, "the flapping link was never down, or never up"
            net.heal("a")
            time.sleep(0.2)
            assert all(reach("a").values())
        finally:
            for s in servers:
                s.kill()
                s.wait()
    assert net.prefix not in _namespaces()


def test_leftovers_of_a_dead_run_are_removed() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"{PREFIX}{dead.pid}-0-sw"
    subprocess.run(["ip", "netns", "add", name], check=True)
    assert name in NetnsNetwork.remove_leftovers()
    assert name not in _namespaces()


def test_bad_arguments_name_the_field() -> None:
    with NetnsNetwork() as net:
        net.add_host("a")
        with pytest.raises(ValueError, match="direction must be"):
            net.cut("a", "controller", direction="sideways")
        with pytest.raises(ValueError, match="no host 'zz'"):
            net.partition("zz")
        with pytest.raises(ValueError, match="host name must match"):
            net.add_host("Bad Name")
        with pytest.raises(ValueError, match="period must be a positive timedelta"):
            net.flap("a", 1.0)  # type: ignore[arg-type]
