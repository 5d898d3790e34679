"""Exact mode in an elastic job: what one exact manager hands to the next one on a new
process group (:class:`ExactHandover`, its wire form a JSON-able dict gathered over ranks)
and the read of a committed window onto other ranks or another placement
(:func:`read_window_resharded`, ``restore(reshard=True)``; the reading itself is
:mod:`moc._exact.reshard`'s). :class:`moc._exact.checkpointer.ExactCheckpointer` calls them;
nothing here writes its fields."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .._config import MoCConfig
from .._daemon import DaemonExecutor
from .._dist import Comm
from .._errors import CheckpointError
from .._run_state import RunState
from .._snapshot import BufferPool
from .._store import CheckpointStore
from .._together import tick_seconds, wait_together
from .reshard import Resharded, read_resharded

__all__ = ["ExactHandover", "ReshardedWindow", "read_window_resharded"]

log = logging.getLogger("moc")


@dataclass(frozen=True)
class ExactHandover:
    """The bookkeeping an exact manager hands to its successor.

    Attributes:
        last_persisted_step: the newest window committed to storage (None: none yet).
        windows_counted: windows completed on every rank (``persist_every`` counts these).
        windows_persisted: windows committed to storage.
        replays, replayed_steps: restores replayed and the steps they replayed.
        replaying: a replay was under way when the manager retired; the model is half
            replayed and the successor must roll back again.
    """

    last_persisted_step: int | None = None
    windows_counted: int = 0
    windows_persisted: int = 0
    replays: int = 0
    replayed_steps: int = 0
    replaying: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {"last_persisted_step": self.last_persisted_step, "windows_counted": self.windows_counted,
                "windows_persisted": self.windows_persisted, "replays": self.replays,
                "replayed_steps": self.replayed_steps, "replaying": self.replaying}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "ExactHandover":
        last = d.get("last_persisted_step")
        return cls(last_persisted_step=None if last is None else int(last),
                   windows_counted=int(d["windows_counted"]), windows_persisted=int(d["windows_persisted"]),
                   replays=int(d["replays"]), replayed_steps=int(d["replayed_steps"]),
                   replaying=bool(d.get("replaying")))

    @classmethod
    def merge(cls, states: Sequence[Mapping[str, Any] | None]) -> "ExactHandover | None":
        """Every rank's handover (None where a rank had none) as one: the counters of the
        first rank that had one (they agree over ranks), ``replaying`` if any rank was
        replaying (a replay interrupted on one rank leaves the model half replayed)."""
        given = [s for s in states if s is not None]
        if not given:
            return None
        first = cls.from_wire(given[0])
        return ExactHandover(**{**first.__dict__, "replaying": any(bool(s.get("replaying")) for s in given)})


@dataclass(frozen=True)
class ReshardedWindow:
    """A committed window read by unit name onto this rank (:func:`read_window_resharded`).

    Attributes:
        read: what :func:`moc._exact.reshard.read_resharded` read (trees, slots, the
            gradient digests, the memory lease, where each unit came from).
        exact: the manifest's exact-mode record (start, window, world, ...).
        checked: the replay-divergence check holds (every rank holds the units it wrote);
            bit-identity is impossible otherwise, so the check is off.
    """

    read: Resharded
    exact: Mapping[str, Any]
    checked: bool


def read_window_resharded(manifest: Any, *, cfg: MoCConfig, store: CheckpointStore, comm: Comm, run: RunState,
                          units: Iterable[str], pool: BufferPool, io: DaemonExecutor) -> ReshardedWindow:
    """Read this rank's units of the window committed in ``manifest``, whatever ranks wrote
    them (collective: every rank calls it with the same manifest). An error on any rank
    is raised on every rank, with this rank's memory lease released."""
    # The read runs on the I/O thread while the ranks meet every tick: a slow store never
    # holds a collective past its timeout (moc._together).
    job = io.submit(lambda: read_resharded(store, manifest, rank=run.rank, world=comm.world, units=units,
                                           pool=pool))
    wait_together(comm, job, tick=tick_seconds(cfg.coordination_timeout), rank=run.rank, step=manifest.step,
                  doing="reading the exact window")
    got, error = None, None
    try:
        got = job.result()
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    if comm.any_true(error is not None):
        if got is not None and got.lease is not None:
            pool.release(got.lease)
        if error is not None:
            raise error
        raise CheckpointError(f"{run.where()}: another rank could not read its units of the exact window "
                              f"at step {manifest.step} (see its error)")
    assert got is not None
    ex = manifest.meta["exact"]
    checked = not comm.any_true(not got.same_layout)
    if not checked:
        log.warning("rank %d step %d: replay-divergence check off: the window %d-%d was written by %d rank(s) "
                    "and this job has %d, or some rank holds other units than it did then (bit-identity is "
                    "impossible there)", run.rank, int(ex["start"]), int(ex["start"]), manifest.step,
                    int(ex.get("world", 1)), comm.world)
    for note in got.notes:
        log.warning("rank %d step %d: %s", run.rank, int(ex["start"]), note)
    return ReshardedWindow(read=got, exact=ex, checked=checked)
