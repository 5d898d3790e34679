"""The new moc manager's process groups, formed in a thread while the state moves (owned
by :class:`._reconfigure.Reconfigurer`).

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
from typing import Any

import torch.distributed as dist

from moc.elastic import Comm

from .._plan import Plan, Superseded
from ._abort import SocketTracker
from ._rendezvous_store import StoreClients

__all__ = ["MocGroups"]

log = logging.getLogger("lazarus.reconfigure")


class MocGroups:
    """``config``: the worker's :class:`.ElasticConfig` (``moc``, ``collective_timeout``,
    ``rendezvous_timeout``); ``where``: this worker's name in log lines; ``sockets``: this
    generation's :class:`SocketTracker` (the groups' sockets join it once taken);
    ``superseded``: an Event set while a plan is applied once a newer one arrived;
    ``stores``: the reconfigurer's store clients (the groups form on the rendezvous one)."""

    def __init__(self, config: Any, *, where: str, sockets: SocketTracker, superseded: threading.Event,
                 stores: StoreClients) -> None:
        self.config = config
        self.where = where
        self.sockets = sockets
        self.superseded = superseded
        self.stores = stores
        self._pending: tuple[threading.Thread, dict[str, Any]] | None = None   # see start
        self.live: Comm | None = None   # the current manager's private groups (aborted on retire)
        self.waited: float | None = None   # how long the plan being applied waited for them

    def timeout(self) -> Any:
        """moc's coordination timeout, capped at ``collective_timeout`` (written back to the config)."""
        cfg = self.config.moc
        if cfg.coordination_timeout > self.config.collective_timeout:
            cfg.coordination_timeout = self.config.collective_timeout
        return cfg.coordination_timeout

    def start(self, plan: Plan, *, rank: int, world: int, generation: int) -> None:
        """Form the new moc manager's three gloo groups (this worker: ``rank`` of ``world``
        in ``generation``) in a thread while this one moves and installs the state: forming
        a group waits on every peer's connections (tens of ms each on loaded cores), time
        the members would otherwise spend idle before the next step. The groups are private
        (:meth:`moc._dist.Comm.create_private`: bare gloo backends on this plan's store,
        never registered with ``torch.distributed``), so the thread can be abandoned: a
        peer that dies while they connect leaves gloo waiting up to five times the connect
        timeout for a connection nothing can interrupt, and a newer plan must not wait for
        that (:meth:`wait`). Their sockets go to this generation's tracker only once taken
        (an abandoned thread's never do). With a torch whose gloo backend cannot change its
        timeout the groups are formed afterwards, as before, by the manager."""
        if self.config.moc is None or not dist.is_initialized() or not Comm.can_form_private():
            return
        timeout = self.timeout()
        # Peers reach this point at different times (a joiner, or every rank on a fresh
        # start, builds its model meanwhile; a rank's store client is held by the members'
        # barrier): connecting waits as long as the rendezvous may; the groups' collectives
        # then run under moc's own timeout.
        form_timeout = max(timeout, self.config.rendezvous_timeout)
        store = dist.PrefixStore(f"{plan.prefix}/moc", self.stores.client_for(plan.store, plan.generation))
        box: dict[str, Any] = {"sockets": SocketTracker()}

        def form() -> None:
            try:
                with box["sockets"].track():
                    box["comm"] = Comm.create_private(store, rank, world, timeout, form_timeout=form_timeout)
            except BaseException as exc:  # noqa: BLE001 - re-raised by take
                box["error"] = exc

        th = threading.Thread(target=form, name=f"lazarus-moc-groups-{generation}", daemon=True)
        self.waited = 0.0
        th.start()
        self._pending = (th, box)

    def wait(self, *, step: int, generation: int) -> None:
        """Wait for the groups' thread (no-op without one); :meth:`take` has them. A newer
        immediate plan (``superseded``) ends the wait: the thread is left to fail on its own
        and :class:`Superseded` raised. ``step``, ``generation``: for the log line."""
        if self._pending is None or not self._pending[0].is_alive():
            return
        t0 = time.time()
        th = self._pending[0]
        while th.is_alive():
            th.join(0.05)
            if self.superseded.is_set() and th.is_alive():
                log.warning("node %s step %d gen %d: a newer plan arrived while moc's groups were connecting (%.2f s); "
                            "left them to fail on their own", self.where, step, generation, time.time() - t0)
                self.drop(step=step, generation=generation)
                raise Superseded()
        self.waited = time.time() - t0

    def take(self, *, step: int, generation: int) -> Any:
        """The groups :meth:`start` formed (None: none started); from now on their sockets
        are this generation's (shut when it retires)."""
        self.wait(step=step, generation=generation)
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        box = pending[1]
        if "error" in box:
            raise box["error"]
        self.sockets.adopt(box["sockets"])
        self.live = box["comm"]
        return box["comm"]

    def drop(self, *, step: int, generation: int) -> None:
        """A plan that failed: let go of the groups' thread without waiting (its groups are
        private: nothing it does later touches the next plan's). Groups it formed are
        aborted, once it ends if it is still forming.

        The thread forms them on the rendezvous' store client, and torch's client runs one
        operation at a time: a thread still waiting there for a peer that died (a store
        wait of up to ``rendezvous_timeout``) would hold the next plan's rendezvous on the
        same store as long (soak seed 4: a node killed while the plan for an earlier kill was
        applied cost the survivors 30 s). So the client goes with the thread: its sockets
        are shut (the thread's wait fails now) and the next plan connects a new one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        th, box = pending
        if th.is_alive() and self.stores.client is not None:
            n = self.stores.drop(shut=True)
            log.info("node %s step %d gen %d: moc's groups were still connecting; their store client dropped "
                     "(%d connections shut)", self.where, step, generation, n)

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
