"""lazarus.runtime._netif: the interface holding the address a node advertises, found from
``ip -o addr`` and from the kernel (ioctl, /proc), and the GLOO/NCCL socket settings a
worker gets from it. The namespace case runs in a real network namespace (root only)."""

from __future__ import annotations

import ipaddress
import logging
import subprocess
import sys

import pytest

from lazarus.runtime import _netif
from lazarus.runtime._netif import GLOO_IFNAME, NCCL_IFNAME, interface_of, socket_env

LOOPBACK = next(name for name, addr in _netif._from_kernel() if addr == ipaddress.ip_address("127.0.0.1"))


@pytest.mark.parametrize("source", ["ip", "kernel"])
def test_loopback_addresses_are_the_loopback_interface(source: str) -> None:
    table = _netif._from_ip_command() if source == "ip" else _netif._from_kernel()
    if table is None:
        pytest.skip("iproute2's `ip` is not installed")
    assert interface_of("127.0.0.1", table) == LOOPBACK
    assert interface_of("127.0.1.1", table) == LOOPBACK   # Debian's hostname address: not on lo itself
    assert interface_of("localhost", table) == LOOPBACK   # a name resolves first
    assert interface_of("198.51.100.77", table) is None    # TEST-NET-2: on no interface here
    assert interface_of("no-such-host.invalid", table) is None


def test_both_sources_agree_on_every_ipv4_primary_address() -> None:
    listed = _netif._from_ip_command()
    if listed is None:
        pytest.skip("iproute2's `ip` is not installed")
    for name, addr in _netif._from_kernel():
        if addr.version == 4:
            assert interface_of(str(addr), listed) == name


def test_socket_env_names_the_interface_and_keeps_what_the_user_set(caplog: pytest.LogCaptureFixture) -> None:
    assert socket_env("127.0.0.1", {}) == {GLOO_IFNAME: LOOPBACK, NCCL_IFNAME: "=" + LOOPBACK}
    assert socket_env("127.0.0.1", {GLOO_IFNAME: "eth7"}) == {NCCL_IFNAME: "=" + LOOPBACK}
    assert socket_env("127.0.0.1", {GLOO_IFNAME: "eth7", NCCL_IFNAME: "eth7"}) == {}
    with caplog.at_level(logging.WARNING, logger="lazarus.agent"):
        assert socket_env("198.51.100.77", {}, where="n4") == {}
    assert "node n4" in caplog.text and "198.51.100.77" in caplog.text and GLOO_IFNAME in caplog.text


@pytest.mark.timeout(60)
def test_in_a_network_namespace_the_address_is_found_on_its_veth() -> None:
    from examples.netns_cluster import NetnsNetwork, unavailable

    why = unavailable(need_nft=False)
    if why is not None:
        pytest.skip(f"needs a network namespace: {why}")
    with NetnsNetwork() as net:
        addr = net.add_host("h1")
        code = ("import sys; from lazarus.runtime import _netif as n; a = sys.argv[1]; "
                "print(n.interface_of(a, n._from_ip_command()), n.interface_of(a, n._from_kernel()), "
                "n.socket_env(a, {}))")
        r = net.run("h1", [sys.executable, "-c", code, addr], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split(" ", 2)[:2] == ["eth0", "eth0"]
        assert "'GLOO_SOCKET_IFNAME': 'eth0'" in r.stdout and "'NCCL_SOCKET_IFNAME': '=eth0'" in r.stdout
    assert net.namespace("h1") not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                      text=True).stdout
