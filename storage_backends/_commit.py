"""Atomic publication of one object.

POSIX (local disk, NFS): write to a hidden temporary name in the same directory, fsync it,
rename over the final name, fsync the directory. An exclusive publication (a conditional
commit) links the fsynced temporary to the final name instead: ``link`` fails with
``EEXIST`` when the name is taken, atomically, on local filesystems and on NFS alike. A
reader sees the old object, the new one, or nothing, never a torn one. Object stores (S3,
memory): a single PUT is atomic, so the object is simply written last by the caller (the manifest-last rule).
"""

from __future__ import annotations

import os
import uuid
from typing import Iterable

__all__ = ["TMP_MARKER", "is_temporary", "write_local_atomic", "write_local_exclusive", "fsync_dir"]

TMP_MARKER = ".tmp-"


def is_temporary(name: str) -> bool:
    """True for the hidden temporary names :func:`write_local_atomic` uses."""
    base = name.rsplit("/", 1)[-1]
    return base.startswith(".") and TMP_MARKER in base


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_local_atomic(path: str, buffers: Iterable[memoryview], *, fsync: bool, exclusive: bool = False) -> int:
    """Write ``buffers`` to ``path`` atomically; return the number of bytes written.

    ``exclusive``: never replace an existing ``path``; ``FileExistsError`` when it exists
    (nothing is published then)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}{TMP_MARKER}{uuid.uuid4().hex[:12]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    total = 0
    try:
        for buf in buffers:
            view = buf
            while len(view):
                written = os.write(fd, view)
                view = view[written:]
                total += written
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    try:
        if exclusive:
            os.link(tmp, path)      # EEXIST when taken: atomic on local filesystems and NFS
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(directory)
    return total


def write_local_exclusive(path: str, buffers: Iterable[memoryview], *, fsync: bool) -> int:
    """:func:`write_local_atomic` that never replaces an existing ``path`` (``FileExistsError``)."""
    return write_local_atomic(path, buffers, fsync=fsync, exclusive=True)
