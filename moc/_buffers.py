"""The snapshot level: three preallocated CPU buffers in shared memory.

Each buffer is a file mapped into the process (``/dev/shm`` by default), so a snapshot
outlives a killed training process on the same node and the restarted process recovers
from memory. A buffer's contents count only once its header (``buf<i>.json``) is
published, atomically, after the copy is complete; before a buffer is refilled its
header is removed first. A torn snapshot is therefore never read.

States cycle SNAPSHOT (being filled) -> PERSIST (being written to storage) -> RECOVERY
(the newest complete copy, kept for fast restore); a buffer not needed by either of those
roles is FREE. Memory is allocated once (and again only if a snapshot outgrows it).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

__all__ = ["SnapshotBuffer", "BufferPool", "FREE", "SNAPSHOT", "READY", "PERSIST"]

FREE, SNAPSHOT, READY, PERSIST = "free", "snapshot", "ready", "persist"
HEADER_VERSION = 1


def _checksum_header(body: dict[str, Any]) -> str:
    return "xxh3:" + xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


@dataclass
class SnapshotBuffer:
    index: int
    directory: str
    capacity: int = 0
    data: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    state: str = FREE
    step: int | None = None
    persisted: bool = False
    header: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return os.path.join(self.directory, f"buf{self.index}.bin")

    @property
    def header_path(self) -> str:
        return os.path.join(self.directory, f"buf{self.index}.json")

    def ensure(self, nbytes: int) -> None:
        """Make the buffer at least ``nbytes`` long (allocates only when it must grow)."""
        if nbytes <= self.capacity:
            return
        capacity = max(nbytes, 4096)
        with open(self.path, "wb") as f:
            f.truncate(capacity)
        self.data = torch.from_file(self.path, shared=True, size=capacity, dtype=torch.uint8)
        self.capacity = capacity

    def invalidate(self) -> None:
        """Withdraw the published snapshot before the bytes get overwritten."""
        try:
            os.remove(self.header_path)
        except FileNotFoundError:
            pass
        self.step = None
        self.persisted = False

    def publish(self, header: dict[str, Any]) -> None:
        body = dict(header, version=HEADER_VERSION, buffer=self.index)
        body["checksum"] = _checksum_header(body)
        tmp = f"{self.header_path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, self.header_path)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.data[offset: offset + nbytes].numpy()).cast("B")


def read_headers(directory: str) -> list[dict[str, Any]]:
    """Published, intact snapshot headers found in ``directory`` (any process's)."""
    out = []
    if not os.path.isdir(directory):
        return out
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("buf") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                body = json.load(f)
            stored = body.pop("checksum", None)
            if stored != _checksum_header(body) or body.get("version") != HEADER_VERSION:
                continue
            out.append(body)
        except (OSError, ValueError):
            continue
    return out


class BufferPool:
    """Three buffers and the rules for picking one to fill."""

    def __init__(self, directory: str, count: int = 3) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.buffers = [SnapshotBuffer(i, directory) for i in range(count)]

    def newest_complete(self) -> SnapshotBuffer | None:
        done = [b for b in self.buffers if b.step is not None and b.state in (READY, PERSIST)]
        return max(done, key=lambda b: b.step) if done else None

    def acquire(self) -> SnapshotBuffer:
        """A buffer to fill: free, else the oldest complete one that is neither being
        persisted nor the newest complete copy (that one is the RECOVERY copy)."""
        newest = self.newest_complete()
        for b in self.buffers:
            if b.state == FREE:
                break
        else:
            candidates = [x for x in self.buffers if x.state == READY and x is not newest]
            if not candidates:
                raise RuntimeError("no snapshot buffer available (more than one snapshot in flight)")
            b = min(candidates, key=lambda x: x.step)
        b.invalidate()
        b.state = SNAPSHOT
        return b

    def allocated_bytes(self) -> int:
        return sum(b.capacity for b in self.buffers)

    def remove_files(self) -> None:
        for b in self.buffers:
            b.invalidate()
            b.data = torch.empty(0, dtype=torch.uint8)
            b.capacity = 0
            try:
                os.remove(b.path)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self.directory)
        except OSError:
            pass
