"""A process killed while building or loading the dispatcher extension must not stall the
others: torch's build lock file stays behind after a SIGKILL, and every later load in that
build directory used to wait on it forever (seen: the survivor of a node killed during its
first step hung in ``cpp_extension.load``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lazarus.dispatch import _build, load_ops

HOLD = r"""
import sys, time
from torch.utils.file_baton import FileBaton
baton = FileBaton(sys.argv[1])
assert baton.try_acquire()
print("holding", flush=True)
time.sleep(600)
"""

LOAD = "from lazarus.dispatch import load_ops; s = load_ops(); print('cpp', s.cpp, s.reason)"


def _leave_stale_lock(lock: Path) -> None:
    """A process takes torch's build lock file and is SIGKILLed holding it."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding" and lock.exists()
        os.kill(holder.pid, signal.SIGKILL)      # dies holding torch's lock file
        holder.wait(timeout=30)
        assert lock.exists()
    finally:
        if holder.poll() is None:
            holder.kill()


def _load(env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=400)
    return out, time.monotonic() - t0


@pytest.mark.timeout(600)
def test_a_build_lock_left_by_a_killed_process_does_not_stall_the_next_load(tmp_path: Path) -> None:
    state = load_ops()      # built (or loaded) once here: the build directory exists
    if not state.cpp:
        pytest.skip(f"no C++ toolchain here: {state.reason}")
    src = _build.csrc_dir()
    name = f"lazarus_dispatch_cpu_{_build._tag(src, False)}"
    env = dict(os.environ, LAZARUS_DISPATCH_BACKEND="cpp")

    # 1. A current build exists: it is loaded directly, whatever lock lies beside it.
    lock = _build.cache_root() / name / "lock"
    try:
        _leave_stale_lock(lock)
        out, took = _load(env)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.startswith("cpp True"), (out.stdout, out.stderr[-2000:])
        assert took < 120
    finally:
        lock.unlink(missing_ok=True)

    # 2. Nothing built yet (a fresh cache): the loader that must build finds the stale
    # lock under its flock, removes it and builds instead of waiting forever.
    fresh = tmp_path / "ext"
    lock = fresh / name / "lock"
    _leave_stale_lock(lock)
    out, took = _load(dict(env, LAZARUS_EXT_DIR=str(fresh)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("cpp True"), (out.stdout, out.stderr[-2000:])
    assert "stale build lock" in out.stderr
    assert not lock.exists() and (fresh / name / f"{name}.so").exists()
