"""Units: what moc saves and restores, found from a model and its optimizer.

* one unit per expert of each MoE layer (parameters matched by ``expert_pattern``, with
  named groups ``layer`` and ``expert``) holding its weights and optimizer state;
* one unit per non-expert module (the entries of ``model.state_dict()`` grouped by the
  module that owns them) with its weights, buffers and optimizer state;
* one ``extra`` unit: step, RNG states, optimizer hyper-parameters, user objects.

Optimizer state is keyed by parameter *name*, never by position, so a checkpoint restores
onto a model whose expert layout or world size differs.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np
import torch

__all__ = [
    "DEFAULT_EXPERT_PATTERN",
    "UnitSpec",
    "UnitLayout",
    "discover_units",
    "capture_rng",
    "restore_rng",
]

DEFAULT_EXPERT_PATTERN = r"(?P<layer>.+)\.experts\.(?P<expert>\d+)\."


@dataclass
class UnitSpec:
    name: str
    kind: str                      # "expert" | "module"
    keys: list[str]                # model.state_dict() keys in this unit
    layer: str | None = None
    expert: int | None = None
    nbytes: int = 0                # weights only


@dataclass
class UnitLayout:
    """The units of one model: experts per layer and non-expert modules."""

    units: dict[str, UnitSpec]
    layers: dict[str, list[int]] = field(default_factory=dict)  # layer -> expert ids

    def experts(self, layer: str) -> list[UnitSpec]:
        return [self.units[expert_unit_name(layer, e)] for e in self.layers[layer]]

    def modules(self) -> list[UnitSpec]:
        return [u for u in self.units.values() if u.kind == "module"]


def expert_unit_name(layer: str, expert: int) -> str:
    return f"expert/{layer}/{expert}"


def module_unit_name(module: str) -> str:
    return f"module/{module or '<root>'}"


def discover_units(model: torch.nn.Module, expert_pattern: str = DEFAULT_EXPERT_PATTERN) -> UnitLayout:
    """Split ``model.state_dict()`` into expert and module units.

    Raises ``ValueError`` when the pattern lacks the ``layer``/``expert`` groups or matches
    no parameter of the model.
    """
    try:
        regex = re.compile(expert_pattern)
    except re.error as exc:
        raise ValueError(f"expert_pattern {expert_pattern!r} is not a valid regex: {exc}") from exc
    if not {"layer", "expert"} <= set(regex.groupindex):
        raise ValueError(f"expert_pattern {expert_pattern!r} must have named groups 'layer' and 'expert'")
    state = model.state_dict(keep_vars=True)
    units: dict[str, UnitSpec] = {}
    layers: dict[str, set[int]] = {}
    for key, value in state.items():
        m = regex.match(key)
        nbytes = value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
        if m:
            layer, expert = m.group("layer"), int(m.group("expert"))
            name = expert_unit_name(layer, expert)
            spec = units.setdefault(name, UnitSpec(name, "expert", [], layer, expert))
            layers.setdefault(layer, set()).add(expert)
        else:
            module = key.rsplit(".", 1)[0] if "." in key else ""
            name = module_unit_name(module)
            spec = units.setdefault(name, UnitSpec(name, "module", []))
        spec.keys.append(key)
        spec.nbytes += nbytes
    if not layers:
        sample = ", ".join(list(state)[:3])
        raise ValueError(
            f"expert_pattern {expert_pattern!r} matched no parameter of the model "
            f"(names look like: {sample}); pass expert_pattern= with groups 'layer' and 'expert'"
        )
    return UnitLayout(units, {k: sorted(v) for k, v in layers.items()})


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def capture_unit(spec: UnitSpec, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 *, state: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The unit's state tree: ``{"model": {key: tensor}, "optimizer": {param: {..}}}``.

    Tensors are the live ones (no copy); callers snapshot them before the next update.
    """
    state = model.state_dict(keep_vars=True) if state is None else state
    tree: dict[str, Any] = {"model": {k: state[k].detach() for k in spec.keys}}
    if optimizer is not None:
        by_name = {name: p for name, p in model.named_parameters()}
        opt_state = {}
        for k in spec.keys:
            p = by_name.get(k)
            if p is not None and p in optimizer.state and optimizer.state[p]:
                opt_state[k] = dict(optimizer.state[p])
        if opt_state:
            tree["optimizer"] = {"state": opt_state}
    return tree


def optimizer_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Hyper-parameters of each param group, with parameters named instead of numbered."""
    names = _param_names(model)
    groups = []
    for g in optimizer.param_groups:
        entry = {k: v for k, v in g.items() if k != "params"}
        entry["params"] = [names[id(p)] for p in g["params"] if id(p) in names]
        groups.append(entry)
    return groups


def capture_rng() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
    }


def restore_rng(rng: Mapping[str, Any]) -> None:
    # A fresh tensor: the generator reads the state from the start of the storage, so a
    # view at an offset (decoded from a shared buffer) would be misread.
    torch.set_rng_state(rng["torch"].clone())
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    n = rng["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))


def _copy_model(current: Mapping[str, torch.Tensor], tree: Mapping[str, Any]) -> list[str]:
    """Copy a unit tree's tensors into the model's (in place); return the keys copied."""
    keys = []
    for key, value in tree.get("model", {}).items():
        if key not in current:
            raise KeyError(f"checkpoint has {key!r}, which the model does not")
        target = current[key]
        if tuple(target.shape) != tuple(value.shape):
            raise ValueError(f"{key}: checkpoint shape {tuple(value.shape)} != model shape {tuple(target.shape)}")
        target.copy_(value)
        keys.append(key)
    return keys


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
    if (isinstance(live, torch.Tensor) and live.shape == value.shape and live.dtype == value.dtype
            and live.device == value.device and live.data_ptr() != value.data_ptr()):
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


def apply_partial(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  trees: Iterable[Mapping[str, Any]]) -> None:
    """Copy some units into the model and set their parameters' optimizer state, leaving
    every other parameter and its optimizer state as it is."""
    current = model.state_dict(keep_vars=True)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for tree in trees:
            _copy_model(current, tree)
            if optimizer is None:
                continue
            for key in tree.get("model", {}):
                p = params.get(key)
                if p is not None:
                    optimizer.state.pop(p, None)
            for key, st in tree.get("optimizer", {}).get("state", {}).items():
                p = params.get(key)
                if p is not None:
                    optimizer.state[p] = {k: (v.detach().clone().to(p.device) if isinstance(v, torch.Tensor) and v.dim() > 0
                                              else (v.detach().clone() if isinstance(v, torch.Tensor) else v))
                                          for k, v in st.items()}


def apply_units(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                trees: Iterable[Mapping[str, Any]], groups: list[dict[str, Any]] | None) -> list[str]:
    """Copy unit trees into the model (in place) and the optimizer; return missing keys."""
    current = model.state_dict(keep_vars=True)
    seen: set[str] = set()
    opt_by_name: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for tree in trees:
            seen.update(_copy_model(current, tree))
            opt_by_name.update(tree.get("optimizer", {}).get("state", {}))
    if optimizer is not None and groups is not None:
        names = _param_names(model)
        index: dict[str, int] = {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                index[names[id(p)]] = len(index)
        sd_groups = []
        for g_live, g_saved in zip(optimizer.param_groups, groups):
            entry = {k: v for k, v in g_saved.items() if k != "params"}
            entry["params"] = [index[names[id(p)]] for p in g_live["params"]]
            sd_groups.append(entry)
        if len(sd_groups) != len(optimizer.param_groups):
            raise ValueError(f"checkpoint has {len(groups)} optimizer param groups, the optimizer {len(optimizer.param_groups)}")
        state = {index[n]: s for n, s in opt_by_name.items() if n in index}
        optimizer.load_state_dict({"state": state, "param_groups": sd_groups})
    return sorted(set(current) - seen)
