"""Retries with exponential backoff for transient storage errors."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, TypeVar

from ._errors import CommitConflict, classify

__all__ = ["RetryPolicy", "StorageError"]

log = logging.getLogger("storage_backends")
T = TypeVar("T")


def _exception(kind: type[BaseException], message: str) -> BaseException:
    return kind(message)


class StorageError(OSError):
    """Raised when an unknown provider error cannot be mapped to a more specific type."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a store retries a transient failure.

    ``attempts`` counts the first try. The delay before retry ``i`` (1-based) is
    ``min(initial * multiplier**(i-1), maximum)`` with up to ``jitter`` relative noise.
    """

    attempts: int = 5
    initial: timedelta = timedelta(milliseconds=100)
    maximum: timedelta = timedelta(seconds=5)
    multiplier: float = 2.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be an integer >= 1, got {self.attempts!r}")
        for name in ("initial", "maximum"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value < timedelta(0):
                raise ValueError(f"RetryPolicy.{name} must be a non-negative timedelta, got {value!r}")
        if self.multiplier < 1.0:
            raise ValueError(f"RetryPolicy.multiplier must be >= 1.0, got {self.multiplier!r}")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter!r}")

    def delay(self, retry: int) -> float:
        """Seconds to sleep before retry number ``retry`` (1-based)."""
        base = min(
            self.initial.total_seconds() * self.multiplier ** (retry - 1),
            self.maximum.total_seconds(),
        )
        return max(0.0, base * (1.0 + self.jitter * (2.0 * random.random() - 1.0)))

    def call(self, fn: Callable[[], T], *, what: str) -> T:
        """Run ``fn``; retry transient failures; raise a built-in exception naming ``what``."""
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except CommitConflict:
                raise  # typed already, and no retry finds the key free
            except Exception as exc:  # noqa: BLE001 - every provider error is mapped below
                kind, transient = classify(exc)
                if transient and attempt < self.attempts:
                    pause = self.delay(attempt)
                    log.warning(
                        "storage: %s failed (%s: %s); retry %d/%d in %.2fs",
                        what, type(exc).__name__, exc, attempt, self.attempts - 1, pause,
                    )
                    time.sleep(pause)
                    continue
                if kind is OSError:
                    kind = StorageError
                suffix = f" after {attempt} attempts" if transient and attempt > 1 else ""
                raise _exception(kind, f"{what}: {type(exc).__name__}: {exc}{suffix}") from exc
        raise AssertionError("unreachable")  # pragma: no cover
