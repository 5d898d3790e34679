"""Hard abort of a broken gloo process group.

gloo gives no way to interrupt peers: ``destroy_process_group``, ``shutdown()`` and
``abort()`` leave its TCP connections open, so a survivor blocked in a collective with a
rank that already gave up waits out its whole timeout. The sockets a group opened are
recorded (the process's socket descriptors that appear while the group is created) and,
at the first failure, shut down: every peer still waiting on this rank gets EOF at once
and fails fast too, as if this process had died. Linux only (``/proc/self/fd``);
elsewhere it degrades to waiting for the collective timeout.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from typing import Iterator

__all__ = ["SocketTracker"]


def _socket_fds() -> dict[int, str]:
    out = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out[int(name)] = target
    return out


class SocketTracker:
    """Remembers the TCP sockets opened inside :meth:`track` blocks."""

    def __init__(self) -> None:
        self._fds: dict[int, str] = {}

    @contextmanager
    def track(self) -> Iterator[None]:
        before = _socket_fds()
        try:
            yield
        finally:
            after = _socket_fds()
            for fd, inode in after.items():
                if before.get(fd) != inode:
                    self._fds[fd] = inode

    @staticmethod
    def open_sockets() -> dict[int, str]:
        """This process's socket descriptors now (for :meth:`shutdown_opened_since`)."""
        return _socket_fds()

    @classmethod
    def shutdown_opened_since(cls, before: dict[int, str]) -> int:
        """Shut down the connected TCP sockets opened since ``before`` was taken (by any
        thread: a blocked ``init_process_group`` is interrupted this way)."""
        tracker = cls()
        tracker._fds = {fd: inode for fd, inode in _socket_fds().items() if before.get(fd) != inode}
        return tracker.shutdown_all()

    def shutdown_all(self) -> int:
        """``shutdown(SHUT_RDWR)`` every tracked socket still open (the same inode);
        returns how many were shut down."""
        current = _socket_fds()
        n = 0
        for fd, inode in list(self._fds.items()):
            if current.get(fd) != inode:
                continue
            try:
                s = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)
            except OSError:
                continue
            try:
                # Connected TCP only: a listening socket has no peer (getpeername fails)
                # and shutting gloo's listener down makes its accept thread terminate the
                # process; AF_UNIX peers (the agent link) fail the AF_INET address parse.
                peer = s.getpeername()
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) == socket.SOCK_STREAM and \
                        isinstance(peer, tuple) and len(peer) >= 2:
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
            except OSError:
                pass
            finally:
                s.close()
        self._fds.clear()
        return n
