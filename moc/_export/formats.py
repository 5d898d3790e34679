"""Writers for ``moc export``: safetensors (Hugging Face), DCP and ``torch.save`` files.

Each writer lays its output out from the export plan (names, shapes, dtypes: known from
the manifest before any data is read), then fills it from a :class:`moc._export.plan.TensorStream`
one tensor at a time, so memory stays at about one group of units however big the model.

* ``safetensors``: ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` plus
  ``model.safetensors.index.json`` past ``max_shard_size``, model weights only, under the
  model's own state-dict keys (transformers 5.x fused experts stay fused: its
  ``from_pretrained`` loads them as they are). Written byte for byte per the safetensors
  spec (8-byte header length, JSON header, little-endian data) so no file is held in memory.
* ``dcp``: ``torch.distributed.checkpoint`` with its own ``FileSystemWriter``; the state
  dict is ``{"model": ..., "optimizer": ...}`` as ``get_state_dict(model, optimizer)``
  names them, planned from meta tensors, each tensor produced when the writer asks for it.
* ``torch``: one ``torch.save``-format file (``torch.load(weights_only=True)``), written
  record by record: tensor storages as they are assembled, the pickled structure last.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import struct
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .._store import CheckpointStore
from .._store.codec import _tensor_view
from .plan import (Entry, ExportPlan, TensorStream, assemble_state, merged_param_groups, pick_manifest, plan_export,
                   read_extras)

__all__ = ["FORMATS", "ExportResult", "parse_size", "export_safetensors", "export_dcp", "export_torch", "export"]

FORMATS = ("torch", "safetensors", "dcp")
Progress = Callable[[int, int], None]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MB"``, ``"2GiB"``, ``"1048576"`` (bytes); > 0."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"size {text!r} is not a size: use bytes or a number with KB, MB, GB, TB "
                             "(or KiB, MiB, GiB, TiB), e.g. 500MB or 5GB")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size {text!r} must be > 0 bytes")
    return value


@dataclass
class ExportResult:
    format: str
    step: int
    path: str
    files: list[str]
    tensors: int
    nbytes: int
    fallbacks: list[tuple[str, int, int]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)   # entries the format cannot hold


def _stream(cs: CheckpointStore, plan: ExportPlan, entries: list[Entry], progress: Progress | None) -> TensorStream:
    return TensorStream(cs, plan, entries, progress=progress)


# -- safetensors ---------------------------------------------------------------------------
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code
_ST_NAME = re.compile(r"^model(?:-\d{5}-of-\d{5})?\.safetensors(?:\.index\.json)?$")


def _shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _st_header(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata}
    pos = 0
    for e in entries:
        assert e.dtype is not None      # tensor entries only
        header[e.key] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * ((-len(raw)) % 8)   # data starts 8-byte aligned, as safetensors writes it


def _write_tensor(f: Any, t: torch.Tensor) -> None:
    if t.numel():
        f.write(_tensor_view(t))


def _replace(tmp: str, path: str) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def export_safetensors(cs: CheckpointStore, out_dir: str, *, step: int | None = None,
                       max_shard_size: int | str = "5GB", hf_config: str | None = None,
                       progress: Progress | None = None) -> ExportResult:
    """The model's weights as safetensors under its own state-dict keys (see module doc);
    ``hf_config``: a ``config.json`` (or a folder holding one) copied in so that
    ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads it."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors export needs a little-endian host")
    max_bytes = parse_size(max_shard_size)
    config_src = _hf_config(hf_config) if hf_config else None
    plan = plan_export(pick_manifest(cs, step))
    entries = plan.entries(optimizer=False)
    tensors = [e for e in entries if e.is_tensor]
    skipped = [e.key for e in entries if not e.is_tensor]
    bad = sorted({str(e.dtype) for e in tensors if e.dtype not in _ST_DTYPES})
    if bad:
        raise ValueError(f"safetensors cannot hold dtypes {bad}; use --format dcp or torch")
    shards = _shards(tensors, max_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    os.makedirs(out_dir, exist_ok=True)
    for old in os.listdir(out_dir):   # weights of an earlier export would shadow or mix with these
        if _ST_NAME.match(old) and old not in names:
            os.remove(os.path.join(out_dir, old))
    if config_src is not None:
        shutil.copyfile(config_src, os.path.join(out_dir, "config.json"))
    metadata = {"format": "pt", "moc_step": str(plan.manifest.step)}
    stream = _stream(cs, plan, tensors, progress)
    it = iter(stream)
    try:
        for name, shard in zip(names, shards):
            path = os.path.join(out_dir, name)
            header = _st_header(shard, metadata)
            with open(path + ".tmp", "wb") as f:
                f.write(struct.pack("<Q", len(header)))
                f.write(header)
                for e in shard:
                    got, t = next(it)
                    assert got is e, (got.key, e.key)
                    _write_tensor(f, t)
                    del t
            _replace(path + ".tmp", path)
    finally:
        it.close()
    files = list(names)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in tensors), "moc_step": plan.manifest.step},
                 "weight_map": {e.key: name for name, shard in zip(names, shards) for e in shard}}
        path = os.path.join(out_dir, "model.safetensors.index.json")
        with open(path + ".tmp", "w") as f:
            json.dump(index, f, indent=2)
        _replace(path + ".tmp", path)
        files.append("model.safetensors.index.json")
    if config_src is not None:
        files.append("config.json")
    return ExportResult("safetensors", plan.manifest.step, out_dir, files, len(tensors),
                        sum(e.nbytes for e in tensors), stream.fallbacks, skipped)


def _hf_config(src: str) -> str:
    path = os.path.join(src, "config.json") if os.path.isdir(src) else src
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--hf-config {src}: no such file")
    try:
        with open(path) as f:
            body = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--hf-config {path} is not a JSON file: {exc}") from exc
    if not isinstance(body, dict) or "model_type" not in body:
        raise ValueError(f"--hf-config {path} is not a transformers config.json (no model_type)")
    return path


# -- DCP -----------------------------------------------------------------------------------
def _streaming_planner(stream: TensorStream, order: dict[str, int]) -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class StreamingSavePlanner(DefaultSavePlanner):
        """Plans from meta tensors; hands each real tensor to the writer when it asks for it,
        in the stream's order (so only the group being written is in memory)."""

        def __init__(self) -> None:
            super().__init__()
            self._it = iter(stream)
            self._ready: dict[str, torch.Tensor] = {}

        def finish_plan(self, new_plan: Any) -> Any:
            items = sorted(new_plan.items, key=lambda wi: (wi.type != WriteItemType.BYTE_IO,
                                                           order.get(wi.index.fqn, -1)))
            return super().finish_plan(dataclasses.replace(new_plan, items=items))

        def resolve_data(self, write_item: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            fqn = write_item.index.fqn
            while fqn not in self._ready:
                try:
                    entry, tensor = next(self._it)
                except StopIteration:
                    raise RuntimeError(f"DCP asked for {fqn!r}, which the export stream does not hold") from None
                self._ready[entry.fqn] = tensor
            return self._ready.pop(fqn)

    return StreamingSavePlanner()


DCP_FILE_BYTES = 256 << 20   # DCP's writer keeps a file's tensors until the file is closed


def _dcp_writer(out_dir: str, file_bytes: int) -> Any:
    """DCP's ``FileSystemWriter`` with one writer thread and no copy-ahead (its serial loader
    asks for tensors in plan order), cutting files at ``file_bytes``: the writer holds
    every tensor of the file it writes until that file is closed, so one file per rank
    would hold the whole model."""
    from torch.distributed.checkpoint import filesystem as fs

    class Writer(fs.FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            prefix = getattr(plan.storage_data, "prefix", None)
            if prefix is None or not hasattr(self, "_write_data") or not hasattr(fs, "DEFAULT_SUFFIX"):
                self.single_file_per_rank = False   # a DCP without these internals: a file per tensor
                return super().write_data(plan, planner)
            buckets: list[list[Any]] = [[]]
            size = 0
            for item in plan.items:
                n = fs._item_size(item) if item.tensor_data is not None else 0
                if buckets[-1] and size + n > file_bytes:
                    buckets.append([])
                    size = 0
                buckets[-1].append(item)
                size += n
            queue: Any = fs.queue.Queue()
            for i, bucket in enumerate(buckets):
                name = f"{prefix}{i}{fs.DEFAULT_SUFFIX}"
                queue.put((self.fs.concat_path(self.path, name), name, bucket))
            return self._write_data(planner, queue)

    return Writer(out_dir, thread_count=1, per_thread_copy_ahead=0)


def export_dcp(cs: CheckpointStore, out_dir: str, *, step: int | None = None,
               progress: Progress | None = None) -> ExportResult:
    """A ``torch.distributed.checkpoint`` checkpoint of ``{"model": model_sd, "optimizer": optim_sd}``
    with the keys ``get_state_dict(model, optimizer)`` uses (``model.<fqn>``,
    ``optimizer.state.<fqn>.exp_avg``, ``optimizer.param_groups``...)."""
    import torch.distributed.checkpoint as dcp

    plan = plan_export(pick_manifest(cs, step))
    extras = read_extras(cs, plan)
    entries = plan.entries()
    model: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    for e in entries:
        value = torch.empty(e.shape, dtype=e.dtype, device="meta") if e.is_tensor else e.value
        if e.section == "model":
            model[e.key] = value
        else:
            state.setdefault(e.key, {})[e.name or ""] = value
    sd: dict[str, Any] = {"model": model}
    groups = merged_param_groups(extras)
    if state or groups:
        sd["optimizer"] = {"state": state, "param_groups": groups}
    tensors = [e for e in entries if e.is_tensor]
    stream = _stream(cs, plan, tensors, progress)
    planner = _streaming_planner(stream, {e.fqn: i for i, e in enumerate(tensors)})
    os.makedirs(out_dir, exist_ok=True)
    writer = _dcp_writer(out_dir, DCP_FILE_BYTES)
    with warnings.catch_warnings():   # single process is the intent here, not a fallback
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(sd, storage_writer=writer, planner=planner, no_dist=True)
    files = sorted(os.listdir(out_dir))
    return ExportResult("dcp", plan.manifest.step, out_dir, files, len(tensors),
                        sum(e.nbytes for e in tensors), stream.fallbacks)


# -- torch.save format ---------------------------------------------------------------------
@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype
    nbytes: int


@dataclass(frozen=True)
class _TensorRef:
    storage: _StorageRef
    shape: tuple[int, ...]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


class _ZipWriter:
    """Records of a ``torch.save`` zip file (torch's own writer, as ``torch.save`` uses it)."""

    def __init__(self, path: str) -> None:
        from torch.serialization import _get_storage_alignment, get_crc32_options

        self.zip = torch._C.PyTorchFileWriter(path, get_crc32_options(), _get_storage_alignment())
        self.count = 0

    def tensor(self, t: torch.Tensor) -> _TensorRef:
        t = t.detach().cpu().contiguous()
        if t.untyped_storage().nbytes() != t.nbytes or t.storage_offset():
            t = t.clone()
        ref = _StorageRef(str(self.count), t.dtype, t.nbytes)
        self.count += 1
        # ignore: torch's stub for write_record omits the UntypedStorage overload it has
        self.zip.write_record(f"data/{ref.key}", t.untyped_storage(), t.nbytes)  # type: ignore[arg-type]
        return _TensorRef(ref, tuple(t.shape))


def _pickle(obj: Any, zw: _ZipWriter) -> bytes:
    """Pickle ``obj`` as ``torch.save`` does: tensors rebuilt by ``torch._utils._rebuild_tensor_v2``
    (``_v3`` for dtypes without a typed storage) from storages that are records of the zip."""
    storage_types = {dtype: getattr(torch, name) for dtype, name in torch.storage._dtype_to_storage_type_map().items()}
    new_dtypes = set(torch.storage._new_dtypes())

    class Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, _StorageRef):
                if o.dtype in new_dtypes or o.dtype not in storage_types:
                    return ("storage", torch.UntypedStorage, o.key, "cpu", o.nbytes)
                return ("storage", storage_types[o.dtype], o.key, "cpu", o.nbytes // o.dtype.itemsize)
            return None

        def reducer_override(self, o: Any) -> Any:
            if isinstance(o, torch.Tensor):
                o = zw.tensor(o)
            if isinstance(o, _TensorRef):
                s = o.storage
                args: tuple[Any, ...] = (s, 0, o.shape, _contiguous_stride(o.shape), False, collections.OrderedDict())
                if s.dtype in new_dtypes or s.dtype not in storage_types:
                    return torch._utils._rebuild_tensor_v3, args + (s.dtype,)
                return torch._utils._rebuild_tensor_v2, args
            return NotImplemented

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def export_torch(cs: CheckpointStore, out_file: str, *, step: int | None = None,
                 progress: Progress | None = None) -> ExportResult:
    """One file for ``torch.load(weights_only=True)``: ``{"model", "optimizer", "extra", "moc"}``
    (see :func:`moc._export.plan.export_state`), streamed record by record."""
    plan = plan_export(pick_manifest(cs, step))
    extras = read_extras(cs, plan)
    entries = plan.entries()
    stream = _stream(cs, plan, [e for e in entries if e.is_tensor], progress)
    parent = os.path.dirname(os.path.abspath(out_file))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"output folder {parent} does not exist")
    tmp = f"{out_file}.tmp"
    zw = _ZipWriter(tmp)
    try:
        refs: dict[int, Any] = {}
        for e, t in stream:
            refs[id(e)] = zw.tensor(t)
            del t
        model: dict[str, Any] = {}
        state: dict[str, dict[str, Any]] = {}
        for e in entries:
            value = refs.get(id(e), e.value)
            if e.section == "model":
                model[e.key] = value
            else:
                state.setdefault(e.key, {})[e.name or ""] = value
        obj = assemble_state(plan, model, state, extras, stream.versions)
        data = _pickle(obj, zw)
        zw.zip.write_record("data.pkl", data, len(data))
        # No ".format_version" record: it lets torch.load compute storage offsets assuming
        # the storages were written in the order the pickle meets them, which a stream
        # written group by group does not follow; without it every record is looked up.
        # ignore: torch's stub for write_record omits the str overload it has
        zw.zip.write_record("byteorder", sys.byteorder, len(sys.byteorder))  # type: ignore[arg-type]
        zw.zip.write_end_of_file()
        del zw
        _replace(tmp, out_file)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    tensors = [e for e in entries if e.is_tensor]
    return ExportResult("torch", plan.manifest.step, out_file, [out_file], len(tensors),
                        sum(e.nbytes for e in tensors), stream.fallbacks)


def export(cs: CheckpointStore, fmt: str, out: str, *, step: int | None = None, max_shard_size: int | str = "5GB",
           hf_config: str | None = None, progress: Progress | None = None) -> ExportResult:
    """Export step ``step`` (newest by default) of ``cs`` to ``out`` in format ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if hf_config is not None and fmt != "safetensors":
        raise ValueError("--hf-config applies to --format safetensors only")
    if fmt == "safetensors":
        return export_safetensors(cs, out, step=step, max_shard_size=max_shard_size, hf_config=hf_config,
                                  progress=progress)
    if fmt == "dcp":
        return export_dcp(cs, out, step=step, progress=progress)
    return export_torch(cs, out, step=step, progress=progress)

