"""The controller's plan, typed: what a generation's group is and where every expert goes.

The controller builds a :class:`Plan` and sends :meth:`Plan.to_wire` (the ``plan``
message, also what its state directory keeps); the agents and the training workers take
:meth:`Plan.from_wire` where a message comes in and read attributes. Every check of a
plan's fields is here: a bad field raises :class:`~._wire.MalformedMessageError` naming
the field and its value. Pure Python (no torch, no numpy): the agent imports it.

Ranks are contiguous per node: node ``i`` of ``members`` holds ranks ``i * G`` to
``i * G + G - 1`` (``G = gpus_per_node``), so a node's ranks are neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, TypeGuard

from ._wire import MalformedMessageError

__all__ = ["MODES", "Plan", "Superseded", "rank_layout"]

#: ``immediate``: apply now (a failure, a start); ``between_steps``: at a step boundary
#: every member agreed on (joins, leaves, rebalancing).
MODES = ("immediate", "between_steps")


class Superseded(Exception):
    """A newer plan arrived while this one was being applied."""


def rank_layout(members: Sequence[str], gpus_per_node: int) -> dict[str, list[int]]:
    """``node -> its ranks``: contiguous blocks in member order (node ``i`` holds ranks
    ``i * G`` to ``i * G + G - 1``; its local rank ``l`` is rank ``i * G + l``)."""
    g = int(gpus_per_node)
    return {m: list(range(i * g, (i + 1) * g)) for i, m in enumerate(members)}


def _bad(name: str, what: str, value: Any) -> MalformedMessageError:
    return MalformedMessageError(f"plan field {name!r} must be {what}, got {value!r:.200}")


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _node_list(d: Mapping[str, Any], name: str, *, required: bool = False) -> list[str]:
    """``d[name]``: node ids (distinct, and there, when ``required``: the members)."""
    value = d.get(name) if required else d.get(name, [])
    if not isinstance(value, list) or not all(isinstance(n, str) and n for n in value):
        raise _bad(name, "a list of node ids", value)
    if required and len(set(value)) != len(value):
        raise _bad(name, "a list of distinct node ids", value)
    return list(value)


def _optional(d: Mapping[str, Any], name: str, check, what: str) -> Any:
    value = d.get(name)
    if value is not None and not check(value):
        raise _bad(name, what + " or null", value)
    return value


def _dict(d: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = d.get(name, {})
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _bad(name, "an object", value)
    return value


@dataclass(frozen=True)
class Plan:
    """One generation's plan (frozen; its lists and dicts are not to be changed either).

    Attributes:
        generation: the plan's number, from 1, increasing.
        members: the nodes of the new group, in rank order.
        store: where the group forms: ``{"host", "port", ...}`` of a rendezvous store
            (a member's worker's, with its ``node`` and ``incarnation``, or the
            controller's, with its ``epoch``).
        prefix: the generation's key prefix in that store.
        mode: one of :data:`MODES` (None in plans that do not say).
        reason: why it was issued (``start``, ``failure``, ``join``, ``leave``, ...).
        leaving: nodes that hand their state over and leave with this plan.
        incarnations: node -> the worker incarnation the plan counts on.
        slots: replica slots per node (``c``).
        gpus_per_node: workers (ranks) per node, ``G``.
        layers: MoE layer -> one row of expert ids per member (its ``c`` slots).
        lost, joined: the nodes that failed, and those that join, with this plan.
        detected_at, issued_at: when the event planned for was seen, and the plan issued
            (epoch seconds).
        fetches, missing, transfers, recovery_probability: the planner's figures
            (reports only).
        gpus: with G > 1, layer -> member -> GPU -> expert ids (the split of ``layers``
            rows over a node's ranks); None: round-robin.
    """

    generation: int
    members: list[str]
    store: dict[str, Any]
    prefix: str
    mode: str | None = None
    reason: str | None = None
    leaving: list[str] = field(default_factory=list)
    incarnations: dict[str, int] = field(default_factory=dict)
    slots: int | None = None
    gpus_per_node: int = 1
    layers: dict[str, list[list[int]]] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    joined: list[str] = field(default_factory=list)
    detected_at: float | None = None
    issued_at: float | None = None
    fetches: dict[str, Any] | None = None
    missing: dict[str, Any] = field(default_factory=dict)
    transfers: dict[str, Any] = field(default_factory=dict)
    recovery_probability: dict[str, Any] | None = None
    gpus: dict[str, Any] | None = None

    # ------------------------------------------------------------------ ranks
    @property
    def world(self) -> int:
        """Ranks of the plan: its nodes times their workers (``gpus_per_node``)."""
        return len(self.members) * self.gpus_per_node

    @property
    def ranks(self) -> dict[str, list[int]]:
        """``node -> its ranks`` (:func:`rank_layout`)."""
        return rank_layout(self.members, self.gpus_per_node)

    def rank(self, node: str, local_rank: int, local_world: int) -> int:
        """The rank of ``node``'s worker ``local_rank`` in this plan: node index * G +
        local rank.

        Raises:
            RuntimeError: the plan's workers per node differ from this agent's (a node
                started with another ``--nproc-per-node`` than the job's), or
                ``local_rank`` is outside them.
            ValueError: ``node`` is no member.
        """
        g = self.gpus_per_node
        if g != local_world:
            raise RuntimeError(f"plan {self.generation} has {g} workers per node but node {node} runs "
                               f"{local_world} (--nproc-per-node must be the same on every node)")
        if not 0 <= local_rank < g:
            raise RuntimeError(f"local rank {local_rank} outside [0, {g})")
        return self.members.index(node) * g + local_rank

    # ------------------------------------------------------------------ wire
    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Plan:
        """The plan of a ``plan`` message (or of the one a controller's state keeps).

        ``generation``, ``members``, ``store`` and ``prefix`` are required; every other
        field may be absent (its default). ``world_size`` and ``ranks``, when there, must
        agree with ``members`` and ``gpus_per_node``. Fields this version does not know
        are ignored.

        Raises:
            MalformedMessageError: a field is missing or wrong (the message names it and
                its value).
        """
        if not isinstance(d, Mapping):
            raise MalformedMessageError(f"a plan must be an object, got {d!r:.200}")
        if d.get("type", "plan") != "plan":
            raise _bad("type", "'plan'", d.get("type"))
        generation = d.get("generation")
        if not _is_int(generation) or generation < 1:
            raise _bad("generation", "an integer >= 1", generation)
        members = _node_list(d, "members", required=True)
        store = d.get("store")
        if not isinstance(store, dict) or not isinstance(store.get("host"), str) or not store["host"] \
                or not _is_int(store.get("port")) or not 1 <= store["port"] <= 65535:
            raise _bad("store", "{'host': address, 'port': 1-65535, ...}", store)
        prefix = d.get("prefix")
        if not isinstance(prefix, str) or not prefix:
            raise _bad("prefix", "a non-empty string", prefix)
        mode = d.get("mode")
        if mode is not None and mode not in MODES:
            raise _bad("mode", " or ".join(repr(m) for m in MODES) + " or null", mode)
        reason = _optional(d, "reason", lambda v: isinstance(v, str), "a string")
        incarnations = d.get("incarnations") or {}
        if not isinstance(incarnations, dict) or not all(isinstance(k, str) and _is_int(v)
                                                         for k, v in incarnations.items()):
            raise _bad("incarnations", "an object of node id -> integer", incarnations)
        slots = _optional(d, "slots", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
        g = d.get("gpus_per_node", 1)
        if not _is_int(g) or g < 1:
            raise _bad("gpus_per_node", "an integer >= 1", g)
        if "world_size" in d and d["world_size"] != len(members) * g:
            raise _bad("world_size", f"len(members) * gpus_per_node = {len(members) * g}", d["world_size"])
        if "ranks" in d and d["ranks"] != rank_layout(members, g):
            raise _bad("ranks", "contiguous blocks of gpus_per_node ranks in member order", d["ranks"])
        layers = _dict(d, "layers")
        for name, rows in layers.items():
            if not isinstance(rows, list) or len(rows) != len(members) or not all(
                    isinstance(row, list) and all(_is_int(e) and e >= 0 for e in row) for row in rows):
                raise _bad("layers", f"an object of layer -> {len(members)} rows (one per member) of expert ids",
                           {name: rows})
        gpus = d.get("gpus") or None
        if gpus is not None and (not isinstance(gpus, dict) or not all(
                isinstance(k, str) and isinstance(v, list) and len(v) == len(members) for k, v in gpus.items())):
            raise _bad("gpus", f"an object of layer -> {len(members)} per-GPU splits (one per member)", gpus)
        return cls(
            generation=generation, members=members, store=dict(store), prefix=prefix, mode=mode, reason=reason,
            leaving=_node_list(d, "leaving"), incarnations=dict(incarnations), slots=slots, gpus_per_node=g,
            layers=layers, lost=_node_list(d, "lost"), joined=_node_list(d, "joined"),
            detected_at=_optional(d, "detected_at", _is_number, "a time in epoch seconds"),
            issued_at=_optional(d, "issued_at", _is_number, "a time in epoch seconds"),
            fetches=_optional(d, "fetches", lambda v: isinstance(v, dict), "an object"),
            missing=_dict(d, "missing"), transfers=_dict(d, "transfers"),
            recovery_probability=_optional(d, "recovery_probability", lambda v: isinstance(v, dict), "an object"),
            gpus=gpus,
        )

    def to_wire(self) -> dict[str, Any]:
        """The ``plan`` message: the JSON object the agents, the workers and the
        controller's state file have always carried (field order included; ``gpus`` only
        when there is a split). Nested values are this plan's own: not to be changed."""
        msg = {
            "type": "plan", "generation": self.generation, "mode": self.mode, "reason": self.reason,
            "members": list(self.members), "leaving": list(self.leaving), "incarnations": dict(self.incarnations),
            "store": dict(self.store), "prefix": self.prefix, "slots": self.slots,
            "gpus_per_node": self.gpus_per_node, "world_size": self.world, "ranks": self.ranks,
            "layers": self.layers, "lost": list(self.lost), "joined": list(self.joined),
            "detected_at": self.detected_at, "issued_at": self.issued_at, "fetches": self.fetches,
            "missing": self.missing, "transfers": self.transfers,
            "recovery_probability": self.recovery_probability,
        }
        if self.gpus:
            msg["gpus"] = self.gpus
        return msg
