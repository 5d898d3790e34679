"""The tensors of a checkpoint as the model holds them, streamed for export.

:func:`plan_export` reads nothing but the manifest: from each unit's record it lists the
tensors of the model's state dict and of the optimizer state under their original keys and
full (global) shapes. A fused expert parameter (``...experts.gate_up_proj`` [E, 2F, D]) is
one tensor assembled from the rows its E expert units hold; a DTensor parameter is one
tensor assembled from its shards (``#p..`` pieces); Adam's scalar ``step``, which every
expert unit of a fused parameter carries, is the newest (largest) of its copies. Coverage
is checked up front: an element no saved piece covers is an error, never a silent hole.

:class:`TensorStream` then yields ``(entry, tensor)`` in plan order, group by group. A
group is the set of units whose pieces make up the same tensors (the E experts of one
fused MoE layer, one module's shards, one per-expert module), so memory peaks at one
group's assembled tensors plus the few units being read, never at the model.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterable, Iterator, Mapping, Protocol

import numpy as np
import torch

from storage_backends import Store

# the store's codec and manifest modules, not the room: the store exports through this module
from .._store.codec import TensorMeta, meta_tree
from .._store.format import Manifest
from .._units.capture import _copy_box, _saved_box

__all__ = ["Entry", "Piece", "Group", "ExportPlan", "TensorStream", "plan_export", "read_extras",
           "merged_param_groups", "export_state", "pick_manifest", "natural_key"]

Progress = Callable[[int, int], None]


class CheckpointSource(Protocol):
    """What an export reads from a checkpoint store. :class:`moc.CheckpointStore` is one;
    it exports through this module (:meth:`~moc.CheckpointStore.export`), so this module
    names the few methods it uses instead of importing the store's."""

    store: Store

    def latest_manifest(self) -> Manifest | None: ...

    def read_manifest(self, step: int) -> Manifest: ...

    def iter_units(self, manifest: Manifest, names: Iterable[str], *, fallback: bool = True,
                   window: int | None = None,
                   max_ahead_bytes: int | None = None) -> Generator[tuple[str, Any, int], None, None]: ...
READ_AHEAD_BYTES = 64 << 20   # units read ahead of the one being assembled (at least one)


def natural_key(text: str) -> list[Any]:
    """Sort key putting ``layers.2`` before ``layers.10``."""
    return [int(t) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", text))]


@dataclass(frozen=True)
class Piece:
    """Where one saved piece of an output tensor lives: a unit and a path in its tree."""

    unit: str
    path: tuple[str, ...]
    place: Mapping[str, Any] | None  # global shape / offset / expert_dim; None: the whole tensor
    size: tuple[int, ...]            # the piece's extent in global coordinates


@dataclass
class Entry:
    """One tensor (or non-tensor value) of the exported state dict."""

    section: str                   # "model" | "optimizer"
    key: str                       # state-dict key; the parameter's name for optimizer state
    name: str | None = None        # optimizer state name ("exp_avg", "step", ...)
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None   # None: not a tensor, ``value`` holds it
    value: Any = None
    pieces: list[Piece] = field(default_factory=list)
    group: int = -1

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None

    @property
    def placed(self) -> bool:
        return any(p.place is not None for p in self.pieces)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize if self.dtype is not None else 0

    @property
    def fqn(self) -> str:
        """The key as ``torch.distributed.checkpoint`` flattens ``{"model": .., "optimizer": ..}``."""
        return f"model.{self.key}" if self.section == "model" else f"optimizer.state.{self.key}.{self.name}"


@dataclass
class Group:
    units: list[str]
    entries: list[Entry]


@dataclass
class ExportPlan:
    manifest: Manifest
    groups: list[Group]
    extras: list[str]   # "extra" units (step, RNG, optimizer hyper-parameters, user state), rank order

    def entries(self, *, optimizer: bool = True, tensors_only: bool = False) -> list[Entry]:
        """Entries in stream order: each group's model tensors, then its optimizer state."""
        return [e for g in self.groups for e in g.entries
                if (optimizer or e.section == "model") and (e.is_tensor or not tensors_only)]


def pick_manifest(cs: CheckpointSource, step: int | None) -> Manifest:
    """The manifest of ``step``, or the newest committed one when ``step`` is None (``moc
    export`` and ``moc inspect`` alike); FileNotFoundError when the store has none."""
    if step is not None:
        return cs.read_manifest(step)
    manifest = cs.latest_manifest()
    if manifest is None:
        raise FileNotFoundError(f"no committed checkpoint in {cs.store.url}")
    return manifest


# -- planning from the manifest ------------------------------------------------------------
def _global_shape(value: torch.Tensor, place: Mapping[str, Any] | None) -> tuple[int, ...]:
    return tuple(int(x) for x in place["shape"]) if place is not None else tuple(value.shape)


def _add(entries: dict[tuple[str, str, str | None], Entry], ident: tuple[str, str, str | None],
         unit: str, path: tuple[str, ...], value: Any, place: Mapping[str, Any] | None) -> None:
    entry = entries.get(ident)
    what = ".".join(x for x in ident[1:] if x)
    if not isinstance(value, torch.Tensor):
        if entry is None:
            entries[ident] = Entry(ident[0], ident[1], ident[2], value=value)
        elif entry.is_tensor:
            raise ValueError(f"{ident[0]} {what!r} is a tensor in one unit and a {type(value).__name__} in {unit!r}")
        return
    shape, dtype = _global_shape(value, place), value.dtype
    if entry is None:
        entry = entries[ident] = Entry(ident[0], ident[1], ident[2], shape, dtype)
    elif not entry.is_tensor:
        raise ValueError(f"{ident[0]} {what!r} is a tensor in unit {unit!r} and a value elsewhere")
    elif (entry.shape, entry.dtype) != (shape, dtype):
        raise ValueError(f"{ident[0]} {what!r}: unit {unit!r} holds a piece of a {dtype} {list(shape)} tensor, "
                         f"unit {entry.pieces[0].unit!r} one of a {entry.dtype} {list(entry.shape)} tensor")
    size = tuple(_saved_box(value, place)[0].shape)
    if place is not None and not (len(place.get("offset", ())) == len(size) == len(shape)):
        raise ValueError(f"{ident[0]} {what!r}: unit {unit!r} places a {list(value.shape)} piece at offset "
                         f"{place.get('offset')} of a {list(shape)} tensor (malformed place record)")
    entry.pieces.append(Piece(unit, path, place, size))


def _covered(entry: Entry) -> int:
    """Elements of ``entry`` covered by the union of its pieces' boxes (exact)."""
    if entry.numel == 0:
        return 0
    boxes = [((0,) * len(entry.shape) if p.place is None else tuple(int(o) for o in p.place["offset"]), p.size)
             for p in entry.pieces]
    cuts = [sorted({0, n} | {min(n, max(0, x)) for o, s in boxes for x in (o[d], o[d] + s[d])})
            for d, n in enumerate(entry.shape)]
    cells = np.zeros([max(1, len(c) - 1) for c in cuts], dtype=bool)
    for off, size in boxes:
        sl = tuple(slice(c.index(max(0, off[d])), c.index(min(entry.shape[d], off[d] + size[d])))
                   for d, c in enumerate(cuts))
        cells[sl] = True
    widths = [np.diff(np.array(c)) for c in cuts]
    if not widths:
        return 1 if cells.any() else 0
    vol = widths[0]
    for w in widths[1:]:
        vol = np.multiply.outer(vol, w)
    return int(vol[cells].sum())


def plan_export(manifest: Manifest) -> ExportPlan:
    """Every tensor of the checkpoint's model and optimizer state, from the manifest alone.

    Raises ``ValueError`` for a checkpoint that cannot be reassembled: pieces that disagree
    on a tensor's shape or dtype, elements no piece covers, experts missing from a layer.
    """
    entries: dict[tuple[str, str, str | None], Entry] = {}
    extras: list[str] = []
    for name in sorted(manifest.units, key=natural_key):
        rec = manifest.units[name]
        if rec.kind == "extra":
            extras.append(name)
            continue
        tree = meta_tree(rec.skeleton, [TensorMeta.from_json(t) for t in rec.tensors])
        if not isinstance(tree, dict) or not isinstance(tree.get("model", {}), dict):
            raise ValueError(f"unit {name!r} is not a model unit (a dict with 'model', 'optimizer', 'place')")
        places = tree.get("place") or {}
        model = tree.get("model") or {}
        for key, value in model.items():
            _add(entries, ("model", key, None), name, ("model", key), value, places.get(key))
        for key, state in ((tree.get("optimizer") or {}).get("state") or {}).items():
            ref = model.get(key)
            for sname, value in state.items():
                # Tensors shaped like the saved piece of the parameter are placed like it.
                placed = (isinstance(value, torch.Tensor) and isinstance(ref, torch.Tensor) and value.dim() > 0
                          and tuple(value.shape) == tuple(ref.shape))
                _add(entries, ("optimizer", key, sname), name, ("optimizer", "state", key, sname), value,
                     places.get(key) if placed else None)
    for entry in entries.values():
        if entry.is_tensor and entry.placed:
            got = _covered(entry)
            if got != entry.numel:
                units = sorted({p.unit for p in entry.pieces}, key=natural_key)
                raise ValueError(f"{entry.section} {entry.key!r}{'.' + entry.name if entry.name else ''}: the saved "
                                 f"pieces cover {got} of its {entry.numel} elements (units {units[:4]}"
                                 f"{'...' if len(units) > 4 else ''}); a rank's or an expert's piece is missing")
    _check_experts(manifest)
    return ExportPlan(manifest, _groups(list(entries.values())), sorted(extras, key=natural_key))


def _check_experts(manifest: Manifest) -> None:
    expected = ((manifest.meta.get("layout") or {}).get("experts_per_layer") or {})
    layers = manifest.layers()
    for layer, count in expected.items():
        have = set(layers.get(layer, {}))
        missing = sorted(set(range(int(count))) - have)
        if missing:
            raise ValueError(f"MoE layer {layer!r}: step {manifest.step} has no saved version of experts {missing[:8]} "
                             f"of {count}")


def _groups(entries: list[Entry]) -> list[Group]:
    parent: dict[str, str] = {}

    def find(u: str) -> str:
        while parent.setdefault(u, u) != u:
            parent[u] = parent[parent[u]]
            u = parent[u]
        return u

    for e in entries:
        units = [p.unit for p in e.pieces]
        for u in units[1:]:
            parent[find(u)] = find(units[0])
    by_root: dict[str, list[Entry]] = defaultdict(list)
    loose: list[Entry] = []
    for e in entries:
        (by_root[find(e.pieces[0].unit)] if e.pieces else loose).append(e)

    def order(e: Entry) -> tuple[Any, ...]:
        return (e.section != "model", natural_key(e.key))

    groups = []
    for items in by_root.values():
        items.sort(key=order)  # stable: optimizer state names keep the optimizer's order
        units = sorted({p.unit for e in items for p in e.pieces}, key=natural_key)
        groups.append(Group(units, items))
    if loose:  # non-tensor values of no unit in particular: nothing to read
        groups.append(Group([], sorted(loose, key=order)))
    groups.sort(key=lambda g: [natural_key(e.key) for e in g.entries if e.section == "model"][:1] or [[]])
    for i, g in enumerate(groups):
        for e in g.entries:
            e.group = i
    return groups


# -- streaming -----------------------------------------------------------------------------
def _at(tree: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


class TensorStream:
    """``(entry, tensor or value)`` for ``wanted`` entries of ``plan``, in plan order.

    Reads each group's units once (``read_concurrency`` at a time, at most ``read_ahead``
    bytes ahead),
    copies their pieces into the group's full tensors and yields them. ``versions`` and
    ``fallbacks`` report the unit versions actually read (a corrupt unit falls back to its
    previous version, as restore does).
    """

    def __init__(self, cs: CheckpointSource, plan: ExportPlan, wanted: Iterable[Entry], *,
                 progress: Progress | None = None, read_ahead: int | None = None) -> None:
        self.cs = cs
        self.read_ahead = READ_AHEAD_BYTES if read_ahead is None else read_ahead
        self.plan = plan
        self.wanted = list(wanted)
        rank = {id(e): i for i, e in enumerate(plan.entries())}
        if [rank[id(e)] for e in self.wanted] != sorted(rank[id(e)] for e in self.wanted):
            raise ValueError("TensorStream: entries must come in plan order")
        self.progress = progress
        self.total = sum(e.nbytes for e in self.wanted)
        self.versions: dict[str, int] = {}
        self.fallbacks: list[tuple[str, int, int]] = []

    def __iter__(self) -> Generator[tuple[Entry, Any], None, None]:
        by_group: dict[int, list[Entry]] = defaultdict(list)
        for e in self.wanted:
            by_group[e.group].append(e)
        order = sorted(by_group)
        units = [u for g in order for u in self._units(by_group[g])]
        manifest = self.plan.manifest
        reads = self.cs.iter_units(manifest, units, max_ahead_bytes=self.read_ahead)
        done = 0
        try:
            for g in order:
                outs = self._assemble(by_group[g], reads)
                for e in by_group[g]:
                    value = outs.pop(id(e))
                    yield e, value
                    done += e.nbytes
                    if self.progress is not None:
                        self.progress(done, self.total)
        finally:
            reads.close()

    @staticmethod
    def _units(entries: list[Entry]) -> list[str]:
        return sorted({p.unit for e in entries if e.is_tensor for p in e.pieces}, key=natural_key)

    def _assemble(self, entries: list[Entry], reads: Iterator[tuple[str, Any, int]]) -> dict[int, Any]:
        outs: dict[int, Any] = {}
        uses: dict[str, list[tuple[Entry, Piece]]] = defaultdict(list)
        for e in entries:
            if not e.is_tensor:
                outs[id(e)] = e.value
                continue
            if e.placed:
                outs[id(e)] = torch.empty(e.shape, dtype=e.dtype)
            for p in e.pieces:
                uses[p.unit].append((e, p))
        for unit in self._units(entries):
            name, tree, version = next(reads)
            assert name == unit, (name, unit)
            self.versions[name] = version
            rec = self.plan.manifest.units[name]
            if version != rec.step:
                self.fallbacks.append((name, rec.step, version))
            for e, p in uses[name]:
                value = _at(tree, p.path)
                if e.placed:
                    src, off, _ = _saved_box(value, p.place)
                    _copy_box(outs[id(e)], (0,) * len(e.shape), src, off)
                elif id(e) not in outs:
                    outs[id(e)] = value.clone()   # own memory: the unit's buffer goes away
                elif value.numel() == 1 and float(value.item()) > float(outs[id(e)].item()):
                    outs[id(e)] = value.clone()   # Adam's step in every expert row: the newest
            del tree
        return outs


# -- the rest of the state -----------------------------------------------------------------
def read_extras(cs: CheckpointSource, plan: ExportPlan) -> dict[str, Any]:
    """``{extra unit name: its tree}`` (small: step, RNG, optimizer groups, user state)."""
    return {name: tree for name, tree, _ in cs.iter_units(plan.manifest, plan.extras)}


def merged_param_groups(extras: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The optimizer's param groups with parameters named, as
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives them; ranks holding
    different parameters (expert parallelism) contribute theirs to the same group."""
    merged: list[dict[str, Any]] = []
    for name in sorted(extras, key=natural_key):
        tree = extras[name]
        groups = (tree.get("extra", tree) if isinstance(tree, dict) else {}).get("optimizer_groups") or []
        for i, g in enumerate(groups):
            if i >= len(merged):
                merged.append({**g, "params": list(g.get("params", []))})
            else:
                seen = set(merged[i]["params"])
                merged[i]["params"].extend(p for p in g.get("params", []) if p not in seen)
    return merged


def extra_state(extras: Mapping[str, Any]) -> dict[str, Any]:
    """``{"rank0": {...}, ...}``: each rank's extra state (``extra/rank0`` -> ``rank0``)."""
    out = {}
    for name in sorted(extras, key=natural_key):
        tree = extras[name]
        key = name.split("/", 1)[1] if "/" in name else name
        out[key] = tree.get("extra", tree) if isinstance(tree, dict) else tree
    return out


def export_state(cs: CheckpointSource, step: int | None = None, *, progress: Progress | None = None) -> dict[str, Any]:
    """The whole checkpoint as one in-memory state dict (what ``--format torch`` writes):
    ``{"model": {key: full tensor}, "optimizer": {"state": {name: {...}}, "param_groups": [...]},
    "extra": {"rank0": {...}}, "moc": {"step", "versions"}}``."""
    plan = plan_export(pick_manifest(cs, step))
    extras = read_extras(cs, plan)
    stream = TensorStream(cs, plan, plan.entries(), progress=progress)
    model: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    for e, value in stream:
        if e.section == "model":
            model[e.key] = value
        else:
            state.setdefault(e.key, {})[e.name or ""] = value
    return assemble_state(plan, model, state, extras, stream.versions)


def assemble_state(plan: ExportPlan, model: dict[str, Any], state: dict[str, Any], extras: Mapping[str, Any],
                   versions: Mapping[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model}
    groups = merged_param_groups(extras)
    if state or groups:
        out["optimizer"] = {"state": state, "param_groups": groups}
    if extras:
        out["extra"] = extra_state(extras)
    all_versions = {n: plan.manifest.units[n].step for n in plan.manifest.units}
    all_versions.update(versions)
    out["moc"] = {"step": plan.manifest.step, "versions": dict(sorted(all_versions.items()))}
    return out
