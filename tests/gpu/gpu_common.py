"""Shared by the CUDA tests (``make test-gpu``): the marker, the skip, small helpers."""

from __future__ import annotations

import os
import shutil
import socket
import uuid

import pytest
import torch

# Every test module here: ``pytestmark = GPU``. Without CUDA they skip with this reason.
GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (torch.cuda.is_available() is False); CI is CPU-only, "
                              "run `make test-gpu` on a machine with a GPU"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def to_host(tree):
    """A nested dict/list of tensors with every tensor on the CPU (DTensors as local shards)."""
    if isinstance(tree, torch.Tensor):
        t = tree.to_local() if hasattr(tree, "to_local") else tree
        return t.detach().cpu().clone()
    if isinstance(tree, dict):
        return {k: to_host(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_host(v) for v in tree)
    return tree


SHM_NEEDED = 8 << 30


@pytest.fixture
def shm_dir(tmp_path):
    """A snapshot directory on tmpfs (``/dev/shm``, moc's default): page-locking a file
    mapping with ``cudaHostRegister`` needs shared memory (Linux refuses long-term pins of
    writable mappings of ordinary files). Falls back to ``tmp_path`` when ``/dev/shm`` is
    missing or smaller than 8 GiB; tests that check page-locking then fail, naming it."""
    path = None
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize >= SHM_NEEDED:
            path = f"/dev/shm/moc-gpu-test-{uuid.uuid4().hex[:8]}"
            os.makedirs(path)
    except OSError:
        path = None
    if path is None:
        yield str(tmp_path / "shm")
        return
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


#: where ``make gpu-check`` (benchmarks/gpu/check.py) collects the figures the tests measure
FIGURES_ENV = "LAZARUS_GPU_FIGURES"


def record_figure(name: str, **values) -> None:
    """Append one measured figure (JSON line) to the file ``$LAZARUS_GPU_FIGURES`` names, for
    the gpu-check summary; nothing when it is unset (a plain ``make test-gpu``)."""
    import json

    path = os.environ.get(FIGURES_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"name": name, **values}) + "\n")
