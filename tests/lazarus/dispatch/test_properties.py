"""Dispatcher properties over random placements and routings (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lazarus.dispatch import dispatch_counts, dispatch_permutation, load_ops

BACKENDS = ["cpp", "torch", "cuda"]


@st.composite
def counts(draw):
    e = draw(st.integers(1, 6))
    n = draw(st.integers(1, 7))
    big = draw(st.booleans())
    R = torch.tensor(draw(st.lists(st.lists(st.integers(0, 3), min_size=n, max_size=n), min_size=e, max_size=e)))
    T = torch.tensor(draw(st.lists(st.lists(st.integers(0, 10_000 if big else 40), min_size=n, max_size=n),
                                   min_size=e, max_size=e)))
    # An expert without replicas may exist only when nothing is routed to it.
    T[R.sum(1) == 0] = 0
    return R.to(torch.int64), T.to(torch.int64)


def _table(R: torch.Tensor, T: torch.Tensor, backend: str) -> torch.Tensor:
    if backend == "cuda":
        return dispatch_counts(R.cuda(), T.cuda(), backend="cpp").cpu()
    return dispatch_counts(R, T, backend=backend)


def _rank(R: torch.Tensor, T: torch.Tensor, i: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "cuda":
        send, recv = dispatch_counts(R.cuda(), T.cuda(), i, backend="cpp")
        return send.cpu(), recv.cpu()
    return dispatch_counts(R, T, i, backend=backend)


def _skip_unavailable(backend: str) -> None:
    if backend == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU on this machine")
    if backend in ("cpp", "cuda") and not getattr(load_ops(), "cpp" if backend == "cpp" else "cuda"):
        pytest.skip(f"{backend} op not built: {load_ops().reason}")


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(rt=counts())
def test_table_invariants(backend: str, rt) -> None:
    _skip_unavailable(backend)
    R, T = rt
    D = _table(R, T, backend)  # [src, dst, E]
    n = R.shape[1]
    # Every source sends exactly the tokens routed on it.
    assert torch.equal(D.sum(1), T.t())
    # A rank with no replica of e receives none of e.
    assert int(D.permute(2, 1, 0)[R == 0].sum()) == 0
    # Every rank processes within one token of its fair share, and the shares sum to t_e.
    got = D.sum(0).t()  # [E, dst]
    r = R.sum(1, keepdim=True).clamp(min=1)
    t = T.sum(1, keepdim=True)
    fair = t * R
    assert bool(((got * r - fair).abs() < r).all())
    assert torch.equal(got.sum(1, keepdim=True), t)
    # Local tokens are served locally first.
    local = torch.diagonal(D, dim1=0, dim2=1)  # [E, N]
    assert torch.equal(local, torch.minimum(got, T))
    remote_in = got - local
    assert bool((T[remote_in > 0] == local[remote_in > 0]).all())  # receivers keep all their own
    sent_away = T - local
    assert bool((got[sent_away > 0] == local[sent_away > 0]).all())  # senders are at capacity
    # Per-rank counts equal the full table.
    for i in range(n):
        send, recv = _rank(R, T, i, backend)
        assert torch.equal(send, D[i]) and torch.equal(recv, D[:, i])


@pytest.mark.parametrize("backend", ["cpp", "cuda"])
@SETTINGS
@given(rt=counts())
def test_compiled_equals_torch(backend: str, rt) -> None:
    _skip_unavailable(backend)
    R, T = rt
    ref = dispatch_counts(R, T, backend="torch")
    assert torch.equal(_table(R, T, backend), ref)
    for i in range(R.shape[1]):
        s, r = _rank(R, T, i, "torch")
        s2, r2 = _rank(R, T, i, backend)
        assert torch.equal(s, s2) and torch.equal(r, r2)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(rt=counts(), data=st.data())
def test_permutation_is_send_order(backend: str, rt, data) -> None:
    _skip_unavailable(backend)
    R, T = rt
    i = data.draw(st.integers(0, R.shape[1] - 1))
    send, _ = dispatch_counts(R, T, i, backend="torch")
    ids = [e for e in range(R.shape[0]) for _ in range(int(T[e, i]))]
    order = data.draw(st.permutations(ids)) if len(ids) < 300 else ids
    experts = torch.tensor(order, dtype=torch.int64)
    if backend == "cuda":
        perm = dispatch_permutation(experts.cuda(), send.cuda(), backend="cpp").cpu()
    else:
        perm = dispatch_permutation(experts, send, backend=backend)
    assert torch.equal(torch.sort(perm).values, torch.arange(len(order)))
    assert torch.equal(perm, dispatch_permutation(experts, send, backend="torch"))
    # Consecutive (destination, expert) segments of the sizes in send, in that order.
    expected = torch.repeat_interleave(torch.arange(send.shape[1]).repeat(send.shape[0]), send.flatten())
    assert torch.equal(experts[perm], expected)
    # Within each expert, original order is kept.
    for e in range(R.shape[0]):
        pos = perm[experts[perm] == e]
        assert torch.equal(pos, torch.sort(pos).values)
