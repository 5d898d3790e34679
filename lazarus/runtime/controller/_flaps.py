"""Hysteresis for flapping nodes: a node whose link keeps going down and up is kept out of
the plans until it has been stable for a while, instead of costing the members two
reconfigurations (drop, then join) per flap.

:class:`FlapDamper` counts, per node, the times it went silent or lost its connection
(heartbeat timeout or disconnect, as a member or as a joiner) while its agent process stayed
the same (a node that is killed and started again is a new agent: its count starts over, so
a spot replacement is never held). Once a node has been dropped ``flap_limit`` times within
``flap_window``, its next join waits until it has been connected without a drop for
``flap_hold_down``; every further drop starts that wait again. The settings are
:class:`~lazarus.runtime.ControllerConfig`'s ``flap_limit``, ``flap_window`` and
``flap_hold_down`` (0 turns the hold-down off).
"""

from __future__ import annotations

from collections import deque
from datetime import timedelta

__all__ = ["FlapDamper"]


class FlapDamper:
    """Drops per node and whether its join is held (times on one monotonic clock, seconds)."""

    def __init__(self, limit: int, window: timedelta, hold_down: timedelta) -> None:
        self.limit = limit
        self.window = window.total_seconds()
        self.hold_down = hold_down.total_seconds()
        self._drops: dict[str, deque[float]] = {}
        self._pid: dict[str, int | None] = {}

    def registered(self, node: str, pid: int | None) -> None:
        """``node``'s agent registered: a different process (or none known) starts afresh."""
        if pid is None or self._pid.get(node) != pid:
            self._drops.pop(node, None)
        self._pid[node] = pid

    def dropped(self, node: str, now: float) -> int:
        """``node`` went silent or lost its connection at ``now``; returns its drops within
        the window."""
        q = self._drops.setdefault(node, deque())
        q.append(now)
        while q and q[0] < now - self.window:
            q.popleft()
        return len(q)

    def flaps(self, node: str, now: float) -> int:
        """``node``'s drops within the window before ``now``."""
        q = self._drops.get(node)
        return 0 if not q else sum(1 for t in q if t >= now - self.window)

    def held(self, node: str, now: float) -> float:
        """Seconds ``node`` must still stay stable before it may join (0: it may now)."""
        q = self._drops.get(node)
        if not q or self.hold_down <= 0 or self.flaps(node, q[-1]) < self.limit:
            return 0.0
        return max(0.0, q[-1] + self.hold_down - now)
