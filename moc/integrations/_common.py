"""Pieces the trainer adapters share: the callbacks' common state (:class:`CallbackRun`),
unwrapping optimizers, the RNG hand-off, hints."""

from __future__ import annotations

import logging
import re
import warnings
from typing import Any, Callable, Mapping

import torch

from .._config import MoCConfig
from .._manager import CheckpointManager
from .._optional import import_optional
from .._restore import RestoreReport
from .._units import capture_rng, restore_rng

__all__ = ["inner_optimizer", "RngHandoff", "require", "check_callback_args", "CallbackRun", "delegated", "QuietRecord",
           "QuietWarning"]


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


class CallbackRun:
    """What a trainer callback holds for moc, whichever trainer it serves: its checked
    arguments, the :class:`moc.CheckpointManager` while training runs, the step the newest
    run restored and the RNG hand-off. Each callback owns one (composition) and keeps its
    trainer's own loop logic to itself.

    Args:
        config, resume, extra_state, manager_kwargs: the callback's arguments.
        reserved: the ``extra_state`` names the callback uses itself.
    """

    def __init__(self, config: MoCConfig, *, resume: bool, extra_state: Mapping[str, Any] | None,
                 manager_kwargs: Mapping[str, Any] | None, reserved: Callable[[str], bool]) -> None:
        check_callback_args(config, extra_state, manager_kwargs, reserved=reserved)
        self.config = config
        self.resume = bool(resume)
        self.extra_state = dict(extra_state or {})
        self.manager_kwargs = dict(manager_kwargs or {})
        self.manager: CheckpointManager | None = None
        self.resumed_step: int | None = None
        self.last_restore_report: RestoreReport | None = None
        self.rng = RngHandoff()

    def open(self, model: torch.nn.Module, optimizer: Any, extra: Mapping[str, Any]) -> CheckpointManager:
        """A new manager over ``model`` and the (unwrapped) ``optimizer``, with the
        callback's own ``extra`` state and the user's ``extra_state``."""
        self.resumed_step = None
        self.last_restore_report = None
        self.manager = CheckpointManager(self.config, model=model, optimizer=inner_optimizer(optimizer),
                                         extra_state={**extra, **self.extra_state}, **self.manager_kwargs)
        return self.manager

    def restore(self) -> int | None:
        """Restore moc's newest step: the step restored, None when nothing was stored."""
        assert self.manager is not None     # opened by the callback's start hook
        next_step = self.manager.restore()
        self.last_restore_report = self.manager.last_restore_report
        return next_step - 1 if next_step else None

    def close(self, **kwargs: Any) -> None:
        """Close the manager (``kwargs``: :meth:`moc.CheckpointManager.close`'s), once."""
        if self.manager is not None:
            manager, self.manager = self.manager, None
            manager.close(**kwargs)


def delegated(name: str, doc: str) -> property:
    """A callback attribute kept in its :class:`CallbackRun` (``self._run``), readable and
    settable under the callback's public name."""
    return property(lambda self: getattr(self._run, name), lambda self, value: setattr(self._run, name, value),
                    doc=doc)


class QuietRecord(logging.Filter):
    """Keeps one log record of a trainer from the user: the one a moc restore makes
    misleading, told by the start of its message, on the one logger that emits it. Installed
    by a callback only after moc restored, removed when that no longer holds."""

    def __init__(self, logger: str, starts: str) -> None:
        super().__init__()
        self.logger = logging.getLogger(logger)
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == self.logger.name and record.getMessage().startswith(self.starts))

    def install(self) -> None:
        self.logger.addFilter(self)       # (once: a filter already there is not added again)

    def remove(self) -> None:
        self.logger.removeFilter(self)


class QuietWarning:
    """Keeps one ``warnings`` warning of a trainer from the user, the one a moc restore
    makes misleading: a filter matching its message's start, its category and the module
    that warns, nothing else; installed only after moc restored, and removed (that entry
    alone, whatever filters were added meanwhile) as soon as it no longer applies."""

    def __init__(self, starts: str, category: type[Warning], module: str) -> None:
        self.starts, self.category, self.module = starts, category, module
        self._entry: Any = None

    def install(self) -> None:
        if self._entry is None:
            warnings.filterwarnings("ignore", message=re.escape(self.starts), category=self.category,
                                    module=re.escape(self.module) + "$")
            self._entry = warnings.filters[0]

    def remove(self) -> None:
        entry, self._entry = self._entry, None
        filters: list[Any] = warnings.filters  # type: ignore[assignment]  # a list, typeshed says Sequence
        if entry is not None and entry in filters:
            filters.remove(entry)
