"""The new moc manager's process groups, formed in a thread while the state moves (mixed
into :class:`._reconfigure.Reconfigurer`).

Forming a group waits on every peer's connections (tens of ms each on loaded cores): time
the members would otherwise spend idle before the next step. The groups are private
(:meth:`moc._dist.Comm.create_private`: bare gloo backends on the plan's store, never
registered with ``torch.distributed``), so a newer plan can abandon the thread that forms
them without touching the default group, the group names or the next generation's sockets.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from moc.elastic import Comm

from .._plan import Plan, Superseded
from ._abort import SocketTracker

__all__ = ["MocGroups"]

log = logging.getLogger("lazarus.reconfigure")


class MocGroups:
    """Expects of the class it is mixed into: ``t`` (the trainer), ``sockets`` (this
    generation's :class:`SocketTracker`), ``_superseded`` (an Event set once a newer plan
    arrived), ``_store_client(spec, generation)`` and the client it returns as ``_store``,
    its sockets in ``_store_sockets``, and ``_drop_store(shut=)`` that forgets it."""

    t: Any
    sockets: SocketTracker
    _superseded: threading.Event
    _store: Any
    _store_sockets: SocketTracker
    _drop_store: Callable[..., int]

    def _init_moc_groups(self) -> None:
        self._moc_comm: tuple[threading.Thread, dict[str, Any]] | None = None   # see _start_moc_comm
        self._live_comm: Comm | None = None   # the current manager's private groups (aborted on retire)
        self._moc_groups_wait: float | None = None

    def _moc_timeout(self) -> Any:
        cfg = self.t.config.moc
        if cfg.coordination_timeout > self.t.config.collective_timeout:
            cfg.coordination_timeout = self.t.config.collective_timeout
        return cfg.coordination_timeout

    def _start_moc_comm(self, plan: Plan) -> None:
        """Form the new moc manager's three gloo groups in a thread while this one moves
        and installs the state: forming a group waits on every peer's connections (tens of
        ms each on loaded cores), time the members would otherwise spend idle before the
        next step. The groups are private (:meth:`moc._dist.Comm.create_private`: bare gloo
        backends on this plan's store, never registered with ``torch.distributed``), so the
        thread can be abandoned: a peer that dies while they connect leaves gloo waiting up
        to five times the connect timeout for a connection nothing can interrupt, and a newer
        plan must not wait for that (:meth:`_await_moc_comm`). Their sockets go to this
        generation's tracker only once taken (an abandoned thread's never do). With a torch
        whose gloo backend cannot change its timeout the groups are formed afterwards, as
        before, by the manager."""
        if self.t.config.moc is None or not dist.is_initialized() or not Comm.can_form_private():
            return
        t = self.t
        timeout = self._moc_timeout()
        # Peers reach this point at different times (a joiner, or every rank on a fresh
        # start, builds its model meanwhile; a rank's store client is held by the members'
        # barrier): connecting waits as long as the rendezvous may; the groups' collectives
        # then run under moc's own timeout.
        form_timeout = max(timeout, t.config.rendezvous_timeout)
        store = dist.PrefixStore(f"{plan.prefix}/moc", self._store_client(plan.store, plan.generation))
        rank, world = t.rank, t.world
        box: dict[str, Any] = {"sockets": SocketTracker()}

        def form() -> None:
            try:
                with box["sockets"].track():
                    box["comm"] = Comm.create_private(store, rank, world, timeout, form_timeout=form_timeout)
            except BaseException as exc:  # noqa: BLE001 - re-raised by _take_moc_comm
                box["error"] = exc

        th = threading.Thread(target=form, name=f"lazarus-moc-groups-{t.generation}", daemon=True)
        self._moc_groups_wait = 0.0
        th.start()
        self._moc_comm = (th, box)

    def _await_moc_comm(self) -> None:
        """Wait for the groups' thread (no-op without one); :meth:`_take_moc_comm` has them.
        A newer immediate plan (see :meth:`_interruptible`) ends the wait: the thread is
        left to fail on its own and :class:`Superseded` raised."""
        if self._moc_comm is None or not self._moc_comm[0].is_alive():
            return
        t0 = time.time()
        th = self._moc_comm[0]
        while th.is_alive():
            th.join(0.05)
            if self._superseded.is_set() and th.is_alive():
                log.warning("node %s step %d gen %d: a newer plan arrived while moc's groups were connecting (%.2f s); "
                            "left them to fail on their own", self.t.where, self.t.step, self.t.generation,
                            time.time() - t0)
                self._drop_moc_comm()
                raise Superseded()
        self._moc_groups_wait = time.time() - t0

    def _take_moc_comm(self) -> Any:
        """The groups :meth:`_start_moc_comm` formed (None: none started); from now on their
        sockets are this generation's (shut when it retires)."""
        self._await_moc_comm()
        pending, self._moc_comm = self._moc_comm, None
        if pending is None:
            return None
        box = pending[1]
        if "error" in box:
            raise box["error"]
        self.sockets.adopt(box["sockets"])
        self._live_comm = box["comm"]
        return box["comm"]

    def _drop_moc_comm(self) -> None:
        """A plan that failed: let go of the groups' thread without waiting (its groups are
        private: nothing it does later touches the next plan's). Groups it formed are
        aborted, once it ends if it is still forming.

        The thread forms them on the rendezvous' store client, and torch's client runs one
        operation at a time: a thread still waiting there for a peer that died (a store
        wait of up to ``rendezvous_timeout``) would hold the next plan's rendezvous on the
        same store as long (soak seed 4: a node killed while the plan for an earlier kill was
        applied cost the survivors 30 s). So the client goes with the thread: its sockets
        are shut (the thread's wait fails now) and the next plan connects a new one."""
        pending, self._moc_comm = self._moc_comm, None
        if pending is None:
            return
        th, box = pending
        if th.is_alive() and self._store is not None:
            n = self._drop_store(shut=True)
            log.info("node %s step %d gen %d: moc's groups were still connecting; their store client dropped "
                     "(%d connections shut)", self.t.where, self.t.step, self.t.generation, n)

        def discard() -> None:
            th.join()
            comm = box.get("comm")
            if comm is not None:
                comm.destroy()
            # (not its tracker's sockets: a thread left behind tracked whatever this process
            # opened meanwhile, the next generation's connections among them)

        if th.is_alive():
            threading.Thread(target=discard, name="lazarus-moc-groups-discard", daemon=True).start()
        else:
            discard()
