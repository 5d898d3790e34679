"""Real locations that refuse writes, for storage error tests: an immutable directory tree
(``chattr +i``) and a read-only tmpfs mount. Tests run as root, where ``chmod`` alone does
not stop a write; a facility this machine lacks is a skip that says which."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True)


def make_immutable(path: str) -> None:
    """``chattr -R +i path`` (skips the test where the filesystem has no such flag)."""
    r = _run("chattr", "-R", "+i", path)
    if r.returncode != 0:
        pytest.skip(f"chattr +i not supported here ({r.stderr.strip()}): cannot make {path} immutable")


def make_mutable(path: str) -> None:
    if os.path.exists(path):
        _run("chattr", "-R", "-i", path)


@contextmanager
def immutable(path: str) -> Iterator[str]:
    """``path`` (a directory, created) with the immutable flag on it and everything in it."""
    os.makedirs(path, exist_ok=True)
    make_immutable(path)
    try:
        yield path
    finally:
        make_mutable(path)


@contextmanager
def read_only_mount(path: str) -> Iterator[str]:
    """An empty tmpfs mounted read-only at ``path`` (skips where mounting is not allowed)."""
    os.makedirs(path, exist_ok=True)
    r = _run("mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", path)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here ({r.stderr.strip()})")
    try:
        yield path
    finally:
        _run("umount", "-l", path)
