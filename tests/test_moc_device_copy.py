"""moc's copy helper (:mod:`moc._device_copy`) on the host: which copier a snapshot gets,
page-locking guarded where CUDA is absent, restores' host-to-device helper. The CUDA side
is exercised by ``tests/gpu`` (``make test-gpu``)."""

from __future__ import annotations

import torch

from moc._buffers import BufferPool
from moc._codec import plan_tree
from moc._device_copy import (CudaCopier, HostCopier, copier_for, copy_into, cuda_devices, finish_copies,
                              host_register)

import pytest


def _tree() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(5, 7, generator=g), "b": torch.arange(3, dtype=torch.int16),
            "t": torch.randn(4, 6, generator=g).t(),            # not contiguous
            "step": torch.tensor(3.0), "lr": 0.1}


def test_host_copier_copies_any_byte_range_like_the_plan() -> None:
    plan = plan_tree(_tree())
    whole = torch.empty(plan.nbytes, dtype=torch.uint8)
    plan.copy_range(0, plan.nbytes, whole)
    copier = HostCopier()
    assert not copier.device_async and not copier.pins_buffers
    for start, end in [(0, plan.nbytes), (3, 50), (17, plan.nbytes - 1), (40, 41)]:
        out = torch.full((end - start,), 0xAB, dtype=torch.uint8)
        copier.copy(plan, start, end, out)
        assert torch.equal(out, whole[start:end]), (start, end)


def test_host_tensors_get_the_host_copier_and_keep_it() -> None:
    plan = plan_tree(_tree())
    assert cuda_devices(plan.sources) == []
    first = copier_for(plan.sources)
    assert isinstance(first, HostCopier)
    assert copier_for(plan.sources, first) is first          # reused, not rebuilt per checkpoint
    meta = torch.empty(3, device="meta")
    assert isinstance(copier_for([meta]), HostCopier)       # only CUDA tensors change the path


def test_cuda_copier_needs_a_device() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        CudaCopier([])


def test_page_locking_is_guarded_without_cuda(tmp_path) -> None:
    """``cudaHostRegister`` only where CUDA runs; elsewhere the buffer stays usable and
    the engine keeps the thread-copy path (on a GPU machine the buffer is pinned)."""
    with pytest.raises(ValueError, match="CPU tensor"):
        host_register(torch.empty(4, device="meta"))
    pool = BufferPool(str(tmp_path / "bufs"))
    buf = pool.acquire()
    dev = torch.device("cuda", 0)
    buf.ensure(1 << 16, pin=dev)
    buf.settle()                                             # page-locked by the upkeep thread
    assert buf.pinned == torch.cuda.is_available()
    assert buf.data.is_pinned() == torch.cuda.is_available()
    buf.data[:5].copy_(torch.arange(5, dtype=torch.uint8))
    assert bytes(buf.view(0, 5)) == bytes(range(5))
    buf.ensure(4 << 20, pin=dev)                             # a resize re-registers (or stays unpinned)
    buf.settle()
    assert buf.capacity >= 4 << 20 and buf.pinned == torch.cuda.is_available()
    pool.remove_files()
    assert not any(b.pinned for b in pool.buffers)


def test_copy_into_is_blocking_on_the_host() -> None:
    dst, src = torch.zeros(4), torch.arange(4.0)
    assert copy_into(dst, src) is False                      # only host-to-device copies are async
    assert torch.equal(dst, src)
    finish_copies([torch.device("cpu"), dst.device])         # nothing to wait for on the host
