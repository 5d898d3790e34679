"""Per-unit serialisation plans, reused from one checkpoint to the next while the unit's
tensors stay the same.

A unit's :class:`~moc._store.codec.TreePlan` (skeleton, tensor table, byte layout, views of the
live tensors it copies from) depends only on which tensors the unit reads (weights,
buffers, optimizer state), their memory, shapes and dtypes, and the non-tensor values of
its tree. Capturing a unit (state-dict views, DTensor local shards, Adam state) and laying
it out costs 0.1-0.5 ms, so re-planning every unit at every checkpoint was the largest
synchronous cost of ``step()`` under FSDP2.

:class:`UnitPlans` keeps one plan per unit with the *signature* of every state-dict entry
it was planned from: for a tensor (the local shard of a DTensor) its data pointer, shape,
stride, dtype and device (and a DTensor's placements); for a parameter also the same of
each optimizer-state tensor, and non-tensor state by value. At each checkpoint the
signatures of all entries are recomputed (microseconds per entry) and only units with a
changed entry are planned again: the optimizer state created by the first
``optimizer.step()``, ``optimizer.load_state_dict`` or a restore replacing state tensors,
``load_state_dict(assign=True)`` or ``.to()`` replacing parameters, an optimizer whose
scalar state (a Python ``int`` step) changes. Values of other types (a module's extra
state object) make their units uncacheable: planned at every checkpoint, as before.

A cached plan holds views of the tensors it was planned from, so their memory stays
allocated while it is cached and no other tensor can appear at the same address: an
unchanged data pointer means the same memory.

The layout (which rows and shards a unit covers) was found once, when the manager was
built. A DTensor whose shard changed (resharded onto another mesh or placement) or a fused
expert tensor whose rows changed (experts moved) no longer matches it; that raises
``ValueError`` naming the parameter instead of saving bytes at the wrong offsets (build a
new manager, with ``handover=``, after such a change).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .._store import TreePlan, plan_tree
from .capture import capture_unit
from .layouts import UnitLayout, UnitSpec, _dtensor_cls, fused_row_map, local_box

__all__ = ["UnitPlans"]

_SCALARS = (int, float, bool, str, type(None))


class _Uncacheable:
    """A signature equal to nothing, itself included: the unit is planned every time."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return False

    def __hash__(self) -> int:
        return id(self)


def _tensor_sig(t: torch.Tensor) -> tuple:
    dtensor = _dtensor_cls()
    if dtensor is not None and isinstance(t, dtensor):
        # ``to_local()`` is an autograd op (~50 us per call); the attribute is what it returns.
        loc = t._local_tensor
        return (loc.data_ptr(), loc.shape, loc.stride(), loc.dtype, loc.device, t.placements, t.shape)
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _value_sig(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        try:
            return _tensor_sig(v)
        except RuntimeError:    # no data pointer (sparse, ...): plan_tree decides what happens
            return _Uncacheable()
    if isinstance(v, _SCALARS):
        return (type(v), v)
    return _Uncacheable()


def _state_sig(st: Mapping[str, Any] | None) -> Any:
    if not st:
        return None
    return tuple((name, _value_sig(v)) for name, v in st.items())


class UnitPlans:
    """The plans of one rank's units (see the module docstring).

    Args:
        model: the (local part of the) model.
        optimizer: its optimizer (state is part of the units), or None.
        layout: the units found in ``model`` (built from the model as it is now).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, layout: UnitLayout) -> None:
        self.model = model
        self.optimizer = optimizer
        self.layout = layout
        self.replanned = 0            # unit plans computed so far (status, tests)
        self.params: dict[str, torch.nn.Parameter] = {}   # named parameters at the newest refresh
        self._plans: dict[str, TreePlan] = {}
        self._sigs: dict[str, Any] = {}
        self._units_of: dict[str, list[str]] = {}
        for spec in layout.units.values():
            for k in spec.keys:
                self._units_of.setdefault(k, []).append(spec.name)
        # Where each placed tensor's local piece sits, as the layout saw it.
        state = model.state_dict(keep_vars=True)
        self._geometry: dict[str, Any] = {}
        for spec in layout.units.values():
            for ref in spec.refs:
                if (ref.offset is not None or ref.expert_dim is not None) and ref.key not in self._geometry:
                    self._geometry[ref.key] = self._geometry_of(ref.key, state[ref.key], ref.expert_dim)

    def _geometry_of(self, key: str, t: torch.Tensor, expert_dim: int | None) -> tuple:
        rows = fused_row_map(self.model, key, t, expert_dim) if expert_dim is not None else None
        return (local_box(key, t), None if rows is None else (tuple(rows[0]), rows[1]))

    def invalidate(self) -> None:
        """Forget every plan (after a restore rewrote the model and optimizer state)."""
        self._plans.clear()
        self._sigs.clear()

    def refresh(self) -> dict[str, TreePlan]:
        """Every unit's plan, valid for the tensors the model and optimizer hold now."""
        model, optimizer = self.model, self.optimizer
        state = model.state_dict(keep_vars=True)
        params = self.params = dict(model.named_parameters())
        opt_state = optimizer.state if optimizer is not None else None
        dirty = {name for name in self.layout.units if name not in self._plans}
        sigs: dict[str, Any] = {}
        for key, units in self._units_of.items():
            v = state.get(key)
            p = params.get(key)
            sig = (_value_sig(v), _state_sig(opt_state.get(p)) if opt_state is not None and p is not None else None)
            old = self._sigs.get(key)
            if sig != old:
                if key in self._geometry and isinstance(v, torch.Tensor) and (old is None or not sig[0] == old[0]):
                    self._check_geometry(key, v)
                dirty.update(units)
            sigs[key] = sig
        for name in sorted(dirty):
            spec = self.layout.units[name]
            self._plans[name] = plan_tree(capture_unit(spec, model, optimizer, state=state, params=params))
            self.replanned += 1
        self._sigs = sigs
        return self._plans

    def _check_geometry(self, key: str, t: torch.Tensor) -> None:
        expert_dim = next((r.expert_dim for u in self._units_of[key] for r in self.layout.units[u].refs
                           if r.key == key and r.expert_dim is not None), None)
        now = self._geometry_of(key, t, expert_dim)
        if now != self._geometry[key]:
            raise ValueError(
                f"parameter {key!r}: its local piece changed since the CheckpointManager was built "
                f"(shard / expert rows {self._geometry[key]} -> {now}); the manager's unit layout no longer "
                "matches the model: build a new CheckpointManager (pass handover=) after resharding or moving "
                "experts")

    def plan_of(self, spec: UnitSpec) -> TreePlan:
        """The plan of ``spec`` from the newest :meth:`refresh`."""
        return self._plans[spec.name]
