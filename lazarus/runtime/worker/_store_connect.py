"""A rendezvous-store client whose connect can be given up on.

torch's ``TCPStore`` client retries a connect that fails (refused, reset, timed out) with
exponential backoff sleeps of its own, and a sleep can outlast the ``timeout`` it was given
(2.5 s seen inside a 1 s attempt when the store's host had just been killed). Nothing can
interrupt that from outside, so the connect runs in a thread watched every 50 ms: whoever
waits on it can stop waiting (a newer plan; a deadline) and leave the thread behind; a
client it connects later is simply dropped.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from ._abort import SocketTracker

__all__ = ["GaveUp", "connect_store"]

_POLL_S = 0.05


class GaveUp(Exception):
    """``give_up()`` turned true while the connect was under way."""


def connect_store(host: str, port: int, *, timeout: timedelta, tracker: SocketTracker | None = None,
                  give_up: Callable[[], bool] = lambda: False, wall: float | None = None) -> Any:
    """A client of the store at ``host:port``: one torch connect under ``timeout`` (its
    sockets recorded by ``tracker``), in a thread. Raises :class:`GaveUp` as soon as
    ``give_up()`` is true while it connects, ``TimeoutError`` when it has not finished
    after ``wall`` seconds (default: no limit of our own), else what the connect raised."""
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            if tracker is not None:
                with tracker.track():
                    box["store"] = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
            else:
                box["store"] = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    th = threading.Thread(target=connect, name=f"lazarus-store-connect-{host}:{port}", daemon=True)
    t0 = time.monotonic()
    th.start()
    while th.is_alive():
        th.join(_POLL_S)
        if not th.is_alive():
            break
        if give_up():
            raise GaveUp(f"gave up connecting to the store {host}:{port}")
        if wall is not None and time.monotonic() - t0 > wall:
            raise TimeoutError(f"the store {host}:{port} did not accept a client within {wall:.1f} s")
    if "error" in box:
        raise box["error"]
    return box["store"]
