"""A one-thread executor whose thread never holds up the interpreter's exit.

``concurrent.futures.ThreadPoolExecutor`` joins its workers at exit, so a job stuck on
storage that does not answer (a hung NFS mount, an S3 endpoint that keeps a connection
open) would keep a finished training process alive forever. The jobs run here write
only objects that an atomic commit publishes, so cutting them short at exit loses
nothing committed.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

__all__ = ["DaemonExecutor"]


class DaemonExecutor:
    """Runs submitted callables one at a time, in order, on one daemon thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: "queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple[Any, ...]] | None]" = \
            queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        """Nothing queued or running."""
        with self._lock:
            return self._pending == 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: submit after shutdown")
            self._pending += 1
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def shutdown(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """No more jobs; ``wait``: wait up to ``timeout`` seconds for the queued ones."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._jobs.put(None)
        if wait:
            self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> bool:
        """After :meth:`shutdown`: wait up to ``timeout`` seconds for the thread to end;
        True once it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            self._run_one(*item)
            # Nothing of a finished job stays referenced here while idle: the thread is a
            # daemon, and dropping the last reference to an object that owns a process
            # group from it while the interpreter exits aborts the process (its destructor
            # releases the GIL; taking it back during finalisation ends the thread inside
            # C++: "terminate called without an active exception").
            del item

    def _run_one(self, fut: Future, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        result: Any = None
        error: BaseException | None = None
        running = fut.set_running_or_notify_cancel()
        if running:
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the future's owner
                error = exc
        # Idle before the future resolves: whoever saw it done sees the executor idle.
        with self._lock:
            self._pending -= 1
        if running:
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)
