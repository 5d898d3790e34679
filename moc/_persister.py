"""The second level: complete snapshots written to storage by a background thread, the
ranks' chunk records gathered, and the manifest committed by rank 0.

Storage errors are retried at later decision points, reported in ``status()`` and never
raised into training; :meth:`Persister.flush` (leaving the ``with`` block, SIGTERM) is
where they surface. A permanent error (permission, read-only, credentials, access denied,
no bucket: :func:`storage_backends.permanent_fault`) is logged once per kind with its fix,
and the flush raises it after one more try instead of retrying until ``persist_timeout``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from datetime import timedelta
from typing import Any, cast

from storage_backends import CommitConflict, PermanentFault, PermanentStorageError, permanent_fault

from ._config import MoCConfig
from ._errors import FencedError, ForeignRunError
from ._daemon import DaemonExecutor
from ._dist import Comm
from ._plt import PLTTracker
from ._policy import CheckpointPolicy
from ._run_state import RunState
from ._snapshot import PERSIST, READY, BufferPool, SnapshotBuffer
from ._store import CheckpointStore, ChunkRecord, Manifest, UnitRecord
from ._together import tick_seconds, wait_together

__all__ = ["Persister"]

log = logging.getLogger("moc")


class Persister:
    """Writes this rank's part of complete snapshots; rank 0 commits.

    Args:
        cfg: the manager's configuration.
        store: the persistent store.
        pool: the snapshot buffers it reads from.
        comm: the persist thread's collectives.
        run: the shared run bookkeeping.
        policy: told which experts a committed checkpoint holds (PLT).
    """

    def __init__(self, cfg: MoCConfig, *, store: CheckpointStore, pool: BufferPool, comm: Comm, run: RunState,
                 policy: CheckpointPolicy) -> None:
        self.cfg = cfg
        self.store = store
        self.pool = pool
        self.comm = comm
        self.run = run
        self.policy = policy
        # Daemon threads: a job stuck on storage never holds up the process's exit.
        self._exec = DaemonExecutor(f"moc-persist-r{run.rank}")
        self._io = DaemonExecutor(f"moc-persist-io-r{run.rank}")
        self.in_flight: Future | None = None
        self.base: Manifest | None = None          # newest committed manifest (rank 0)
        self.last_persisted_step: int | None = None
        self.failures = 0
        self.skipped = 0          # persists not tried: some rank skipped that snapshot
        # Jobs are numbered in start order, the same on every rank (starts are collective
        # decisions). What a commit changes in the decisions of later checkpoints (has_base,
        # the persist level of PLT) is applied by the training thread at a point where
        # every rank applies the same jobs (:meth:`settle`), never from the persist thread.
        self.started_seq = 0
        self.finished_seq = 0
        self._outcomes: list[tuple[int, dict[str, list[int]], dict[str, list[int]]]] = []
        #: the permanent storage error of the newest failed persist (None: none, or a
        #: commit since): what :meth:`flush` raises at once
        self.permanent: PermanentFault | None = None
        self._reported: set[str] = set()   # permanent kinds logged since the last commit
        #: the newest persist was refused by fencing (a newer generation took over): what
        #: :meth:`flush` raises at once (no retry cures it)
        self.fenced: str | None = None

    @property
    def busy(self) -> bool:
        """A persist job runs, or storage I/O of one that ended (a peer died) still does."""
        return (self.in_flight is not None and not self.in_flight.done()) or not self._io.idle

    def retry_candidate(self, mode: str = "retry", *, before_snapshot: bool = False) -> int | None:
        """The complete snapshot this rank would persist now (local; the ranks agree on it
        in a round): ``retry``: the newest one that was due for storage but is not there
        yet; ``flush``: the newest one, due or not. ``before_snapshot``: a snapshot starts
        before the persist does, so the buffer it will fill is no candidate."""
        with self.run.lock:
            refill = self.pool.victim() if before_snapshot else None
            done = [b for b in self.pool.buffers if b.step is not None and b.state in (READY, PERSIST)
                    and b is not refill]
            if mode == "retry":
                done = [b for b in done if b.header.get("persist_due")]
            # done: buffers holding a step (cast: the type checker cannot see the filter)
            newest = max(done, key=lambda b: cast(int, b.step)) if done else None
            # Never commit a step older than one already committed: manifests only move forward.
            behind = newest is not None and self.last_persisted_step is not None \
                and cast(int, newest.step) <= self.last_persisted_step
            return None if newest is None or newest.persisted or behind else newest.step

    def start(self, step: int, snapshot: Future | None = None) -> None:
        """Persist the snapshot of ``step`` in the background (every rank starts the same
        steps in the same order: the caller took the decision with the others).
        ``snapshot``: the snapshot still being taken, else a complete buffer of ``step``."""
        self.reap()
        self.started_seq += 1
        self.in_flight = self._exec.submit(self._job, snapshot, step, self.started_seq)

    def maybe_persist(self, mode: str, snapshot: Future | None = None) -> None:
        """Start a persist if every rank is idle and agrees on the snapshot (collective:
        two rounds here; checkpoints take this decision inside their one round instead).

        ``new``: the snapshot just started (``snapshot``, due for storage); ``retry``: the
        newest complete snapshot that was due but is not in storage yet; ``flush``: the
        newest complete snapshot, due or not.
        """
        if self.comm.any_true(self.busy):
            return
        self.reap()
        candidate = self.run.last_step if mode == "new" else self.retry_candidate(mode)
        steps = self.comm.gather_json(candidate)
        if any(s is None for s in steps) or len(set(steps)) != 1:
            return
        assert candidate is not None    # this rank's is among the steps gathered, none of them None
        self.start(candidate, snapshot if mode == "new" else None)

    def reap(self) -> None:
        fut = self.in_flight
        if fut is not None and fut.done():
            self.in_flight = None
            exc = fut.exception()
            if exc is not None:
                self.run.last_error = f"persist failed: {exc}"

    def drain(self, timeout: float) -> None:
        """Wait for the job in flight (its errors are reported, not raised) and apply every
        finished job (the caller is at a point every rank reaches with no job running)."""
        fut = self.in_flight
        if fut is not None:
            try:
                fut.result(timeout=timeout)
            except FuturesTimeout:
                log.error("%s: persist job still running after %.0f s", self.run.where(), timeout)
            except Exception:  # noqa: BLE001 - reported by reap()
                pass
            self.reap()
        self.apply_outcomes()

    def settle(self, seq: int) -> None:
        """Apply the outcomes of persist jobs up to number ``seq``: the newest job that every
        rank has finished, agreed in a round. No rank waits for its own job here (it can be
        stuck on storage for as long as the store takes); every rank
        calls this with the same ``seq``, so has_base and the PLT persist marks change at
        the same point everywhere, whatever moment each rank's persist thread finished at."""
        self.apply_outcomes(min(seq, self.finished_seq))

    def apply_outcomes(self, upto: int | None = None) -> None:
        """Book committed jobs numbered <= ``upto`` (default: all finished here)."""
        upto = self.finished_seq if upto is None else upto
        with self.run.lock:
            while self._outcomes and self._outcomes[0][0] <= upto:
                _, selection, cum = self._outcomes.pop(0)
                self.run.has_base = True
                self.policy.mark_persisted(selection, cum)

    def _job(self, snap: Future | None, step: int, seq: int) -> bool:
        try:
            return self._persist(snap, step, seq)
        finally:
            with self.run.lock:
                self.finished_seq = max(self.finished_seq, seq)

    def _persist(self, snap: Future | None, step: int, seq: int) -> bool:
        """Persist the snapshot of ``step``: every rank writes its share, rank 0 commits.

        Storage I/O runs on the I/O thread; this thread meets the other ranks' persist
        threads every :attr:`tick` seconds until every rank's I/O is done, so no collective
        of the persist group ever waits on storage (a group's timeout can be seconds under
        Lazarus; a collective that timed out on some ranks and not on others would leave
        the group out of step and the ranks disagreeing on what was committed). A slow or
        hung store makes the job long, never the ranks' views different."""
        hand = _Handoff()
        try:
            io = self._io.submit(self._write_io, snap, step, hand)
            self._wait_together(io, step, "writing its share")
            mine = io.result()
            results = self.comm.gather_json(mine, persist=True)
            missing = not all(r["ok"] for r in results) and all(r["ok"] or r.get("missing") for r in results)
            error = mine["error"]
            commit: Future = Future()
            if self.run.rank == 0 and not self.run.abandoned and all(r["ok"] for r in results):
                assert hand.buf is not None     # this rank's share was written: it leased the buffer
                commit = self._io.submit(self._commit_io, step, results, hand.buf.header)
            else:
                fault = mine.get("fault")
                if self.run.rank == 0 and not all(r["ok"] for r in results):
                    error = "; ".join(f"rank {i}: {r['error']}" for i, r in enumerate(results) if not r["ok"])
                    fault = next((r["fault"] for r in results if r.get("fault")), None)
                fenced = next((r["fenced"] for r in results if r.get("fenced")), None)
                commit.set_result({"committed": False, "error": error, "fault": fault, "fenced": fenced})
            self._wait_together(commit, step, "committing")
            outcome = self.comm.broadcast_json(commit.result(), persist=True)
            return self._book(step, seq, hand.buf, outcome, missing)
        finally:
            with self.run.lock:
                hand.closed = True
                buf = hand.buf
                if buf is not None:
                    if not self.run.abandoned and buf.state == PERSIST:
                        buf.state = READY
                    buf.users = max(0, buf.users - 1)

    def _wait_together(self, fut: Future, step: int, doing: str) -> None:
        wait_together(self.comm, fut, tick=self.tick, rank=self.run.rank, step=step, doing=doing)

    @property
    def tick(self) -> float:
        """Seconds between the persist threads' meetings: well inside the group's timeout."""
        return tick_seconds(self.cfg.coordination_timeout)

    def _write_io(self, snap: Future | None, step: int, hand: "_Handoff") -> dict[str, Any]:
        """I/O thread: find the snapshot of ``step``, lease it (one lease for this job, one
        handed to the persist thread for its bookkeeping) and write this rank's share."""
        buf = None
        if snap is not None:
            try:
                buf = snap.result()
            except Exception:  # noqa: BLE001 - reported by the snapshot engine
                buf = None
        with self.run.lock:
            # A buffer reserved for the next snapshot is the training thread's to refill: a
            # lease taken on it now made that snapshot's acquire fail inside ``step()``.
            if buf is None or buf.step != step or buf.state != READY or buf.reserved:
                found = [b for b in self.pool.buffers if b.step == step and b.state == READY and not b.reserved]
                buf = found[0] if found else None
            if buf is not None and (self.run.abandoned or hand.closed):
                buf = None
            if buf is not None:
                buf.state = PERSIST
                buf.users += 2
                hand.buf = buf
        if buf is None:
            return {"ok": False, "error": f"snapshot of step {step} is not available", "units": {},
                    "missing": True}
        try:
            units = self._write_share(buf)
            return {"ok": True, "error": None, "units": units, "missing": False}
        except Exception as exc:  # noqa: BLE001 - storage trouble never reaches training
            self._note_refusal(step, exc)
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "units": {}, "missing": False,
                   "fault": _fault_json(exc)}
            if isinstance(exc, FencedError):
                out["fenced"] = str(exc)
            return out
        finally:
            self.pool.release(buf)

    def _commit_io(self, step: int, results: list[dict[str, Any]], header: dict[str, Any]) -> dict[str, Any]:
        """I/O thread, rank 0: publish the manifest."""
        try:
            self._commit(step, results, header)
            return {"committed": True, "error": None}
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            self._note_refusal(step, exc)
            out = {"committed": False, "error": f"commit failed: {type(exc).__name__}: {exc}",
                   "fault": _fault_json(exc)}
            if isinstance(exc, FencedError):
                out["fenced"] = str(exc)
            if isinstance(exc, ForeignRunError):
                out["foreign"] = {"message": str(exc), "url": exc.url, "key": exc.key, "other_run": exc.other_run,
                                  "run": exc.run}
            return out

    def _note_refusal(self, step: int, exc: BaseException) -> None:
        """Log a write that fencing refused, with this rank (never silent)."""
        if isinstance(exc, FencedError):
            what = (f"rank {self.run.rank} step {step}: write refused, generation {exc.generation} is fenced by "
                    f"generation {exc.fence}: {exc}")
        elif isinstance(exc, ForeignRunError):
            what = f"rank {self.run.rank} step {step}: {exc}"
        elif isinstance(exc, CommitConflict):
            what = f"rank {self.run.rank} step {step}: commit refused: {exc}"
        else:
            return
        log.error("%s", what)   # counted by the store (CheckpointStore.refusals)

    def _book(self, step: int, seq: int, buf: SnapshotBuffer | None, outcome: dict[str, Any],
              missing: bool) -> bool:
        """Book the outcome every rank received (the same on each)."""
        with self.run.lock:
            if self.run.abandoned:
                return bool(outcome["committed"])
            if outcome.get("fenced"):
                self.fenced = str(outcome["fenced"])
            elif outcome["committed"]:
                self.fenced = None
            foreign = outcome.get("foreign")
            if foreign and self.run.fatal is None:
                self.run.fatal = ForeignRunError(foreign["message"], url=foreign["url"], key=foreign["key"],
                                                 other_run=foreign["other_run"], run=foreign["run"])
            if buf is not None:
                buf.state = READY
            fault = PermanentFault.from_json(outcome["fault"]) if outcome.get("fault") else None
            was: PermanentFault | None = None
            first = fault is not None and fault.kind not in self._reported
            if outcome["committed"] and buf is not None:
                buf.persisted = True
                self.last_persisted_step = step
                self._outcomes.append((seq, buf.header["selection"], buf.header["plt"]["cum"]))
            elif missing:
                self.skipped += 1
                self.run.last_error = outcome["error"]
            else:
                self.failures += 1
                self.run.last_error = outcome["error"]
            if outcome["committed"]:
                was, self.permanent = self.permanent, None
                self._reported.clear()
            elif not missing:
                self.permanent = fault
                if fault is not None:
                    self._reported.add(fault.kind)
        url = self.store.store.url
        if outcome["committed"]:
            if was is not None:
                log.warning("rank %d step %d: %s is writable again (was: %s); checkpoint persisted",
                            self.run.rank, step, url, was.kind)
            log.info("rank %d step %d: checkpoint persisted to %s", self.run.rank, step, url)
        elif fault is not None and first:
            log.error("rank %d step %d: storage %s refuses writes (%s; retrying will not help): %s. Fix: %s. "
                      "Training goes on from the in-memory snapshots; persists are tried again at later "
                      "checkpoints (not logged again for this kind), and closing the manager raises this.",
                      self.run.rank, step, url, fault.kind, outcome["error"], fault.fix)
        elif fault is not None:
            log.debug("rank %d step %d: persist failed again (%s): %s", self.run.rank, step, fault.kind,
                      outcome["error"])
        else:
            log.warning("rank %d step %d: persist failed, snapshot kept in memory: %s",
                        self.run.rank, step, outcome["error"])
        return bool(outcome["committed"])

    def _write_share(self, buf: SnapshotBuffer) -> dict[str, Any]:
        header = buf.header
        writer = self.store.writer(header["step"], f"r{self.run.rank}")
        out = {}
        for piece in header["pieces"]:
            if not piece["persist"]:
                continue
            name = piece["unit"]
            u = header["units"][name]
            view = buf.view(piece["offset"], piece["end"] - piece["start"])
            chunk = writer.add_bytes([view], offset=piece["start"], itemsize=u["itemsize"],
                                     group="experts" if u["kind"] == "expert" else "state")
            out[name] = {"chunk": chunk.to_json(), **{k: u[k] for k in ("kind", "layer", "expert", "unit_nbytes",
                                                                          "skeleton", "tensors")}}
        writer.finish()
        return out

    def _commit(self, step: int, results: list[dict[str, Any]], header: dict[str, Any]) -> None:
        merged: dict[str, dict[str, Any]] = {}
        for r in results:
            for name, u in r["units"].items():
                entry = merged.setdefault(name, dict(u, chunks=[]))
                entry["chunks"].append(ChunkRecord.from_json(u["chunk"]))
        for name, u in merged.items():
            pos = 0
            for c in sorted(u["chunks"], key=lambda c: c.offset):
                if c.offset != pos:
                    break
                pos += c.nbytes
            if pos != int(u["unit_nbytes"]):
                raise RuntimeError(f"step {step}: the ranks' chunks of {name} cover {pos} of its "
                                   f"{u['unit_nbytes']} bytes; not committing an incomplete checkpoint")
        records = [
            UnitRecord(name=name, kind=u["kind"], step=step, nbytes=int(u["unit_nbytes"]), skeleton=u["skeleton"],
                       tensors=u["tensors"], chunks=sorted(u["chunks"], key=lambda c: c.offset),
                       layer=u["layer"], expert=u["expert"])
            for name, u in merged.items()
        ]
        base = self.base if self.base is not None else self.store.latest_manifest()
        plt = PLTTracker(self.policy.num_experts, self.policy.tracker.top_k)
        plt.load_state(header["plt"])
        carry_persist_counters(plt, base)
        for layer, experts in header["selection"].items():
            plt.mark_saved("persist", layer, experts)
        self.base = self.store.commit(step, records, base=base, plt=plt.state(), meta=header["meta"])

    # -- waiting ---------------------------------------------------------------------------
    def _deadline(self, deadline: float) -> float:
        """``deadline``, or the stop deadline of a SIGTERM when that comes first (read each
        time: the signal may arrive while a flush waits)."""
        stop = self.run.stop_deadline
        return deadline if stop is None else min(deadline, stop)

    def wait_in_flight(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds (less once a SIGTERM set a stop deadline) for the
        job in flight; raise ``TimeoutError`` when it is still running then."""
        fut = self.in_flight
        if fut is None:
            return
        deadline = self._deadline(time.monotonic() + timeout)
        while not fut.done():
            left = self._deadline(deadline) - time.monotonic()
            if left <= 0:
                newest = self.pool.newest_complete()
                raise TimeoutError(self._timeout_message(newest.step if newest is not None else None, deadline))
            try:
                # short waits: a SIGTERM meanwhile (a stop deadline) is seen within a tick
                fut.result(timeout=min(0.25, left))
            except FuturesTimeout:
                continue
        fut.result()
        self.reap()

    def flush(self, deadline: float) -> None:
        """Persist the newest complete snapshot (collective); retry transient errors until
        ``deadline`` (``time.monotonic()``; a SIGTERM's stop deadline when sooner), then
        raise ``TimeoutError`` / ``OSError``; raise :class:`PermanentStorageError` as soon
        as a try fails with a permanent error (no retry cures it)."""
        while True:
            self.wait_in_flight(max(0.0, self._deadline(deadline) - time.monotonic()))
            newest = self.pool.newest_complete()
            if newest is None or newest.persisted:
                return
            if time.monotonic() >= self._deadline(deadline):
                raise TimeoutError(self._timeout_message(newest.step, deadline))
            before = self.failures
            self.maybe_persist("flush")
            self.wait_in_flight(max(0.0, self._deadline(deadline) - time.monotonic()))
            failed = self.failures > before
            if failed and self.fenced is not None:
                raise FencedError(
                    f"{self.run.where()}: checkpoint of step {newest.step} not persisted: {self.fenced}",
                    step=cast(int, newest.step), generation=self.store.generation,
                    fence=getattr(self.store.newest_fence(), "generation", -1))
            if failed and self.permanent is not None:
                fault = self.permanent
                raise PermanentStorageError(
                    f"{self.run.where()}: checkpoint of step {newest.step} cannot be persisted to "
                    f"{self.store.store.url}: {fault.kind} ({self.run.last_error}), a permanent error that no "
                    f"retry cures. Fix: {fault.fix}. The newest persisted step is {self.last_persisted_step}; "
                    f"the newest snapshot (step {newest.step}) stays in {self.pool.directory} for a restart "
                    f"on this node.", fault)
            if failed and time.monotonic() >= self._deadline(deadline):
                raise OSError(f"checkpoint of step {newest.step} could not be persisted: {self.run.last_error}")
            if failed:
                time.sleep(min(1.0, max(0.0, self._deadline(deadline) - time.monotonic())))

    def _timeout_message(self, step: int | None, deadline: float) -> str:
        stop = self.run.stop_deadline
        if stop is not None and stop <= deadline:
            return (f"{self.run.where()}: SIGTERM: checkpoint of step {step} not persisted within "
                    f"MoCConfig.stop_timeout ({self.cfg.stop_timeout}); it stays in {self.pool.directory} "
                    f"for a restart on this node; last storage error: {self.run.last_error}")
        return (f"checkpoint of step {step} not persisted within {self.cfg.persist_timeout} "
                f"(MoCConfig.persist_timeout; storage slow or hung?): {self.run.last_error}")

    def abandon(self, grace: timedelta) -> None:
        """Detach: give the persist in flight ``grace`` to finish; one still blocked in a
        collective is left behind and never committed (``run.abandoned``)."""
        fut = self.in_flight
        if fut is not None:
            try:
                fut.result(timeout=grace.total_seconds())
            except FuturesTimeout:
                log.warning("rank %d: background persist still blocked at reconfiguration; abandoned", self.run.rank)
            except Exception as exc:  # noqa: BLE001 - the group is gone; the snapshot stays in memory
                log.warning("rank %d: in-flight persist abandoned at reconfiguration: %s", self.run.rank, exc)
            self.in_flight = None

    def join(self, timeout: float) -> bool:
        """After ``shutdown(wait=False)``: wait up to ``timeout`` seconds (in all) for both
        threads to end; True once they have."""
        deadline = time.monotonic() + timeout
        return all(ex.join(max(0.0, deadline - time.monotonic())) for ex in (self._exec, self._io))

    def shutdown(self, *, wait: bool = True, timeout: float = 30.0) -> None:
        """Stop the threads; ``wait``: up to ``timeout`` seconds each (the caller already
        waited ``persist_timeout`` for the job in flight). A job still stuck on storage
        after that is left behind on its daemon thread, logged: it can publish nothing
        the ranks did not agree on, and it does not keep the process from exiting."""
        self._exec.shutdown(wait=wait, timeout=timeout)
        self._io.shutdown(wait=wait, timeout=timeout)
        if wait and not (self._exec.idle and self._io.idle):
            log.warning("rank %d: a persist job is still blocked on storage at close; left behind: %s",
                        self.run.rank, self.run.last_error)


def _fault_json(exc: BaseException) -> dict[str, str] | None:
    fault = permanent_fault(exc)
    return fault.to_json() if fault is not None else None


class _Handoff:
    """The buffer a persist job's I/O leased for it (under the run's lock): the persist
    thread books the outcome on it and ends that lease; ``closed`` once the job ended, so
    I/O that starts late takes no lease nobody would end."""

    def __init__(self) -> None:
        self.buf: SnapshotBuffer | None = None
        self.closed = False


def carry_persist_counters(plt: PLTTracker, base: Manifest | None) -> None:
    """Make the persist-level counters of a commit agree with the versions it records.

    A snapshot's header holds the counters of the moment it was taken. When the persist
    before it was still running then, the header does not know that persist's experts yet,
    while the commit carries their versions over from ``base`` (that persist's manifest):
    the counter of each expert the commit does not save itself must be the one ``base``
    recorded for the version it carries. Counters only grow along a timeline (a restore
    moves a stale expert's back to its version, never below the one stored for it), so
    the newer of the two is the one of the version carried."""
    if base is None:
        return
    carried = ((base.plt or {}).get("saved") or {}).get("persist") or {}
    rows = plt.saved["persist"]
    for layer, row in rows.items():
        old = carried.get(layer)
        if isinstance(old, list) and len(old) == len(row):
            rows[layer] = [max(int(a), int(b)) for a, b in zip(row, old)]
