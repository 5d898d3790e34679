"""An agent's answer to the controller's ``probe``: which of the given peers it cannot reach.

The controller sends ``{"type": "probe", "generation": g, "targets": {node: [host, port]},
"timeout_s": t}`` (each member's published address: its worker's rendezvous store) after a
collective error; the agent tries a TCP connect to each (closed at once) within ``t`` and answers
``{"type": "probe_result", "generation": g, "unreachable": [...]}``. From the same network
namespace as its workers, so what it cannot reach they cannot either. No torch.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from .._wire import MalformedMessageError

__all__ = ["parse_targets", "unreachable"]


def parse_targets(msg: dict[str, Any], *, exclude: str) -> tuple[dict[str, tuple[str, int]], float]:
    """The probe's ``targets`` without this node, and its timeout (0.05-10 s);
    MalformedMessageError naming the field."""
    timeout = msg.get("timeout_s")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0.05 <= timeout <= 10:
        raise MalformedMessageError(f"probe: field 'timeout_s' must be seconds in [0.05, 10], got {timeout!r}")
    targets = msg.get("targets")
    if not isinstance(targets, dict):
        raise MalformedMessageError("probe: field 'targets' must be an object of node -> [host, port]")
    out = {}
    for node, addr in targets.items():
        if (not isinstance(addr, list) or len(addr) != 2 or not isinstance(addr[0], str)
                or not isinstance(addr[1], int) or isinstance(addr[1], bool) or not 0 < addr[1] < 65536):
            raise MalformedMessageError(f"probe: target {node!r} must be [host, port], got {addr!r}")
        if node != exclude:
            out[str(node)] = (addr[0], addr[1])
    return out, float(timeout)


async def unreachable(targets: dict[str, tuple[str, int]], timeout: float) -> list[str]:
    """The nodes of ``targets`` a TCP connect does not reach within ``timeout`` seconds."""

    async def one(node: str, host: str, port: int) -> str | None:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except (OSError, asyncio.TimeoutError):
            return node
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
        return None

    found = await asyncio.gather(*(one(n, h, p) for n, (h, p) in targets.items()))
    return sorted(n for n in found if n is not None)
