"""Optional dependencies: import one, or fail with a one-line hint naming the extra."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["import_optional", "EXTRAS"]

# what `pip install "moc-lazarus[EXTRA]"` brings, by top-level module
EXTRAS = {"matplotlib": "plot", "transformers": "hf", "accelerate": "hf", "lightning": "lightning"}


def import_optional(module: str, what: str, extra: str | None = None) -> ModuleType:
    """``importlib.import_module(module)``, or ``ImportError("<what> needs <module>: pip
    install "moc-lazarus[<extra>]"")`` when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        extra = extra or EXTRAS.get(top)
        hint = f'pip install "moc-lazarus[{extra}]"' if extra else f"pip install {top}"
        raise ImportError(f"{what} needs {top}, which is not installed: {hint}") from exc
