"""Which node (failure domain) each rank runs on.

A node failure takes every rank on it at once, so a snapshot copy meant to outlive the
holders of a unit must sit on a rank of *another* node. The caller may name its node
(:class:`~moc.CheckpointManager`'s ``node`` argument; the Lazarus runtime passes its node
id). Otherwise it is derived from the launcher's environment:

* ``LOCAL_WORLD_SIZE`` > 1 (torchrun, ``lazarus agent --nproc-per-node``): the ranks of
  one host share a node, ``<hostname>`` (``<hostname>/<GROUP_RANK>`` when torchrun's
  ``GROUP_RANK`` is set, so that several simulated nodes on one host stay apart);
* otherwise every rank is its own node (one process per machine, or a launcher that says
  nothing): the behaviour of a job with one rank per node.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

__all__ = ["default_node", "check_node"]


def check_node(node: object, field: str = "node") -> str:
    """``node`` as a non-empty string, else a ValueError naming ``field``."""
    if not isinstance(node, str) or not node or len(node) > 256:
        raise ValueError(f"{field} must be a non-empty string of at most 256 characters naming this process's "
                         f"node (failure domain), got {node!r}")
    return node


def default_node(rank: int, env: Mapping[str, str] | None = None) -> str:
    """This rank's node when the caller named none (see the module docstring)."""
    env = os.environ if env is None else env
    try:
        local_world = int(env.get("LOCAL_WORLD_SIZE", "") or 0)
    except ValueError:
        local_world = 0
    if local_world > 1:
        group = env.get("GROUP_RANK")
        host = socket.gethostname()
        return f"{host}/{group}" if group else host
    return f"rank{rank}"
