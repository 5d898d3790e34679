"""Bookkeeping shared by the parts of a :class:`moc.CheckpointManager`.

The manager is composed of small parts (policy, snapshot engine, persister, recovery);
the few facts they all read and write live here, guarded by one lock, so no part reaches
into another's fields.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["RunState"]


@dataclass
class RunState:
    """Facts about the run that every part of the manager shares.

    Attributes:
        rank, world: this process's place in the checkpointing group.
        run_id: one id for the whole job (kept across restores and reconfigurations).
        has_base: a committed manifest holds every unit (partial checkpoints may start).
        first_done: a snapshot was taken by this process or the manager it replaced.
        abandoned: the manager was detached; background jobs must not touch its buffers.
        sigterm: SIGTERM was received; the newest snapshot is flushed and the process exits
            (at once in a single process, else at the step the ranks agree on).
        stop_deadline: ``time.monotonic()`` by which a flush after SIGTERM gives up (the
            signal's time + ``MoCConfig.stop_timeout``); None before a SIGTERM.
        last_step: the step passed to the newest ``step()`` call.
        last_error: the newest error any part reported (status only).
        fatal: an error that ends checkpointing for good (another job writes to the same
            storage path); the next ``step()`` raises it.
        lock: guards these facts and the snapshot buffers' states; the manager passes its
            buffer pool's lock, so a successor after a handover and any background job of
            the manager it replaced serialise on the same lock.
    """

    rank: int
    world: int
    run_id: str = ""
    has_base: bool = False
    first_done: bool = False
    abandoned: bool = False
    sigterm: bool = False
    stop_deadline: float | None = None
    last_step: int | None = None
    last_error: str | None = None
    fatal: BaseException | None = None
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    def where(self) -> str:
        """``rank R step S`` for log lines."""
        return f"rank {self.rank} step {'-' if self.last_step is None else self.last_step}"
