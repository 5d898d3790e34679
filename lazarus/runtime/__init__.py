"""Lazarus runtime: the control plane of elastic expert-parallel training.

* :class:`Controller` (one per job) — membership, failure detection (disconnects, missed
  heartbeats, worker exits, collective errors), replica allocation + MRO placement +
  migration planning, plans to the agents, and the rendezvous ``TCPStore``. Its state
  lives in a state directory: restarted, it resumes the job.
* :class:`Agent` (one per node) — registers, heartbeats, runs and watches the worker
  (restarts capped against crash loops), relays plans down and reports up, turns SIGTERM
  into a graceful leave, keeps the worker training while it reconnects to a lost
  controller, and never kills a worker that reported done.
* :class:`AgentChannel` — the worker's end of the agent connection (inside the trainer).
* :class:`ElasticTrainer` (+ :class:`ElasticConfig`) — the training process: step loop,
  in-process reconfiguration on a broken collective, peer transfers, moc fallback (restore
  the lost experts and book PLT, or roll back and replay an exact window:
  ``ElasticConfig.lost_experts``).
* ``_wire`` — length-prefixed, HMAC-SHA256-authenticated JSON frames (no pickle).

The code is laid out by the process that runs it: :mod:`.controller`, :mod:`.agent` and
:mod:`.worker` (the training process); at this level only what they share: the wire format
(``_wire``), the controller's and agents' configs (``_config``), the plan (``_plan``) and
the command lines (``_cli``).

The trainer names load lazily, so the controller and agents never import torch's
training stack; so does :class:`Controller` (the planner, numpy), so that an agent starts
its worker 0.3-1 s sooner (the worker's imports are most of a cold join).

CLI: ``lazarus controller`` and ``lazarus agent`` (see ``lazarus <cmd> --help``).
"""

from ._config import AgentConfig, ControllerConfig, parse_duration
from ._wire import (
    BadMacError,
    ConnectionClosed,
    FrameTooLargeError,
    MalformedMessageError,
    ProtocolError,
)
from .agent._agent import Agent
from .worker._channel import AgentChannel

_LAZY = {
    "Controller": (".controller._controller", "Controller"),
    "ElasticTrainer": (".worker._trainer", "ElasticTrainer"),
    "ElasticConfig": (".worker._elastic_config", "ElasticConfig"),
    "is_collective_error": (".worker._trainer", "is_collective_error"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module, __name__), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Agent",
    "AgentChannel",
    "AgentConfig",
    "BadMacError",
    "ConnectionClosed",
    "Controller",
    "ControllerConfig",
    "ElasticConfig",
    "ElasticTrainer",
    "FrameTooLargeError",
    "MalformedMessageError",
    "ProtocolError",
    "is_collective_error",
    "parse_duration",
]
