"""Exact mode in an elastic job: the hand-over of a manager to the next one on a new process
group (:meth:`ElasticExact.detach`, :meth:`ElasticExact.adopt`) and the restore of a window
onto other ranks or another placement (``restore(reshard=True)``, read by
:mod:`moc._exact.reshard`). A mixin of :class:`moc._exact.checkpointer.ExactCheckpointer`."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .._config import MoCConfig
from .._daemon import DaemonExecutor
from .._dist import Comm
from .._errors import CheckpointError
from .._run_state import RunState
from .._snapshot import BufferPool
from .._store import CheckpointStore
from .._units import UnitLayout
from .._together import tick_seconds, wait_together
from .reshard import read_resharded
from .state import Replay as _Replay

__all__ = ["ElasticExact"]

log = logging.getLogger("moc")


class ElasticExact:
    """Hand-over and resharded restore (the attributes are :class:`ExactCheckpointer`'s)."""

    # What this mixin uses of ExactCheckpointer, declared for the type checker (set and
    # defined there).
    cfg: MoCConfig
    layout: UnitLayout
    pool: BufferPool
    store: CheckpointStore
    run: RunState
    comm: Comm
    replay: _Replay | None
    last_persisted_step: int | None
    windows_counted: int
    windows_persisted: int
    replays: int
    replayed_steps: int
    interrupted_replay: bool
    _capture: ThreadPoolExecutor
    _persist: DaemonExecutor
    _io: DaemonExecutor

    if TYPE_CHECKING:
        def _settle(self) -> None: ...
        def _abort_window(self, reason: str) -> None: ...
        def _drop(self, r: _Replay) -> None: ...
        def _window_steps(self, ex: Mapping[str, Any], slots: Mapping[str, int],
                          trees: Mapping[tuple[str, int, str], Any]) -> dict[int, Any]: ...
        def _start_replay(self, replay: _Replay, info: dict[str, Any]) -> int: ...

    # -- hand-over to the manager of a new process group (CheckpointManager.detach) --------
    def detach(self) -> dict[str, Any]:
        """Retire for a manager on another process group: the capture in flight (a local
        copy) is finished, so a window it completes stays usable; the window still being
        captured is dropped; a replay under way is ended (the successor must roll back
        again: ``replaying``); the persist in flight is abandoned. Returns the bookkeeping
        the successor adopts (:meth:`adopt`)."""
        self._settle()
        self._abort_window("the process group changed")
        state = {"last_persisted_step": self.last_persisted_step, "windows_counted": self.windows_counted,
                 "windows_persisted": self.windows_persisted, "replays": self.replays,
                 "replayed_steps": self.replayed_steps, "replaying": self.replay is not None}
        self._capture.shutdown(wait=True)
        self._persist.shutdown(wait=False)
        self._io.shutdown(wait=False)
        r, self.replay = self.replay, None
        if r is not None:
            self._drop(r)
        return state

    def join(self, timeout: float) -> bool:
        """After :meth:`detach`: wait up to ``timeout`` seconds (in all) for the persist
        threads to end; True once they have."""
        deadline = time.monotonic() + timeout
        return all(ex.join(max(0.0, deadline - time.monotonic())) for ex in (self._persist, self._io))

    def adopt(self, states: Sequence[Mapping[str, Any] | None]) -> None:
        """Continue the bookkeeping of the exact managers this one replaces (every rank's
        :meth:`detach` state, None where a rank had none): a replay interrupted on any rank
        leaves the model half replayed, so :attr:`interrupted_replay` asks for a new restore."""
        mine = next((s for s in states if s is not None), None)
        if mine is None:
            return
        self.last_persisted_step = mine["last_persisted_step"]
        self.windows_counted, self.windows_persisted = int(mine["windows_counted"]), int(mine["windows_persisted"])
        self.replays, self.replayed_steps = int(mine["replays"]), int(mine["replayed_steps"])
        self.interrupted_replay = any(bool(s and s.get("replaying")) for s in states)

    def _restore_resharded(self, manifest) -> int:
        """``restore(reshard=True)`` once every rank has ``manifest`` (None: nothing stored)."""
        if manifest is None:
            return 0
        got, error = None, None
        # The read runs on the I/O thread while the ranks meet every tick: a slow store
        # never holds a collective past its timeout (moc._together).
        io = self._io.submit(lambda: read_resharded(self.store, manifest, rank=self.run.rank, world=self.comm.world,
                                                    units=self.layout.units, pool=self.pool))
        wait_together(self.comm, io, tick=tick_seconds(self.cfg.coordination_timeout), rank=self.run.rank,
                      step=manifest.step, doing="reading the exact window")
        try:
            got = io.result()
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
        if self.comm.any_true(error is not None):
            if got is not None and got.lease is not None:
                self.pool.release(got.lease)
            if error is not None:
                raise error
            raise CheckpointError(f"{self.run.where()}: another rank could not read its units of the exact window "
                                  f"at step {manifest.step} (see its error)")
        assert got is not None
        ex = manifest.meta["exact"]
        checked = not self.comm.any_true(not got.same_layout)
        if not checked:
            log.warning("rank %d step %d: replay-divergence check off: the window %d-%d was written by %d rank(s) "
                        "and this job has %d, or some rank holds other units than it did then (bit-identity is "
                        "impossible there)", self.run.rank, int(ex["start"]), int(ex["start"]), manifest.step,
                        int(ex.get("world", 1)), self.comm.world)
        for note in got.notes:
            log.warning("rank %d step %d: %s", self.run.rank, int(ex["start"]), note)
        replay = _Replay(start=int(ex["start"]), end=manifest.step,
                         steps=self._window_steps(ex, got.slots, got.trees), grad=got.grad if checked else None,
                         source="memory" if got.from_storage == 0 else "storage", lease=got.lease)
        self.run.run_id = manifest.meta.get("run_id") or self.run.run_id
        return self._start_replay(replay, {"source": replay.source, "resharded": True, "checked": checked,
                                           "units": {"memory": got.from_memory, "storage": got.from_storage},
                                           "world": int(ex.get("world", 1))})
