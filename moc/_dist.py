"""Small, pickle-free collectives for the checkpoint manager's coordination.

Metadata travels as UTF-8 JSON in uint8 tensors (``all_gather_object`` would unpickle
bytes from the network, which this project never does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Comm"]

# Bytes of each rank's JSON that :meth:`Comm.gather_json` carries in its first (often only)
# round: up to 64 KiB a rank, the round's total held near 1 MiB in large worlds.
GATHER_INLINE_MAX = 1 << 16
GATHER_ROUND_BYTES = 1 << 20


def gather_inline(world: int) -> int:
    """Bytes per rank that ride in :meth:`Comm.gather_json`'s first round for ``world`` ranks."""
    return max(4096, min(GATHER_INLINE_MAX, GATHER_ROUND_BYTES // max(world, 1)))


@dataclass
class Comm:
    """Rank, world and the process groups the manager uses (or a single process)."""

    rank: int = 0
    world: int = 1
    group: Any = None          # coordination from the training thread
    persist_group: Any = None  # coordination from the persist thread
    snapshot_group: Any = None  # remote snapshot copies from the snapshot thread
    private: bool = False       # bare gloo backends, not registered with torch.distributed

    @staticmethod
    def can_form_private() -> bool:
        """Can :meth:`create_private` form groups under one timeout and run them under
        another (a gloo backend with ``_set_default_timeout``)?"""
        return dist.is_available() and callable(getattr(getattr(dist, "ProcessGroupGloo", None),
                                                        "_set_default_timeout", None))

    @staticmethod
    def create(process_group: Any, timeout: timedelta) -> "Comm":
        """The manager's groups on ``process_group`` (default: the world), registered with
        ``torch.distributed``; ``timeout`` bounds their collectives."""
        if not (dist.is_available() and dist.is_initialized()):
            return Comm()
        pg = process_group if process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(pg)
        # Gloo groups of their own, one per thread that talks (training thread, persist thread,
        # snapshot thread), so their collectives never interleave on one group.
        group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        persist_group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        snapshot_group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        return Comm(rank=dist.get_rank(pg), world=len(ranks), group=group, persist_group=persist_group,
                    snapshot_group=snapshot_group)

    @staticmethod
    def create_private(store: Any, rank: int, world: int, timeout: timedelta,
                       form_timeout: timedelta | None = None) -> "Comm":
        """The manager's three gloo groups of ``world`` ranks, formed on ``store`` (every
        rank passes a store with the same keys, e.g. a ``PrefixStore`` of one rendezvous)
        and never registered with ``torch.distributed``: the default group, the group names
        and ``destroy_process_group`` never see them. A thread forming them can therefore
        be abandoned (a peer died while connecting: gloo waits up to 5x ``form_timeout``
        for a connection that never comes, and nothing can interrupt it); whatever it forms
        later is garbage. ``form_timeout`` bounds the connecting, ``timeout`` (set once
        formed) the collectives. :meth:`destroy` aborts them."""
        if world <= 1:
            return Comm(rank=rank, world=max(world, 1))
        first = form_timeout if form_timeout is not None else timeout
        groups = []
        for name in ("train", "persist", "snapshot"):
            pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world, first)
            if first != timeout:
                pg._set_default_timeout(timeout)
            groups.append(pg)
        return Comm(rank=rank, world=world, group=groups[0], persist_group=groups[1], snapshot_group=groups[2],
                    private=True)

    # -- the four collectives moc uses, on a registered group or a private backend -------------
    def _all_gather(self, out: list[torch.Tensor], t: torch.Tensor, group: Any) -> None:
        if self.private:
            group.allgather([out], [t]).wait()
        else:
            dist.all_gather(out, t, group=group)

    def _all_reduce(self, t: torch.Tensor, op: Any, group: Any) -> None:
        if self.private:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            group.allreduce([t], opts).wait()
        else:
            dist.all_reduce(t, op=op, group=group)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def gather_json(self, value: Any, *, persist: bool = False) -> list[Any]:
        """Every rank's ``value`` (JSON-able), in rank order, on every rank. One all-gather
        when every rank's encoding fits :func:`gather_inline` bytes (the common case: each
        round costs every rank a wait for the slowest), a second for the rest otherwise."""
        if not self.distributed:
            return [value]
        group = self.persist_group if persist else self.group
        data = json.dumps(value).encode()
        head = gather_inline(self.world)
        first = torch.zeros(8 + head, dtype=torch.uint8)
        first[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        if data:
            first[8: 8 + min(len(data), head)] = torch.frombuffer(bytearray(data[:head]), dtype=torch.uint8)
        out = [torch.empty(8 + head, dtype=torch.uint8) for _ in range(self.world)]
        self._all_gather(out, first, group)
        sizes = [int(o[:8].clone().view(torch.int64).item()) for o in out]
        parts = [bytes(o[8: 8 + min(n, head)].numpy()) for o, n in zip(out, sizes)]
        rest = max(sizes) - head
        if rest > 0:   # some rank's value is longer: the remainders, padded to the longest
            tail = torch.zeros(rest, dtype=torch.uint8)
            if len(data) > head:
                tail[: len(data) - head] = torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8)
            more = [torch.empty(rest, dtype=torch.uint8) for _ in range(self.world)]
            self._all_gather(more, tail, group)
            parts = [p + bytes(m[: max(0, n - head)].numpy()) for p, m, n in zip(parts, more, sizes)]
        return [json.loads(p.decode()) for p in parts]

    def gather_bytes(self, payload: bytes, lengths: list[int]) -> list[bytes]:
        """Every rank's ``payload`` in rank order (training-thread group), in ONE all-gather:
        ``lengths`` (every rank's payload length, agreed beforehand) sizes the padding."""
        if len(lengths) != self.world or lengths[self.rank] != len(payload):
            raise ValueError(f"lengths must list {self.world} payload sizes with this rank's "
                             f"({len(payload)}) at index {self.rank}, got {lengths}")
        if not self.distributed:
            return [payload]
        longest = max(lengths)
        padded = torch.zeros(longest, dtype=torch.uint8)
        if payload:
            padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world)]
        self._all_gather(out, padded, self.group)
        return [bytes(o[:n].numpy()) for o, n in zip(out, lengths)]

    def broadcast_json(self, value: Any, src: int = 0, *, persist: bool = False) -> Any:
        if not self.distributed:
            return value
        return self.gather_json(value if self.rank == src else None, persist=persist)[src]

    def any_true(self, flag: bool) -> bool:
        """Logical OR of ``flag`` over ranks (training-thread group)."""
        if not self.distributed:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        self._all_reduce(t, dist.ReduceOp.MAX, self.group)
        return bool(t.item())

    def sum_int64(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks of an int64 CPU tensor (training-thread group)."""
        if self.distributed:
            self._all_reduce(t, dist.ReduceOp.SUM, self.group)
        return t

    def exchange(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], *,
                 snapshot: bool = False) -> torch.Tensor:
        """One uneven all-to-all of uint8 bytes (training-thread group, or the snapshot
        thread's with ``snapshot=True``); the result is on ``send``'s device (a CUDA
        ``send`` on a group with an NCCL backend moves over NCCL)."""
        if not self.distributed:
            return send
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=send.device)
        group = self.snapshot_group if snapshot else self.group
        if self.private:
            group.alltoall_base(recv, send, list(recv_splits), list(send_splits), dist.AllToAllOptions()).wait()
        else:
            dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
        return recv

    def barrier(self) -> None:
        if self.distributed:
            if self.private:
                self.group.barrier(dist.BarrierOptions()).wait()
            else:
                dist.barrier(group=self.group)

    def destroy(self) -> None:
        if self.private:
            for g in (self.group, self.persist_group, self.snapshot_group):
                if g is not None:
                    try:
                        g.abort()
                    except Exception:  # noqa: BLE001 - already broken or aborted
                        pass
            return
        if self.distributed and dist.is_initialized():
            for g in (self.group, self.persist_group, self.snapshot_group):
                try:
                    dist.destroy_process_group(g)
                except Exception:  # noqa: BLE001 - the default group may already be gone
                    pass
