"""Elastic jobs for :class:`moc.CheckpointManager`: handing a manager's buffers and
bookkeeping to its successor on a new process group (:meth:`ElasticMixin.detach`), and
the remote snapshot copies that keep a share alive on a rank not holding its unit."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import xxhash

from ._buffers import FREE, PERSIST, READY, SNAPSHOT, BufferPool, SnapshotBuffer

__all__ = ["ElasticMixin", "Handover"]

log = logging.getLogger("moc")


@dataclass
class Handover:
    """What a retired manager passes to its successor: the buffers and its bookkeeping."""

    pool: BufferPool
    state: dict[str, Any]


class ElasticMixin:
    """Mixed into CheckpointManager."""

    # -- reconfiguration -----------------------------------------------------------------
    def _export_state(self) -> dict[str, Any]:
        with self._lock:
            return {"run_id": self.run_id, "k_snapshot": self.k_snapshot, "k_persist": self.k_persist,
                    "interval": self.interval, "checkpoints": self._checkpoints,
                    "persist_rounds": self._persist_rounds, "has_base": self._has_base,
                    "first_done": self._first_done, "last_persisted_step": self._last_persisted_step,
                    "last_snapshot_step": self._last_snapshot_step, "recoveries": self._recoveries,
                    "persist_failures": self._persist_failures, "plt": self.plt_tracker.state()}

    def _adopt(self, handover: "Handover | None") -> None:
        """Continue the bookkeeping of the manager(s) this one replaces (collective)."""
        states = self.comm.gather_json(handover.state if handover is not None else None)
        state = next((s for s in states if s is not None), None)
        if state is None:
            return
        self.run_id = state["run_id"]
        self.k_snapshot, self.k_persist = int(state["k_snapshot"]), int(state["k_persist"])
        self.interval = int(state["interval"])
        self._checkpoints, self._persist_rounds = int(state["checkpoints"]), int(state["persist_rounds"])
        self._has_base, self._first_done = bool(state["has_base"]), bool(state["first_done"])
        self._last_persisted_step = state["last_persisted_step"]
        self._last_snapshot_step = state["last_snapshot_step"]
        self._recoveries = int(state["recoveries"])
        self._persist_failures = int(state["persist_failures"])
        self.plt_tracker.load_state(state["plt"])

    def detach(self, grace: timedelta = timedelta(milliseconds=500)) -> "Handover":
        """Retire this manager because its process group is broken or being replaced,
        keeping the snapshot buffers (node memory) and the bookkeeping for the manager
        built on the next process group (pass the result as ``handover=``).

        Local only, commits nothing new. Background snapshot/persist jobs get ``grace`` to
        finish; one still blocked in a collective (gloo peers that are alive but have left
        the group only time out) is abandoned: it can no longer publish a snapshot or
        write into a buffer, and its persist is never committed by anyone.
        """
        with self._lock:
            self._abandoned = True
        for name in ("_snapshot", "_persist"):
            fut = getattr(self, name)
            if fut is None:
                continue
            try:
                fut.result(timeout=grace.total_seconds())
            except FuturesTimeout:
                log.warning("rank %d: background %s still blocked at reconfiguration; abandoned", self.rank,
                            name.strip("_"))
            except Exception as exc:  # noqa: BLE001 - the group is gone; the snapshot stays in memory
                log.warning("rank %d: in-flight %s abandoned at reconfiguration: %s", self.rank, name.strip("_"), exc)
            setattr(self, name, None)
        with self._lock:
            for b in self.pool.buffers:
                # Its shares were planned for this group: a successor on another group must
                # not persist them (pieces of lost ranks would be missing). They stay in
                # memory as recovery sources.
                b.persisted = True
                if b.state == PERSIST:
                    b.state = READY
                elif b.state == SNAPSHOT:
                    b.invalidate()
                    b.state = FREE
        state = self._export_state()
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
        self._snap_exec.shutdown(wait=False)
        self._persist_exec.shutdown(wait=False)
        return Handover(pool=self.pool, state=state)

    def _exchange_copies(self, buf: SnapshotBuffer, remote, landing, where) -> list[dict[str, Any]]:
        """Send the shares this rank owns to their remote copy holders and land the
        copies it holds for others, with one all-to-all on the snapshot thread's group."""
        send_parts, send_splits, recv_splits = [], [0] * self.world, [0] * self.world
        for unit, start, end, src, dst in remote:   # one global order on every rank
            if src == self.rank:
                off = where[(unit, start)]
                send_parts.append((dst, buf.data[off: off + end - start]))
                send_splits[dst] += end - start
            if dst == self.rank:
                recv_splits[src] += end - start
        # all_to_all_single wants the send buffer grouped by destination rank; a stable
        # sort keeps the global order within each destination, which is how it lands.
        send_parts.sort(key=lambda x: x[0])
        send = torch.cat([t for _, t in send_parts]) if send_parts else torch.empty(0, dtype=torch.uint8)
        received = self.comm.exchange(send, send_splits, recv_splits, snapshot=True)
        starts, pos = {}, 0
        for q in range(self.world):
            starts[q] = pos
            pos += recv_splits[q]
        pieces = []
        with self._lock:
            if self._abandoned:  # the buffer may belong to the successor now
                raise RuntimeError("snapshot abandoned: the manager was detached")
            for (unit, start, end, src, _), off in landing:
                n = end - start
                buf.data[off: off + n].copy_(received[starts[src]: starts[src] + n])
                starts[src] += n
                pieces.append({"unit": unit, "start": start, "end": end, "offset": off,
                               "checksum": "xxh3:" + xxhash.xxh3_64_hexdigest(buf.view(off, n)), "persist": False})
        return pieces
