"""Hosts on a real network on one machine: each in its own Linux network namespace, with its
own address on one bridge, and the faults a real network has.

Used by the multi-host tests (``tests/lazarus/runtime/test_netns.py``) and meant for the soak
and the demo as well, hence here beside :mod:`examples.local_cluster` (which benchmarks and
examples already import) rather than under ``tests/``. A :class:`NetnsNetwork` is given to
:class:`~examples.local_cluster.LocalCluster` (``network=``): the controller and every node
then run in a namespace of their own (``ip netns exec``), the controller bound to its
address, and nothing tells gloo or NCCL which interface to use: the product must find it.

Layout (names ``mocl-<pid>-<n>``, so that :meth:`NetnsNetwork.remove_leftovers` can find the
namespaces of a run that died): one *switch* namespace holding the bridge ``br0`` and no
address; per host a namespace whose ``eth0`` (one end of a veth pair) has an address in
``192.0.2.0/24`` (TEST-NET-1), the other end a port ``p-<host>`` of the bridge. Nothing is
added to the machine's own namespace, so its routes (which may use the same range) stay as
they are.

Faults, all undone by :meth:`NetnsNetwork.heal`:

* :meth:`~NetnsNetwork.partition`: the host's switch port goes down (``ip link set ... down``),
  as when its cable or switch port fails: its packets vanish, nobody is told;
* :meth:`~NetnsNetwork.cut`: nft rules in the host's namespace drop what goes to (``out``)
  and/or comes from (``in``) the controller, the storage endpoint, its peers or one host;
* :meth:`~NetnsNetwork.flap`: the switch port goes down and up every ``period``.

Needs root, iproute2 and (for :meth:`~NetnsNetwork.cut`) nftables; :func:`unavailable` says
what is missing.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Sequence

__all__ = ["NetnsNetwork", "NetnsS3", "PREFIX", "unavailable"]

#: every namespace this module creates starts with it
PREFIX = "mocl-"
SUBNET = ipaddress.ip_network("192.0.2.0/24")
_TABLE = "mocl"
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,11}")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


def unavailable(*, need_nft: bool = True) -> str | None:
    """Why a :class:`NetnsNetwork` cannot be built here (None when it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (os.geteuid() != 0)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if need_nft and shutil.which("nft") is None:
        return "nftables' `nft` is not installed (make test installs it where apt-get is)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` fails here: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NetnsNetwork:
    """A bridge and one namespace per host. ``with NetnsNetwork() as net:`` removes them all
    at the end (also at interpreter exit, and those of dead runs when a new one starts)."""

    def __init__(self, prefix: str | None = None) -> None:
        NetnsNetwork.remove_leftovers()
        self.prefix = prefix or f"{PREFIX}{os.getpid()}-{id(self) % 10000}"
        self.switch = f"{self.prefix}-sw"
        self.hosts: dict[str, str] = {}        # host -> address
        self._ns: dict[str, str] = {}          # host -> namespace
        self._flaps: dict[str, threading.Event] = {}
        self._closed = False
        self._next = 11
        _ip("netns", "add", self.switch)
        atexit.register(self.close)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    # -- hosts ---------------------------------------------------------------------------------
    def add_host(self, name: str) -> str:
        """A new host ``name`` (or the existing one): its namespace, its link to the bridge
        and its address, which is returned."""
        if name in self.hosts:
            return self.hosts[name]
        if not _NAME.fullmatch(name):
            raise ValueError(f"host name must match {_NAME.pattern} (a switch port is named after it), got {name!r}")
        ns = f"{self.prefix}-{len(self._ns)}"
        addr = str(SUBNET[self._next])
        self._next += 1
        _ip("netns", "add", ns)
        self._ns[name] = ns
        _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p-{name}", "netns", self.switch)
        _ip("-n", self.switch, "link", "set", f"p-{name}", "master", "br0")
        _ip("-n", self.switch, "link", "set", f"p-{name}", "up")
        _ip("-n", ns, "addr", "add", f"{addr}/{SUBNET.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.hosts[name] = addr
        return addr

    def namespace(self, host: str) -> str:
        return self._ns[self._check(host)]

    def address(self, host: str) -> str:
        return self.hosts[self._check(host)]

    def wrap(self, host: str, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run on ``host`` (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.namespace(host), *cmd]

    def run(self, host: str, cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``cmd`` on ``host`` to the end (``subprocess.run`` arguments)."""
        return subprocess.run(self.wrap(host, cmd), **kwargs)

    def _check(self, host: str) -> str:
        if host not in self.hosts:
            raise ValueError(f"no host {host!r} on this network; hosts: {sorted(self.hosts)}")
        return host

    # -- faults --------------------------------------------------------------------------------
    def partition(self, host: str) -> float:
        """Take ``host``'s switch port down: it reaches nothing, nothing reaches it. Returns when."""
        self._check(host)
        t = time.time()
        _ip("-n", self.switch, "link", "set", f"p-{host}", "down")
        return t

    def cut(self, host: str, from_: str, direction: str = "both") -> float:
        """Drop ``host``'s traffic with ``from_`` (``"controller"``, ``"storage"``, ``"peers"``
        (every other host but those two) or a host's name): ``direction`` ``"out"`` what it
        sends them, ``"in"`` what it receives from them, ``"both"``; silently, as a dead
        link (connects time out). Returns when."""
        self._check(host)
        if direction not in ("both", "in", "out"):
            raise ValueError(f"direction must be 'both', 'in' or 'out', got {direction!r}")
        if from_ == "peers":
            others = [h for h in self.hosts if h not in (host, "controller", "storage")]
        else:
            others = [self._check(from_)]
        if not others or host in others:
            raise ValueError(f"cut {host!r} from {from_!r}: nothing to cut from")
        addrs = ", ".join(self.hosts[h] for h in others)
        rules = [f"table inet {_TABLE} {{",
                 "  chain in { type filter hook input priority 0; policy accept; }",
                 "  chain out { type filter hook output priority 0; policy accept; }", "}"]
        if direction in ("both", "in"):
            rules.append(f"add rule inet {_TABLE} in ip saddr {{ {addrs} }} drop")
        if direction in ("both", "out"):
            rules.append(f"add rule inet {_TABLE} out ip daddr {{ {addrs} }} drop")
        t = time.time()
        r = self.run(host, ["nft", "-f", "-"], input="\n".join(rules) + "\n", capture_output=True, text=True,
                     timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"nft on {host}: {r.stderr.strip()}")
        return t

    def flap(self, host: str, period: timedelta, duration: timedelta | None = None, *,
             up_to: timedelta | None = None, seed: int = 0) -> list[tuple[float, bool]]:
        """Take ``host``'s switch port down and up every ``period`` (for ``duration``, or
        until :meth:`heal`), in a background thread; with ``up_to``, each wait is drawn
        uniformly from [``period``, ``up_to``] by a ``random.Random(seed)``. Returns the list
        the thread appends each change to (``(time.time(), up)``); the link is up at the end."""
        self._check(host)
        if not isinstance(period, timedelta) or period <= timedelta(0):
            raise ValueError(f"period must be a positive timedelta, got {period!r}")
        if up_to is not None and (not isinstance(up_to, timedelta) or up_to < period):
            raise ValueError(f"up_to must be a timedelta >= period ({period}), got {up_to!r}")
        stop = self._flaps.pop(host, None)
        if stop is not None:
            stop.set()
        stop = self._flaps[host] = threading.Event()
        end = None if duration is None else time.monotonic() + duration.total_seconds()
        rng = random.Random(seed)
        lo, hi = period.total_seconds(), (up_to or period).total_seconds()
        changes: list[tuple[float, bool]] = []

        def run() -> None:
            up = True
            while not stop.wait(rng.uniform(lo, hi)) and (end is None or time.monotonic() < end):
                up = not up
                _ip("-n", self.switch, "link", "set", f"p-{host}", "up" if up else "down", check=False)
                changes.append((time.time(), up))
            _ip("-n", self.switch, "link", "set", f"p-{host}", "up", check=False)
            if not up:
                changes.append((time.time(), True))

        threading.Thread(target=run, name=f"flap-{host}", daemon=True).start()
        return changes

    def heal(self, host: str) -> float:
        """Undo every fault of ``host``: flapping stops, its port is up, its nft rules gone."""
        self._check(host)
        stop = self._flaps.pop(host, None)
        if stop is not None:
            stop.set()
        t = time.time()
        _ip("-n", self.switch, "link", "set", f"p-{host}", "up")
        if shutil.which("nft") is not None:
            self.run(host, ["nft", "delete", "table", "inet", _TABLE], capture_output=True, timeout=30)
        self._wait_up(host)
        return t

    def _wait_up(self, host: str, timeout: float = 10.0) -> None:
        """Until both ends of ``host``'s link carry traffic again; its neighbour entries that
        failed while it was down are forgotten (else the first packets wait for them to expire)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            a = _ip("-n", self._ns[host], "-o", "link", "show", "eth0", check=False).stdout
            b = _ip("-n", self.switch, "-o", "link", "show", f"p-{host}", check=False).stdout
            if "state UP" in a and "state UP" in b:
                break
            time.sleep(0.02)
        _ip("-n", self._ns[host], "neigh", "flush", "all", check=False)

    # -- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every namespace (their veths and the bridge go with them)."""
        if self._closed:
            return
        self._closed = True
        for stop in self._flaps.values():
            stop.set()
        for ns in [*self._ns.values(), self.switch]:
            _ip("netns", "del", ns, check=False)
        atexit.unregister(self.close)

    def __enter__(self) -> "NetnsNetwork":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @staticmethod
    def remove_leftovers() -> list[str]:
        """Delete the namespaces of runs whose process is gone (``mocl-<pid>-...``); returns them."""
        r = _ip("netns", "list", check=False)
        gone = []
        for line in r.stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-.*", name)
            if m and not _pid_alive(int(m.group(1))):
                _ip("netns", "del", name, check=False)
                gone.append(name)
        return gone


class NetnsS3:
    """moto's S3 server on host ``storage`` of ``network``. :attr:`env` points a worker at it
    (``AWS_ENDPOINT_URL`` ...); :meth:`run` runs a command on the storage host, where the
    endpoint is also reachable on loopback (``moc verify`` while a node is cut from it)."""

    PORT = 5000

    def __init__(self, network: NetnsNetwork, *, log: str | os.PathLike[str] | None = None) -> None:
        self.network = network
        self.address = network.add_host("storage")
        creds = {"AWS_ACCESS_KEY_ID": "mocl", "AWS_SECRET_ACCESS_KEY": "mocl", "AWS_REGION": "us-east-1"}
        self.url = f"http://{self.address}:{self.PORT}"
        self.env = {"AWS_ENDPOINT_URL": self.url, **creds}
        self.local_env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.PORT}", **creds}
        out = open(log, "a") if log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(network.wrap("storage", [sys.executable, "-m", "moto.server", "-H", "0.0.0.0",
                                                              "-p", str(self.PORT)]),
                                     stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while self._call("import urllib.request as u; u.urlopen(u.Request('http://127.0.0.1:%d/moto-api/'), "
                         "timeout=2)" % self.PORT).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"moto did not start on the storage host (exit {self.proc.returncode})")
            time.sleep(0.3)

    def _call(self, code: str) -> subprocess.CompletedProcess:
        return self.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)

    def run(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        env = dict(os.environ, **self.local_env)
        return self.network.run("storage", cmd, env=env, **kwargs)

    def make_bucket(self, name: str) -> None:
        r = self._call("import boto3; boto3.client('s3').create_bucket(Bucket=%r)" % name)
        if r.returncode != 0:
            raise RuntimeError(f"cannot create bucket {name!r}: {r.stderr[-500:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
