"""The worker's plans as :class:`~lazarus.runtime._plan.Plan`\\ s, each message parsed once.

The agent channel hands over plan messages as they came (dicts: what
:class:`~lazarus.runtime.AgentChannel` promises its users); the trainer and the
reconfigurer read them typed, through these two functions. The newest message parsed is
remembered with its plan, so polling the newest plan (every step, every 50 ms while a
plan is applied) parses it once, not every time.
"""

from __future__ import annotations

from typing import Any

from .._plan import Plan

__all__ = ["latest_plan", "parsed", "wait_plan"]

_last: tuple[dict[str, Any], Plan] | None = None   # the newest message parsed (held: its id stays its own)


def parsed(msg: dict[str, Any] | None) -> Plan | None:
    """The plan of the ``plan`` message ``msg`` (None for None).

    Raises:
        MalformedMessageError: a field of the message is wrong (see :meth:`Plan.from_wire`).
    """
    global _last
    if msg is None:
        return None
    last = _last
    if last is not None and last[0] is msg:
        return last[1]
    plan = Plan.from_wire(msg)
    _last = (msg, plan)
    return plan


def latest_plan(channel: Any) -> Plan | None:
    """The newest plan ``channel`` (an :class:`~lazarus.runtime.AgentChannel`) received, or None."""
    return parsed(channel.latest_plan())


def wait_plan(channel: Any, newer_than: int, timeout: float | None = None) -> Plan:
    """:meth:`AgentChannel.wait_plan <lazarus.runtime.AgentChannel.wait_plan>`, typed."""
    plan = parsed(channel.wait_plan(newer_than, timeout=timeout))
    assert plan is not None
    return plan
