"""Hard abort of a broken process group: NCCL communicators are aborted, gloo's sockets shut.

NCCL: a survivor of a crashed peer aborts the communicators (``ncclCommAbort`` through
the backend's ``abort()``; torch's ``_abort_process_group`` for the teardown). Destroying a
broken NCCL communicator can hang, so it is never destroyed first. A blocked NCCL kernel
(a collective with a dead or frozen peer) returns once its communicator is aborted, so a
watcher thread can interrupt the training thread this way. Torch's async error handling
is off (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, see ``_backend``): its watchdog only records
an error or a timeout, and :meth:`GroupAborter.watchdog_error` reads it so that the
trainer's watcher aborts the communicators itself. A communicator still being formed
(non-blocking init) is aborted the same way.

gloo gives no way to interrupt peers: ``destroy_process_group``, ``shutdown()`` and
``abort()`` leave its TCP connections open, so a survivor blocked in a collective with a
rank that already gave up waits out its whole timeout. The sockets a group opened are
recorded (the process's socket descriptors that appear while the group is created) and,
at the first failure, shut down: every peer still waiting on this rank gets EOF at once
and fails fast too, as if this process had died. Linux only (``/proc/self/fd``);
elsewhere it degrades to waiting for the collective timeout.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch.distributed as dist

__all__ = ["SocketTracker", "GroupAborter", "AbortReport", "nccl_backends", "nccl_errors", "reset_group_names",
           "release_in_background", "registered_groups"]

log = logging.getLogger("lazarus.trainer")


def reset_group_names() -> None:
    """Name the next process groups from 0 again, as on every other member.

    torch names every group but WORLD by a per-process counter (their store keys are
    ``<name>/...``) and resets it only when WORLD is destroyed. An ``init_process_group``
    that failed midway (the controller's store died, a peer vanished) has already advanced
    it, on some members and not on others: from then on every generation's groups would
    wait for keys the other members never write, and no reconfiguration could succeed
    again. Called before a generation's group is formed (nothing is initialised then)."""
    if dist.is_available() and not dist.is_initialized():
        from torch.distributed import distributed_c10d as c10d

        c10d._world.group_count = 0


def release_in_background(objs: list[Any], *, name: str, settle: Sequence[Callable[[], Any]] = ()) -> threading.Thread:
    """Drop the references in ``objs`` (emptied here) from another thread, which then holds
    the last ones if the caller holds none: destroying a gloo process group waits for its
    connections to close (70-100 ms for moc's three private groups on a quiet machine,
    waiting with the GIL released), time the members of a healthy group would otherwise
    spend at a step boundary when a plan replaces their groups. Returns the thread.

    Not a daemon: the interpreter waits for it at exit. A process that left the job right
    after retiring its groups otherwise exited while a destructor ran in the thread, and
    the C++ runtime aborted it (``terminate called without an active exception``, SIGABRT:
    a worker leaving on a spot notice in the soak).

    ``settle``: called first, in the thread (a retired moc manager's ``join_threads``): the
    objects' own daemon threads must have let go of them before the references here are
    dropped, or the last one could be dropped in a daemon thread while the interpreter
    exits (the same abort; a leaving worker's persist thread, seen in
    ``test_spot_notice_hands_both_workers_experts_over_and_the_node_leaves``)."""
    box, calls = list(objs), list(settle)
    objs.clear()

    def release() -> None:
        for call in calls:
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - freeing goes on
                log.warning("%s: %s", name, exc)
        calls.clear()
        box.clear()

    th = threading.Thread(target=release, name=name, daemon=False)
    th.start()
    return th


def registered_groups() -> list[Any]:
    """The process groups torch.distributed holds now (WORLD and every subgroup).

    A reference kept past ``destroy_process_group`` moves the groups' destructors to
    whoever drops it last: a gloo group's destructor waits ~10 ms for its I/O loop to stop
    (measured on a quiet machine, 4 ranks; the shutdown itself is ~0.05 ms)."""
    from torch.distributed import distributed_c10d as c10d

    groups = list(getattr(getattr(c10d, "_world", None), "pg_map", None) or {})
    if not groups and c10d.GroupMember.WORLD is not None:
        groups = [c10d.GroupMember.WORLD]
    return groups


def _socket_fds() -> dict[int, str]:
    out: dict[int, str] = {}
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
    """Remembers the TCP sockets opened inside :meth:`track` blocks.

    Connections accepted by a server this process hosts for others (the rendezvous store
    of :meth:`protect_port`) are never shut down: they are other members' clients, opened
    by its server thread at any time, not this process's group or plan.
    """

    _protected_ports: set[int] = set()

    def __init__(self) -> None:
        self._fds: dict[int, str] = {}

    @classmethod
    def protect_port(cls, port: int) -> None:
        """Never shut down connections whose local end is ``port`` (a server's port)."""
        cls._protected_ports.add(int(port))

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

    def adopt(self, other: "SocketTracker") -> None:
        """Track ``other``'s sockets too (a thread's own tracker, once its work is kept)."""
        self._fds.update(other._fds)
        other._fds = {}

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
                if s.getsockname()[1] in self._protected_ports:
                    continue
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


def nccl_backends() -> list[Any]:
    """The NCCL backends of every live process group of this process (none without NCCL)."""
    if not (dist.is_available() and dist.is_initialized() and dist.is_nccl_available()):
        return []
    import torch
    from torch.distributed.distributed_c10d import ProcessGroupNCCL, _world

    out = []
    for pg in list(_world.pg_map):
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except RuntimeError:     # the group has no CUDA backend
            continue
        if isinstance(backend, ProcessGroupNCCL):
            out.append(backend)
    return out


def nccl_errors(backends: list[Any] | None = None) -> list[str]:
    """The errors the NCCL watchdog recorded on ``backends`` (default: every live NCCL
    backend): ``ErrorType`` names other than ``SUCCESS`` (``TIMEOUT``, ``COMM_ERROR``,
    ``REMOTE_ERROR``), one per backend that has one."""
    out = []
    for backend in nccl_backends() if backends is None else backends:
        try:
            error = backend.get_error()
        except (AttributeError, RuntimeError):   # not reported by this build
            continue
        name = getattr(error, "name", str(error))
        if name != "SUCCESS":
            out.append(name)
    return out


@dataclass
class AbortReport:
    """What one abort did (for the log line and the tests)."""

    backend: str
    nccl_aborted: int = 0       # NCCL backends whose communicators were aborted
    sockets_shut: int = 0       # gloo TCP connections shut down
    teardown: str = ""          # "abort" (torch's _abort_process_group), "destroy", or "" (none)


class GroupAborter:
    """Interrupts and tears down a trainer's process groups, the way their backend needs.

    ``backend`` is the trainer's (``"gloo"`` or ``"nccl"``). With NCCL the group is
    ``cpu:gloo,cuda:nccl`` and moc's groups are gloo, so both mechanisms run: the NCCL
    communicators are aborted and the gloo sockets shut down.
    """

    def __init__(self, backend: str) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.backend = backend
        self.sockets = SocketTracker()
        self.interrupted = False     # set before the communicators are aborted
        self._retired: list[Any] = []   # gloo groups torn down by retire(), still referenced

    def formed(self) -> None:
        """A new generation's groups exist: nothing of them has been interrupted."""
        self.interrupted = False

    def check_healthy(self) -> None:
        """Raise a collective error if the NCCL communicators were aborted (here, or by
        NCCL's watchdog on an error or timeout) since :meth:`formed`.

        NCCL collectives do not block the host: a communicator aborted while a step's
        collectives ran leaves garbage in their outputs and raises nothing until the next
        collective. The trainer calls this after the step's collectives have completed on
        the device and before ``optimizer.step()``, so such a step is never applied. A
        no-op for gloo (its collectives raise where they fail)."""
        if self.backend != "nccl":
            return
        if self.interrupted:
            raise RuntimeError("NCCL communicator aborted during the step (process group interrupted)")
        errors = nccl_errors()
        if errors:
            raise RuntimeError(f"NCCL process group reported {errors[0]}; its collectives are not valid")

    def watchdog_error(self) -> str | None:
        """The first error or timeout NCCL's watchdog recorded on the current groups (with
        async error handling off it aborts nothing itself), or None. The trainer's watcher
        polls this and calls :meth:`interrupt`: a collective blocked on a frozen peer ends
        ``collective_timeout`` after it started, in the training thread's next sync."""
        if self.backend != "nccl" or self.interrupted:
            return None
        errors = nccl_errors()
        return errors[0] if errors else None

    def interrupt_nccl(self) -> int:
        """Abort every live NCCL communicator (formed or still forming) and mark the
        groups interrupted; gloo sockets are left to the caller. Returns how many NCCL
        backends were aborted (0 for a gloo trainer)."""
        if self.backend != "nccl":
            return 0
        self.interrupted = True
        n = 0
        for backend in nccl_backends():
            try:
                backend.abort()
                n += 1
            except Exception as exc:  # noqa: BLE001 - already aborted
                log.debug("NCCL abort: %s", exc)
        return n

    def interrupt(self) -> AbortReport:
        """Make every collective blocked on the current groups fail now (safe from another
        thread: the groups stay registered; :meth:`retire` tears them down)."""
        report = AbortReport(self.backend)
        self.interrupted = True
        report.nccl_aborted = self.interrupt_nccl()
        report.sockets_shut = self.sockets.shutdown_all()
        return report

    def take_retired(self) -> list[Any]:
        """The gloo groups :meth:`retire` tore down, still referenced (and forgotten here):
        the caller frees them where it likes. A gloo group's destructor waits ~10 ms for
        its I/O loop (:func:`release_in_background` runs it off the training thread)."""
        out, self._retired = self._retired, []
        return out

    def retire(self) -> AbortReport:
        """Interrupt, then drop the default group and every subgroup: NCCL with torch's
        process-group abort (never a destroy of a broken communicator), gloo with
        ``destroy_process_group``."""
        report = self.interrupt()
        if not (dist.is_available() and dist.is_initialized()):
            return report
        try:
            if self.backend == "nccl":
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()
                report.teardown = "abort"
            else:
                self._retired += registered_groups()
                dist.destroy_process_group()
                report.teardown = "destroy"
        except Exception as exc:  # noqa: BLE001 - already broken
            log.debug("process group teardown: %s", exc)
        return report
