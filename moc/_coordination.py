"""What the ranks agree on at a checkpoint, in one collective.

At every checkpoint, and at the decision points between checkpoints, each rank brings a
:class:`Ballot`: SIGTERM seen, its snapshots failing, a unit it could not plan, no buffer for the due
snapshot, its persist thread busy, the snapshot it could persist, the newest persist job it has finished, its
routing counts, rank 0's tuning proposals, and the sizes of its units that changed since it
last published them. The numbers travel in ONE int64 all-reduce (SUM; per-rank values sit in
per-rank slots, so the sum doubles as a gather). Unit sizes, only when some rank has new ones
(the first checkpoint, optimizer state appearing, a restore), take one more all-gather,
whose lengths the all-reduce carried.

The resulting :class:`Agreement` is identical on every rank, so every decision taken from it
(flush and exit, raise, K, interval, selection, which snapshot to persist) is too. Each
collective is a round trip that also waits for the slowest rank, so they are folded into
one instead of one per question (SIGTERM, failures, routing sums, sizes, the persist
decision: ~10 gloo round trips per checkpoint when each asked its own).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping

import torch

from ._dist import Comm
from ._snapshot import PublishedSizes
from ._store import TreePlan

__all__ = ["Ballot", "Agreement", "Coordinator"]

# Slots of the all-reduced vector: counts over ranks, then rank 0's proposals.
_SIGTERM, _FAILED, _BROKEN, _BUSY, _K, _INTERVAL, _NO_BUFFER = range(7)
_FIXED = 7


@dataclass
class Ballot:
    """What one rank brings to a round."""

    sigterm: bool = False
    failed: bool = False              # max_consecutive_failures snapshots in a row failed here
    broken: bool = False              # planning this rank's units raised
    no_buffer: bool = False           # no snapshot buffer could be reserved for the due snapshot
    persist_busy: bool = False
    retry_step: int | None = None     # the complete snapshot this rank could persist now
    finished_seq: int = 0             # newest persist job finished on this rank
    routing: torch.Tensor | None = None   # int64 routing counts to sum (checkpoints only)
    k_snapshot: int | None = None     # tuning proposals; rank 0's are adopted
    interval: int | None = None
    sizes: dict[str, int] = field(default_factory=dict)   # this rank's units with new sizes


@dataclass
class Agreement:
    """The outcome of a round: the same on every rank."""

    sigterm: bool
    failed: bool
    broken: bool
    persist_busy: bool
    no_buffer: bool                   # some rank has no buffer: every rank skips the snapshot
    retry_steps: list[int | None]
    finished_seq: int                 # newest persist job finished on every rank
    routing: torch.Tensor | None
    k_snapshot: int | None
    interval: int | None
    collectives: int                  # issued by this round (0 on a single process)

    def persist_step(self, designated: bool, step: int) -> int | None:
        """The snapshot to persist now, or None: the one just taken (``designated``) or the
        newest due one every rank has complete and unpersisted, and only while no rank's
        persist thread is busy."""
        if self.persist_busy:
            return None
        if designated:
            return step
        steps = set(self.retry_steps)
        if len(steps) != 1 or None in steps:
            return None
        return steps.pop()


class Coordinator:
    """Runs rounds over the training thread's group and keeps every rank's published unit
    sizes (``sizes``).

    Args:
        comm: the manager's collectives.
        routing_len: length of the routing-count vector (the same on every rank).
    """

    def __init__(self, comm: Comm, routing_len: int) -> None:
        self.comm = comm
        self.routing_len = routing_len
        self.sizes = PublishedSizes(comm.world)
        self.rounds = 0
        self.collectives = 0

    def changed_sizes(self, plans: Mapping[str, TreePlan]) -> dict[str, int]:
        """This rank's units whose size differs from what it last published."""
        mine = self.sizes.tables[self.comm.rank]
        return {n: p.nbytes for n, p in plans.items() if mine.get(n) != p.nbytes}

    def agree(self, ballot: Ballot) -> Agreement:
        """One round (collective: every rank of the group calls it at the same step)."""
        world, rank = self.comm.world, self.comm.rank
        retry0, seq0, len0, route0 = _FIXED, _FIXED + world, _FIXED + 2 * world, _FIXED + 3 * world
        v = torch.zeros(route0 + self.routing_len, dtype=torch.int64)
        v[_SIGTERM], v[_FAILED], v[_BROKEN], v[_BUSY] = (int(ballot.sigterm), int(ballot.failed), int(ballot.broken),
                                                         int(ballot.persist_busy))
        v[_NO_BUFFER] = int(ballot.no_buffer)
        if rank == 0:
            v[_K] = ballot.k_snapshot or 0
            v[_INTERVAL] = ballot.interval or 0
        v[retry0 + rank] = -1 if ballot.retry_step is None else ballot.retry_step
        v[seq0 + rank] = ballot.finished_seq
        blob = json.dumps(ballot.sizes, separators=(",", ":")).encode() if ballot.sizes else b""
        v[len0 + rank] = len(blob)
        if ballot.routing is not None:
            if ballot.routing.numel() != self.routing_len:
                raise ValueError(f"routing has {ballot.routing.numel()} counts, the round carries {self.routing_len}")
            v[route0:] = ballot.routing
        collectives = 0
        if self.comm.distributed:
            # Every rank writes only its own per-rank slots, so the sum is the gather.
            self.comm.sum_int64(v)
            collectives += 1
        vals = v[:route0].tolist()
        lengths = vals[len0:route0]
        if any(lengths):
            blobs = self.comm.gather_bytes(blob, lengths)
            collectives += int(self.comm.distributed)
            for r, b in enumerate(blobs):
                if b:
                    self.sizes.update(r, {str(n): int(nb) for n, nb in json.loads(b.decode()).items()})
        self.rounds += 1
        self.collectives += collectives
        retry = vals[retry0:seq0]
        return Agreement(
            sigterm=vals[_SIGTERM] > 0, failed=vals[_FAILED] > 0, broken=vals[_BROKEN] > 0,
            persist_busy=vals[_BUSY] > 0, no_buffer=vals[_NO_BUFFER] > 0,
            retry_steps=[None if s < 0 else s for s in retry],
            finished_seq=min(vals[seq0:len0]), routing=v[route0:] if ballot.routing is not None else None,
            k_snapshot=vals[_K] or None, interval=vals[_INTERVAL] or None, collectives=collectives)
