"""Tensor trees round-trip through raw bytes + JSON, with and without zstd."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moc._store.codec import DTYPES, checksum, compress, decode_tree, decompress, encode_tree

FLOATS = ["float32", "float64", "float16", "bfloat16"]


def _join(enc):
    return bytearray(b"".join(enc.buffers))


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b and type(a) is type(b)


@st.composite
def tensors(draw):
    name = draw(st.sampled_from(sorted(n for n in DTYPES
                                       if not n.startswith(("float8", "uint16", "uint32", "uint64", "complex")))))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    t = torch.randn(shape, generator=g) * 100
    return t.to(DTYPES[name]) if name != "bool" else t > 0


leaves = st.one_of(tensors(), st.none(), st.booleans(), st.integers(-2**62, 2**62),
                   st.floats(allow_nan=True), st.text(max_size=8))
trees = st.recursive(
    leaves,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.tuples(kids, kids),
        st.dictionaries(st.text(min_size=1, max_size=6).filter(lambda k: not k.startswith("@")), kids, max_size=4),
        st.dictionaries(st.integers(0, 100), kids, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(trees)
def test_any_tree_round_trips(tree):
    enc = encode_tree(tree)
    assert enc.nbytes == sum(len(b) for b in enc.buffers)
    assert _equal(tree, decode_tree(enc.skeleton, enc.tensors, _join(enc)))


@settings(max_examples=60, deadline=None)
@given(trees, st.integers(0, 200), st.integers(0, 200))
def test_stream_slices_are_exact(tree, a, b):
    enc = encode_tree(tree)
    lo, hi = sorted((min(a, enc.nbytes), min(b, enc.nbytes)))
    assert b"".join(enc.stream(lo, hi)) == bytes(_join(enc))[lo:hi]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("itemsize_override", [None, 1])
def test_zstd_shuffle_round_trip(dtype, itemsize_override):
    t = torch.randn(1000).to(DTYPES[dtype])
    enc = encode_tree({"w": t})
    itemsize = itemsize_override or enc.itemsize
    stored = compress(enc.buffers, "zstd", itemsize=itemsize)
    raw = decompress(stored, "zstd", raw_nbytes=enc.nbytes, itemsize=itemsize)
    assert raw == bytes(_join(enc))


def test_shuffle_compresses_smooth_floats_better():
    t = torch.linspace(0, 1, 100_000, dtype=torch.float32) + torch.randn(100_000) * 1e-4
    enc = encode_tree({"w": t})
    plain = compress(enc.buffers, "zstd", itemsize=1)
    shuffled = compress(enc.buffers, "zstd", itemsize=4)
    assert len(shuffled) < len(plain) < enc.nbytes


def test_unsupported_leaf_names_path():
    with pytest.raises(TypeError, match=r"opt\.state\[0\]: value of type object"):
        encode_tree({"opt": {"state": [object()]}})
    with pytest.raises(TypeError, match="sparse|strided"):
        encode_tree({"s": torch.eye(3).to_sparse()})


def test_non_contiguous_and_views_are_saved_by_value():
    base = torch.arange(12.0).reshape(3, 4)
    tree = {"t": base.t(), "s": base[1:, ::2]}
    enc = encode_tree(tree)
    out = decode_tree(enc.skeleton, enc.tensors, _join(enc))
    assert torch.equal(out["t"], base.t()) and torch.equal(out["s"], base[1:, ::2])


def test_tensor_offsets_are_aligned():
    enc = encode_tree([torch.ones(3, dtype=torch.int8), torch.ones(5), torch.ones(1, dtype=torch.float64)])
    assert all(t.offset % 16 == 0 for t in enc.tensors)


def test_checksum_changes_with_any_byte():
    data = bytearray(b"x" * 1000)
    before = checksum(data)
    data[500] ^= 1
    assert checksum(data) != before and before.startswith("xxh3:")


def test_decode_rejects_metadata_that_does_not_fit():
    enc = encode_tree({"w": torch.ones(10)})
    with pytest.raises(ValueError, match="does not fit"):
        decode_tree(enc.skeleton, enc.tensors, _join(enc)[:20])


@settings(max_examples=80, deadline=None)
@given(trees, st.integers(0, 300), st.integers(0, 300))
def test_plan_copy_range_matches_encoded_stream(tree, a, b):
    from moc._store.codec import plan_tree

    plan = plan_tree(tree)
    enc = encode_tree(tree)
    lo, hi = sorted((min(a, plan.nbytes), min(b, plan.nbytes)))
    out = torch.full((hi - lo,), 0xAB, dtype=torch.uint8)
    plan.copy_range(lo, hi, out)
    assert bytes(out.numpy()) == bytes(_join(enc))[lo:hi]
