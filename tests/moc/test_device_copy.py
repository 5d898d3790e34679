"""moc's copy helper (:mod:`moc._cuda.copies`) on the host: which copier a snapshot gets,
page-locking guarded where CUDA is absent, restores' host-to-device helper. The CUDA side
is exercised by ``tests/gpu`` (``make test-gpu``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from moc._snapshot.buffers import BufferPool
from moc._store.codec import plan_tree
from moc._cuda.copies import (CudaCopier, HostCopier, LateCopies, copier_for, copy_into, cuda_devices, finish_copies,
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


def _fs_type(path: str) -> str:
    """The file system type of ``path`` (the longest mount point above it in /proc/mounts)."""
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mount = parts[1].replace("\\040", " ")
                if os.path.realpath(path).startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
                    best, kind = mount, parts[2]
    except OSError:
        pass
    return kind


def test_page_locking_is_guarded_without_cuda(tmp_path) -> None:
    """``cudaHostRegister`` only where CUDA runs; elsewhere the buffer stays usable and
    the engine keeps the thread-copy path. On a GPU machine a buffer on tmpfs is pinned
    (moc's default ``/dev/shm``) and one in an ordinary file is not: Linux refuses to pin
    a writable shared mapping of such a file for long (seen on an H200: cudaError 1); the
    buffer says why and stays usable."""
    with pytest.raises(ValueError, match="CPU tensor"):
        host_register(torch.empty(4, device="meta"))
    cuda = torch.cuda.is_available()
    where = tmp_path / "bufs"
    if cuda and os.path.isdir("/dev/shm"):
        where = Path(tempfile.mkdtemp(prefix="moc-pin-test-", dir="/dev/shm"))
    pinnable = cuda and _fs_type(str(where)) == "tmpfs"
    try:
        pool = BufferPool(str(where))
        buf = pool.acquire()
        dev = torch.device("cuda", 0)
        buf.ensure(1 << 16, pin=dev)
        buf.settle()                                             # page-locked by the upkeep thread
        assert buf.pinned == pinnable and buf.data.is_pinned() == pinnable, buf.pin_error
        if cuda and not pinnable:
            assert "cudaHostRegister" in buf.pin_error
        buf.data[:5].copy_(torch.arange(5, dtype=torch.uint8))
        assert bytes(buf.view(0, 5)) == bytes(range(5))
        buf.ensure(4 << 20, pin=dev)                             # a resize re-registers (or stays unpinned)
        buf.settle()
        assert buf.capacity >= 4 << 20 and buf.pinned == pinnable
        pool.remove_files()
        assert not any(b.pinned for b in pool.buffers)
    finally:
        if where != tmp_path / "bufs":
            shutil.rmtree(where, ignore_errors=True)


def test_an_ordinary_file_is_not_page_locked_on_cuda(tmp_path) -> None:
    """Where CUDA runs and ``tmp_path`` is an ordinary file system: the buffer is usable,
    unpinned, and says why (without CUDA: unpinned, no CUDA call made)."""
    pool = BufferPool(str(tmp_path / "bufs"))
    buf = pool.acquire()
    buf.ensure(1 << 16, pin=torch.device("cuda", 0))
    buf.settle()
    if torch.cuda.is_available() and _fs_type(str(tmp_path)) != "tmpfs":
        assert not buf.pinned and "cudaHostRegister" in buf.pin_error, buf
    elif not torch.cuda.is_available():
        assert not buf.pinned
    buf.data[:3].copy_(torch.arange(3, dtype=torch.uint8))
    assert bytes(buf.view(0, 3)) == bytes(range(3))
    pool.remove_files()


def test_copy_into_is_blocking_on_the_host() -> None:
    dst, src = torch.zeros(4), torch.arange(4.0)
    assert copy_into(dst, src) is False                      # only host-to-device copies are async
    assert torch.equal(dst, src)
    finish_copies([torch.device("cpu"), dst.device])         # nothing to wait for on the host


class _Event:
    """A copy's completion as the caller sees it: query() False until the test lets it pass."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def test_late_copies_hand_over_only_what_arrived_with_their_labels(monkeypatch) -> None:
    import moc._cuda.copies as dc

    events: list[_Event] = []

    def later(t: torch.Tensor, out: torch.Tensor | None = None):
        events.append(_Event())
        return events[-1], t.clone()

    monkeypatch.setattr(dc, "to_host_later", later)
    copies: LateCopies[str] = LateCopies(torch.cat)
    copies.send([(torch.tensor([1, 2]), "a"), (torch.tensor([3]), "b")])   # one device: one joined copy
    copies.send([(torch.tensor([4]), "c")])
    assert len(copies) == 2
    assert copies.arrived(wait=False) == []          # nothing reached the host: kept, nothing waited for
    assert not any(e.waited for e in events)
    events[1].done = True
    [(host, labels)] = copies.arrived(wait=False)
    assert labels == ["c"] and host.tolist() == [4] and len(copies) == 1
    [(host, labels)] = copies.arrived(wait=True)     # waits for the rest
    assert labels == ["a", "b"] and host.tolist() == [1, 2, 3] and events[0].waited and len(copies) == 0


def test_late_copies_of_host_tensors_arrive_at_once() -> None:
    copies: LateCopies[int] = LateCopies(torch.stack)
    copies.send([(torch.tensor(True), 1), (torch.tensor(False), 2)])
    [(flags, labels)] = copies.arrived(wait=False)
    assert flags.tolist() == [True, False] and labels == [1, 2]
    copies.send([])
    assert copies.arrived(wait=False) == [] and len(copies) == 0


def test_late_copies_reuse_their_page_locked_host_tensors(monkeypatch) -> None:
    """A step's late copies have the same shapes every step: after the first ones, no
    page-locked memory is allocated (a spare of the same shape and dtype takes the copy),
    and a host tensor handed over is not written again before the next call."""
    import moc._cuda.copies as dc

    given: list[torch.Tensor | None] = []

    def later(t: torch.Tensor, out: torch.Tensor | None = None):
        given.append(out)
        host = out if out is not None else torch.empty_like(t)   # the "page-locked" tensor
        host.copy_(t)
        return None, host

    monkeypatch.setattr(dc, "to_host_later", later)
    monkeypatch.setattr(dc, "_device_side", lambda t: True)      # as if the counts lived on a GPU
    copies: LateCopies[str] = LateCopies(torch.cat)
    seen = []
    for step in range(5):
        copies.send([(torch.tensor([step, step + 1]), "a"), (torch.tensor([10 * step]), "b")])
        [(host, labels)] = copies.arrived(wait=True)
        assert host.tolist() == [step, step + 1, 10 * step] and labels == ["a", "b"]
        seen.append(host)
    assert copies.allocations == 1 and given[0] is None and all(g is seen[0] for g in given[1:])
    # two copies in flight at once: the second needs a host tensor of its own
    copies.send([(torch.tensor([1, 2, 3]), "x")])
    copies.send([(torch.tensor([4, 5, 6]), "y")])
    out = copies.arrived(wait=True)
    assert [(h.tolist(), labels) for h, labels in out] == [([1, 2, 3], ["x"]), ([4, 5, 6], ["y"])]
    assert out[0][0] is not out[1][0] and copies.allocations == 2
    # another shape: a fresh one; the handed-over ones became spares only now
    copies.send([(torch.tensor([7]), "z")])
    assert copies.allocations == 3 and copies.arrived(wait=True)[0][0].tolist() == [7]
