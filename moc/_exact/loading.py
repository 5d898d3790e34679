"""Where a restore finds an exact window: the windows in this rank's shared-memory buffers,
the newest manifest in storage, the newest window every rank holds in memory, and a
window read (into a :class:`.state.Replay`) from either.

:class:`WindowLoader` serves one :class:`.checkpointer.ExactCheckpointer` (one rank),
which decides which window to replay and replays it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import xxhash

from .._dist import Comm
from .._errors import CheckpointError
from .._run_state import RunState
from .._snapshot import READY, BufferPool, read_headers
from .._store import CheckpointStore, TensorMeta, decode_tree
from .._units import UnitLayout
from .state import Replay as _Replay, window_steps
from .store import read_part

__all__ = ["WindowLoader"]

log = logging.getLogger("moc")


class WindowLoader:
    """Reads exact windows for one rank: its ``layout``'s units from its ``pool`` or the
    ``store``, agreeing with the other ranks over ``comm``; ``shared``: units other ranks
    hold too."""

    def __init__(self, *, layout: UnitLayout, pool: BufferPool, store: CheckpointStore, run: RunState, comm: Comm,
                 shared: set[str]) -> None:
        self.layout = layout
        self.pool = pool
        self.store = store
        self.run = run
        self.comm = comm
        self.shared = shared

    def memory_candidates(self) -> list[dict[str, Any]]:
        """The exact windows in this rank's buffers that cover its units, oldest first."""
        units = set(self.layout.units)
        out = [h for h in read_headers(self.pool.directory)
               if isinstance(h.get("exact"), dict) and set(h["exact"].get("slots", {})) == units
               and h.get("world", 1) == self.comm.world]
        return sorted(out, key=lambda h: h["step"])

    def storage_manifest(self):
        """The newest manifest in storage that can be read, or None; raises if it was not
        written in exact mode."""
        for step in reversed(self.store.steps()):
            try:
                m = self.store.read_manifest(step)
            except Exception as exc:  # noqa: BLE001 - a corrupt manifest: an older one may do
                log.warning("rank %d: skipping manifest of step %d: %s", self.run.rank, step, exc)
                continue
            if not m.meta.get("exact"):
                raise CheckpointError(
                    f"{self.store.store.url}: the newest checkpoint (step {step}) was not written in exact mode "
                    "(MoCConfig(exact=True)); it has no window to replay. Open it with exact=False, or use new storage")
            return m
        return None

    def agree_memory(self, memory: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The newest window every rank holds in memory (same run, same steps), or None."""
        keys = [[h["run"], int(h["exact"]["start"]), int(h["step"])] for h in memory]
        common = {tuple(k) for k in keys}
        for other in self.comm.gather_json(keys):
            common &= {tuple(k) for k in other}
        if not common:
            return None
        run, start, end = max(common, key=lambda k: k[2])
        return next(h for h in memory if h["run"] == run and int(h["step"]) == end
                    and int(h["exact"]["start"]) == start)

    def from_memory(self, header: dict[str, Any]) -> _Replay:
        """The window of ``header`` read from its buffer (checksums checked), under a lease."""
        buf = self.pool.buffers[int(header["buffer"])]
        size = os.path.getsize(buf.path)
        with self.run.lock:
            if buf.users:
                raise ValueError(f"buffer {buf.index} is in use")
            buf.ensure(max(size, buf.capacity))
            buf.users += 1
        try:
            trees = {}
            for p in header["pieces"]:
                view = buf.view(p["offset"], p["nbytes"])
                if "xxh3:" + xxhash.xxh3_64_hexdigest(view) != p["checksum"]:
                    raise ValueError(f"piece {p['unit']} of step {p['step']} failed its checksum")
                data = buf.data[p["offset"]: p["offset"] + p["nbytes"]]
                trees[(p["what"], int(p["step"]), p["unit"])] = decode_tree(
                    p["skeleton"], [TensorMeta.from_json(m) for m in p["tensors"]], data)
            ex = header["exact"]
            steps = window_steps(ex, ex["slots"], trees)
        except BaseException:
            self.pool.release(buf)
            raise
        with self.run.lock:
            buf.step, buf.header, buf.state, buf.persisted = header["step"], header, READY, False
        return _Replay(start=int(ex["start"]), end=int(header["step"]), steps=steps, grad=ex.get("grad"),
                       source="memory", lease=buf)

    def from_storage(self, manifest) -> _Replay:
        """This rank's part of the window of ``manifest``, read from storage."""
        mine, trees = read_part(self.store, manifest, self.run.rank, self.comm.world, self.layout.units, self.shared)
        ex = manifest.meta["exact"]
        slots = {u: int(s) for u, s in mine["slots"].items() if u in self.layout.units}
        return _Replay(start=int(ex["start"]), end=manifest.step, steps=window_steps(ex, slots, trees),
                       grad=mine.get("grad"), source="storage")

    def drop(self, r: _Replay) -> None:
        """Forget a replay's data and give its buffer back."""
        r.steps.clear()
        if r.lease is not None:
            self.pool.release(r.lease)
