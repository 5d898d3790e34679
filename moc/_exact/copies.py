"""How exact mode copies a step's capture into its window's buffer: on the host, or from
CUDA on :mod:`moc._cuda`'s side streams.

On CUDA every copy runs on a side stream per device that waits on an event recorded right
after ``optimizer.step()`` (never on the default stream, never from a thread racing the
training stream). Into a page-locked buffer they are all issued from ``step()``,
asynchronously: the next forward waits on the device for the copies of state it changes in
place, the next update (:meth:`CaptureCopies.order_update`, from the optimizer pre-hook)
for all of them, and the capture thread waits for their completion event before it
checksums. A buffer not page-locked (yet: the upkeep thread locks it once its window ends)
is copied by the capture thread, the pre-hook waiting for it as on the CPU.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from .._cuda import CudaCopier, CudaCopyBatch, HostCopier, copier_for, runtime
from .._snapshot import BufferPool, SnapshotBuffer
from .._store import TreePlan

__all__ = ["CaptureCopies"]

log = logging.getLogger("moc")

# (what, unit or extra name, plan, unit spec or None, offset in the buffer)
Placed = tuple[str, str, TreePlan, Any, int]


class CaptureCopies:
    """The copier of one :class:`~moc._exact.checkpointer.ExactCheckpointer` and its counts."""

    def __init__(self, pool: BufferPool, where) -> None:
        self.pool = pool
        self._where = where                        # () -> "rank r step s" for log lines
        self._copier: HostCopier | CudaCopier = HostCopier()
        self._batch: CudaCopyBatch | None = None   # copies the next update waits for on the device
        self.device_async = 0                      # steps whose copies were issued into page-locked memory
        self.device_fallback = 0                   # ... copied by the capture thread (buffer not page-locked)
        self._pin_error_logged = False

    def refresh(self, sources: Iterable[torch.Tensor]) -> None:
        """At a window's first step: the copier for where the model's tensors live now."""
        self._copier = copier_for(sources, self._copier)

    def pin_device(self) -> torch.device | None:
        """The CUDA device the buffers are page-locked for (None on the host)."""
        return self._copier.device if isinstance(self._copier, CudaCopier) else None

    def issue(self, buf: SnapshotBuffer, end: int, sync: list[Placed], later: list[Placed]
              ) -> tuple[CudaCopyBatch | None, bool, list[Placed]]:
        """``step()``: copy ``sync`` (state the next forward changes) now and issue ``later``
        where the device can copy it asynchronously (``buf`` page-locked up to ``end``).
        Returns (the batch, whether it was issued, what the capture thread still copies)."""
        batch = self._copier.begin() if self._copier.device_async else None
        if batch is not None and buf.pinned_for(end):
            for _, _, plan, _, off in sync:
                batch.copy(plan, 0, plan.nbytes, buf.data[off: off + plan.nbytes])
            batch.fence()
            for _, _, plan, _, off in later:
                batch.copy(plan, 0, plan.nbytes, buf.data[off: off + plan.nbytes])
            batch.finish()
            self._batch = batch
            self.device_async += 1
            return batch, True, []
        if batch is not None:
            self.device_fallback += 1
            error = self.pool.pin_error()
            if error is not None and not self._pin_error_logged:
                self._pin_error_logged = True
                log.warning("%s: a snapshot buffer in %s cannot be page-locked (%s); exact captures from CUDA are "
                            "copied by the capture thread and the optimizer step waits for it", self._where(),
                            self.pool.directory, error)
        for _, _, plan, _, off in sync:
            self.copy_now(batch, plan, buf.data[off: off + plan.nbytes])
        return batch, False, later

    @staticmethod
    def copy_now(batch: CudaCopyBatch | None, plan: TreePlan, out: torch.Tensor) -> None:
        """A copy complete on return: on the host, or on the side stream behind the update."""
        if batch is None:
            plan.copy_range(0, plan.nbytes, out)
        else:
            batch.copy(plan, 0, plan.nbytes, out, non_blocking=False)

    def land(self, buf: SnapshotBuffer, batch: CudaCopyBatch | None, issued: bool, later: list[Placed]) -> None:
        """The capture thread: wait for the copies issued by ``step()``, make the others."""
        if batch is not None:
            runtime().set_device(batch.device)    # before any CUDA call of this thread
            if issued:
                batch.synchronize()
        for _, _, plan, _, off in later:
            self.copy_now(batch, plan, buf.data[off: off + plan.nbytes])

    def order_update(self) -> bool:
        """The optimizer pre-hook: order the update after the newest issued copies on the
        device; True when there were some (the host need not wait for the capture thread)."""
        batch, self._batch = self._batch, None
        if batch is None:
            return False
        batch.order_update()
        return True
