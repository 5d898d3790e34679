"""Keep ``torch._dynamo`` out of a worker's start-up until something compiles.

Every ``torch.optim`` optimizer imports ``torch._dynamo`` on its first use: its
constructor's ``add_param_group`` and ``zero_grad`` / ``state_dict`` are wrapped by
``torch._disable_dynamo`` (which imports it to call ``torch._dynamo.disable``) and every
``step()`` runs ``import torch._dynamo; torch._dynamo.graph_break()``. That import costs
1.3 s on a quiet core and 3-9 s on two loaded ones, paid by every worker that starts (a
joining node, a restarted worker) before it can train, for two functions that do nothing
while nothing is being compiled: ``graph_break()`` is a no-op outside tracing and
``disable(fn)`` runs ``fn`` as is.

:func:`defer_dynamo_import` puts a stand-in module under ``sys.modules["torch._dynamo"]``
that answers exactly those two (and ``trace_rules.clear_lru_cache()``, which
``init_process_group`` calls whenever the name is in ``sys.modules``) without importing
anything, and imports the real module the moment anything else is asked of it
(``torch.compile``, ``torch._dynamo.config``, a submodule import, ...), from then on
forwarding every attribute to it. A function
"disabled" through the stand-in calls straight through until the real module is loaded,
then through torch's own ``disable`` wrapper (built once): before the real module exists
no frame can be traced by dynamo, so behaviour never differs from torch's. Opt out with
``LAZARUS_DEFER_DYNAMO=0``.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
import types
from typing import Any, Callable

__all__ = ["defer_dynamo_import", "dynamo_loaded"]

_NAME = "torch._dynamo"
_LOCK = threading.RLock()


def _graph_break(msg: str = "") -> None:
    """``torch._dynamo.graph_break`` outside tracing: nothing."""


class _DeferredTraceRules:
    """``torch._dynamo.trace_rules`` for ``init_process_group``, which clears its caches
    whenever ``"torch._dynamo" in sys.modules``: caches of a module never imported hold
    nothing. Anything else is asked of the real one."""

    def __init__(self, parent: "_DeferredDynamo") -> None:
        self._parent = parent

    def clear_lru_cache(self) -> None:
        real = self._parent.__dict__["_real"]
        if real is not None:
            real.trace_rules.clear_lru_cache()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parent._load().trace_rules, name)


class _DeferredDynamo(types.ModuleType):
    """The stand-in: ``graph_break`` and ``disable`` without the import, anything else
    from the real module (imported on first need)."""

    def __init__(self) -> None:
        super().__init__(_NAME, "torch._dynamo, imported when first needed (lazarus.runtime.worker._lazy_dynamo)")
        self.__dict__["_real"] = None

    def _load(self) -> types.ModuleType:
        real = self.__dict__["_real"]
        if real is not None:
            return real
        with _LOCK:
            real = self.__dict__["_real"]
            if real is None:
                if sys.modules.get(_NAME) is self:
                    del sys.modules[_NAME]
                import torch

                if torch.__dict__.get("_dynamo") is self:
                    del torch.__dict__["_dynamo"]
                if os.environ.get("LAZARUS_DEFER_DYNAMO_TRACE"):   # who needed it (diagnosis)
                    import traceback
                    traceback.print_stack(limit=12)
                real = importlib.import_module(_NAME)
                self.__dict__["_real"] = real
        return real

    def __getattr__(self, name: str) -> Any:
        if self.__dict__["_real"] is None:
            if name == "graph_break":
                return _graph_break
            if name == "disable":
                return self._disable
            if name == "trace_rules":
                return _DeferredTraceRules(self)
        return getattr(self._load(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._load(), name, value)

    def _disable(self, fn: Callable | None = None, recursive: bool = True, *, reason: str | None = None,
                 wrapping: bool = True) -> Any:
        """``torch._dynamo.disable`` with the same signature: ``fn`` as is until the real
        module is loaded, then torch's wrapper of it."""
        if fn is None:
            return functools.partial(self._disable, recursive=recursive, reason=reason, wrapping=wrapping)
        stub = self
        resolved: list[Callable] = []

        def call(*args: Any, **kwargs: Any) -> Any:
            if not resolved:
                real = stub.__dict__["_real"]
                if real is None:
                    return fn(*args, **kwargs)
                resolved.append(real.disable(fn, recursive, reason=reason, wrapping=wrapping))
            return resolved[0](*args, **kwargs)

        if wrapping:
            functools.update_wrapper(call, fn)
        return call


def defer_dynamo_import() -> bool:
    """Install the stand-in (see the module docstring) unless ``torch._dynamo`` is already
    imported or ``LAZARUS_DEFER_DYNAMO=0``. Returns whether it is installed now."""
    if os.environ.get("LAZARUS_DEFER_DYNAMO", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    with _LOCK:
        current = sys.modules.get(_NAME)
        if isinstance(current, _DeferredDynamo):
            return current.__dict__["_real"] is None
        if current is not None:
            return False
        import torch

        stub = _DeferredDynamo()
        sys.modules[_NAME] = stub
        torch.__dict__["_dynamo"] = stub
        return True


def dynamo_loaded() -> bool:
    """Is the real ``torch._dynamo`` imported (whether or not through the stand-in)?"""
    current = sys.modules.get(_NAME)
    if isinstance(current, _DeferredDynamo):
        return current.__dict__["_real"] is not None
    return current is not None
