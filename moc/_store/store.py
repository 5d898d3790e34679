"""The persistent level: writing, committing, reading, verifying and retiring checkpoints.

:class:`CheckpointStore` owns the store layout described in :mod:`moc._store.format`. Saving is
split so that many ranks can write in parallel and one of them commits:

1. each writer packs its share of unit bytes into one object per group with a
   :class:`ShardWriter` (raw tensor bytes, or zstd with byte-plane shuffle, each chunk
   checksummed) and returns :class:`UnitRecord`\\ s;
2. one process calls :meth:`CheckpointStore.commit` with all records: units not saved at
   this step are carried over from the previous manifest, the manifest is published
   atomically (last), then retention deletes old manifests and unreferenced objects.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Generator, Iterable

import xxhash

from storage_backends import CommitConflict, Store, open_store

from .._errors import FencedError, ForeignRunError
from .._export import export_state
from .codec import (CODECS, EncodedUnit, TensorMeta, checksum, compress, decode_tree, decompress, encode_tree,
                    unit_buffer)
from .format import (DATA_PREFIX, FENCE_PREFIX, MANIFEST_PREFIX, ChunkRecord, Fence, Manifest, ManifestError,
                     UnitRecord, data_prefix, fence_key, generation_of_fence_key, manifest_key, parse_manifest_key,
                     step_of_data_key, visible_manifests)

__all__ = ["CheckpointStore", "ShardWriter", "CorruptObjectError", "LoadResult", "VerifyProblem"]

log = logging.getLogger("moc.store")
_WRITER_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

Progress = Callable[[int, int], None]


class CorruptObjectError(OSError):
    """A stored object failed its checksum, was truncated, or would not decode."""

    def __init__(self, where: str, reason: str, *, key: str, unit: str | None = None) -> None:
        super().__init__(f"object {where} {reason}" + (f" (unit {unit})" if unit else ""))
        self.key = key
        self.unit = unit
        self.reason = reason


@dataclass
class LoadResult:
    step: int
    manifest: Manifest
    units: dict[str, Any]               # unit name -> state tree
    versions: dict[str, int]            # unit name -> step of the version loaded
    fallbacks: list[tuple[str, int, int]] = field(default_factory=list)  # (unit, bad step, used step)


@dataclass(frozen=True)
class VerifyProblem:
    key: str
    units: tuple[str, ...]
    reason: str

    def __str__(self) -> str:
        return f"{self.key}: {self.reason}" + (f" (units: {', '.join(self.units)})" if self.units else "")


class ShardWriter:
    """Packs one writer's chunks of one step into one object per group, then writes them."""

    def __init__(self, owner: "CheckpointStore", step: int, writer: str, generation: int = 0) -> None:
        if not _WRITER_RE.match(writer):
            raise ValueError(f"writer must match {_WRITER_RE.pattern}, got {writer!r}")
        self.owner = owner
        self.step = step
        self.writer = writer
        self.generation = generation
        self._parts: dict[str, list[Any]] = {}
        self._sizes: dict[str, int] = {}
        self.raw_nbytes = 0

    def key(self, group: str) -> str:
        # generation and this process's nonce: no other writer (a stale generation's, another
        # job's, this job's before a restart) ever writes the same key
        return f"{data_prefix(self.step)}g{self.generation}.{self.writer}.{self.owner.nonce}.{group}.bin"

    def add_chunk(self, enc: EncodedUnit, *, start: int = 0, end: int | None = None,
                  group: str = "state") -> ChunkRecord:
        """Queue bytes ``[start, end)`` of an encoded unit; return the chunk's record."""
        end = enc.nbytes if end is None else end
        if not 0 <= start <= end <= enc.nbytes:
            raise ValueError(f"chunk range [{start}, {end}) outside the unit's {enc.nbytes} bytes")
        return self.add_bytes(enc.stream(start, end), offset=start, itemsize=enc.itemsize, group=group)

    def add_bytes(self, views: list[memoryview], *, offset: int, itemsize: int = 1,
                  group: str = "state") -> ChunkRecord:
        """Queue raw unit bytes that start at ``offset`` in the unit's stream."""
        if not _WRITER_RE.match(group):
            raise ValueError(f"group must match {_WRITER_RE.pattern}, got {group!r}")
        nbytes = sum(len(v) for v in views)
        codec = self.owner.compression
        stored = compress(views, codec, itemsize=itemsize, level=self.owner.zstd_level)
        if isinstance(stored, bytes):
            parts: list[Any] = [stored]
            digest = checksum(stored)
        else:
            parts = stored
            h = xxhash.xxh3_64()
            for v in parts:
                h.update(v)
            digest = "xxh3:" + h.hexdigest()
        size = sum(len(p) for p in parts)
        key = self.key(group)
        pos = self._sizes.get(group, 0)
        self._parts.setdefault(group, []).extend(parts)
        self._sizes[group] = pos + size
        self.raw_nbytes += nbytes
        return ChunkRecord(key=key, start=pos, stored_nbytes=size, offset=offset, nbytes=nbytes,
                           codec=codec, itemsize=itemsize if codec == "zstd" else 1, checksum=digest)

    def add_unit(self, name: str, tree: Any, *, kind: str, layer: str | None = None,
                 expert: int | None = None, group: str | None = None) -> UnitRecord:
        """Encode and queue a whole unit; return its record."""
        enc = encode_tree(tree)
        chunk = self.add_chunk(enc, group=group or ("experts" if kind == "expert" else "state"))
        return make_record(name, enc, [chunk], kind=kind, step=self.step, layer=layer, expert=expert)

    @property
    def stored_nbytes(self) -> int:
        return sum(self._sizes.values())

    def finish(self) -> int:
        """Write every queued object (streamed, retried); return the bytes written.
        Raises :class:`moc.FencedError` (writing nothing) when a newer generation fenced
        this writer's."""
        self.owner.check_fence(self.step, self.generation, fresh=False)
        total = 0
        for group, parts in self._parts.items():
            total += self.owner.store.write(self.key(group), parts)
        self._parts.clear()
        return total


def make_record(name: str, enc: EncodedUnit, chunks: list[ChunkRecord], *, kind: str, step: int,
                layer: str | None = None, expert: int | None = None) -> UnitRecord:
    return UnitRecord(name=name, kind=kind, step=step, nbytes=enc.nbytes, skeleton=enc.skeleton,
                      tensors=[t.to_json() for t in enc.tensors], chunks=list(chunks),
                      layer=layer, expert=expert)


class CheckpointStore:
    """Checkpoints of one run in one store (see :mod:`moc._store.format` for the layout).

    ``compression``: ``"raw"`` (default) or ``"zstd"`` (byte-plane shuffled).
    ``keep_last``: number of committed steps to keep (None keeps all).
    ``read_concurrency``: units :meth:`load` reads at once (reads release the GIL; on
    NFS, S3 and virtual disks one sequential reader leaves most of the bandwidth idle).
    """

    def __init__(self, store: Store | str, *, compression: str | None = "raw", zstd_level: int = 3,
                 keep_last: int | None = None, storage_options: dict[str, Any] | None = None,
                 read_concurrency: int = 8) -> None:
        compression = compression or "raw"
        if compression not in CODECS:
            raise ValueError(f"compression must be one of {CODECS} or None, got {compression!r}")
        if not (isinstance(zstd_level, int) and 1 <= zstd_level <= 22):
            raise ValueError(f"zstd_level must be an integer in [1, 22], got {zstd_level!r}")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be an integer >= 1 or None, got {keep_last!r}")
        if not (isinstance(read_concurrency, int) and 1 <= read_concurrency <= 256):
            raise ValueError(f"read_concurrency must be an integer in [1, 256], got {read_concurrency!r}")
        self.read_concurrency = read_concurrency
        self.store = store if isinstance(store, Store) else open_store(store, **(storage_options or {}))
        self.compression = compression
        self.zstd_level = zstd_level
        self.keep_last = keep_last
        # Temp files older than this are debris of killed writers and are removed by gc.
        self.stale_temporaries = timedelta(hours=1)
        #: the fencing generation this process writes as (an elastic runtime sets it)
        self.generation = 0
        #: added to the generations a job asks for: the newest fence of the store its first
        #: restore found (a new job on a path an earlier job fenced), so they only grow
        self.generation_base = 0
        #: in every data key this process writes: no two processes share one
        self.nonce = uuid.uuid4().hex[:8]
        #: how long a listing of the fence markers is reused before data writes (commits
        #: always list afresh)
        self.fence_ttl = timedelta(seconds=2)
        self._fences: dict[str, Fence] = {}        # key -> marker (markers never change)
        self._fence_listed: tuple[float, list[Fence]] = (-1e18, [])   # (monotonic time, fences) of the newest listing
        self._fence_lock = threading.Lock()
        #: writes this process had refused by fencing (a newer generation's fence, or a
        #: manifest key already taken), whichever part wrote; and what the newest said
        self.refusals = 0
        self.last_refusal: str | None = None
        #: a fence this process still has to publish (:meth:`defer_fence`): done before its
        #: next commit at the latest
        self._pending_fence: tuple[int, int, str] | None = None

    def __repr__(self) -> str:
        return f"CheckpointStore({self.store.url!r})"

    # -- reading manifests ---------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending. A step without a manifest is never listed, nor one
        whose only manifests a fence hides (see :mod:`moc._store.format`)."""
        return sorted(self.manifest_index()[0])

    def manifest_index(self) -> tuple[dict[int, tuple[int, str]], list[str]]:
        """``({step: (generation, manifest key)}, hidden manifest keys)``: what readers use."""
        return visible_manifests(self.store.list(MANIFEST_PREFIX), self.fences())

    # -- fencing -------------------------------------------------------------------------
    def fences(self) -> list[Fence]:
        """Every fence marker in the store, oldest generation first (listed afresh)."""
        out = []
        for key in self.store.list(FENCE_PREFIX):
            if generation_of_fence_key(key) is None:
                continue
            fence = self._fences.get(key)
            if fence is None:
                try:
                    fence = Fence.from_bytes(self.store.read(key), source=f"{self.store.url}/{key}")
                except FileNotFoundError:
                    continue
                self._fences[key] = fence
            out.append(fence)
        fences = sorted(out, key=lambda f: f.generation)
        with self._fence_lock:
            self._fence_listed = (time.monotonic(), fences)
        return fences

    def newest_fence(self, *, fresh: bool = True) -> Fence | None:
        """The fence of the newest generation (None: no fence); ``fresh=False`` reuses a
        listing younger than :attr:`fence_ttl`."""
        with self._fence_lock:
            at, fences = self._fence_listed
        if fresh or time.monotonic() - at > self.fence_ttl.total_seconds():
            fences = self.fences()
        return fences[-1] if fences else None

    def check_fence(self, step: int, generation: int, *, fresh: bool = True) -> None:
        """Raise :class:`moc.FencedError` when a fence of a newer generation than
        ``generation`` is in the store: such a writer may neither write nor commit."""
        fence = self.newest_fence(fresh=fresh)
        if fence is not None and fence.generation > generation:
            raise self._refused(FencedError(
                f"step {step}: write refused: this writer's generation {generation} is stale, generation "
                f"{fence.generation} took over at step {fence.resume_step} ({self.store.url}/"
                f"{fence_key(fence.generation)})", step=step, generation=generation, fence=fence.generation))

    def defer_fence(self, generation: int, resume_step: int, *, run_id: str = "") -> None:
        """Publish generation ``generation``'s fence in a background thread now, and before
        this process's next commit at the latest (a caller that must not wait on storage:
        an elastic runtime in the middle of a reconfiguration). A failure is logged here and
        raised by that commit."""
        with self._fence_lock:
            self._pending_fence = (generation, resume_step, run_id)

        def publish() -> None:
            try:
                self.ensure_fence()
            except Exception as exc:  # noqa: BLE001 - the next commit tries again and raises
                log.warning("generation %d: fence marker not written yet (%s: %s); the next commit writes it",
                            generation, type(exc).__name__, exc)

        threading.Thread(target=publish, name=f"moc-fence-g{generation}", daemon=True).start()

    def ensure_fence(self) -> None:
        """Publish the fence :meth:`defer_fence` left pending, if any."""
        with self._fence_lock:
            pending = self._pending_fence
        if pending is None:
            return
        self.write_fence(pending[0], pending[1], run_id=pending[2])
        with self._fence_lock:
            if self._pending_fence == pending:
                self._pending_fence = None

    def write_fence(self, generation: int, resume_step: int, *, run_id: str = "") -> Fence:
        """Publish generation ``generation``'s fence (conditionally: a marker already there
        for it stays, and is returned); raises :class:`moc.FencedError` when a newer
        generation already fenced this one."""
        if not isinstance(generation, int) or generation < 1:
            raise ValueError(f"generation must be an integer >= 1, got {generation!r}")
        if not isinstance(resume_step, int) or resume_step < 0:
            raise ValueError(f"resume_step must be a non-negative int, got {resume_step!r}")
        self.check_fence(resume_step, generation)
        fence = Fence(generation=generation, resume_step=resume_step, run_id=run_id, created_at=time.time())
        key = fence_key(generation)
        try:
            self.store.commit_new(key, fence.to_bytes())
        except CommitConflict:
            fence = Fence.from_bytes(self.store.read(key), source=f"{self.store.url}/{key}")
        self._fences[key] = fence
        self.fences()
        log.info("generation %d fenced older writers from step %d on in %s", generation, fence.resume_step,
                 self.store.url)
        return fence

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def read_manifest(self, step: int) -> Manifest:
        visible = self.manifest_index()[0]
        if step not in visible:
            raise FileNotFoundError(
                f"no checkpoint at step {step} in {self.store.url}; committed steps: {sorted(visible)}")
        key = visible[step][1]
        try:
            data = self.store.read(key)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no checkpoint at step {step} in {self.store.url}; committed steps: {self.steps()}"
            ) from None
        manifest = Manifest.from_bytes(data, source=f"manifest {self.store.url}/{key}")
        if manifest.step != step:
            raise ManifestError(f"manifest {key} claims step {manifest.step}")
        return manifest

    def latest_manifest(self) -> Manifest | None:
        """The newest manifest that parses; corrupt newer ones are skipped with a warning."""
        for step in reversed(self.steps()):
            try:
                return self.read_manifest(step)
            except ManifestError as exc:
                log.warning("skipping step %d: %s", step, exc)
        return None

    # -- writing -------------------------------------------------------------------------
    def writer(self, step: int, writer: str = "w0", *, generation: int | None = None) -> ShardWriter:
        """A writer of step ``step``'s objects, as generation ``generation`` (default:
        :attr:`generation`)."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        return ShardWriter(self, step, writer, self.generation if generation is None else generation)

    def commit(self, step: int, records: Iterable[UnitRecord], *, base: Manifest | None = None,
               plt: dict[str, Any] | None = None, meta: dict[str, Any] | None = None,
               generation: int | None = None) -> Manifest:
        """Publish step ``step``: ``records`` plus every other unit of ``base``, as generation
        ``generation`` (default: :attr:`generation`).

        All objects the records point to must already be written. The manifest is
        written last, atomically and conditionally (never over an existing manifest);
        retention runs afterwards. Raises :class:`moc.FencedError` when a newer
        generation fenced this one, :class:`moc.ForeignRunError` when another job's
        manifest holds the key, :class:`storage_backends.CommitConflict` when one of
        this job's does.
        """
        generation = self.generation if generation is None else generation
        units = dict(base.units) if base is not None else {}
        for rec in records:
            if rec.step > step:
                raise ValueError(f"unit {rec.name!r} has version step {rec.step} > commit step {step}")
            units[rec.name] = rec
        if not units:
            raise ValueError("commit needs at least one unit")
        meta = dict(meta or {})
        if generation:
            meta["generation"] = generation
        manifest = Manifest(step=step, units=units, plt=dict(plt or {}), meta=meta, created_at=time.time())
        self.ensure_fence()
        self.check_fence(step, generation)
        key = manifest_key(step, generation)
        try:
            self.store.commit_new(key, manifest.to_bytes())
        except CommitConflict as exc:
            self._refused(exc)
            self._raise_foreign(key, str(meta.get("run_id", "")))
            raise
        log.info("committed step %d (%d units) to %s", step, len(units), self.store.url)
        if self.keep_last is not None:
            self.gc(upto=step)
        return manifest

    def _refused(self, exc: BaseException) -> BaseException:
        """Count a refused write (:attr:`refusals`); return ``exc`` to raise."""
        with self._fence_lock:
            self.refusals += 1
            self.last_refusal = f"{type(exc).__name__}: {exc}"
        return exc

    def _raise_foreign(self, key: str, run: str) -> None:
        """Raise :class:`moc.ForeignRunError` when the manifest at ``key`` is another run's."""
        try:
            other = Manifest.from_bytes(self.store.read(key), source=f"{self.store.url}/{key}")
        except (OSError, ManifestError):
            return
        other_run = str(other.meta.get("run_id", ""))
        if run and other_run and other_run != run:
            raise ForeignRunError(
                f"two jobs write checkpoints to {self.store.url}: run {other_run} already committed {key} "
                f"(this is run {run}). A storage path belongs to one job: give this job its own "
                f"MoCConfig.storage, or stop the other job", url=self.store.url, key=key, other_run=other_run,
                run=run)

    def _key_of(self, step: int) -> str:
        """The manifest key readers use for ``step`` (the generation-0 key when none)."""
        found = self.manifest_index()[0].get(step)
        return found[1] if found is not None else manifest_key(step)

    def discard_step(self, step: int) -> list[str]:
        """Delete every manifest of ``step`` (all generations); return their keys."""
        keys = [k for k in self.store.list(MANIFEST_PREFIX) if (parse_manifest_key(k) or (-1, 0))[0] == step]
        for key in keys:
            self.store.delete(key, missing_ok=True)
        return keys

    def save(self, step: int, units: dict[str, tuple[Any, dict[str, Any]]], *,
             base: Manifest | None = None, plt: dict[str, Any] | None = None,
             meta: dict[str, Any] | None = None, writer: str = "w0") -> Manifest:
        """Single-writer convenience: ``units[name] = (tree, {"kind":..., "layer":..., "expert":...})``."""
        w = self.writer(step, writer)
        records = [w.add_unit(name, tree, **info) for name, (tree, info) in units.items()]
        w.finish()
        return self.commit(step, records, base=base, plt=plt, meta=meta)

    # -- reading units -------------------------------------------------------------------
    def _read_chunk(self, chunk: ChunkRecord, unit: str | None, blob: bytes | None = None) -> bytes:
        where = f"{self.store.url}/{chunk.key}[{chunk.start}:{chunk.start + chunk.stored_nbytes}]"
        if blob is None:
            try:
                blob = self.store.read(chunk.key, chunk.start, chunk.start + chunk.stored_nbytes)
            except FileNotFoundError as exc:
                raise CorruptObjectError(where, "is missing", key=chunk.key, unit=unit) from exc
        if len(blob) != chunk.stored_nbytes:
            raise CorruptObjectError(where, f"is truncated: {len(blob)} of {chunk.stored_nbytes} bytes",
                                     key=chunk.key, unit=unit)
        got = checksum(blob)
        if got != chunk.checksum:
            raise CorruptObjectError(where, f"failed its checksum (expected {chunk.checksum}, got {got})",
                                     key=chunk.key, unit=unit)
        try:
            raw = decompress(blob, chunk.codec, raw_nbytes=chunk.nbytes, itemsize=chunk.itemsize)
        except Exception as exc:  # noqa: BLE001 - a codec failure is corruption too
            raise CorruptObjectError(where, f"does not decode: {exc}", key=chunk.key, unit=unit) from exc
        if len(raw) != chunk.nbytes:
            raise CorruptObjectError(where, f"decodes to {len(raw)} bytes, expected {chunk.nbytes}",
                                     key=chunk.key, unit=unit)
        return raw

    def _read_raw_into(self, chunk: ChunkRecord, out: memoryview, unit: str | None) -> None:
        """An uncompressed chunk straight into its place in the unit's buffer, verified there."""
        where = f"{self.store.url}/{chunk.key}[{chunk.start}:{chunk.start + chunk.stored_nbytes}]"
        try:
            n = self.store.read_into(chunk.key, out, chunk.start)
        except FileNotFoundError as exc:
            raise CorruptObjectError(where, "is missing", key=chunk.key, unit=unit) from exc
        if n != chunk.stored_nbytes:
            raise CorruptObjectError(where, f"is truncated: {n} of {chunk.stored_nbytes} bytes",
                                     key=chunk.key, unit=unit)
        got = checksum(out)
        if got != chunk.checksum:
            raise CorruptObjectError(where, f"failed its checksum (expected {chunk.checksum}, got {got})",
                                     key=chunk.key, unit=unit)

    def read_unit(self, rec: UnitRecord) -> Any:
        """Read, verify and decode one unit's saved version."""
        data, view = unit_buffer(rec.nbytes)
        for chunk in rec.chunks:
            target = view[chunk.offset: chunk.offset + chunk.nbytes]
            if chunk.codec == "raw" and chunk.stored_nbytes == chunk.nbytes:
                self._read_raw_into(chunk, target, rec.name)
            else:
                target[:] = self._read_chunk(chunk, rec.name)
        tensors = [TensorMeta.from_json(t) for t in rec.tensors]
        try:
            return decode_tree(rec.skeleton, tensors, data)
        except (ValueError, KeyError, TypeError) as exc:
            key = rec.chunks[0].key if rec.chunks else "?"
            raise CorruptObjectError(f"{self.store.url}/{key}", f"does not decode: {exc}",
                                     key=key, unit=rec.name) from exc

    def _older_versions(self, name: str, below: int, before_step: int) -> Iterable[UnitRecord]:
        """Older saved versions of unit ``name`` (version step < ``below``), newest first."""
        seen: set[int] = set()
        for step in reversed([s for s in self.steps() if s < before_step]):
            try:
                rec = self.read_manifest(step).units.get(name)
            except ManifestError:
                continue
            if rec is not None and rec.step < below and rec.step not in seen:
                seen.add(rec.step)
                yield rec

    def version_counter(self, name: str, version: int) -> int | None:
        """The routing counter of expert unit ``name`` when its version of step ``version``
        was saved (what PLT charges a restore to that version with): read from the newest
        kept manifest that records that version (a manifest's persist counters are those
        of the versions it records). None: not an expert, or no kept manifest records it."""
        for step in reversed([s for s in self.steps() if s >= version]):
            try:
                manifest = self.read_manifest(step)
            except ManifestError:
                continue
            rec = manifest.units.get(name)
            if rec is None or rec.step != version or rec.layer is None or rec.expert is None:
                continue
            row = (((manifest.plt or {}).get("saved") or {}).get("persist") or {}).get(rec.layer)
            if isinstance(row, list) and int(rec.expert) < len(row):
                return int(row[int(rec.expert)])
        return None

    def load(self, step: int | None = None, names: Iterable[str] | None = None, *,
             fallback: bool = True, progress: Progress | None = None) -> LoadResult:
        """Read the units of ``step`` (newest valid step by default).

        A unit whose bytes are corrupt or missing falls back to its previous saved version
        (from an older kept manifest) when ``fallback``; the substitution is reported in
        ``LoadResult.fallbacks`` and logged. Without a good version the error propagates.
        """
        manifest = self.latest_manifest() if step is None else self.read_manifest(step)
        if manifest is None:
            raise FileNotFoundError(f"no committed checkpoint in {self.store.url}")
        wanted = list(manifest.units) if names is None else list(names)
        result = LoadResult(step=manifest.step, manifest=manifest, units={}, versions={})
        total = sum(manifest.units[n].stored_nbytes for n in wanted if n in manifest.units)
        done = 0
        for name, tree, version in self.iter_units(manifest, wanted, fallback=fallback, window=len(wanted)):
            rec = manifest.units[name]
            done += rec.stored_nbytes
            result.units[name] = tree
            result.versions[name] = version
            if version != rec.step:
                result.fallbacks.append((name, rec.step, version))
            if progress is not None:
                progress(done, total)
        return result

    def iter_units(self, manifest: Manifest, names: Iterable[str], *, fallback: bool = True,
                   window: int | None = None,
                   max_ahead_bytes: int | None = None) -> Generator[tuple[str, Any, int], None, None]:
        """``(name, tree, version step)`` of each named unit of ``manifest``, in order.

        Reads run on ``read_concurrency`` threads with at most ``window`` units (default
        ``read_concurrency``) and, when given, ``max_ahead_bytes`` raw bytes (but always one
        unit) read ahead of the consumer, so memory stays bounded while streaming. Corrupt
        units fall back to older versions as in :meth:`load`.
        """
        wanted = list(names)
        missing = [n for n in wanted if n not in manifest.units]
        if missing:
            raise KeyError(f"units {missing[:5]} are not in step {manifest.step}")
        if not wanted:
            return
        ahead = max(1, window if window is not None else self.read_concurrency)
        pool = ThreadPoolExecutor(max(1, min(self.read_concurrency, len(wanted))), thread_name_prefix="moc-read")
        try:
            reads: deque[tuple[Future, int]] = deque()
            pending = 0
            nxt = 0
            for name in wanted:
                while nxt < len(wanted) and len(reads) < ahead:
                    size = manifest.units[wanted[nxt]].nbytes
                    if reads and max_ahead_bytes is not None and pending + size > max_ahead_bytes:
                        break
                    reads.append((pool.submit(self.read_unit, manifest.units[wanted[nxt]]), size))
                    pending += size
                    nxt += 1
                read, size = reads.popleft()
                pending -= size
                rec = manifest.units[name]
                try:
                    tree, version = read.result(), rec.step
                except CorruptObjectError as exc:
                    if not fallback:
                        raise
                    tree, version = self._fall_back(name, rec, manifest.step, exc)
                yield name, tree, version
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # after an error: no reads left running

    def _fall_back(self, name: str, rec: UnitRecord, step: int, error: CorruptObjectError) -> tuple[Any, int]:
        """The newest readable older version of unit ``name`` and its step, else raise ``error``."""
        for older in self._older_versions(name, rec.step, step):
            try:
                tree = self.read_unit(older)
            except CorruptObjectError:
                continue
            log.warning("unit %s: version of step %d is unreadable (%s); using step %d",
                        name, rec.step, error, older.step)
            return tree, older.step
        raise error

    # -- verification --------------------------------------------------------------------
    def verify(self, step: int | None = None, *, progress: Progress | None = None) -> list[VerifyProblem]:
        """Re-read every object referenced by ``step`` (all committed steps when None)."""
        manifests = []
        problems: list[VerifyProblem] = []
        steps = self.steps()
        bad: list[tuple[int, ManifestError]] = []
        for s in ([step] if step is not None else steps):
            try:
                manifests.append(self.read_manifest(s))
            except ManifestError as exc:
                bad.append((s, exc))
        readable = {m.step for m in manifests}
        for s, error in bad:
            problems.append(VerifyProblem(self._key_of(s), (), self._manifest_problem(s, error, steps, readable)))
        chunks: dict[tuple[str, int], tuple[ChunkRecord, set[str]]] = {}
        for m in manifests:
            for rec in m.units.values():
                for c in rec.chunks:
                    chunks.setdefault((c.key, c.start), (c, set()))[1].add(rec.name)
        by_key: dict[str, list[tuple[ChunkRecord, set[str]]]] = {}
        for c, units in chunks.values():
            by_key.setdefault(c.key, []).append((c, units))
        total = sum(c.stored_nbytes for c, _ in chunks.values())
        done = 0
        for key in sorted(by_key):
            entries = sorted(by_key[key], key=lambda e: e[0].start)
            try:
                blob = self.store.read(key)
            except FileNotFoundError:
                missing = tuple(sorted(set[str]().union(*(u for _, u in entries))))
                problems.append(VerifyProblem(key, missing, "object is missing"))
                blob = None
            for c, units in entries:
                if blob is not None:
                    try:
                        self._read_chunk(c, None, blob[c.start: c.start + c.stored_nbytes])
                    except CorruptObjectError as exc:
                        problems.append(VerifyProblem(key, tuple(sorted(units)),
                                                      f"bytes [{c.start}, {c.start + c.stored_nbytes}) {exc.reason}"))
                done += c.stored_nbytes
                if progress is not None:
                    progress(done, total)
        return problems

    def _manifest_problem(self, step: int, exc: ManifestError, steps: list[int], readable: set[int]) -> str:
        """What is wrong with the manifest of ``step`` and what it means for a restore."""
        try:
            nbytes = self.store.size(self._key_of(step))
            size = f"{nbytes} bytes" + (", cut short" if f"(char {nbytes})" in str(exc) else "")
        except OSError as err:
            size = f"size unknown: {err}"
        newer = [s for s in steps if s > step and s in readable]
        if newer:
            return (f"manifest of step {step} is unreadable ({size}): {exc}; the units it records are not "
                    f"checked; restore() uses the newer step {newer[-1]}, but can no longer fall back to this "
                    f"step's versions")
        fallback = None
        for s in reversed([s for s in steps if s < step]):
            if s in readable:
                fallback = s
                break
            try:
                self.read_manifest(s)
            except ManifestError:
                continue
            fallback = s
            break
        then = (f"restore() and export skip it and use step {fallback}, the newest readable older manifest"
                if fallback is not None else "no older manifest is readable: restore() would start from step 0")
        return (f"manifest of step {step} is unreadable ({size}): {exc}; the units it records are not checked; "
                f"{then}")

    # -- retention -----------------------------------------------------------------------
    def gc(self, upto: int | None = None) -> list[str]:
        """Apply ``keep_last`` and delete data objects no kept manifest references.

        Only objects of steps <= ``upto`` (the newest committed step by default) are
        considered, so a writer's in-flight objects for a later step are never touched.
        Old manifests are deleted before objects, so no kept manifest ever loses data.
        """
        visible, hidden = self.manifest_index()
        steps = sorted(visible)
        if not steps:
            return []
        upto = steps[-1] if upto is None else upto
        keep = steps if self.keep_last is None else steps[-self.keep_last:]
        deleted: list[str] = []
        for s in steps:
            if s not in keep:
                self.store.delete(visible[s][1], missing_ok=True)
                deleted.append(visible[s][1])
        for key in hidden:      # a fenced writer's, or an older generation's of a step: never read
            if (parse_manifest_key(key) or (upto + 1, 0))[0] <= upto:
                self.store.delete(key, missing_ok=True)
                deleted.append(key)
        referenced: set[str] = set()
        for s in keep:
            try:
                referenced |= self.read_manifest(s).keys()
            except ManifestError as exc:
                # Can't tell what a corrupt manifest references: keep everything this round.
                log.warning("gc skipped: %s", exc)
                return deleted
        for key in self.store.list(DATA_PREFIX):
            data_step = step_of_data_key(key)
            if data_step is not None and data_step <= upto and key not in referenced:
                self.store.delete(key, missing_ok=True)
                deleted.append(key)
        if deleted:
            log.info("gc removed %d objects from %s", len(deleted), self.store.url)
        self.store.remove_temporaries(self.stale_temporaries)
        return deleted

    # -- export --------------------------------------------------------------------------
    def export(self, step: int | None = None, *, progress: Progress | None = None) -> dict[str, Any]:
        """The checkpoint as one in-memory state dict (weights_only-loadable): the model's
        state dict with full tensors (fused experts and shards reassembled), the optimizer's
        state by parameter name and its param groups, each rank's extra state, and
        ``"moc": {"step", "versions"}``. ``moc export`` streams the same to a file."""
        return export_state(self, step, progress=progress)
