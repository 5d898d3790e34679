"""Encoding of unit state: JSON skeleton + raw tensor bytes, checksums, zstd + shuffle.

A unit's state is a nested tree of dicts/lists/tuples whose leaves are tensors or JSON
scalars. :func:`encode_tree` turns it into a JSON skeleton (tensors replaced by
``{"@t": index}``) plus one contiguous byte stream holding every tensor, 16-byte aligned.
Decoding rebuilds tensors with ``torch.frombuffer``; nothing is ever unpickled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard

__all__ = [
    "EncodedUnit",
    "TreePlan",
    "plan_tree",
    "unit_buffer",
    "TensorMeta",
    "encode_tree",
    "decode_tree",
    "meta_tree",
    "checksum",
    "compress",
    "decompress",
    "DTYPES",
    "CODECS",
]

ALIGN = 16
CODECS = ("raw", "zstd")

# dtype <-> stable name. Every name written to storage must be in this table.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
    "complex64": torch.complex64, "complex128": torch.complex128,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def checksum(data: bytes | bytearray | memoryview) -> str:
    """``xxh3:<16 hex digits>`` of ``data``."""
    return "xxh3:" + xxhash.xxh3_64_hexdigest(data)


@dataclass(frozen=True)
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "TensorMeta":
        return TensorMeta(str(d["dtype"]), tuple(int(x) for x in d["shape"]), int(d["offset"]), int(d["nbytes"]))


@dataclass
class EncodedUnit:
    """A unit ready to write: its skeleton, tensor table and byte stream (as buffer views)."""

    skeleton: Any
    tensors: list[TensorMeta]
    buffers: list[memoryview]  # back to back they form the unit's byte stream
    nbytes: int
    itemsize: int  # element size used for byte-plane shuffling

    def stream(self, start: int = 0, end: int | None = None) -> list[memoryview]:
        """Views covering bytes ``[start, end)`` of the unit's stream, without copying."""
        end = self.nbytes if end is None else end
        out, pos = [], 0
        for buf in self.buffers:
            lo, hi = pos, pos + len(buf)
            if hi > start and lo < end:
                out.append(buf[max(start, lo) - lo: min(end, hi) - lo])
            pos = hi
            if pos >= end:
                break
        return out


def _tensor_view(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type, unused-ignore]  # numpy's stubs give ndarray __buffer__ only on Python >= 3.12


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (no copy for contiguous tensors)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


@dataclass
class TreePlan:
    """Where every tensor of a tree goes in the unit's byte stream, without touching data.

    The snapshot level copies byte ranges of the stream straight from the live tensors
    into preallocated buffers (:meth:`copy_range`); :func:`encode_tree` turns a plan into
    zero-copy buffer views for writing.
    """

    skeleton: Any
    tensors: list[TensorMeta]
    sources: list[torch.Tensor]
    nbytes: int
    itemsize: int

    def copy_range(self, start: int, end: int, out: torch.Tensor, *, non_blocking: bool = False) -> None:
        """Copy stream bytes ``[start, end)`` into the uint8 tensor ``out`` (len end-start).

        Alignment padding between tensors is written as zeros.
        """
        if out.numel() != end - start:
            raise ValueError(f"out has {out.numel()} bytes, range needs {end - start}")
        pos = start
        for meta, src in zip(self.tensors, self.sources):
            lo, hi = max(start, meta.offset), min(end, meta.offset + meta.nbytes)
            if hi <= lo:
                continue
            if lo > pos:
                out[pos - start: lo - start].zero_()
            out[lo - start: hi - start].copy_(_byte_view(src)[lo - meta.offset: hi - meta.offset],
                                              non_blocking=non_blocking)
            pos = hi
        if pos < end:
            out[pos - start:].zero_()


_PLAIN = frozenset((int, str, bool, type(None)))   # leaves a skeleton holds as they are


def plan_tree(tree: Any) -> TreePlan:
    """Lay out ``tree``; raise ``TypeError`` naming the path of any unsupported leaf."""
    tensors: list[TensorMeta] = []
    sources: list[torch.Tensor] = []
    pos = 0
    sizes: dict[int, int] = {}

    def walk(node: Any, path: str) -> Any:
        nonlocal pos
        if isinstance(node, torch.Tensor):
            if node.dtype not in _DTYPE_NAMES:
                raise TypeError(f"{path or '<root>'}: tensors of dtype {node.dtype} cannot be checkpointed")
            if node.is_sparse or node.layout != torch.strided:
                raise TypeError(f"{path or '<root>'}: only strided (dense) tensors can be checkpointed")
            pos += (-pos) % ALIGN
            nbytes = node.numel() * node.element_size()
            tensors.append(TensorMeta(_DTYPE_NAMES[node.dtype], tuple(node.shape), pos, nbytes))
            sources.append(node.detach())
            pos += nbytes
            sizes[node.element_size()] = sizes.get(node.element_size(), 0) + nbytes
            return {"@t": len(tensors) - 1}
        if isinstance(node, dict):
            if all(isinstance(k, str) for k in node) and not any(k.startswith("@") for k in node):
                return {k: walk(v, f"{path}.{k}" if path else k) for k, v in node.items()}
            items = []
            for k, v in node.items():
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    raise TypeError(f"{path or '<root>'}: dict key {k!r} of type {type(k).__name__} is not supported")
                items.append([k, walk(v, f"{path}[{k!r}]")])
            return {"@d": items}
        if isinstance(node, (tuple, list)):
            if all(type(v) in _PLAIN for v in node):   # e.g. Python's RNG state: 625 ints
                items = list(node)
            else:
                items = [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]
            return {"@tuple": items} if isinstance(node, tuple) else items
        if isinstance(node, float) and not math.isfinite(node):
            return {"@f": repr(node)}
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, torch.dtype) and node in _DTYPE_NAMES:
            return {"@dtype": _DTYPE_NAMES[node]}
        raise TypeError(
            f"{path or '<root>'}: value of type {type(node).__name__} cannot be checkpointed "
            "(allowed: tensors, dict, list, tuple, str, int, float, bool, None)"
        )

    skeleton = walk(tree, "")
    itemsize = max(sizes, key=sizes.__getitem__) if sizes else 1
    return TreePlan(skeleton, tensors, sources, pos, itemsize)


def encode_tree(tree: Any) -> EncodedUnit:
    """Flatten ``tree`` into a skeleton and zero-copy views of its tensors' bytes."""
    plan = plan_tree(tree)
    buffers: list[memoryview] = []
    pos = 0
    for meta, src in zip(plan.tensors, plan.sources):
        if meta.offset > pos:
            buffers.append(memoryview(bytes(meta.offset - pos)))
        if meta.nbytes:
            buffers.append(_tensor_view(src))
        pos = meta.offset + meta.nbytes
    return EncodedUnit(plan.skeleton, plan.tensors, buffers, plan.nbytes, plan.itemsize)


#: Bytes per element of each dtype in :data:`DTYPES` (looked up per decoded tensor).
_ITEMSIZE: dict[torch.dtype, int] = {d: torch.empty((), dtype=d).element_size() for d in DTYPES.values()}


def unit_buffer(nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """An uninitialised byte buffer for a unit (no zero-fill pass) and a writable view."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    return t, memoryview(t.numpy()) if nbytes else memoryview(bytearray())  # type: ignore[arg-type, unused-ignore]  # numpy's stubs give ndarray __buffer__ only on Python >= 3.12


def decode_tree(skeleton: Any, tensors: list[TensorMeta], data: bytearray | bytes | torch.Tensor) -> Any:
    """Rebuild the tree; tensors are CPU tensors backed by ``data`` (no copy)."""
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise ValueError("data must be a 1-D uint8 tensor")
        base: torch.Tensor | None = data
        buf: Any = data
    else:
        base = None
        buf = data if isinstance(data, bytearray) else bytearray(data)

    def tensor(i: int) -> torch.Tensor:
        meta = tensors[i]
        dtype = DTYPES.get(meta.dtype)
        if dtype is None:
            raise ValueError(f"unknown dtype {meta.dtype!r} in checkpoint; known: {sorted(DTYPES)}")
        numel = math.prod(meta.shape)
        itemsize = _ITEMSIZE[dtype]
        if numel * itemsize != meta.nbytes or meta.offset + meta.nbytes > len(buf):
            raise ValueError(f"tensor {i} metadata does not fit the unit's bytes")
        if numel == 0:
            return torch.empty(meta.shape, dtype=dtype)
        if base is not None:
            return base[meta.offset: meta.offset + meta.nbytes].view(dtype).view(meta.shape)
        return torch.frombuffer(buf, dtype=dtype, count=numel, offset=meta.offset).view(meta.shape)

    return _walk_skeleton(skeleton, tensor)


def meta_tree(skeleton: Any, tensors: list[TensorMeta]) -> Any:
    """The tree a unit decodes to, with tensors on the ``meta`` device (shapes and dtypes
    only): what a unit holds, read from its manifest record without reading its bytes."""

    def tensor(i: int) -> torch.Tensor:
        meta = tensors[i]
        dtype = DTYPES.get(meta.dtype)
        if dtype is None:
            raise ValueError(f"unknown dtype {meta.dtype!r} in checkpoint; known: {sorted(DTYPES)}")
        return torch.empty(meta.shape, dtype=dtype, device="meta")

    return _walk_skeleton(skeleton, tensor)


def _walk_skeleton(node: Any, tensor: Any) -> Any:
    # A module-level recursion, not a nested function calling itself: that would be a
    # reference cycle holding ``tensor`` (and the unit's whole buffer) until the next gc.
    if isinstance(node, dict):
        if "@t" in node:
            return tensor(int(node["@t"]))
        if "@d" in node:
            return {k: _walk_skeleton(v, tensor) for k, v in node["@d"]}
        if "@tuple" in node:
            return tuple(_walk_skeleton(v, tensor) for v in node["@tuple"])
        if "@f" in node:
            return float(node["@f"])
        if "@dtype" in node:
            return DTYPES[node["@dtype"]]
        return {k: _walk_skeleton(v, tensor) for k, v in node.items()}
    if isinstance(node, list):
        return [_walk_skeleton(v, tensor) for v in node]
    return node


def _shuffle(data: bytes | memoryview, itemsize: int) -> bytes:
    """Byte-plane shuffle: all first bytes of each element, then all second bytes, ..."""
    n = len(data) - len(data) % itemsize
    arr = np.frombuffer(data, dtype=np.uint8)
    head = arr[:n].reshape(-1, itemsize).T.tobytes()
    return head + arr[n:].tobytes()


def _unshuffle(data: bytes, itemsize: int) -> bytes:
    n = len(data) - len(data) % itemsize
    arr = np.frombuffer(data, dtype=np.uint8)
    head = arr[:n].reshape(itemsize, -1).T.tobytes()
    return head + arr[n:].tobytes()


def compress(buffers: list[memoryview], codec: str, *, itemsize: int = 1, level: int = 3) -> list[memoryview] | bytes:
    """Encode one chunk. ``raw`` returns the buffers untouched (zero copy)."""
    if codec == "raw":
        return buffers
    if codec != "zstd":
        raise ValueError(f"compression must be one of {CODECS}, got {codec!r}")
    joined = buffers[0] if len(buffers) == 1 else b"".join(buffers)
    if itemsize > 1:
        joined = _shuffle(joined, itemsize)
    return zstandard.ZstdCompressor(level=level).compress(joined)


def decompress(stored: bytes, codec: str, *, raw_nbytes: int, itemsize: int = 1) -> bytes:
    if codec == "raw":
        return stored
    if codec != "zstd":
        raise ValueError(f"unknown codec {codec!r}; known: {CODECS}")
    out = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_nbytes)
    if itemsize > 1:
        out = _unshuffle(out, itemsize)
    return out
