"""The first level, snapshots in shared memory: the three buffers (:mod:`.buffers`), who
copies which bytes at a checkpoint (:mod:`.plan`), the copies made while training goes on
(:mod:`.engine`), and the published buffers read back for a restore (:mod:`.reader`)."""

from .buffers import FREE, HEADER_VERSION, PERSIST, READY, BufferPool, SnapshotBuffer, read_headers
from .engine import SnapshotEngine
from .plan import Inventory, PublishedSizes, plan_snapshot
from .reader import SnapshotMaps

__all__ = ["FREE", "HEADER_VERSION", "PERSIST", "READY", "BufferPool", "SnapshotBuffer", "read_headers", "Inventory",
           "PublishedSizes", "plan_snapshot", "SnapshotEngine", "SnapshotMaps"]
