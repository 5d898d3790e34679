"""Waiting for storage I/O on every rank without a collective that waits on storage.

A persist's I/O runs on its own thread; the ranks' persist threads meet every tick until
every rank's I/O is done. No collective of the persist group then ever waits longer than
a tick plus the ranks' skew, however slow the store, so it never times out on some ranks
and not on others (which would leave the group out of step and the ranks disagreeing on
what was committed).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from datetime import timedelta

from ._dist import Comm

__all__ = ["tick_seconds", "wait_together"]

log = logging.getLogger("moc")


def tick_seconds(timeout: timedelta) -> float:
    """Seconds between meetings: a tenth of the group's timeout, at most 1 s."""
    return max(0.05, min(1.0, timeout.total_seconds() / 10))


def wait_together(comm: Comm, fut: Future, *, tick: float, rank: int, step: int, doing: str) -> None:
    """Meet the other ranks every ``tick`` seconds until ``fut`` is done on every rank
    (collective on the persist group). Says every minute which ranks' storage is still
    busy: a slow store is visible, never silent. ``fut``'s outcome is the caller's."""
    started = last_log = time.monotonic()
    while True:
        try:
            fut.result(timeout=tick)
        except FuturesTimeout:
            pass
        except Exception:  # noqa: BLE001 - the caller reads the future's error
            pass
        done = comm.gather_json(fut.done(), persist=True)
        if all(done):
            return
        now = time.monotonic()
        if now - last_log >= 60.0:
            last_log = now
            log.warning("rank %d step %d: persist %s for %.0f s; storage still busy on rank(s) %s", rank, step,
                        doing, now - started, [i for i, d in enumerate(done) if not d])
