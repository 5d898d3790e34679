"""How long a failure plan waits for members that are going silent.

Nodes cut off by one event (a switch, a partition of half the job) time out up to a
heartbeat interval apart: their last heartbeats came at different moments. A failure plan
issued at the first timeout would drop one of them, and a second plan a fraction of a second
later the other: two reconfigurations of the survivors for one event. So once
``failure_grace`` has passed, a failure plan is held while another member has been silent for
over half the heartbeat timeout: until it times out (and joins the plan) or speaks again
(and stays), for half the timeout at most from the first failure.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._port import Node

__all__ = ["hold_for_silent"]

#: after a silent member's timeout, what the controller's next heartbeat round may take
ROUND_S = 0.05


def hold_for_silent(others: Iterable[Node], timeout: float, now: float, held_s: float) -> float:
    """Seconds to hold a failure plan (0: issue it now). ``others``: the members not yet
    declared failed; ``now``: the clock of their ``last_seen``; ``held_s``: how long since
    the first failure of this plan."""
    if held_s >= timeout / 2:
        return 0.0
    left = [timeout - (now - n.last_seen) for n in others if not n.dead and now - n.last_seen > timeout / 2]
    return max(min(left), 0.0) + ROUND_S if left else 0.0
