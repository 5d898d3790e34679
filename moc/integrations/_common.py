"""Pieces the trainer adapters share: unwrapping optimizers, the RNG hand-off, hints."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from .._config import MoCConfig
from .._optional import import_optional
from .._units import capture_rng, restore_rng

__all__ = ["inner_optimizer", "RngHandoff", "require", "check_callback_args"]


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The ``torch.optim.Optimizer`` under wrappers (accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``); ``None`` stays ``None``."""
    # AcceleratedOptimizer subclasses Optimizer without its hooks: always descend to the
    # innermost object that is an Optimizer.
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"moc needs a torch.optim.Optimizer (or a wrapper of one), got {type(optimizer).__name__}")
    return optimizer


class RngHandoff:
    """Holds the RNG state a restore brought back until the trainer reaches the point of
    the loop where the saving run was (the trainer draws from the global RNG in between,
    e.g. when it builds the epoch's data iterator)."""

    def __init__(self) -> None:
        self._state: dict[str, Any] | None = None

    def hold(self) -> None:
        self._state = capture_rng()

    def release(self) -> bool:
        if self._state is None:
            return False
        restore_rng(self._state)
        self._state = None
        return True

    @property
    def pending(self) -> bool:
        return self._state is not None


def require(module: str, extra: str | None, what: str) -> Any:
    """Import ``module`` or raise an ``ImportError`` saying which extra installs it."""
    return import_optional(module, what, extra)


def check_callback_args(config: Any, extra_state: Mapping[str, Any] | None, manager_kwargs: Mapping[str, Any] | None,
                        *, reserved: Callable[[str], bool]) -> None:
    """A callback's arguments: a :class:`MoCConfig`, ``extra_state`` names the callback does
    not use itself (``reserved``), ``manager_kwargs`` that leave the model, optimizer and
    extra state to the callback."""
    if not isinstance(config, MoCConfig):
        raise TypeError(f"MoCCallback(config=...) must be a moc.MoCConfig, got {type(config).__name__}")
    taken = sorted(n for n in (extra_state or {}) if reserved(n))
    if taken:
        raise ValueError(f"MoCCallback(extra_state=...) may not use the names {taken} (used by moc)")
    bad = {"model", "optimizer", "extra_state", "handover", "cfg"} & set(manager_kwargs or {})
    if bad:
        raise ValueError(f"MoCCallback(manager_kwargs=...) may not set {sorted(bad)}; allowed: "
                         "process_group, node, expert_pattern, memory_key")
