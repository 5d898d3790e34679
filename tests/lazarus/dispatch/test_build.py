"""The compiled dispatcher's build cache survives processes killed while loading it.

``torch.utils.cpp_extension.load`` guards every load with a lock file that a SIGKILLed
process leaves behind (the fault-injection tests kill workers at any moment), after which
every later load waits forever. An existing, current library (its name hashes the
sources) is therefore loaded directly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

_PROBE = """
    import torch
    from lazarus.dispatch import compiled_backend, dispatch_counts
    from lazarus.dispatch._build import cache_root
    R = torch.tensor([[1, 1], [1, 0]]); T = torch.tensor([[3, 1], [0, 2]])
    print(compiled_backend(), dispatch_counts(R, T, 0)[0].tolist(), cache_root())
"""


def _probe(ext_dir: Path, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, LAZARUS_EXT_DIR=str(ext_dir), LAZARUS_DISPATCH_BACKEND="auto")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(_PROBE)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(400)
def test_a_stale_build_lock_does_not_hang_later_loads(tmp_path: Path) -> None:
    from lazarus.dispatch._build import _missing_tools, _tag, csrc_dir

    if _missing_tools(csrc_dir(), False):
        pytest.skip(f"no C++ toolchain here: {_missing_tools(csrc_dir(), False)}")
    name = f"lazarus_dispatch_cpu_{_tag(csrc_dir(), False)}"
    ext = tmp_path / "ext"
    first = _probe(ext, 300)                     # builds into the empty cache
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.split()[0] == "cpp", first.stdout + first.stderr[-2000:]
    built = ext / name / f"{name}.so"
    assert built.exists()
    (ext / name / "lock").touch()                # what a process killed inside load() leaves
    again = _probe(ext, 60)                      # would wait forever on the lock before the fix
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout == first.stdout            # the compiled op, the same answer
    shutil.rmtree(ext, ignore_errors=True)
