"""The worker's side of the progress beat (:mod:`lazarus.runtime._beat`): the training
thread says, at every step, which step it runs and on which generation, or that it waits
for a plan, reconfigures, or finished. Its agent reads the region to tell a worker that
stopped making progress from one that is merely slow.

Only the training thread calls :class:`ProgressBeat`: a background thread that kept
beating while the step is stuck would hide the hang. Outside a worker started by
``lazarus agent`` (no ``LAZARUS_PROGRESS_FD``) every call is a no-op.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time

from .._beat import (BEAT_BYTES, FIELDS, FIELDS_AT, PHASE_DONE, PHASE_IDLE, PHASE_STEP, PROGRESS_FD_ENV, SEQ, SEQ_AT,
                     pack_header)

__all__ = ["ProgressBeat"]

log = logging.getLogger("lazarus.trainer")

#: weight of the newest step in the typical step time (an exponential average)
_EMA = 0.2


class ProgressBeat:
    """Writes this worker's beat; see the module docstring."""

    def __init__(self, fd: int | None) -> None:
        self._map: mmap.mmap | None = None
        self._seq = 0
        self._phase = -1
        self._step = -1
        self._t_ns = 0
        self._typical_ns = 0.0
        self._steady = 0        # consecutive steps timed since the last pause
        self._tid = 0           # the training thread's native id (the first caller's)
        if fd is None:
            return
        try:
            self._map = mmap.mmap(fd, BEAT_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            pack_header(self._map)
        except (OSError, ValueError) as exc:
            log.warning("progress beat off: %s=%d cannot be mapped (%s); the agent cannot tell a hung worker "
                        "from a slow one", PROGRESS_FD_ENV, fd, exc)
            self._map = None
        finally:
            os.close(fd)

    @classmethod
    def from_env(cls) -> ProgressBeat:
        """The region the agent passed (``LAZARUS_PROGRESS_FD``); a no-op beat without one."""
        raw = os.environ.pop(PROGRESS_FD_ENV, None)   # not inherited by the worker's own children
        if not raw:
            return cls(None)
        try:
            fd = int(raw)
        except ValueError:
            log.warning("progress beat off: %s=%r is no descriptor", PROGRESS_FD_ENV, raw)
            return cls(None)
        return cls(fd)

    @property
    def active(self) -> bool:
        return self._map is not None

    def step(self, step: int, generation: int) -> None:
        """The training thread starts step ``step`` on ``generation``."""
        now = time.monotonic_ns()
        if self._phase == PHASE_STEP and step == self._step + 1:
            dt = now - self._t_ns   # the previous step, start to start
            self._steady += 1       # (the first step after a pause, its warm-up, is not averaged)
            if self._steady == 2:
                self._typical_ns = dt
            elif self._steady > 2:
                self._typical_ns = (1 - _EMA) * self._typical_ns + _EMA * dt
        self._write(PHASE_STEP, step, generation, now)

    def idle(self, step: int, generation: int) -> None:
        """The worker waits for a plan or reconfigures (not a step: not judged as one)."""
        self._steady = 0   # the first step after a pause is no typical one (warm-up, compile)
        self._typical_ns = 0.0
        self._write(PHASE_IDLE, step, generation, time.monotonic_ns())

    def done(self, step: int, generation: int) -> None:
        self._write(PHASE_DONE, step, generation, time.monotonic_ns())

    def _write(self, phase: int, step: int, generation: int, t_ns: int) -> None:
        self._phase, self._step, self._t_ns = phase, step, t_ns
        m = self._map
        if m is None:
            return
        # typical: known once two steps in a row were timed (the first after a pause is not)
        typical = int(self._typical_ns) if self._steady >= 2 else 0
        if not self._tid:
            self._tid = threading.get_native_id() & 0xFFFFFFFF
        self._seq += 1
        SEQ.pack_into(m, SEQ_AT, self._seq)            # odd: writing
        FIELDS.pack_into(m, FIELDS_AT, phase, self._tid, step, generation, t_ns, typical)
        self._seq += 1
        SEQ.pack_into(m, SEQ_AT, self._seq)            # even: consistent
