"""Expert layouts: how a model stores its experts, recognised from names and shapes.

A unit is always "global expert ``e`` of MoE layer ``l``". What changes between the models
people train is where its tensors live:

* ``per_expert``: one module per expert (``...experts.7.w1.weight``, or
  ``...experts.expert_7.wi.weight`` as Switch Transformers and NLLB-MoE name them), found by
  ``MoCConfig.expert_pattern`` (named groups ``layer`` and ``expert``);
* ``megatron_sequential``: Megatron-core SequentialMLP, ``...experts.local_experts.<i>...``;
* ``te_grouped``: Transformer Engine GroupedMLP, ``...experts.linear_fc1.weight<i>``;
* ``hf_fused``: Hugging Face transformers 5.x, a layer's experts stacked in
  ``...experts.gate_up_proj`` [E, 2F, D] / ``down_proj`` [E, D, F] (GPT-OSS adds ``_bias``);
* ``torchtitan``: ``GroupedExperts``, ``...experts.w1`` / ``w2`` / ``w3`` with or without
  a shape suffix (``w1_EFD``), or ``w13``; torchtitan 0.3's
  ``<layer>.routed_experts.inner_experts.w1_EFD`` too;
* ``flattened``: DBRX, a layer's experts stacked *and flattened* in ``...experts.mlp.w1`` /
  ``v1`` / ``w2`` [E * F, D]; E is the experts module's ``num_experts``, expert ``e`` is
  rows ``e*F .. (e+1)*F - 1``;
* ``parallel_experts``: JetMoE (and ScatterMoE-style) ``ParallelExperts`` modules,
  ``...input_linear.weight`` / ``output_linear.weight`` [E, ...] whose module declares
  ``num_experts`` = E (JetMoE's attention experts are a second MoE layer of each block);
* ``embedding_experts``: product-key retrieval experts (Doge's CDMoE), expert ``e`` is row
  ``e`` of ``...down_embed.weight`` and ``up_embed.weight`` [E, D], E the module's
  ``num_experts``;
* ``fused``: an explicit :class:`ExpertLayout` (a parameter regex plus the expert dim).

A fused tensor may hold more rows than the layer has experts when its module declares
fewer (LongCat-Flash: ``gate_up_proj`` has E + Z rows for Z zero-compute "identity"
experts, ``down_proj`` E): rows ``E ..`` are no expert's, they are saved with the module
like any non-expert tensor, and router ids ``>= E`` select a zero-compute expert.

For Megatron and TE the index in the name is local to the expert-parallel rank; the
module's ``local_expert_indices`` (Megatron's own attribute) maps it to the global id.
For fused tensors the expert index is the position along the expert dim of the *global*
tensor (a DTensor sharded on that dim holds rows ``offset .. offset + local - 1``), or,
when the module owning the tensor has ``local_expert_indices`` (a rank holding any subset
of the experts, as Lazarus' replicated expert parallelism does), the id listed for the row;
the module's ``num_experts`` is then the global count.

Parameters that are DTensors (FSDP2, expert parallelism, both) are described by the piece
this rank holds: its global offsets, read from the DTensor's mesh and placements. A unit
whose pieces differ between ranks gets a piece suffix (``expert/L/3#p1a2b3c4d``): ranks
holding the same piece share its saving, ranks holding different pieces each save theirs.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard, Union

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "DEFAULT_EXPERT_PATTERN",
    "LAYOUT_NAMES",
    "ExpertLayout",
    "TensorRef",
    "UnitSpec",
    "UnitLayout",
    "discover_units",
    "expert_unit_name",
    "module_unit_name",
    "unit_base",
    "parse_expert",
    "local_box",
    "fused_row_map",
]

DEFAULT_EXPERT_PATTERN = r"(?P<layer>.+)\.experts\.(?:expert_)?(?P<expert>\d+)\."
LAYOUT_NAMES = ("auto", "per_expert", "megatron", "te_grouped", "hf_fused", "torchtitan", "flattened",
                "parallel_experts", "embedding_experts")

_MEGATRON = r"(?P<layer>.+)\.experts\.local_experts\.(?P<expert>\d+)\."
_TE_GROUPED = r"(?P<layer>.+)\.experts\.linear_fc[12]\.(?:weight|bias)(?P<expert>\d+)$"
_HF_FUSED = r"(?P<layer>.+)\.experts\.(?:gate_up_proj|down_proj|gate_proj|up_proj)(?:_bias)?$"
_TORCHTITAN = r"(?P<layer>.+)\.(?:routed_)?experts(?:\.inner_experts)?\.w(?:1|2|3|13)(?:_[A-Z]+)?$"
_FLATTENED = r"(?P<layer>.+)\.experts\.mlp\.(?:w1|v1|w2)$"
_PARALLEL = r"(?P<layer>.+)\.(?:input_linear|output_linear)\.weight$"
_EMBEDDING = r"(?P<layer>.+)\.(?:down_embed|up_embed)\.weight$"
# Attributes by which a module declares how many (routed, non zero-compute) experts it has.
_COUNT_ATTRS = ("num_routed_experts", "num_experts", "moe_num_experts", "n_routed_experts")

_DESCRIPTIONS = {
    "per_expert": "per-expert modules",
    "megatron_sequential": "Megatron-core SequentialMLP (experts.local_experts.<i>)",
    "te_grouped": "Transformer Engine GroupedMLP (experts.linear_fc1.weight<i>)",
    "hf_fused": "transformers fused experts (experts.gate_up_proj / down_proj [E, ...])",
    "torchtitan": "torchtitan GroupedExperts (experts.w1 / w2 / w3 [E, ...])",
    "flattened": "flattened experts (experts.mlp.w1 / v1 / w2 [E*F, D], DBRX)",
    "parallel_experts": "parallel experts (input_linear / output_linear [E, ...], JetMoE)",
    "embedding_experts": "product-key retrieval experts (down_embed / up_embed rows, Doge)",
    "fused": "fused experts (explicit layout)",
}


@dataclass(frozen=True)
class ExpertLayout:
    """An explicit expert layout for models no built-in layout recognises.

    ``pattern`` is a regex over ``model.state_dict()`` keys with a named group ``layer``.
    Per-expert tensors: the pattern also has a group ``expert`` (global expert id) and
    ``expert_dim`` is None. Fused tensors: no ``expert`` group, and ``expert_dim`` is the
    dimension indexing the experts (0 for every known library). ``num_experts`` (fused
    only) says the expert dim is *flattened*: it holds ``num_experts * n`` rows, expert
    ``e`` the ``n`` consecutive rows from ``e * n`` (DBRX's ``[E * F, D]``).
    """

    pattern: str
    expert_dim: int | None = None
    num_experts: int | None = None

    def __post_init__(self) -> None:
        try:
            groups = set(re.compile(self.pattern).groupindex)
        except (re.error, TypeError) as exc:
            raise ValueError(f"ExpertLayout.pattern is not a valid regex: {exc}") from exc
        if "layer" not in groups:
            raise ValueError("ExpertLayout.pattern must have a named group 'layer'")
        if self.expert_dim is None and "expert" not in groups:
            raise ValueError("ExpertLayout.pattern needs a named group 'expert' (per-expert tensors), "
                             "or pass expert_dim= for fused tensors")
        if self.expert_dim is not None:
            if "expert" in groups:
                raise ValueError("ExpertLayout: a fused layout (expert_dim set) must not have an 'expert' group")
            if isinstance(self.expert_dim, bool) or not isinstance(self.expert_dim, int) or self.expert_dim < 0:
                raise ValueError(f"ExpertLayout.expert_dim must be an integer >= 0 or None, got {self.expert_dim!r}")
        if self.num_experts is not None:
            if self.expert_dim is None:
                raise ValueError("ExpertLayout.num_experts (a flattened expert dim) needs expert_dim=")
            if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 1:
                raise ValueError(f"ExpertLayout.num_experts must be an integer >= 1 or None, got {self.num_experts!r}")


LayoutSpec = Union[str, ExpertLayout]


@dataclass(frozen=True)
class TensorRef:
    """One tensor of a unit: a ``model.state_dict()`` key, and for fused tensors the row
    along ``expert_dim`` of the local tensor holding this expert.

    ``offset``/``global_shape`` place the saved piece in the global tensor (the expert
    dim included, at the expert's index); None for a whole, unsharded tensor. ``span``
    ``(dim, start, length)``: the unit holds that slice of the local tensor (the rows of
    one expert of a flattened tensor, the rows of a fused tensor that are no expert's).
    """

    key: str
    expert_dim: int | None = None
    row: int | None = None
    offset: tuple[int, ...] | None = None
    global_shape: tuple[int, ...] | None = None
    span: tuple[int, int, int] | None = None

    def numel_of(self, t: torch.Tensor) -> int:
        """Elements of the local tensor ``t`` this reference covers."""
        if self.span is not None:
            d, _, n = self.span
            return t.numel() // max(1, t.shape[d]) * n
        if self.expert_dim is not None:
            return t.numel() // max(1, t.shape[self.expert_dim])
        return t.numel()

    def place(self) -> dict[str, Any] | None:
        if self.offset is None:
            return None
        return {"shape": list(self.global_shape or ()), "offset": list(self.offset), "expert_dim": self.expert_dim}


@dataclass
class UnitSpec:
    name: str
    kind: str                      # "expert" | "module"
    keys: list[str]                # model.state_dict() keys in this unit
    layer: str | None = None
    expert: int | None = None
    nbytes: int = 0                # weights only (this rank's piece)
    refs: list[TensorRef] = field(default_factory=list)

    def ref(self, key: str) -> TensorRef:
        for r in self.refs:
            if r.key == key:
                return r
        return TensorRef(key)


@dataclass
class UnitLayout:
    """The units of one model: experts per layer and non-expert modules."""

    units: dict[str, UnitSpec]
    layers: dict[str, list[int]] = field(default_factory=dict)  # layer -> expert ids held here
    kinds: dict[str, str] = field(default_factory=dict)         # layer -> layout kind
    experts_per_layer: dict[str, int] = field(default_factory=dict)  # global E where known
    # layer -> ids its router may select when more than E: ids E .. n-1 are zero-compute experts
    routed_ids: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_expert = {(u.layer, u.expert): u for u in self.units.values() if u.kind == "expert"}

    def expert_unit(self, layer: str, expert: int) -> UnitSpec | None:
        """This rank's unit (or piece of it) for global expert ``expert`` of ``layer``."""
        return self._by_expert.get((layer, expert))

    def experts(self, layer: str) -> list[UnitSpec]:
        return [self._by_expert[(layer, e)] for e in self.layers[layer]]

    def modules(self) -> list[UnitSpec]:
        return [u for u in self.units.values() if u.kind == "module"]

    def describe(self) -> dict[str, Any]:
        """What was found, for the log, the manifest and ``moc inspect``."""
        kinds = sorted(set(self.kinds.values()))
        counts = sorted(set(self.experts_per_layer.values()))
        text = " + ".join(_DESCRIPTIONS.get(k, k) for k in kinds)
        text += f": {len(self.layers)} MoE layers x {'/'.join(map(str, counts))} experts"
        return {"kind": kinds[0] if len(kinds) == 1 else "mixed", "kinds": kinds, "description": text,
                "experts_per_layer": dict(self.experts_per_layer)}


def expert_unit_name(layer: str, expert: int) -> str:
    return f"expert/{layer}/{expert}"


def module_unit_name(module: str) -> str:
    return f"module/{module or '<root>'}"


def unit_base(name: str) -> str:
    """A unit's name without its piece suffix (``expert/L/3#p..`` -> ``expert/L/3``)."""
    return name.split("#", 1)[0]


def parse_expert(name: str) -> tuple[str, int]:
    """``expert/<layer>/<e>[#piece]`` -> (layer, e)."""
    layer, e = unit_base(name)[len("expert/"):].rsplit("/", 1)
    return layer, int(e)


# -- DTensor pieces ------------------------------------------------------------------------
def _dtensor_cls() -> Any:
    """torch's ``DTensor`` class, or None while ``torch.distributed.tensor`` is not
    imported: no tensor can be a DTensor before its module is, and importing it only to
    ask costs 0.5 s of every process's start (sympy and the sharding rules), a worker
    joining a job included."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(t: Any) -> TypeGuard[DTensor]:
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this process holds (a view, no copy)."""
    return t.to_local() if is_dtensor(t) else t


def local_box(key: str, t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(global shape, global offset, local shape) of the piece of ``t`` held here.

    Raises ``ValueError`` naming ``key`` for placements whose local part is not one box
    of the global tensor (``_StridedShard``, ``Partial``) and for other tensor subclasses.
    """
    if is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        from torch.distributed.tensor.placement_types import Replicate, Shard

        for p in t.placements:
            if type(p) not in (Shard, Replicate):
                raise ValueError(f"parameter {key!r}: DTensor placement {p} is not supported by moc "
                                 "(supported: Shard(d), Replicate())")
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = tuple(t.to_local().shape)
        if tuple(shape) != local:
            raise ValueError(f"parameter {key!r}: local shard shape {local} does not match its placements "
                             f"({tuple(shape)} expected)")
        return tuple(t.shape), tuple(int(o) for o in offset), local
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise ValueError(f"parameter {key!r} is a {type(t).__name__}: moc checkpoints plain tensors and DTensors "
                         "(FSDP2 / tensor or expert parallel) only")
    return tuple(t.shape), (0,) * t.dim(), tuple(t.shape)


# -- discovery -----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Rule:
    kind: str
    regex: re.Pattern
    expert_dim: int | None     # None: per-expert tensors (the regex names the expert)
    local_ids: bool = False    # the expert number in the name is local to the EP rank
    declared: bool = False     # only where a module declares exactly that many experts
    flat: bool = False         # the expert dim is flattened: E * n rows, E declared (or `num`)
    num: int | None = None     # E of a flattened explicit layout


def _rules(layout: LayoutSpec, expert_pattern: str) -> list[_Rule]:
    per_expert = _Rule("per_expert", re.compile(expert_pattern), None)
    table = {
        "per_expert": [per_expert],
        "megatron": [_Rule("megatron_sequential", re.compile(_MEGATRON), None, True)],
        "te_grouped": [_Rule("te_grouped", re.compile(_TE_GROUPED), None, True)],
        "hf_fused": [_Rule("hf_fused", re.compile(_HF_FUSED), 0)],
        "torchtitan": [_Rule("torchtitan", re.compile(_TORCHTITAN), 0)],
        "flattened": [_Rule("flattened", re.compile(_FLATTENED), 0, flat=True)],
        "parallel_experts": [_Rule("parallel_experts", re.compile(_PARALLEL), 0, declared=True)],
        "embedding_experts": [_Rule("embedding_experts", re.compile(_EMBEDDING), 0, declared=True)],
    }
    if isinstance(layout, ExpertLayout):
        kind = "per_expert" if layout.expert_dim is None else "fused"
        return [_Rule(kind, re.compile(layout.pattern), layout.expert_dim, flat=layout.num_experts is not None,
                      num=layout.num_experts)]
    if layout == "auto":
        return (table["megatron"] + table["te_grouped"] + [per_expert] + table["hf_fused"] + table["torchtitan"]
                + table["flattened"] + table["parallel_experts"] + table["embedding_experts"])
    if layout not in table:
        raise ValueError(f"expert_layout must be one of {LAYOUT_NAMES} or an ExpertLayout, got {layout!r}")
    return table[layout]


def _declared_count(model: torch.nn.Module, paths: tuple[str, ...]) -> int | None:
    """The number of experts the first of ``paths`` that exists declares (see _COUNT_ATTRS)."""
    for path in paths:
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            continue
        for attr in _COUNT_ATTRS:
            n = getattr(mod, attr, None)
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                return n
    return None


def _local_index_map(model: torch.nn.Module, layer: str) -> list[int] | None:
    """Megatron's ``local_expert_indices`` (global ids of this rank's experts), if any."""
    for path in (f"{layer}.experts", layer):
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            continue
        ids = getattr(mod, "local_expert_indices", None)
        if ids is not None:
            return [int(i) for i in ids]
    return None


def fused_row_map(model: torch.nn.Module, key: str, t: torch.Tensor, dim: int) -> tuple[list[int], int] | None:
    """Global expert ids of the rows of a fused expert tensor that holds a subset of a
    layer's experts (expert parallelism with replicas: any set per rank), or None.

    The module owning the parameter says so the way Megatron-core does for its local
    experts: ``local_expert_indices`` (global id of each row along ``dim``) and
    ``num_experts`` (the layer's global count E). :class:`lazarus.moe.GroupedExperts` sets
    both. The checkpoint then records each row as ``[E, ...]`` at its global index.
    """
    owner_path = key.rsplit(".", 1)[0] if "." in key else ""
    try:
        owner = model.get_submodule(owner_path)
    except AttributeError:
        return None
    ids = getattr(owner, "local_expert_indices", None)
    if ids is None:
        return None
    ids = [int(i) for i in ids]
    num = getattr(owner, "num_experts", None)
    num = int(num) if num is not None else (max(ids) + 1 if ids else 0)
    if is_dtensor(t):
        raise ValueError(f"{key!r}: a DTensor fused expert tensor cannot also have local_expert_indices")
    if len(ids) != t.shape[dim]:
        raise ValueError(f"{key!r}: {t.shape[dim]} expert rows along dim {dim} but "
                         f"{owner_path}.local_expert_indices has {len(ids)} entries")
    if len(set(ids)) != len(ids) or any(not 0 <= i < num for i in ids):
        raise ValueError(f"{key!r}: local_expert_indices {ids} must be distinct ids in [0, num_experts = {num})")
    return ids, num


def _piece_suffix(refs: list[TensorRef], full: dict[str, bool]) -> str:
    if all(full[r.key] for r in refs):
        return ""
    desc = json.dumps([[r.key, list(r.offset or ()), list(r.global_shape or ())] for r in refs])
    return "#p" + hashlib.sha1(desc.encode()).hexdigest()[:8]


def _expert_like_modules(model: torch.nn.Module) -> list[str]:
    """``name (Class)`` of the modules a reader would call experts (named ``*experts``,
    or with a ``num_experts`` attribute), outermost first: what a refusal names."""
    out: list[str] = []
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if name and (leaf.endswith("experts") or isinstance(getattr(mod, "num_experts", None), int)):
            if not any(name.startswith(o + ".") for o in out):
                out.append(name)
    return [f"{n} ({type(model.get_submodule(n)).__name__})" for n in out]


def discover_units(model: torch.nn.Module, expert_pattern: str | None = None, *,
                   layout: LayoutSpec = "auto") -> UnitLayout:
    """Split ``model.state_dict()`` into expert units (global expert ids) and module units.

    ``layout``: ``"auto"`` tries every built-in layout (see the module docstring),
    a name picks one, an :class:`ExpertLayout` describes anything else. Raises
    ``ValueError`` when nothing matches, naming the layouts tried and some parameter names,
    and for tensors moc cannot checkpoint (other tensor subclasses, strided shards).
    """
    pattern = expert_pattern or DEFAULT_EXPERT_PATTERN
    if not isinstance(layout, ExpertLayout):
        try:
            groups = set(re.compile(pattern).groupindex)
        except re.error as exc:
            raise ValueError(f"expert_pattern {pattern!r} is not a valid regex: {exc}") from exc
        if not {"layer", "expert"} <= groups:
            raise ValueError(f"expert_pattern {pattern!r} must have named groups 'layer' and 'expert'")
    rules = _rules(layout, pattern)
    state = model.state_dict(keep_vars=True)
    boxes = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            boxes[key] = local_box(key, value)

    # expert (layer, e) -> refs ; module -> keys
    expert_refs: dict[tuple[str, int], list[TensorRef]] = {}
    kinds: dict[str, str] = {}
    fused_e: dict[str, dict[str, int]] = {}
    module_keys: dict[str, list[str]] = {}
    local_maps: dict[str, list[int] | None] = {}
    full: dict[str, bool] = {}
    extra_refs: dict[str, TensorRef] = {}   # fused rows that are no expert's: saved with their module
    routed: dict[str, int] = {}             # layer -> ids its router selects, zero-compute ones included
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            module_keys.setdefault(key.rsplit(".", 1)[0] if "." in key else "", []).append(key)
            continue
        gshape, goff, lshape = boxes[key]
        matched = None
        for rule in rules:
            m = rule.regex.match(key)
            if m and (rule.expert_dim is None or value.dim() > rule.expert_dim):
                if rule.declared and rule.expert_dim is not None and \
                        _declared_count(model, (key.rsplit(".", 1)[0], m.group("layer"))) != gshape[rule.expert_dim]:
                    continue     # a module that does not say it holds that many experts
                matched = (rule, m)
                break
        if matched is None:
            full[key] = gshape == lshape
            module_keys.setdefault(key.rsplit(".", 1)[0] if "." in key else "", []).append(key)
            continue
        rule, m = matched
        layer = m.group("layer")
        if kinds.setdefault(layer, rule.kind) != rule.kind:
            raise ValueError(f"MoE layer {layer!r} mixes expert layouts {kinds[layer]!r} and {rule.kind!r} "
                             f"(parameter {key!r}); pass expert_layout= explicitly")
        if rule.expert_dim is None:
            e = int(m.group("expert"))
            if rule.local_ids:
                if layer not in local_maps:
                    local_maps[layer] = _local_index_map(model, layer)
                ids = local_maps[layer]
                if ids is not None:
                    if e >= len(ids):
                        raise ValueError(f"{key!r}: local expert {e} but {layer}.local_expert_indices has {len(ids)}")
                    e = ids[e]
            full[key] = gshape == lshape
            off = None if full[key] else goff
            expert_refs.setdefault((layer, e), []).append(
                TensorRef(key, None, None, off, None if full[key] else gshape))
            continue
        d = rule.expert_dim
        rows = fused_row_map(model, key, value, d)
        if rows is not None:    # a subset of the experts, row i = global expert rows[0][i]
            ids, num = rows
            gshape = tuple(num if i == d else n for i, n in enumerate(gshape))
        num = gshape[d]
        owner = key.rsplit(".", 1)[0] if "." in key else ""
        per = 0          # rows per expert of a flattened tensor
        if rule.flat:
            declared = rule.num or _declared_count(model, (f"{layer}.experts", owner, layer))
            if declared is None or num % declared:
                raise ValueError(f"{key!r}: a flattened expert tensor ({num} rows along dim {d}) needs the number "
                                 f"of experts dividing it: {layer}.experts declares {declared} (num_experts); pass "
                                 "ExpertLayout(pattern, expert_dim, num_experts=E)")
            if is_dtensor(value) or rows is not None:
                raise ValueError(f"{key!r}: a flattened expert tensor must be a whole, unsharded tensor")
            per, num = num // declared, declared
        elif rows is None and not is_dtensor(value):
            declared = _declared_count(model, (owner,))
            if declared is not None and declared < num:     # rows beyond E: no expert's (zero-compute)
                start = tuple(declared if i == d else 0 for i in range(len(gshape)))
                extra_refs[key] = TensorRef(key, None, None, start, gshape, (d, declared, num - declared))
                module_keys.setdefault(owner, []).append(key)
                routed[layer] = max(routed.get(layer, 0), num)
                num = declared
        if fused_e.setdefault(layer, {}).setdefault("E", num) != num:
            raise ValueError(f"MoE layer {layer!r}: fused expert tensors disagree on the number of experts "
                             f"({fused_e[layer]['E']} vs {num} in {key!r}, dim {d})")
        rest_full = all(lshape[i] == gshape[i] for i in range(len(gshape)) if i != d)
        full[key] = rest_full
        if per:
            for e in range(num):
                off = tuple(e * per if i == d else 0 for i in range(len(gshape)))
                ref = TensorRef(key, None, None, off, gshape, (d, e * per, per))
                expert_refs.setdefault((layer, e), []).append(ref)
            continue
        for row in range(min(lshape[d], num) if rows is None and goff[d] == 0 else lshape[d]):
            e = goff[d] + row if rows is None else rows[0][row]
            off = tuple(e if i == d else goff[i] for i in range(len(gshape)))
            expert_refs.setdefault((layer, e), []).append(TensorRef(key, d, row, off, gshape))

    if not expert_refs:
        sample = ", ".join(list(state)[:4])
        tried = ", ".join(r.kind for r in rules)
        which = layout if isinstance(layout, str) else "ExpertLayout"
        suspects = _expert_like_modules(model)
        where = (f"; modules that look like experts but hold none of them: {', '.join(suspects[:3])}"
                 if suspects else "")
        raise ValueError(
            f"expert_layout {which!r}: the layouts tried ({tried}) matched no parameter of the model "
            f"(names look like: {sample}){where}; pass MoCConfig(expert_layout=ExpertLayout(pattern, expert_dim)) "
            "for fused tensors, or expert_pattern= with groups 'layer' and 'expert' for per-expert modules"
        )

    units: dict[str, UnitSpec] = {}
    layers: dict[str, set[int]] = {}
    for (layer, e), refs in expert_refs.items():
        name = expert_unit_name(layer, e) + _piece_suffix(refs, full)
        keys = list(dict.fromkeys(r.key for r in refs))
        nbytes = 0
        for r in refs:
            t = local_tensor(state[r.key])
            nbytes += r.numel_of(t) * t.element_size()
        units[name] = UnitSpec(name, "expert", keys, layer, e, nbytes, refs)
        layers.setdefault(layer, set()).add(e)
    for module, keys in module_keys.items():
        refs = []
        nbytes = 0
        for k in keys:
            v = state[k]
            if k in extra_refs:
                refs.append(extra_refs[k])
                nbytes += extra_refs[k].numel_of(v) * v.element_size()
            elif isinstance(v, torch.Tensor):
                gshape, goff, lshape = boxes[k]
                refs.append(TensorRef(k) if gshape == lshape else TensorRef(k, None, None, goff, gshape))
                nbytes += local_tensor(v).numel() * v.element_size()
            else:
                refs.append(TensorRef(k))
        name = module_unit_name(module) + _piece_suffix([r for r in refs if r.key in full], full)
        units[name] = UnitSpec(name, "module", list(keys), nbytes=nbytes, refs=refs)

    per_layer: dict[str, int] = {}
    for layer in layers:
        if layer in fused_e:
            per_layer[layer] = fused_e[layer]["E"]
        else:
            ids = local_maps.get(layer)
            per_layer[layer] = max(layers[layer]) + 1
            if ids is not None:
                per_layer[layer] = max(per_layer[layer], max(ids) + 1)
    return UnitLayout(units, {k: sorted(v) for k, v in sorted(layers.items())},
                      {k: kinds[k] for k in sorted(layers)}, dict(sorted(per_layer.items())),
                      {k: n for k, n in sorted(routed.items()) if n > per_layer.get(k, n)})
