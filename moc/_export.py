"""Export a committed checkpoint to the ecosystem's formats, a group of units at a time.

Units are read per non-expert module and per MoE layer (all its experts, since a fused
parameter needs every expert's row), so peak memory is about one layer's fused tensors,
not the model. Every parameter comes out under its original name and shape: rows of a
fused expert tensor and shards of a DTensor are put back in place from the ``place``
records of their units.

* ``torch``: one file, ``{"model": state_dict, "optimizer": {"state": {fqn: {...}},
  "param_groups": [...]}, "extra": ..., "moc": {"step", "versions"}}``
  (``torch.load(weights_only=True)``);
* ``safetensors``: ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` plus
  ``model.safetensors.index.json`` past ``max_shard_size``), loadable by transformers'
  ``from_pretrained`` when the folder holds the model's ``config.json``;
* ``dcp``: a ``torch.distributed.checkpoint`` folder holding ``{"model": state_dict,
  "optim": optimizer state dict}`` keyed as ``get_state_dict(model, optimizer)`` names them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Callable, Iterator

import torch

from ._ckpt_store import CheckpointStore
from ._layouts import unit_base
from ._units import _clone_all, _copy_box, _saved_box

__all__ = ["FORMATS", "parse_size", "iter_state", "export_torch", "export_safetensors", "export_dcp"]

FORMATS = ("torch", "safetensors", "dcp")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.I)
Progress = Callable[[int, int], None]


def parse_size(text: str) -> int:
    """``"5GB"`` / ``"500MB"`` / ``"1GiB"`` / ``"1024"`` -> bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"--max-shard-size must look like 500MB, 5GB or a byte count, got {text!r}")
    unit = m.group(2).upper().replace("I", "").rstrip("B") or ""
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    return int(float(m.group(1)) * scale)


def _groups(manifest) -> list[list[str]]:
    """Unit names in read groups: one per non-expert module (its pieces), one per MoE
    layer (every expert piece), the extra units last."""
    modules: dict[str, list[str]] = {}
    layers: dict[str, list[str]] = {}
    extras = []
    for name, rec in sorted(manifest.units.items()):
        if rec.kind == "expert":
            layers.setdefault(str(rec.layer), []).append(name)
        elif rec.kind == "module":
            modules.setdefault(unit_base(name), []).append(name)
        else:
            extras.append(name)
    return list(modules.values()) + list(layers.values()) + [extras]


def _assemble(trees: list[dict[str, Any]], section: str) -> dict[str, Any]:
    """Full tensors of one group of units: ``section`` ``model`` -> {key: tensor},
    ``optimizer`` -> {key: {state name: tensor or value}}."""
    out: dict[str, Any] = {}
    for tree in trees:
        place = tree.get("place", {})
        model = tree.get("model", {})
        if section == "model":
            items = [((key,), value, place.get(key)) for key, value in model.items()]
        else:
            items = [((key, n), v, place.get(key) if isinstance(v, torch.Tensor) and key in model
                      and v.dim() > 0 and tuple(v.shape) == tuple(model[key].shape) else None)
                     for key, st in tree.get("optimizer", {}).get("state", {}).items() for n, v in st.items()]
        for path, value, p in items:
            node = out
            for part in path[:-1]:
                node = node.setdefault(part, {})
            leaf = path[-1]
            if not isinstance(value, torch.Tensor):
                node.setdefault(leaf, value)
                continue
            if p is None:
                if value.dim() == 0 and leaf in node:      # Adam's step: the newest version's
                    node[leaf] = torch.maximum(node[leaf], value)
                else:
                    node[leaf] = value.clone()
                continue
            src, off, shape = _saved_box(value, p)
            if leaf not in node:
                node[leaf] = torch.zeros(shape, dtype=value.dtype)
            _copy_box(node[leaf], (0,) * len(shape), src, off)
    return out


def iter_state(cs: CheckpointStore, step: int | None = None, *, optimizer: bool = True,
               progress: Progress | None = None) -> Iterator[tuple[str, Any]]:
    """``("model", {key: tensor})`` / ``("optimizer", {key: {...}})`` / ``("extra", tree)``
    per group of units, then ``("moc", {"step", "versions", "meta"})``."""
    manifest = cs.latest_manifest() if step is None else cs.read_manifest(step)
    if manifest is None:
        raise FileNotFoundError(f"no committed checkpoint in {cs.store.url}")
    total = sum(r.stored_nbytes for r in manifest.units.values())
    done = 0
    versions: dict[str, int] = {}
    for names in _groups(manifest):
        if not names:
            continue
        result = cs.load(manifest.step, names=names)
        versions.update(result.versions)
        trees = [result.units[n] for n in names]
        if manifest.units[names[0]].kind == "extra":
            own = next((t for n, t in zip(names, trees) if n == "extra/rank0"), trees[0])
            yield "extra", _clone_all(own.get("extra", {}))   # own memory, not views of the read buffer
        else:
            yield "model", _assemble(trees, "model")
            if optimizer:
                yield "optimizer", _assemble(trees, "optimizer")
        done += sum(manifest.units[n].stored_nbytes for n in names)
        if progress is not None:
            progress(done, total)
    yield "moc", {"step": manifest.step, "versions": versions, "meta": manifest.meta}


def _collect(cs: CheckpointStore, step: int | None, progress: Progress | None):
    """(model state dict, optimizer state by name, extra tree, moc info) of a whole step."""
    model: dict[str, Any] = {}
    state: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    info: dict[str, Any] = {}
    for kind, part in iter_state(cs, step, progress=progress):
        if kind == "model":
            model.update(part)
        elif kind == "optimizer":
            state.update(part)
        elif kind == "extra":
            extra = part
        else:
            info = part
    return model, state, extra, info


def export_torch(cs: CheckpointStore, out: str, step: int | None = None, *,
                 progress: Progress | None = None) -> dict[str, Any]:
    model, state, extra, info = _collect(cs, step, progress)
    groups = extra.get("optimizer_groups", [])
    result = {"model": model, "optimizer": {"state": state, "param_groups": groups}, "extra": extra,
              "moc": {"step": info["step"], "versions": info["versions"]}}
    torch.save(result, out)
    return {"step": info["step"], "tensors": len(model)}


def export_safetensors(cs: CheckpointStore, out_dir: str, step: int | None = None, *, max_shard_size: int = 5 << 30,
                       hf_config: str | None = None, progress: Progress | None = None) -> dict[str, Any]:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    written: list[str] = []
    weight_map: dict[str, int] = {}
    info: dict[str, Any] = {}

    def flush(final: bool) -> None:
        nonlocal size
        if shards[-1]:
            name = f"shard-{len(written):05d}.tmp"
            save_file(shards[-1], os.path.join(out_dir, name), metadata={"format": "pt"})
            for k in shards[-1]:
                weight_map[k] = len(written)
            written.append(name)
        shards[-1] = {}
        size = 0

    for kind, part in iter_state(cs, step, optimizer=False, progress=progress):
        if kind == "moc":
            info = part
        if kind != "model":
            continue
        for key, t in part.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_size:
                flush(False)
            shards[-1][key] = t.contiguous()
            size += nbytes
        # Whole groups are not kept past their shard: peak ~ one shard + one layer.
    flush(True)
    n = len(written)
    final = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for tmp, name in zip(written, final):
        os.replace(os.path.join(out_dir, tmp), os.path.join(out_dir, name))
    if n > 1:
        total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in final)
        index = {"metadata": {"total_size": total}, "weight_map": {k: final[i] for k, i in sorted(weight_map.items())}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    if hf_config is not None:
        shutil.copyfile(hf_config, os.path.join(out_dir, "config.json"))
    return {"step": info.get("step"), "tensors": len(weight_map), "files": final}


def export_dcp(cs: CheckpointStore, out_dir: str, step: int | None = None, *,
               progress: Progress | None = None) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    model, state, extra, info = _collect(cs, step, progress)
    groups = [dict(g) for g in extra.get("optimizer_groups", [])]
    for g in groups:   # JSON-decoded tuples (betas) stay tuples; DCP keeps scalars as bytes
        g["params"] = list(g.get("params", []))
    dcp.save({"model": model, "optim": {"state": state, "param_groups": groups}},
             storage_writer=dcp.FileSystemWriter(out_dir), no_dist=True)
    return {"step": info.get("step"), "tensors": len(model)}
