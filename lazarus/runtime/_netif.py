"""Which network interface holds an address, and the socket settings a worker gets from it.

A node's agent advertises one address: the rendezvous store its worker hosts, and the
address its peers reach it at (``AgentConfig.store_host``: ``--advertise-host``, else this
machine's address on the route to the controller). gloo and NCCL do not learn it from the
store: unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` say otherwise, gloo binds to
the address the *hostname* resolves to, which on many hosts (``127.0.1.1`` on Debian and
Ubuntu, ``127.0.0.1`` in many containers) is loopback: every peer is then told to connect
to ``127.0.0.1`` and the group cannot form across hosts ("Gloo connectFullMesh failed ...
remote=[127.0.0.1]"). :func:`socket_env` names the interface holding the advertised address
for both, unless the user set them.

No dependency and no torch (the agent imports this): the interfaces and their addresses
come from ``ip -o addr show`` where iproute2 is installed, else from the kernel directly
(``SIOCGIFADDR`` per interface for IPv4, ``/proc/net/if_inet6`` for IPv6).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import shutil
import socket
import struct
import subprocess
from typing import Mapping

__all__ = ["GLOO_IFNAME", "NCCL_IFNAME", "interface_addresses", "interface_of", "socket_env"]

log = logging.getLogger("lazarus.agent")

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME = "NCCL_SOCKET_IFNAME"

_SIOCGIFADDR = 0x8915
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _from_ip_command() -> list[tuple[str, _Address]] | None:
    """``(interface, address)`` of every address ``ip -o addr show`` lists; None without
    iproute2 (or when it fails)."""
    ip = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip")
                                     if shutil.which(p)), None)
    if ip is None:
        return None
    try:
        out = subprocess.run([ip, "-o", "addr", "show"], capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = []
    for line in out.splitlines():
        # "2: eth0    inet 192.0.2.2/24 brd ... scope global eth0\ ..."
        parts = line.split()
        if len(parts) < 4 or parts[2] not in ("inet", "inet6"):
            continue
        name = parts[1].split("@", 1)[0]
        try:
            found.append((name, ipaddress.ip_address(parts[3].split("/", 1)[0].split("%", 1)[0])))
        except ValueError:
            continue
    return found


def _from_kernel() -> list[tuple[str, _Address]]:
    """The same from the kernel: each interface's (primary) IPv4 address by ``SIOCGIFADDR``,
    its IPv6 addresses from ``/proc/net/if_inet6``."""
    found: list[tuple[str, _Address]] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
            except OSError:   # no IPv4 address
                continue
            found.append((name, ipaddress.IPv4Address(res[20:24])))
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) == 6:
                    found.append((fields[5], ipaddress.IPv6Address(int(fields[0], 16))))
    except OSError:
        pass
    return found


def interface_addresses() -> list[tuple[str, _Address]]:
    """``(interface, address)`` for every address of this machine (this network namespace)."""
    listed = _from_ip_command()
    return listed if listed is not None else _from_kernel()


def _resolve(address: str) -> _Address | None:
    try:
        return ipaddress.ip_address(address.strip("[]").split("%", 1)[0])
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError, ValueError):
        return None


def interface_of(address: str, addresses: list[tuple[str, _Address]] | None = None) -> str | None:
    """The interface holding ``address`` (an IP address or a name resolving to one), None
    when no interface of this machine does. Any loopback address (``127.0.1.1`` included)
    is the loopback interface's."""
    ip = _resolve(address)
    if ip is None:
        return None
    table = interface_addresses() if addresses is None else addresses
    for name, have in table:
        if have == ip:
            return name
    if ip.is_loopback:
        for name, have in table:
            if have.is_loopback:
                return name
    return None


def socket_env(address: str, environ: Mapping[str, str], *, where: str = "-") -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` for a worker whose node advertises
    ``address``: the interface holding it (NCCL's as ``=name``, an exact match rather than
    its default prefix match), each only when ``environ`` does not set it already. Empty,
    with a warning, when no interface holds the address (the libraries' own choice stays)."""
    wanted = [v for v in (GLOO_IFNAME, NCCL_IFNAME) if not environ.get(v)]
    if not wanted:
        return {}
    name = interface_of(address)
    if name is None:
        log.warning("node %s step -: no network interface of this machine holds the advertised address %r; "
                    "gloo and NCCL choose their own (set %s / %s, or --advertise-host an address of this machine)",
                    where, address, GLOO_IFNAME, NCCL_IFNAME)
        return {}
    out = {GLOO_IFNAME: name, NCCL_IFNAME: "=" + name}
    return {k: v for k, v in out.items() if k in wanted}
