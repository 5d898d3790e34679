"""The store: a small key/value object API over fsspec file systems."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from datetime import timedelta
from typing import Any, Iterable, Iterator, Sequence, Union

import fsspec

from ._commit import is_temporary, write_local_atomic, write_local_exclusive
from ._errors import CommitConflict
from ._retry import RetryPolicy

__all__ = ["Store", "S3Store", "LocalStore", "Data"]

log = logging.getLogger("storage_backends")

Buffer = Union[bytes, bytearray, memoryview]
# A payload is one bytes-like object or a sequence of them (written back to back without
# being joined first, so a checkpoint object can be streamed from many tensor buffers).
Data = Union[Buffer, Sequence[Buffer]]

DEFAULT_PART_SIZE = 16 * 2**20
MAX_COMMIT_BYTES = 16 * 2**20
# Conditional commits on a file system with no conditional write of its own (memory://):
# check-then-write under one lock per process (a memory store lives in one process).
_EXCLUSIVE = threading.Lock()


def _buffers(data: Data) -> list[memoryview]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        items: Sequence[Any] = (data,)
    elif isinstance(data, (list, tuple)):
        items = data
    else:
        raise TypeError(
            f"data must be bytes-like or a list/tuple of bytes-like objects, got {type(data).__name__}"
        )
    out = []
    for item in items:
        if not isinstance(item, (bytes, bytearray, memoryview)):
            raise TypeError(f"data parts must be bytes-like, got {type(item).__name__}")
        view = memoryview(item)
        out.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    return out


def check_key(key: str, *, allow_empty: bool = False) -> str:
    """Validate a store key: '/'-separated, relative, no '.'/'..' parts, no hidden temp names."""
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, got {type(key).__name__}")
    if key == "" and allow_empty:
        return key
    parts = key.split("/")
    if (
        key == ""
        or key.startswith("/")
        or "\\" in key
        or any(p in ("", ".", "..") for p in parts[:-1])
        or parts[-1] in (".", "..")
        or (parts[-1] == "" and not allow_empty)
        or is_temporary(key)
    ):
        raise ValueError(
            f"invalid key {key!r}: keys are relative '/'-separated paths without empty, '.' or '..' parts"
        )
    return key


class Store:
    """Objects under one root URL, on any fsspec file system.

    Keys are relative '/'-separated paths. Every call retries transient errors with
    exponential backoff (``retry``) and raises built-in exceptions (``FileNotFoundError``,
    ``PermissionError``, ``ConnectionError``, ``TimeoutError``, ``OSError``) naming the URL
    and key.
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        root: str,
        *,
        url: str,
        retry: RetryPolicy | None = None,
        part_size: int = DEFAULT_PART_SIZE,
    ) -> None:
        if part_size < 5 * 2**20:
            raise ValueError(f"part_size must be at least 5 MiB (S3's minimum part), got {part_size}")
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.part_size = int(part_size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # -- helpers -------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _what(self, op: str, key: str) -> str:
        return f"{op} {self.url}/{key}"

    def _put(self, path: str, buffers: list[memoryview], *, durable: bool) -> None:
        # One PUT of the whole payload: atomic on object stores and on fsspec's memory.
        payload = bytes(buffers[0]) if len(buffers) == 1 else b"".join(buffers)
        self.fs.pipe_file(path, payload)

    # -- public API ----------------------------------------------------------------------
    def write(self, key: str, data: Data) -> int:
        """Store ``data`` under ``key`` (replacing any old object); return its size."""
        path = self._path(key)
        buffers = _buffers(data)
        self.retry.call(lambda: self._put(path, buffers, durable=False), what=self._what("write", key))
        return sum(len(b) for b in buffers)

    def commit(self, key: str, data: Data) -> None:
        """Publish a small object atomically and durably (a manifest, a marker).

        Readers see the previous object or the complete new one, never a partial one.
        """
        path = self._path(key)
        buffers = _buffers(data)
        size = sum(len(b) for b in buffers)
        if size > MAX_COMMIT_BYTES:
            raise ValueError(f"commit is for small objects (<= {MAX_COMMIT_BYTES} bytes), got {size}")
        self.retry.call(lambda: self._put(path, buffers, durable=True), what=self._what("commit", key))

    def commit_new(self, key: str, data: Data) -> None:
        """:meth:`commit` that never overwrites: raises :class:`CommitConflict` (naming the
        key) when ``key`` already holds an object, and writes nothing then. S3: a PUT with
        ``If-None-Match: *``; local disk and NFS: the fsynced temporary is hard-linked to the
        key (``EEXIST`` when taken); memory: checked and written under one lock.

        An object with exactly these bytes already there counts as this commit (a retried
        request whose first try landed), so a commit is idempotent for its writer."""
        path = self._path(key)
        buffers = _buffers(data)
        size = sum(len(b) for b in buffers)
        if size > MAX_COMMIT_BYTES:
            raise ValueError(f"commit is for small objects (<= {MAX_COMMIT_BYTES} bytes), got {size}")

        def put() -> None:
            try:
                self._put_new(path, buffers)
            except CommitConflict:
                raise
            except Exception as exc:  # noqa: BLE001 - a refused precondition is a conflict
                if not _is_precondition_failure(exc):
                    raise
                raise CommitConflict(self.url, key) from exc

        try:
            self.retry.call(put, what=self._what("commit", key))
        except CommitConflict:
            try:
                same = self.read(key) == b"".join(bytes(b) for b in buffers)
            except FileNotFoundError:
                same = False
            if not same:
                raise

    def _put_new(self, path: str, buffers: list[memoryview]) -> None:
        with _EXCLUSIVE:
            if self.fs.exists(path):
                raise FileExistsError(path)
            self._put(path, buffers, durable=True)

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Return bytes ``[start, end)`` of the object (the whole object by default)."""
        path = self._path(key)
        for name, value in (("start", start), ("end", end)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")
        if start is not None and end is not None and end < start:
            raise ValueError(f"end ({end}) must be >= start ({start})")
        return self.retry.call(lambda: self._get(path, start, end), what=self._what("read", key))

    def read_into(self, key: str, out: memoryview, start: int = 0) -> int:
        """Fill ``out`` with the object's bytes from ``start``; return how many were read
        (fewer than ``len(out)`` only when the object is shorter)."""
        path = self._path(key)
        return self.retry.call(lambda: self._get_into(path, out, start), what=self._what("read", key))

    def _get_into(self, path: str, out: memoryview, start: int) -> int:
        data = self._get(path, start, start + len(out))
        out[: len(data)] = data
        return len(data)

    def _get(self, path: str, start: int | None, end: int | None) -> bytes:
        if start is not None and end is not None and start == end:
            # An empty range: HTTP cannot express it, so only check that the object exists.
            if not self.fs.isfile(path):
                raise FileNotFoundError(path)
            return b""
        return self.fs.cat_file(path, start=start, end=end)

    def size(self, key: str) -> int:
        path = self._path(key)
        return int(self.retry.call(lambda: self.fs.size(path), what=self._what("size", key)))

    def exists(self, key: str) -> bool:
        path = self._path(key)
        return bool(self.retry.call(lambda: self.fs.isfile(path), what=self._what("exists", key)))

    def list(self, prefix: str = "") -> list[str]:
        """All keys that start with ``prefix``, sorted."""
        if not isinstance(prefix, str) or prefix.startswith("/") or ".." in prefix.split("/"):
            raise ValueError(f"invalid prefix {prefix!r}")
        directory = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = f"{self.root}/{directory}" if directory else self.root

        def find() -> list[str]:
            try:
                return self.fs.find(base)
            except FileNotFoundError:
                return []

        paths = self.retry.call(find, what=self._what("list", prefix))
        strip = self.fs._strip_protocol(self.root).rstrip("/") + "/"
        keys = []
        for p in paths:
            p = self.fs._strip_protocol(p)
            if not p.startswith(strip):
                continue
            key = p[len(strip):]
            if key.startswith(prefix) and not is_temporary(key):
                keys.append(key)
        return sorted(keys)

    def delete(self, key: str, *, missing_ok: bool = False) -> None:
        """Remove one object; ``FileNotFoundError`` when absent unless ``missing_ok``."""
        path = self._path(key)

        def rm() -> None:
            if not self.fs.isfile(path):
                if missing_ok:
                    return
                raise FileNotFoundError(f"no object {key!r}")
            self.fs.rm_file(path)

        self.retry.call(rm, what=self._what("delete", key))

    def check_writable(self) -> None:
        """Write a small probe object at the root and remove it again; raises what the
        write raised (``PermissionError`` for a read-only, immutable or foreign location).
        A store that opened fine can still refuse writes: opening reads, checkpoints write."""
        key = f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.write(key, b"moc write probe\n")
        self.delete(key, missing_ok=True)

    def remove_temporaries(self, older_than: timedelta = timedelta(hours=1)) -> int:
        """Delete temporaries left by writers that died mid-write; return how many.

        Object stores publish with single PUTs or multipart uploads and leave none.
        """
        return 0


def _parts(buffers: Iterable[memoryview], size: int) -> Iterator[bytes]:
    """Regroup buffers into ``size``-byte parts (the last may be shorter), in one pass."""
    pending: list[memoryview] = []
    filled = 0
    for buf in buffers:
        while len(buf):
            take = min(size - filled, len(buf))
            pending.append(buf[:take])
            filled += take
            buf = buf[take:]
            if filled == size:
                yield b"".join(pending)
                pending, filled = [], 0
    if pending:
        yield b"".join(pending)


def _is_precondition_failure(exc: BaseException) -> bool:
    """An S3 ``412 PreconditionFailed`` (``If-None-Match: *`` on a taken key) or a file
    system's ``FileExistsError``, anywhere in the chain of causes."""
    seen = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, FileExistsError):
            return True
        response = getattr(link, "response", None)
        if isinstance(response, dict):
            err = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if err.get("Code") in ("PreconditionFailed", "412") or status == 412:
                return True
        if "PreconditionFailed" in str(link) or "(412)" in str(link):
            return True
        link = link.__cause__ or link.__context__
    return False


class S3Store(Store):
    """S3 and compatible endpoints: one PUT for small objects; for large ones a multipart
    upload with ``upload_concurrency`` parts in flight, completed only when every part is
    in and aborted on any failure, so a partial object is never published."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, url: str,
                 retry: RetryPolicy | None = None, part_size: int = DEFAULT_PART_SIZE,
                 upload_concurrency: int = 8) -> None:
        super().__init__(fs, root, url=url, retry=retry, part_size=part_size)
        if not isinstance(upload_concurrency, int) or upload_concurrency < 1:
            raise ValueError(f"upload_concurrency must be an integer >= 1, got {upload_concurrency!r}")
        self.upload_concurrency = upload_concurrency

    def _put(self, path: str, buffers: list[memoryview], *, durable: bool) -> None:
        if sum(len(b) for b in buffers) <= self.part_size:
            super()._put(path, buffers, durable=durable)
            return
        from fsspec.asyn import sync

        bucket, key = path.split("/", 1)
        sync(self.fs.loop, self._multipart, bucket, key, _parts(buffers, self.part_size))

    def _put_new(self, path: str, buffers: list[memoryview]) -> None:
        payload = bytes(buffers[0]) if len(buffers) == 1 else b"".join(buffers)
        self.fs.pipe_file(path, payload, mode="create")     # a PUT with If-None-Match: *

    async def _multipart(self, bucket: str, key: str, parts: Iterator[bytes]) -> None:
        call = self.fs._call_s3
        upload = await call("create_multipart_upload", Bucket=bucket, Key=key)
        uid = upload["UploadId"]
        slots = asyncio.Semaphore(self.upload_concurrency)
        tasks: list[asyncio.Future] = []

        async def send(number: int, body: bytes) -> dict[str, Any]:
            try:
                out = await call("upload_part", Bucket=bucket, Key=key, UploadId=uid,
                                 PartNumber=number, Body=body)
                return {"PartNumber": number, "ETag": out["ETag"]}
            finally:
                slots.release()

        try:
            for number, body in enumerate(parts, 1):
                await slots.acquire()  # at most upload_concurrency parts in memory
                tasks.append(asyncio.ensure_future(send(number, body)))
            done = await asyncio.gather(*tasks)
            await call("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=uid,
                       MultipartUpload={"Parts": list(done)})
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=uid)
            raise


class LocalStore(Store):
    """Local disk or NFS: atomic temp-file + rename writes, optional fsync."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, url: str,
                 retry: RetryPolicy | None = None, part_size: int = DEFAULT_PART_SIZE,
                 fsync: bool = True) -> None:
        super().__init__(fs, root, url=url, retry=retry, part_size=part_size)
        self.fsync = bool(fsync)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _put(self, path: str, buffers: list[memoryview], *, durable: bool) -> None:
        write_local_atomic(path, buffers, fsync=self.fsync or durable)

    def _put_new(self, path: str, buffers: list[memoryview]) -> None:
        write_local_exclusive(path, buffers, fsync=True)

    def _get(self, path: str, start: int | None, end: int | None) -> bytes:
        with open(path, "rb") as f:
            if start:
                f.seek(start)
            if end is None:
                return f.read()
            return f.read(max(0, end - (start or 0)))

    def _get_into(self, path: str, out: memoryview, start: int) -> int:
        # Straight into the caller's buffer: no intermediate bytes object.
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            done = 0
            while done < len(out):
                n = f.readinto(out[done:])
                if not n:
                    break
                done += n
            return done

    def delete(self, key: str, *, missing_ok: bool = False) -> None:
        path = self._path(key)

        def rm() -> None:
            try:
                os.remove(path)
            except FileNotFoundError:
                if not missing_ok:
                    raise
                return
            # Prune directories the deletion emptied, up to the root.
            parent = os.path.dirname(path)
            while parent != self.root and parent.startswith(self.root):
                try:
                    os.rmdir(parent)
                except OSError:
                    break
                parent = os.path.dirname(parent)

        self.retry.call(rm, what=self._what("delete", key))

    def remove_temporaries(self, older_than: timedelta = timedelta(hours=1)) -> int:
        """Delete hidden temp files (from killed writers) not modified for ``older_than``.

        A live writer keeps touching its temp file, so a generous age never races it.
        """
        cutoff = time.time() - older_than.total_seconds()
        removed = 0
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    if is_temporary(name) and os.stat(path).st_mtime <= cutoff:
                        os.remove(path)
                        removed += 1
                except FileNotFoundError:
                    continue
        if removed:
            log.info("removed %d stale temporaries under %s", removed, self.url)
        return removed
