"""The trainer's one all-reduce per step (``lazarus.runtime.worker._step_reduce.all_reduce_step``):
gradients, a sum and a maximum in one collective where the flat's dtype carries them, the
same results as separate collectives, and the fallback where it cannot (3 gloo ranks,
``rank_harness.run_ranks``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lazarus.runtime.worker._step_reduce import StepTotals, all_reduce_step
from tests.helpers.rank_harness import run_ranks
from tests.helpers.sync_audit import SyncAudit


def _params(rank: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    out = []
    for i, n in enumerate((5, 3, 4)):
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
        if i != 1 or rank != 0:   # rank 0 has no gradient for the second: it counts as zeros
            p.grad = torch.randn(n, generator=torch.Generator().manual_seed(10 * rank + i)).to(dtype)
        out.append(p)
    return out


def _counting(real, calls: list[int]):
    def wrapped(tensor, *a, **kw):
        calls.append(tensor.numel())
        return real(tensor, *a, **kw)

    return wrapped


def prog_rides(rank: int, world: int, dtype_name: str, big_max: bool) -> None:
    dtype = getattr(torch, dtype_name)
    params, reference = _params(rank, dtype), _params(rank, dtype)
    posts = [lambda g: g / world, lambda g: g * 0.5, lambda g: g]
    values = [0.1 * (rank + 1), 2.0 ** -30 * rank]
    sums = [values[0], torch.tensor(values[1], dtype=torch.float64)]   # a number and a 0-dim tensor alike
    maxima = [(1 << 25) + rank if big_max else 7 * (rank % 2), 3 - rank]
    loss = torch.tensor(1.5 + rank, dtype=dtype)            # this rank's own value, not reduced
    calls: list[int] = []
    real = dist.all_reduce
    dist.all_reduce = _counting(real, calls)   # (the module's `dist` is this module object)
    try:
        with SyncAudit() as audit:
            totals = all_reduce_step(list(zip(params, posts)), sums=sums, maxima=maxima, local=[loss, 0.25],
                                     rank=rank, world=world)
    finally:
        dist.all_reduce = real
    got_sums, got_max = totals.sums, totals.maxima
    assert totals.local == [float(loss), 0.25]
    # ONE copy to the host for everything the host needs, riding or not (the audit also sees
    # the copy's own tolist(): on the CPU `.cpu()` returns the tensor itself)
    assert audit.device_reads == ["cpu", "tolist"] and not audit.sync_ops, (audit.device_reads, audit.sync_ops)
    # The same through separate collectives: the gradients' flat, a float64 sum, an int64 max.
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)) for p in reference])
    dist.all_reduce(flat)
    pos = 0
    for p, post, q in zip(params, posts, reference):
        expected = post(flat[pos: pos + p.numel()])
        pos += p.numel()
        assert p.grad.dtype == dtype and torch.equal(p.grad, expected), (p.grad, expected)
    s = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(s)
    m = torch.tensor(maxima, dtype=torch.int64)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    assert got_max == m.tolist(), (got_max, m.tolist())
    rides = dtype in (torch.float32, torch.float64) and not (big_max and dtype == torch.float32)
    if rides:
        assert len(calls) == 1 and calls[0] == 12 + len(sums) + world * len(maxima), calls
        tol = 1e-6 if dtype == torch.float32 else 1e-15
        assert got_sums == pytest.approx(s.tolist(), rel=tol, abs=1e-12), (got_sums, s.tolist())
    else:   # each scalar kind in its own collective, exact as before
        assert len(calls) == 3, calls
        assert got_sums == s.tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype_name,big_max", [("float32", False), ("float64", True), ("bfloat16", False),
                                                ("float32", True)])
def test_scalars_ride_on_the_gradients_all_reduce(tmp_path: Path, dtype_name: str, big_max: bool) -> None:
    """float32 / float64 flats carry the step's sum and maximum in their one all-reduce
    (float32: maxima up to 2**24); bfloat16 flats and larger maxima take one more
    collective per kind. Gradients are those of a plain all-reduce, bit for bit."""
    run_ranks(prog_rides, 3, tmp_path, dtype_name, big_max, join_s=100)


def test_one_rank_sends_nothing_and_bad_maxima_are_refused() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    with SyncAudit() as audit:
        totals = all_reduce_step([(p, lambda g: g * 2)], sums=[1.5], maxima=[4], local=[torch.tensor(3.0)],
                                 rank=0, world=1)
    assert totals == StepTotals([1.5], [4], [3.0])
    assert audit.device_reads == ["cpu", "tolist"], audit.device_reads     # sums and local values in one copy
    assert all_reduce_step([], sums=[torch.tensor(0.25), 1], rank=0, world=1) == StepTotals([0.25, 1.0], [], [])
    assert torch.equal(p.grad, torch.full((3,), 2.0))
    for bad in (-1, 2**53 + 1):
        with pytest.raises(ValueError, match=r"maxima must be integers in \[0, 2\*\*53\]"):
            all_reduce_step([], maxima=[bad], rank=0, world=1)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_total_norm_matches_torch_clipping(max_norm: float) -> None:
    """The counted gradients' norm with the others' squared norm given is torch's total
    norm; the factor is torch's; a norm under the limit leaves the gradients bit for bit."""
    from lazarus.runtime.worker._step_reduce import clip_total_norm_

    gen = torch.Generator().manual_seed(3)
    mine = [torch.randn(n, generator=gen) for n in (7, 4, 9)]
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in mine]
    for p, g in zip(ref, mine):
        p.grad = g.clone()
    before = [g.clone() for g in mine]
    others_sq = sum(float(g.double().pow(2).sum()) for g in mine[2:])
    clip_total_norm_(mine[:2], mine[2:], torch.tensor(others_sq, dtype=torch.float64), max_norm)
    torch.nn.utils.clip_grad_norm_(ref, max_norm)
    for g, p, b in zip(mine, ref, before):
        assert torch.allclose(g, p.grad, rtol=1e-6, atol=0), (g, p.grad)
        if max_norm > 1e3:
            assert torch.equal(g, b)
    if max_norm < 1:
        total = torch.cat(mine).norm()
        assert total == pytest.approx(max_norm, rel=1e-5)
