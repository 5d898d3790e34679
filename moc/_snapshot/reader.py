"""Reading this rank's published snapshot buffers for a restore without staging copies.

A restore from memory used to read every piece into a freshly allocated unit buffer and
then copy it into the parameters. On a cold process the fresh allocation dominated: the
kernel must fault in and zero every page (0.3-2 s per GB on the 2-core VM used for the
benchmarks) before a byte is copied. Here each buffer file is mapped read-only with the
pages populated up front (tmpfs pages already exist, so this only builds page tables), a
piece is a tensor view of the map, its checksum is taken on the map, and the only copy is
the one into the parameters / the optimizer state.

Tensors from :meth:`SnapshotMaps.piece` alias the snapshot file: callers must copy what
they keep (``moc._units.capture.own_tree`` does) and drop the views before the buffer is refilled.
"""

from __future__ import annotations

import mmap
import os
import warnings
from typing import Iterable

import torch

from .._restore import MemoryPiece

__all__ = ["SnapshotMaps"]

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class SnapshotMaps:
    """Read-only maps of ``directory/buf<i>.bin`` covering the given pieces."""

    def __init__(self, directory: str, rank: int, pieces: Iterable[MemoryPiece]) -> None:
        self.directory, self.rank = directory, rank
        spans: dict[int, tuple[int, int]] = {}
        for p in pieces:
            lo, hi = p.offset, p.offset + (p.end - p.start)
            a, b = spans.get(p.buffer, (lo, hi))
            spans[p.buffer] = (min(a, lo), max(b, hi))
        self._maps: dict[int, tuple[int, torch.Tensor]] = {}
        for buf, (lo, hi) in spans.items():
            self._maps[buf] = self._open(buf, lo, hi)

    def _open(self, buf: int, lo: int, hi: int) -> tuple[int, torch.Tensor]:
        path = os.path.join(self.directory, f"buf{buf}.bin")
        base = lo - lo % mmap.ALLOCATIONGRANULARITY
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise RuntimeError(f"snapshot buffer {buf} of rank {self.rank} is gone") from None
        try:
            if os.fstat(fd).st_size < hi:
                raise RuntimeError(f"snapshot buffer {buf} of rank {self.rank} is truncated")
            if hi == base:
                return base, torch.empty(0, dtype=torch.uint8)
            mm = mmap.mmap(fd, hi - base, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ, offset=base)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            # The map is read-only on purpose; nothing writes through these views.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return base, torch.frombuffer(mm, dtype=torch.uint8)

    def piece(self, p: MemoryPiece) -> torch.Tensor:
        """The bytes of ``p`` as a uint8 tensor viewing the map (no copy)."""
        base, t = self._maps[p.buffer]
        lo = p.offset - base
        return t[lo: lo + (p.end - p.start)]

    def close(self) -> None:
        """Drop this object's references; each map is unmapped once no view is left."""
        self._maps.clear()
