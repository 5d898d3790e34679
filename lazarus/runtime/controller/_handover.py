"""The last members' hand-over to a node on its way in: when every member of the job is
leaving (spot notices, SIGTERM) while another node is registered and its worker still
starting, nobody would be left to take their experts, and the job would start again from
checkpoints (rolled back, PLT booked). :class:`HandoverWait` lets the leaving members train
on, for :class:`~lazarus.runtime.ControllerConfig`'s ``handover_wait`` at most, until the
joiner is ready; the membership then issues its join plan, and the leave plan after it hands
their state over as any leave does. When the wait runs out they leave with nobody to hand
over to, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta

from ._port import Port, Timer

__all__ = ["HandoverWait"]


class HandoverWait:
    """One wait at a time: its deadline on the port's clock and the timer that calls
    ``on_expiry`` (the membership re-checks its queue) when it runs out."""

    def __init__(self, wait: timedelta, *, port: Port, on_expiry: Callable[[], None]) -> None:
        self.wait = wait.total_seconds()
        self.port = port
        self.on_expiry = on_expiry
        self._deadline: float | None = None
        self._timer: Timer | None = None

    def waiting(self, leaving: Sequence[str], incoming: Sequence[str], generation: int) -> bool:
        """Every member is ``leaving``, ``incoming`` are on their way in: should they wait?
        The first call starts the wait (an event says so); True until it runs out."""
        if self.wait <= 0 or not incoming:
            return False
        now = self.port.time()
        if self._deadline is None:
            self._deadline = now + self.wait
            self._timer = self.port.call_later(self.wait, self._expired, list(leaving), generation)
            self.port.event("handover_wait", generation=generation, leaving=list(leaving),
                            waiting_for=list(incoming), wait_s=self.wait)
        return now < self._deadline

    def _expired(self, leaving: list[str], generation: int) -> None:
        self._timer = None
        self.port.event("handover_wait_over", level=logging.WARNING, generation=generation, leaving=leaving,
                        waited_s=self.wait)
        self.on_expiry()

    def end(self) -> None:
        """The leave goes ahead (handed over, or with nobody to take it): no wait any more."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._deadline = None
