"""Units: what moc saves and restores, found from a model and its optimizer.

* one unit per expert of each MoE layer (see :mod:`moc._units.layouts` for the layouts
  recognised: per-expert modules, fused expert tensors, DTensor shards) holding its
  weights and optimizer state;
* one unit per non-expert module (the entries of ``model.state_dict()`` grouped by the
  module that owns them) with its weights, buffers and optimizer state;
* one ``extra`` unit: step, RNG states, optimizer hyper-parameters, user objects.

A unit's tree is ``{"model": {key: tensor}, "optimizer": {"state": {key: {...}}},
"place": {key: {"shape", "offset", "expert_dim"}}}``: ``place`` says where a saved tensor
sits in the global parameter when it is not the whole of it (the row of a fused expert
tensor, the shard of a DTensor). Restores copy the intersection of each saved piece with
the piece the live model holds, so any sharding reads any other.

Optimizer state is keyed by parameter *name*, never by position, so a checkpoint restores
onto a model whose expert layout or world size differs.
"""

from __future__ import annotations

import logging
import random
from collections import defaultdict
from typing import Any, Iterable, Mapping, Sequence, cast

import numpy as np
import torch

from .._cuda import copy_into, finish_copies, runtime
from .layouts import (DEFAULT_EXPERT_PATTERN, ExpertLayout, TensorRef, UnitLayout, UnitSpec, discover_units,
                      expert_unit_name, fused_row_map, is_dtensor, local_box, local_tensor, module_unit_name)

log = logging.getLogger("moc")

__all__ = [
    "DEFAULT_EXPERT_PATTERN",
    "ExpertLayout",
    "TensorRef",
    "UnitSpec",
    "UnitLayout",
    "discover_units",
    "expert_unit_name",
    "module_unit_name",
    "capture_unit",
    "capture_rng",
    "restore_rng",
    "apply_units",
    "apply_partial",
]

def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                     params: Mapping[str, torch.nn.Parameter] | None = None) -> list[dict[str, Any]]:
    """Hyper-parameters of each param group, with parameters named instead of numbered
    (``params``: ``dict(model.named_parameters())`` when the caller has it already)."""
    names = _param_names(model) if params is None else {id(p): name for name, p in params.items()}
    groups = []
    for g in optimizer.param_groups:
        entry = {k: v for k, v in g.items() if k != "params"}
        entry["params"] = [names[id(p)] for p in g["params"] if id(p) in names]
        groups.append(entry)
    return groups


def capture_rng() -> dict[str, Any]:
    """The RNG states to restore with a checkpoint: torch's (CPU), every CUDA device's
    (when CUDA is initialised in this process), Python's and NumPy's."""
    # legacy=True (the default) returns the tuple form
    np_state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    out = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
    }
    cuda = runtime().rng_states()
    if cuda:
        out["cuda"] = list(cuda)
    return out


def restore_rng(rng: Mapping[str, Any]) -> None:
    # A fresh tensor: the generator reads the state from the start of the storage, so a
    # view at an offset (decoded from a shared buffer) would be misread.
    torch.set_rng_state(rng["torch"].clone())
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    n = rng["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    cuda = rng.get("cuda") or []
    if cuda:
        restored = runtime().set_rng_states([t.clone() for t in cuda])
        if restored < len(cuda):
            log.info("rank - step -: CUDA RNG state restored on %d of the %d devices it was saved from "
                     "(this process sees %d)", restored, len(cuda), restored)


def _clone_all(node: Any) -> Any:
    if isinstance(node, torch.Tensor):
        return node.clone()
    if isinstance(node, dict):
        return {k: _clone_all(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_clone_all(v) for v in node)
    return node


def _owned(live: Any, value: Any) -> Any:
    """``value`` in memory of its own: copied into ``live`` when that is a tensor of the
    same shape, dtype and device (its pages are already mapped, unlike a fresh clone's)."""
    if not isinstance(value, torch.Tensor):
        return value
    if (isinstance(live, torch.Tensor) and not is_dtensor(live) and live.shape == value.shape
            and live.dtype == value.dtype and live.device == value.device and live.data_ptr() != value.data_ptr()):
        with torch.no_grad():
            live.copy_(value)
        return live
    return value.clone()


def own_tree(tree: Mapping[str, Any], params: Mapping[str, torch.nn.Parameter],
             optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``tree`` made independent of the buffer it was decoded from, for what a restore
    keeps: model tensors stay views (they are copied into the model), optimizer-state
    tensors land in the optimizer's current state tensors where those match (no fresh
    allocation) and are cloned otherwise, everything else is cloned."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if key == "model":
            out[key] = value
        elif key == "optimizer" and isinstance(value, Mapping):
            state = {}
            for name, st in value.get("state", {}).items():
                p = params.get(name)
                live = optimizer.state.get(p, {}) if optimizer is not None and p is not None else {}
                state[name] = {k: _owned(live.get(k), v) for k, v in st.items()}
            out[key] = {k: (state if k == "state" else _clone_all(v)) for k, v in value.items()}
        else:
            out[key] = _clone_all(value)
    return out




# -- capture -------------------------------------------------------------------------------
def _take(t: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    """This rank's part of ``t`` for one unit: the local shard, and for a fused tensor
    the expert's row of it (a view: rows of a contiguous tensor are contiguous)."""
    x = local_tensor(t.detach())
    if ref.span is not None:
        x = x.narrow(*ref.span)
    elif ref.expert_dim is not None:
        assert ref.row is not None      # a fused tensor's reference names its row
        x = x.select(ref.expert_dim, ref.row)
    return x


def capture_unit(spec: UnitSpec, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 *, state: Mapping[str, Any] | None = None,
                 params: Mapping[str, torch.nn.Parameter] | None = None) -> dict[str, Any]:
    """The unit's state tree (see the module docstring).

    Tensors are the live ones (views, no copy); callers snapshot them before the next update.
    """
    state = model.state_dict(keep_vars=True) if state is None else state
    refs = {r.key: r for r in spec.refs} if spec.refs else {k: TensorRef(k) for k in spec.keys}
    tree: dict[str, Any] = {"model": {k: (_take(state[k], refs[k]) if isinstance(state[k], torch.Tensor)
                                          else state[k]) for k in spec.keys}}
    places = {k: r.place() for k, r in refs.items() if r.place() is not None}
    if places:
        tree["place"] = places
    if optimizer is not None:
        by_name = dict(model.named_parameters()) if params is None else params
        opt_state = {}
        for k in spec.keys:
            p = by_name.get(k)
            if p is None or not optimizer.state.get(p):
                continue
            entry = {}
            for name, v in optimizer.state[p].items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == tuple(p.shape):
                    entry[name] = _take(v, refs[k])          # shaped like the parameter: same piece
                elif isinstance(v, torch.Tensor):
                    entry[name] = local_tensor(v.detach())
                else:
                    entry[name] = v
            opt_state[k] = entry
        if opt_state:
            tree["optimizer"] = {"state": opt_state}
    return tree


# -- restore: copy saved pieces into whatever piece the live model holds --------------------
def _saved_box(value: torch.Tensor,
              place: Mapping[str, Any] | None) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(tensor, global offset, global shape) of a saved piece."""
    if place is None:
        return value, (0,) * value.dim(), tuple(value.shape)
    d = place.get("expert_dim")
    if d is not None:
        value = value.unsqueeze(int(d))
    return value, tuple(int(o) for o in place["offset"]), tuple(int(x) for x in place["shape"])


def _copy_box(dst: torch.Tensor, dst_off: Sequence[int], src: torch.Tensor, src_off: Sequence[int]) -> int:
    """Copy the intersection of two boxes given in global coordinates; return its size.

    A host-to-device copy is non-blocking: :func:`_apply` waits for all of them at the end."""
    if dst.shape == src.shape and tuple(dst_off) == tuple(src_off):   # the same box: the common case
        copy_into(dst, src)
        return dst.numel()
    sd, ss = [], []
    for i in range(dst.dim()):
        lo = max(dst_off[i], src_off[i])
        hi = min(dst_off[i] + dst.shape[i], src_off[i] + src.shape[i])
        if hi <= lo:
            return 0
        sd.append(slice(lo - dst_off[i], hi - dst_off[i]))
        ss.append(slice(lo - src_off[i], hi - src_off[i]))
    part = dst[tuple(sd)]
    copy_into(part, src[tuple(ss)])
    return part.numel()


Rows = tuple[list[int], int, int]   # (global expert id of each row, E, expert dim) of a fused tensor


def _live_shape(key: str, live: torch.Tensor, rows: Rows | None) -> tuple[int, ...]:
    if rows is None:
        return tuple(local_box(key, live)[0])
    ids, num, d = rows
    return tuple(num if i == d else n for i, n in enumerate(live.shape))


def _place(dst: torch.Tensor, src: torch.Tensor, src_off: Sequence[int], rows: Rows) -> int:
    """Copy a saved piece into the rows of ``dst`` (a fused tensor holding a subset of the
    experts, or a state tensor shaped like it) that hold the experts the piece covers."""
    ids, _, d = rows
    n = 0
    for r, e in enumerate(ids):
        if src_off[d] <= e < src_off[d] + src.shape[d]:
            off = [0] * dst.dim()
            off[d] = e
            n += _copy_box(dst.narrow(d, r, 1), off, src, src_off)
    return n


def _copy_piece(key: str, live: torch.Tensor, value: torch.Tensor, place: Mapping[str, Any] | None,
                rows: Rows | None = None) -> int:
    src, src_off, gshape = _saved_box(value, place)
    live_shape = _live_shape(key, live, rows)
    if tuple(live_shape) != tuple(gshape):
        raise ValueError(f"{key}: checkpoint shape {tuple(gshape)} != model shape {tuple(live_shape)}")
    if rows is None:
        _, live_off, _ = local_box(key, live)
        return _copy_box(local_tensor(live), live_off, src, src_off)
    return _place(live, src, src_off, rows)


def _scalar_like(v: torch.Tensor, p: torch.Tensor, group: Mapping[str, Any] | None) -> torch.Tensor:
    # Adam's "step" lives on the CPU unless the optimizer is capturable or fused (a unit
    # received over NCCL decodes on the device: bring it back).
    on_device = bool(group and (group.get("capturable") or group.get("fused")))
    out = v.detach().clone()
    return out.to(local_tensor(p).device) if on_device or v.dim() > 0 else out.cpu()


def _assemble_state(key: str, p: torch.nn.Parameter,
                    pieces: list[tuple[dict[str, Any], Any, tuple[int, ...] | None]],
                    live: Mapping[str, Any], group: Mapping[str, Any] | None,
                    rows: Rows | None = None) -> dict[str, Any]:
    """One parameter's optimizer state from saved pieces (rows of a fused tensor, shards).

    Tensors shaped like the saved piece of the parameter are placed like it, into the
    live state tensor where it fits (no allocation) or a fresh one; other tensors (Adam's
    ``step``) come from the newest version: the largest value among the pieces."""
    _, p_off, p_local = local_box(key, p)
    out: dict[str, Any] = {}
    names = list(dict.fromkeys(n for st, _, _ in pieces for n in st))
    for name in names:
        vals = [(st[name], place, shape) for st, place, shape in pieces if name in st]
        v0, _, shape0 = vals[0]
        if isinstance(v0, torch.Tensor) and v0.dim() > 0 and tuple(v0.shape) == shape0:
            lv = live.get(name)
            target = local_tensor(lv) if isinstance(lv, torch.Tensor) else None
            if target is None or tuple(target.shape) != tuple(p_local) or target.dtype != v0.dtype:
                lv = None
                device = local_tensor(p).device
                whole = _saved_box(v0, vals[0][1]) if len(vals) == 1 and rows is None else None
                if whole is not None and whole[0].device == device and tuple(whole[0].shape) == tuple(p_local) \
                        and tuple(whole[1]) == tuple(p_off):
                    target = whole[0].clone(memory_format=torch.contiguous_format)   # it covers it all
                    vals = []
                else:
                    target = torch.zeros(p_local, dtype=v0.dtype, device=device)
            for v, place, _ in vals:
                src, src_off, _ = _saved_box(v, place)
                if rows is None:
                    _copy_box(target, p_off, src, src_off)
                else:
                    _place(target, src, src_off, rows)
            if lv is not None:
                out[name] = lv
            elif is_dtensor(p):
                from torch.distributed.tensor import DTensor
                out[name] = DTensor.from_local(target, p.device_mesh, p.placements, run_check=False,
                                               shape=p.shape, stride=p.stride())
            else:
                out[name] = target
        elif isinstance(v0, torch.Tensor):
            if v0.numel() == 1 and len(vals) > 1:
                v0 = max((v for v, _, _ in vals), key=lambda t: float(t.item()))
            out[name] = _scalar_like(v0, p, group)
        else:
            out[name] = v0
    return out


def _apply(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, trees: Iterable[Mapping[str, Any]],
           *, full: bool, groups: list[dict[str, Any]] | None = None) -> list[str]:
    try:
        return _apply_pieces(model, optimizer, trees, full=full, groups=groups)
    finally:
        # The saved bytes may be page-locked buffers reused right after: every non-blocking
        # host-to-device copy must have landed before returning.
        finish_copies(local_tensor(t).device for t in (*model.parameters(), *model.buffers()))


def _apply_pieces(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  trees: Iterable[Mapping[str, Any]], *, full: bool,
                  groups: list[dict[str, Any]] | None = None) -> list[str]:
    current = model.state_dict(keep_vars=True)
    params = dict(model.named_parameters())
    covered: dict[str, int] = defaultdict(int)
    pieces: dict[str, list[tuple[dict[str, Any], Any, tuple[int, ...] | None]]] = defaultdict(list)
    restored: set[str] = set()
    row_maps: dict[str, Rows | None] = {}

    def rows_of(key: str, place: Mapping[str, Any] | None) -> Rows | None:
        if place is None or place.get("expert_dim") is None:
            return None
        if key not in row_maps:
            d = int(place["expert_dim"])
            found = fused_row_map(model, key, current[key], d)
            row_maps[key] = None if found is None else (found[0], found[1], d)
        return row_maps[key]

    with torch.no_grad():
        for tree in trees:
            place = tree.get("place", {})
            model_part = tree.get("model", {})
            for key, value in model_part.items():
                if key not in current:
                    raise KeyError(f"checkpoint has {key!r}, which the model does not")
                if isinstance(value, torch.Tensor) and isinstance(current[key], torch.Tensor):
                    covered[key] += _copy_piece(key, current[key], value, place.get(key),
                                                rows_of(key, place.get(key)))
                restored.add(key)
            for key, st in tree.get("optimizer", {}).get("state", {}).items():
                shape = tuple(model_part[key].shape) if key in model_part else None
                pieces[key].append((st, place.get(key), shape))
        missing = sorted(k for k, v in current.items() if isinstance(v, torch.Tensor)
                         and covered.get(k, 0) < local_tensor(v).numel())
        if optimizer is None:
            return missing
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        if full and groups is not None:
            if len(groups) != len(optimizer.param_groups):
                raise ValueError(f"checkpoint has {len(groups)} optimizer param groups, "
                                 f"the optimizer {len(optimizer.param_groups)}")
            for g_live, g_saved in zip(optimizer.param_groups, groups):
                g_live.update({k: v for k, v in g_saved.items() if k != "params"})
        live = {p: dict(optimizer.state.get(p, {})) for p in params.values()}
        if full:
            optimizer.state.clear()
        for key, p in params.items():     # parameter order: the same on every rank
            if key not in restored:
                continue
            if key in pieces:
                optimizer.state[p] = _assemble_state(key, p, pieces[key], live[p], group_of.get(id(p)),
                                                     row_maps.get(key))
            elif not full:
                optimizer.state.pop(p, None)
    return missing


def apply_partial(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  trees: Iterable[Mapping[str, Any]]) -> None:
    """Copy some units into the model and set their parameters' optimizer state, leaving
    every other parameter (and, for fused tensors, every other expert's rows) as it is."""
    _apply(model, optimizer, trees, full=False)


def apply_units(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                trees: Iterable[Mapping[str, Any]], groups: list[dict[str, Any]] | None) -> list[str]:
    """Copy unit trees into the model (in place) and rebuild the optimizer's state from
    them; return the keys of the model no saved piece covered."""
    return _apply(model, optimizer, trees, full=True, groups=groups)
