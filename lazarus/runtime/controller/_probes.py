"""The controller's reachability probes: after a collective error, which member's agent
cannot reach which (``probe`` / ``probe_result`` for the generation that failed); and the
admission probe of a node dropped for a broken link, which joins again only once it and
every member reach each other (``admit:<node>``).

:class:`Probes` belongs to one :class:`~._membership.Membership` and, like it, never
touches a socket: it sends through the membership's :class:`~._port.Port` and reads the
view through :class:`ProbeView`. The decision whom to drop is :func:`._reachability.cut_off`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from .._wire import MalformedMessageError
from ._port import Node, Port, msg_field
from ._reachability import ADMIT, PROBE_SLACK_S, PROBE_TIMEOUT_S, probe_targets

__all__ = ["ProbeView", "Probes"]


class ProbeView(Protocol):
    """What the probes read of the membership."""

    nodes: dict[str, Node]

    @property
    def members(self) -> list[str]: ...

    def eligible(self, node_id: str) -> bool: ...


class Probes:
    """The probes under way, their reports, and the nodes cut off for a broken link.
    ``rejoin(node)`` adds a cut node that reaches everyone again as a joiner."""

    def __init__(self, port: Port, *, view: ProbeView, rejoin: Callable[[str], None]) -> None:
        self.port = port
        self._view = view
        self._rejoin = rejoin
        # after a collective error: who each member's agent could not reach
        self._probe_gen: int | None = None
        self._probe_asked: set[str] = set()
        self._probe_reports: dict[str, list[str]] = {}
        self._probe_deadline = 0.0
        # nodes dropped for a broken link: node -> the wait before its next admission probe
        self.cut_nodes: dict[str, float] = {}
        self._admission: dict[str, dict[str, Any]] = {}   # node -> its admission probe under way

    def reports(self, gen: int) -> dict[str, list[str]]:
        """The members' reports of generation ``gen``'s probe (none for another generation)."""
        return self._probe_reports if self._probe_gen == gen else {}

    def send(self, gen: int) -> None:
        """Ask every member's agent which other members it cannot reach (their published
        addresses): a broken link between two members fails every rank's collective, and
        only these reports say whom to drop (:mod:`._reachability`)."""
        targets = probe_targets({m: self._view.nodes[m].store for m in self._view.members if m in self._view.nodes})
        asked = [m for m in self._view.members if self._view.eligible(m)] if len(targets) > 1 else []
        self._probe_gen, self._probe_asked, self._probe_reports = gen, set(asked), {}
        self._probe_deadline = self.port.time() + PROBE_TIMEOUT_S + PROBE_SLACK_S
        for m in asked:
            self.port.send(m, {"type": "probe", "generation": gen, "targets": targets, "timeout_s": PROBE_TIMEOUT_S})

    def on_result(self, node: Node, msg: dict[str, Any]) -> None:
        lost = msg_field(msg, "unreachable", list)
        if not all(isinstance(n, str) for n in lost):
            raise MalformedMessageError("probe_result: field 'unreachable' must be a list of node names")
        tag = msg.get("generation")
        if tag == self._probe_gen and node.node_id in self._probe_asked:
            self._probe_reports[node.node_id] = lost
        elif isinstance(tag, str) and tag.startswith(ADMIT):
            probe = self._admission.get(tag[len(ADMIT):])
            if probe is not None and node.node_id in probe["asked"]:
                probe["reports"][node.node_id] = lost
                if probe["asked"] <= set(probe["reports"]):
                    self._admission_done(tag[len(ADMIT):])

    def admit(self, node_id: str) -> None:
        """``node_id`` was dropped for a broken link and wants to join: first every member's
        agent tries to reach it and it tries to reach every member; it joins only when none
        fails (else again after a wait that doubles up to 30 s: a link that stays broken
        costs the members nothing, a flapping one a bounded number of plans)."""
        node = self._view.nodes.get(node_id)
        if node_id in self._admission or not self._view.eligible(node_id) or node is None or not node.store:
            return
        members = [m for m in self._view.members if self._view.eligible(m) and m != node_id]
        stores = probe_targets({m: self._view.nodes[m].store for m in members})
        mine = probe_targets({node_id: node.store})
        tag = ADMIT + node_id
        self._admission[node_id] = {"asked": {node_id, *stores}, "reports": {}}
        self.port.send(node_id, {"type": "probe", "generation": tag, "targets": stores, "timeout_s": PROBE_TIMEOUT_S})
        for m in stores:
            self.port.send(m, {"type": "probe", "generation": tag, "targets": mine, "timeout_s": PROBE_TIMEOUT_S})
        self.port.call_later(PROBE_TIMEOUT_S + PROBE_SLACK_S, self._admission_done, node_id)

    def _admission_done(self, node_id: str) -> None:
        probe = self._admission.pop(node_id, None)
        if probe is None or node_id not in self.cut_nodes:
            return
        reports: dict[str, list[str]] = probe["reports"]
        missing = sorted(probe["asked"] - set(reports))
        broken = sorted({m for m in reports.get(node_id, [])} | {m for m, lost in reports.items() if node_id in lost})
        if broken or missing:
            wait = self.cut_nodes[node_id] = min(30.0, max(2.0, 2 * self.cut_nodes[node_id]))
            self.port.event("join_deferred", level=logging.WARNING, node=node_id, unreachable=broken,
                            no_answer=missing, retry_s=wait)
            self.port.call_later(wait, self.admit, node_id)
            return
        del self.cut_nodes[node_id]
        self.port.event("reachable_again", node=node_id)
        if node_id not in self._view.members and self._view.eligible(node_id):
            self._rejoin(node_id)

    def pending(self, gen: int) -> bool:
        """Are members' probe reports of ``gen`` still on their way (and time left)?"""
        if self._probe_gen != gen or self.port.time() >= self._probe_deadline:
            return False
        return any(m not in self._probe_reports and self._view.eligible(m) for m in self._probe_asked)
