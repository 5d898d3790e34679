"""Retry pacing for the agent's connections to the controller, and rate-limited logging
of repeated errors for the controller.

:class:`Backoff` spaces the attempts of a retry loop: exponentially growing pauses with
jitter, so that agents that lost the same controller do not come back in lock-step, and
so that a peer which keeps refusing us (or closing the connection) is not hammered.

:class:`RepeatLimiter` lets the first occurrence of an error through and counts the rest
per key (a peer's address) and interval, to be reported as one line with a count.

Both take their clock and random source as arguments, so tests drive them exactly.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

__all__ = ["Backoff", "RepeatLimiter"]


@dataclass
class Backoff:
    """Pauses before the attempts of a retry loop.

    Attempt 0 goes at once; attempt ``k >= 1`` waits ``min(maximum, initial *
    multiplier ** (k - 1))`` less a random share of up to ``jitter`` of it, so a pause
    never exceeds ``maximum``. :meth:`reset` starts again at attempt 0 (call it when a
    connection got as far as being accepted by the peer, not merely opened).

    Attributes:
        initial: the pause before attempt 1.
        maximum: the longest pause.
        multiplier: growth of the pause per attempt (>= 1).
        jitter: the share of each pause drawn at random, in [0, 1]: a pause ``d`` becomes
            a uniform draw from ``[(1 - jitter) * d, d]``.
        rng: the random source (a seeded ``random.Random`` in tests).
    """

    initial: timedelta = timedelta(milliseconds=100)
    maximum: timedelta = timedelta(seconds=1)
    multiplier: float = 2.0
    jitter: float = 0.5
    rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)
    attempts: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        for name in ("initial", "maximum"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value < timedelta(0):
                raise ValueError(f"Backoff: {name} must be a datetime.timedelta >= 0, got {value!r}")
        if self.maximum < self.initial:
            raise ValueError(f"Backoff: maximum ({self.maximum}) must be >= initial ({self.initial})")
        if isinstance(self.multiplier, bool) or not isinstance(self.multiplier, (int, float)) \
                or self.multiplier < 1.0:
            raise ValueError(f"Backoff: multiplier must be a number >= 1, got {self.multiplier!r}")
        if isinstance(self.jitter, bool) or not isinstance(self.jitter, (int, float)) \
                or not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"Backoff: jitter must be a number in [0, 1], got {self.jitter!r}")

    def ceiling(self, attempt: int) -> timedelta:
        """The pause before ``attempt`` without jitter (0 for attempt 0)."""
        if attempt <= 0:
            return timedelta(0)
        # the exponent is bounded: past the cap the pause no longer grows
        exponent = min(attempt - 1, 64)
        seconds = self.initial.total_seconds() * float(self.multiplier) ** exponent
        return min(self.maximum, timedelta(seconds=min(seconds, self.maximum.total_seconds())))

    def next_delay(self) -> timedelta:
        """The pause before the next attempt (which it counts)."""
        top = self.ceiling(self.attempts).total_seconds()
        self.attempts += 1
        if top <= 0:
            return timedelta(0)
        return timedelta(seconds=top * (1.0 - self.jitter * self.rng.random()))

    def reset(self) -> None:
        """The next attempt is attempt 0 again (goes at once)."""
        self.attempts = 0


class RepeatLimiter:
    """One line per key (a peer's address) per ``interval``, with a count of the rest.

    :meth:`hit` returns True for an occurrence to report in full (the first for a key not
    seen lately) and False for one only counted. :meth:`flush` returns, for each key whose
    interval has ended, how many occurrences were counted and over how many seconds; a key
    with a count stays open for another interval (a peer that keeps failing gets one
    summary line per interval), a key without one is forgotten (its next occurrence is
    reported in full again). An ``interval`` of 0 reports every occurrence.
    """

    def __init__(self, interval: timedelta, clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(interval, timedelta) or interval < timedelta(0):
            raise ValueError(f"RepeatLimiter: interval must be a datetime.timedelta >= 0, got {interval!r}")
        self.interval = interval.total_seconds()
        self._clock = clock
        self._open: dict[str, list[float]] = {}   # key -> [interval start, occurrences counted]

    def hit(self, key: str) -> bool:
        """Record an occurrence; True when it is to be reported in full."""
        if self.interval <= 0:
            return True
        entry = self._open.get(key)
        if entry is None:
            self._open[key] = [self._clock(), 0]
            return True
        entry[1] += 1
        return False

    def flush(self, everything: bool = False) -> dict[str, tuple[int, float]]:
        """``{key: (count, seconds)}``: the occurrences counted in each interval that has
        ended (``everything``: in every interval, ended or not: at exit), and its length."""
        now = self._clock()
        due: dict[str, tuple[int, float]] = {}
        for key, (start, count) in list(self._open.items()):
            if now - start < self.interval and not everything:
                continue
            if count:
                due[key] = (int(count), now - start)
                self._open[key] = [now, 0]
            else:
                del self._open[key]
        return due

    def __len__(self) -> int:
        """Keys open (seen within their interval)."""
        return len(self._open)
