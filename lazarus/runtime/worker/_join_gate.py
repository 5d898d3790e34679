"""A join prepared while the members train (owned by :class:`._reconfigure.Reconfigurer`).

A between-steps plan that adds nodes is applied in two halves. The joiner, as soon as the
plan reaches it, builds its model for the rank the plan gives it, before any process group
exists (:func:`lazarus.moe._comm.building_for`: its MoE layers hold the plan's experts),
and counts itself prepared on the store the plan's group forms on. The members keep
training meanwhile: at every step boundary each asks that store whether every joiner is
prepared (:meth:`JoinGate.joiners_prepared`), and the per-step agreement (a MAX
all-reduce) switches all of them together at the first boundary where one has seen it. So
no member waits for a joiner's build, only for the switch itself (the state transfer,
install and moc manager of :mod:`._reconfigure`).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Callable

from torch import nn

from lazarus.moe._comm import building_for

from .._plan import Plan
from ._rendezvous_store import StoreClients
from ._store_connect import connect_store

__all__ = ["GATE_STORE_TIMEOUT", "JoinGate"]

log = logging.getLogger("lazarus.reconfigure")

#: How long a member's question "are the joiners prepared?" may wait on the plan's store.
GATE_STORE_TIMEOUT = timedelta(seconds=2)


class JoinGate:
    """The joiner's preparation and the members' gate. ``config``: the worker's
    :class:`.ElasticConfig` (its ``rendezvous_timeout``); ``where``: this worker's name in
    log lines; ``stores``: the reconfigurer's clients of the plans' stores (the gate asks
    through the rendezvous client when it is that store's)."""

    def __init__(self, config: Any, *, where: str, stores: StoreClients) -> None:
        self.config = config
        self.where = where
        self.stores = stores
        self._gate: tuple[int, float] | None = None   # (generation, first seen) of a join plan held back
        self._gate_client: tuple[tuple[Any, ...], Any] | None = None   # (store spec, client) asked by the gate

    @staticmethod
    def is_prepared_join(plan: Plan) -> bool:
        """A between-steps plan that adds nodes: its joiners build their models first, and
        the members switch to it only once every joiner has (:meth:`joiners_prepared`)."""
        return plan.mode == "between_steps" and bool(plan.joined)

    @staticmethod
    def _prepare_key(plan: Plan) -> str:
        return f"{plan.prefix}/prepared"

    def build(self, rank: int, world: int, build: Callable[[], nn.Module], device: Any) -> nn.Module | None:
        """A joiner, before the plan's rendezvous: ``build()`` (the user's ``build_model``
        for the plan's placements; then moved to ``device``) under
        :func:`lazarus.moe._comm.building_for` ``(rank, world)``: its MoE layers hold the
        experts the plan gives it. A ``build_model`` that cannot build before its process
        group exists (it calls torch.distributed itself) is logged, and None returned: it
        is built after the rendezvous, as before."""
        try:
            with building_for(rank, world):
                model = build()
            return model.to(device)
        except Exception as exc:  # noqa: BLE001 - user code; the build after the rendezvous reports it
            log.warning("node %s step -: build_model failed before the group formed (%s: %s); building it after "
                        "the rendezvous", self.where, type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc)
                        else "")
            return None

    def announce(self, plan: Plan, rank: int, world: int, t0: float, *, built: bool) -> None:
        """A joiner counts itself prepared on the store the plan's group forms on (built or
        not: the members then switch at their next step)."""
        store = self.stores.client_for(plan.store, plan.generation)   # the store the plan's group forms on
        store.add(self._prepare_key(plan), 1)
        log.info("node %s rank %d/%d step - gen %d: prepared to join in %.3f s (model %s); the members switch at "
                 "their next step", self.where, rank, world, plan.generation, time.time() - t0,
                 "built" if built else "to build after the rendezvous")

    def joiners_prepared(self, plan: Plan, step: int) -> bool:
        """A member, at a step boundary (``step``: its next step): may it switch to ``plan``
        now? Yes unless it is a join whose joiners are still building (then the member
        trains another step). A joiner that never prepares holds the members back at most
        ``rendezvous_timeout`` from when this member first saw the plan; then they switch
        and wait for it as before. A store that cannot be asked (its host went away) does
        not hold the switch back either: the rendezvous reports it."""
        if not self.is_prepared_join(plan):
            return True
        gen = plan.generation
        now = time.monotonic()
        if self._gate is None or self._gate[0] != gen:
            self._gate = (gen, now)
        if now - self._gate[1] > self.config.rendezvous_timeout.total_seconds():
            log.warning("node %s step %d: the joiners %s of generation %d did not prepare within %s; switching anyway",
                        self.where, step, plan.joined, gen, self.config.rendezvous_timeout)
            return True
        try:
            done = self._gate_store(plan.store).add(self._prepare_key(plan), 0)
        except Exception as exc:  # noqa: BLE001 - the rendezvous reports a dead store
            log.warning("node %s step %d: cannot ask the store whether generation %d's joiners are prepared (%s)",
                        self.where, step, gen, str(exc).splitlines()[0][:200] if str(exc) else exc)
            self._gate_client = None
            return True
        if done >= len(plan.joined) * plan.gpus_per_node:
            self._gate_client = None
            return True
        return False

    def _gate_store(self, spec: dict[str, Any]) -> Any:
        """The plan's store, for the members' question between two steps: this rank's
        client when it is that store's, else a client of its own that gives up after
        :data:`GATE_STORE_TIMEOUT` (the training thread asks; a store host that died must
        not hold it for ``rendezvous_timeout``, nor torch's client its retries' backoff past
        that: the connect is watched, :func:`._store_connect.connect_store`; the
        rendezvous, interruptible, reports a dead store)."""
        key = tuple(sorted(spec.items()))
        if self.stores.client is not None and self.stores.key == key:
            return self.stores.client
        if self._gate_client is None or self._gate_client[0] != key:
            self._gate_client = None
            client = connect_store(str(spec["host"]), int(spec["port"]), timeout=GATE_STORE_TIMEOUT,
                                   wall=GATE_STORE_TIMEOUT.total_seconds())
            self._gate_client = (key, client)
        return self._gate_client[1]
