"""What a training worker holds between two reconfigurations, and what it lends its
reconfigurer (:class:`._reconfigure.Reconfigurer`), kept apart from both so that neither
module imports the other.

* :class:`WorkerState`: the model, optimizer, moc manager, step and place in the group.
  The trainer holds one; applying a plan takes it and returns the next
  (:meth:`._reconfigure.Reconfigurer.apply`), never writing the trainer's attributes.
* :class:`WorkerContext`: what does not change while the worker lives (its node, place on
  the node, backend, model layout, agent channel, metrics callback).
* A plan that fails part way hands back what it wrote so far with its exception
  (:func:`carry_state` / :func:`state_after`): the trainer's state after the failure is
  the one the apply left, as when it wrote the trainer's fields directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ._backend import TrainerBackend

__all__ = ["StateDraft", "WorkerContext", "WorkerState", "carry_state", "state_after"]

_STATE_ATTR = "_lazarus_worker_state"


@dataclass(frozen=True)
class WorkerState:
    """A worker's training state (replaced whole, never changed in place: ``members`` is
    a fresh list in every state a plan gives)."""

    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    ckpt: Any = None                 # the moc CheckpointManager (None between generations)
    step: int = 0                    # next step to run == optimizer steps applied
    rank: int = -1
    world: int = 0
    members: list[str] = field(default_factory=list)
    generation: int = -1
    left: bool = False               # this node handed its state over and left the job

    def replace(self, **changes: Any) -> WorkerState:
        return replace(self, **changes)


class StateDraft:
    """A :class:`WorkerState` being written, field by field, by one reconfiguration
    (:meth:`freeze` gives the state it reached, also when it failed part way)."""

    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    ckpt: Any
    step: int
    rank: int
    world: int
    members: list[str]
    generation: int
    left: bool

    def __init__(self, state: WorkerState) -> None:
        for f in fields(WorkerState):
            setattr(self, f.name, getattr(state, f.name))

    def freeze(self) -> WorkerState:
        return WorkerState(**{f.name: getattr(self, f.name) for f in fields(WorkerState)})


def carry_state(exc: BaseException, state: WorkerState) -> None:
    """Attach the state a failed reconfiguration reached to its exception."""
    setattr(exc, _STATE_ATTR, state)


def state_after(exc: BaseException, before: WorkerState) -> WorkerState:
    """The state a failed reconfiguration left (:func:`carry_state`), else ``before``."""
    state = getattr(exc, _STATE_ATTR, None)
    return state if isinstance(state, WorkerState) else before


@dataclass(frozen=True)
class WorkerContext:
    """What the reconfigurer needs of its worker beyond the state and the config.

    Args:
        node: the node's id (plans name it).
        local_rank, local_world: this worker's place on the node (``--nproc-per-node``).
        where: its name in log lines (``node`` or ``node/local_rank``).
        backend: the resolved device and backend.
        layout: ``{"layers": {name: num_experts}, "top_k": k}``.
        channel: the link to the node's agent (plans in; reports out).
        memory_key: this worker's snapshot folder in the node's memory.
        metric: appends one record to the metrics file.
    """

    node: str
    local_rank: int
    local_world: int
    where: str
    backend: TrainerBackend
    layout: Mapping[str, Any]
    channel: Any
    memory_key: str = "worker0"
    metric: Callable[[dict[str, Any]], None] = lambda record: None

    @property
    def device(self) -> torch.device:
        return self.backend.device
