"""The reconfigurer's clients of the plans' rendezvous stores (owned by
:class:`._reconfigure.Reconfigurer`, shared with its :class:`._join_gate.JoinGate` and
:class:`._moc_groups.MocGroups`).

A plan names the store its group forms on (a member's worker hosts it, or the controller).
One client serves the rendezvous, its barriers and moc's groups; a second one of the same
store carries the units' descriptions (:meth:`StoreClients.board_for`). A store that changed
gets new clients; a plan that failed or was superseded drops them.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from .._plan import Plan, Superseded
from ._abort import SocketTracker
from ._plan_feed import latest_plan
from ._store_connect import GaveUp, connect_store

__all__ = ["STORE_CONNECT_ATTEMPT", "StoreClients"]

#: Longest single connect to a rendezvous store (then a newer plan is looked for, and again).
STORE_CONNECT_ATTEMPT = timedelta(seconds=1)


class StoreClients:
    """``config``: the worker's :class:`.ElasticConfig` (its ``rendezvous_timeout``);
    ``where``: this worker's name in log lines and errors; ``channel``: its agent channel
    (a newer plan there gives up a connect)."""

    def __init__(self, config: Any, *, where: str, channel: Any) -> None:
        self.config = config
        self.where = where
        self.channel = channel
        self.client: Any = None   # the plan's store client (rendezvous, barriers, moc's groups)
        self.key: tuple[Any, ...] | None = None
        self.sockets = SocketTracker()   # the client's connections
        self.board: Any = None   # a second client of the same store (board_for)
        self.board_key: tuple[Any, ...] | None = None

    def client_for(self, spec: dict[str, Any], generation: int | None = None) -> Any:
        """A client of the plan's store (``spec``: its ``store`` field): a member's worker's,
        or the controller's. A store that changed (another member hosts it, a restarted
        controller hosts a new one, maybe on the same port) gets a new client.

        It connects in attempts of at most :data:`STORE_CONNECT_ATTEMPT`: the store's host
        may have died (the member killed the moment a join's plan was issued), and one
        connect to a dead port retries for the whole ``rendezvous_timeout`` without a
        socket that a newer plan could shut. Between two attempts a newer plan of
        ``generation``'s successor raises :class:`Superseded`; past ``rendezvous_timeout``
        a ``TimeoutError`` says which store did not answer."""
        key = tuple(sorted(spec.items()))
        if self.client is None or self.key != key:
            self.client = None
            self.sockets = SocketTracker()
            self.client = self.connect(str(spec["host"]), int(spec["port"]), generation)
            self.key = key
        return self.client

    def connect(self, host: str, port: int, generation: int | None) -> Any:
        """A client of the store at ``host:port`` in attempts of at most
        :data:`STORE_CONNECT_ATTEMPT`, each watched (:func:`._store_connect.connect_store`):
        a newer plan of ``generation``'s successor raises :class:`Superseded` within 50 ms
        even while torch's client sleeps between its own retries (soak seed 1 on the
        previous code: a joiner held two failure rendezvous 3 s and 1.5 s that way)."""
        limit = self.config.rendezvous_timeout
        deadline = time.monotonic() + limit.total_seconds()

        def superseded() -> bool:
            latest = latest_plan(self.channel)
            return generation is not None and latest is not None and latest.generation > generation

        while True:
            attempt = max(0.05, min(STORE_CONNECT_ATTEMPT.total_seconds(), deadline - time.monotonic()))
            try:
                store = connect_store(host, port, timeout=timedelta(seconds=attempt), tracker=self.sockets,
                                      give_up=superseded)
                store.set_timeout(limit)   # the rendezvous' own waits
                return store
            except GaveUp:
                raise Superseded() from None
            except (RuntimeError, OSError) as exc:   # torch's DistNetworkError is a RuntimeError
                if superseded():
                    raise Superseded() from None
                if time.monotonic() >= deadline:
                    why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                    raise TimeoutError(f"node {self.where}: the rendezvous store {host}:{port} of generation "
                                       f"{generation} did not answer within {limit}: {why}") from None

    def drop(self, *, shut: bool = False) -> int:
        """Forget the store client: the next plan connects a new one. ``shut``: also shut its
        connections (an operation waiting on it elsewhere fails now); returns how many."""
        n = self.sockets.shutdown_all() if shut and self.client is not None else 0
        self.client = self.board = None
        return n

    def board_for(self, plan: Plan) -> Any:
        """A second client of the plan's store, for the units' descriptions
        (:class:`._transfer.StoreBoard`). The first one is shared with the thread forming
        moc's groups, and a client waiting for a key is held until it is set: a rank
        waiting for a peer's post there would block its own groups' connection, which the
        peer's groups wait for before it can post (a cycle until the timeout). Made once
        per store; its sockets are shut with the first client's.

        Connected in the rendezvous, before this plan's group forms: a socket that appears
        while a group forms is counted as that group's (:class:`SocketTracker` compares the
        process's descriptors), and it would be shut when the group retires (then the
        next plan's descriptions found this client's connection shut: "Broken pipe")."""
        self.client_for(plan.store, plan.generation)
        if self.board is None or self.board_key != self.key:
            self.board = self.connect(str(plan.store["host"]), int(plan.store["port"]), plan.generation)
            self.board_key = self.key
        return self.board
