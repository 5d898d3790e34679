"""The progress beat: a 64-byte shared-memory record a worker's training thread updates
at every step and its agent reads, so that the agent sees a worker that stopped making
progress (its hang watchdog, :mod:`lazarus.runtime.agent._watchdog`).

The agent makes one region per worker (a ``memfd``; an unlinked temporary file where
there is none), passes its descriptor to the worker (``LAZARUS_PROGRESS_FD``) and keeps
it mapped; the worker maps it too (:mod:`lazarus.runtime.worker._progress`). A beat is three
``struct.pack_into`` calls into the mapping — no system call, about a microsecond — made
by the training thread only: no background thread writes it, so the beat stops exactly
when the step stops.

Layout (little endian): ``magic "LZPB"``, ``version``, then a seqlock-guarded record:
``seq`` (odd while the worker writes), ``phase``, the training thread's native id,
``step``, ``generation``, the beat's ``time.monotonic_ns()`` (one clock for every
process of the machine) and the worker's typical step time in ns (0 until known).

No torch, numpy or worker imports: the agent loads this.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
from dataclasses import dataclass

__all__ = ["BEAT_BYTES", "Beat", "BeatRegion", "FIELDS", "FIELDS_AT", "PHASE_DONE", "PHASE_IDLE", "PHASE_STARTING",
           "PHASE_STEP", "PROGRESS_FD_ENV", "SEQ", "SEQ_AT", "pack_header"]

#: the environment variable naming the region's descriptor in the worker
PROGRESS_FD_ENV = "LAZARUS_PROGRESS_FD"
BEAT_BYTES = 64
MAGIC = b"LZPB"
VERSION = 1

#: the worker has not started training (imports, model build, the first plan)
PHASE_STARTING = 0
#: the training thread runs a step (the only phase in which missing beats can mean a hang)
PHASE_STEP = 1
#: the worker waits for a plan or reconfigures (the rendezvous has its own timeouts)
PHASE_IDLE = 2
#: training finished (a finished worker is never killed)
PHASE_DONE = 3

_HEADER = struct.Struct("<4sI")
#: the seqlock's counter: odd while the worker writes the fields
SEQ = struct.Struct("<Q")
SEQ_AT = _HEADER.size
#: phase, training thread id, step, generation, beat time (monotonic ns), typical step (ns)
FIELDS = struct.Struct("<IIqqQQ")
FIELDS_AT = SEQ_AT + SEQ.size
assert FIELDS_AT + FIELDS.size <= BEAT_BYTES


def pack_header(buf: mmap.mmap) -> None:
    """Stamp ``buf`` as a beat region (the worker does, when it maps it)."""
    _HEADER.pack_into(buf, 0, MAGIC, VERSION)


@dataclass(frozen=True)
class Beat:
    """One consistent reading of a worker's beat."""

    seq: int
    phase: int
    tid: int
    step: int
    generation: int
    t_ns: int
    typical_ns: int


class BeatRegion:
    """The agent's side of one worker's beat: creates the shared region, hands its
    descriptor to the worker (:attr:`fd`, closed by :meth:`release_fd` once the worker is
    started) and reads it (:meth:`read`)."""

    def __init__(self) -> None:
        try:
            fd = os.memfd_create("lazarus-beat", os.MFD_CLOEXEC)
        except (AttributeError, OSError):   # no memfd here: an unlinked temporary file
            fd = os.dup(tempfile.TemporaryFile().fileno())
        try:
            os.ftruncate(fd, BEAT_BYTES)
            self._map = mmap.mmap(fd, BEAT_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd

    def release_fd(self) -> None:
        """The worker holds its own copy now: close the agent's descriptor (the mapping stays)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.release_fd()
        if not self._map.closed:
            self._map.close()

    def read(self) -> Beat | None:
        """The newest beat, or None: the worker has not beaten yet (it does not use
        :class:`~lazarus.runtime.ElasticTrainer`) or was writing just now (read again)."""
        if self._map.closed:
            return None
        magic, version = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC or version != VERSION:
            return None
        (seq,) = SEQ.unpack_from(self._map, SEQ_AT)
        fields = FIELDS.unpack_from(self._map, FIELDS_AT)
        if seq & 1 or SEQ.unpack_from(self._map, SEQ_AT)[0] != seq:
            return None   # the worker is writing: read again at the next look
        return Beat(seq, *fields)
