"""The edges of the controller's :class:`~._membership.Membership`: the :class:`Port` it
talks to the outside through (send, record an event, save the state, call back later: the
controller gives it sockets and the event loop, a test gives it lists and a fake clock),
the record it keeps per node (:class:`Node`, without the connection) and the check of a
message's fields (:func:`msg_field`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._wire import MalformedMessageError

__all__ = ["EventSink", "Node", "Port", "Scheduler", "StateSink", "Timer", "msg_field"]


class Timer(Protocol):
    """A callback scheduled on the loop (:class:`asyncio.TimerHandle` is one)."""

    def cancel(self) -> None: ...

    def when(self) -> float: ...


class EventSink(Protocol):
    def __call__(self, name: str, level: int = ..., **fields: Any) -> None: ...


class StateSink(Protocol):
    def __call__(self, now: bool = ...) -> None: ...


class Scheduler(Protocol):
    def __call__(self, delay: float, callback: Callable[..., object], *args: Any) -> Timer: ...


@dataclass(frozen=True)
class Port:
    """Everything :class:`Membership` (and the controller's resume logic) may do outside.

    Attributes:
        send: send a message to a node (its connection); False when it has none open.
        event: record an event (events file and log): ``event(name, level, **fields)``.
        save_state: persist the state: at once (``now=True``) or coalesced.
        call_later: run ``callback(*args)`` after ``delay`` seconds on the loop.
        call_soon: run a callback soon on the loop.
        time: the loop's clock (what :meth:`Timer.when` is measured on).
        connected: whether a node's connection is open.
        own_store: the address of the controller's own rendezvous store (plans use it
            when the first member's worker hosts none).
        end_job: the job is done and the agents were told: stop once they have left.
        collective_while_resuming: a collective error's grace passed while the
            controller is resuming (True: of the current generation).
    """

    send: Callable[[str, dict[str, Any]], bool]
    event: EventSink
    save_state: StateSink
    call_later: Scheduler
    call_soon: Callable[[Callable[[], None]], object]
    time: Callable[[], float]
    connected: Callable[[str], bool]
    own_store: Callable[[], dict[str, Any]]
    end_job: Callable[[], None]
    collective_while_resuming: Callable[[bool], None]


@dataclass(eq=False)
class Node:
    """A registered node, as membership sees it (its connection is the controller's)."""

    node_id: str
    peer: str                   # the address of its connection (for the records)
    slots: int
    incarnation: int
    pid: int | None
    last_seen: float
    dead: bool = False          # declared failed (disconnect / heartbeat timeout)
    evict_sent: bool = False
    ready: bool = False         # the current worker incarnation said hello and is alive
    worker_pid: int | None = None
    leaving: bool = False
    step: int | None = None
    registered_at: float = field(default_factory=time.time)
    nproc: int = 1              # workers (GPUs, ranks) the agent runs: --nproc-per-node
    store: dict[str, Any] | None = None   # the rendezvous store its worker hosts (worker_ready)


def msg_field(msg: dict[str, Any], name: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
    """``msg[name]``, checked to be a ``kind`` (None when absent and ``optional``).

    Raises:
        MalformedMessageError: it is missing or of another type (a bool is no int).
    """
    v = msg.get(name)
    if v is None and optional:
        return None
    if isinstance(v, bool) and kind is not bool and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise MalformedMessageError(f"{msg['type']}: field {name!r} has the wrong type")
    if not isinstance(v, kind):
        raise MalformedMessageError(f"{msg['type']}: field {name!r} missing or of the wrong type")
    return v
