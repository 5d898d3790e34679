"""What a controller plan says about ranks, and the exception that ends applying one."""

from __future__ import annotations

from typing import Any

__all__ = ["Superseded", "plan_rank", "plan_world"]


class Superseded(Exception):
    """A newer plan arrived while this one was being applied."""


def plan_world(plan: dict[str, Any]) -> int:
    """Ranks of a plan: its nodes times their workers (``gpus_per_node``)."""
    return len(plan["members"]) * int(plan.get("gpus_per_node", 1))


def plan_rank(plan: dict[str, Any], node: str, local_rank: int, local_world: int) -> int:
    """The rank of ``node``'s worker ``local_rank`` in ``plan``: ranks are contiguous per
    node (node index * G + local rank), so a node's ranks are neighbours.

    Raises:
        RuntimeError: the plan's workers per node differ from this agent's (a node
            started with another ``--nproc-per-node`` than the job's), or ``node`` is no
            member.
    """
    g = int(plan.get("gpus_per_node", 1))
    if g != local_world:
        raise RuntimeError(f"plan {plan.get('generation')} has {g} workers per node but node {node} runs "
                           f"{local_world} (--nproc-per-node must be the same on every node)")
    if not 0 <= local_rank < g:
        raise RuntimeError(f"local rank {local_rank} outside [0, {g})")
    return plan["members"].index(node) * g + local_rank
