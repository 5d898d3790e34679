"""The model-owned half of an MoE layer: this rank's experts and their computation.

Lazarus decides which experts a rank holds (the placement) and which rows each one
processes (the dispatcher); the model decides what an expert computes. A
:class:`LocalExperts` module holds the experts of THIS rank only, one copy per distinct
expert (a rank holding two replicas of an expert holds one copy and receives the larger
share), and exposes:

* ``expert_ids``: sorted global ids held here;
* ``run(x, counts)``: rows of ``x`` arrive grouped by expert in ``expert_ids`` order,
  ``counts[i]`` rows for ``expert_ids[i]``; returns one output row per input row;
* flat views of one expert's weights / gradient (replica sync, migration) and
  ``reassign(ids, flats)`` for a new placement.

Two layouts:

* :class:`MLPExperts`: one module per expert, keyed by global id (parameters
  ``experts.<e>.w1.weight``, moc's default expert pattern); run as a loop;
* :class:`GroupedExperts`: each weight fused over this rank's experts as one
  ``[local_experts, ...]`` tensor (the transformers 5.x layout ``experts.gate_up_proj``),
  run with one grouped matmul per projection where torch has a kernel. Row ``i`` is global
  expert ``expert_ids[i]``; ``local_expert_indices`` says so to moc, and ``num_experts``
  gives the global count, so a checkpoint records ``[E, ...]`` tensors whatever the
  placement.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import copy
import math
from typing import Mapping, Sequence

import torch
from torch import nn

from ._config import MoEConfig
from ._expert import Expert

__all__ = ["GroupedExperts", "LocalExperts", "MLPExperts"]


class LocalExperts(nn.Module, ABC):
    """Interface of the experts of one MoE layer on one rank (see the module docstring).

    Attributes:
        num_experts: global number of experts E of the layer.
        fused: True when the weights are fused tensors: changing the set of held experts
            then replaces the parameters (new tensors), so optimizer state must be carried
            over by the caller (:class:`lazarus.runtime.ElasticTrainer` does, through moc units).
    """

    fused = False

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be an integer >= 1, got {num_experts!r}")
        self.num_experts = num_experts

    # -- to implement -----------------------------------------------------------------------
    @property
    @abstractmethod
    def expert_ids(self) -> list[int]:
        ...

    @abstractmethod
    def run(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        ...

    @abstractmethod
    def expert_tensors(self, e: int) -> list[torch.Tensor]:
        """Expert ``e``'s parameters (or views of its rows), in a fixed order."""

    @abstractmethod
    def expert_grads(self, e: int) -> list[torch.Tensor | None]:
        """Gradients matching :meth:`expert_tensors` (None where no gradient exists)."""

    @abstractmethod
    def set_expert_grads(self, e: int, grads: Sequence[torch.Tensor]) -> None:
        ...

    @abstractmethod
    def reassign(self, ids: Sequence[int], flats: Mapping[int, torch.Tensor]) -> None:
        """Hold exactly ``ids`` from now on: kept experts keep their values, experts in
        ``flats`` (every added one) take the flat vector given."""
        ...

    @abstractmethod
    def initial_flat(self, e: int) -> torch.Tensor:
        """The flat initial state of expert ``e`` (a placeholder to be restored over)."""

    @abstractmethod
    def state_to_flat(self, e: int, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Expert ``e``'s state dict (names relative to the expert) as a flat vector."""
        ...

    @abstractmethod
    def flat_to_state(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`state_to_flat`."""
        ...

    # -- derived ----------------------------------------------------------------------------
    def expert_shapes(self) -> list[torch.Size]:
        ids = self.expert_ids
        if ids:
            return [t.shape for t in self.expert_tensors(ids[0])]
        return self._shapes_without_experts()

    @abstractmethod
    def _shapes_without_experts(self) -> list[torch.Size]:
        ...

    @property
    def expert_numel(self) -> int:
        return sum(math.prod(s) for s in self.expert_shapes())

    def flat_state(self, e: int) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in self.expert_tensors(e)])

    def flat_grad(self, e: int) -> torch.Tensor:
        tensors = self.expert_tensors(e)
        return torch.cat([(g if g is not None else torch.zeros_like(t)).reshape(-1)
                          for t, g in zip(tensors, self.expert_grads(e))])

    def set_flat_grad(self, e: int, flat: torch.Tensor) -> None:
        out, offset = [], 0
        for shape in self.expert_shapes():
            n = math.prod(shape)
            out.append(flat[offset: offset + n].view(shape))
            offset += n
        self.set_expert_grads(e, out)

    def expert_parameters(self) -> list[nn.Parameter]:
        return list(self.parameters())


def _uninitialised_expert(template: Expert, *, device: torch.device | None, dtype: torch.dtype | None) -> Expert:
    """A copy of ``template`` (an :class:`Expert` on the meta device) whose parameters are
    allocated, not initialised: each parameter replaced by an empty one. A copy, not a new
    ``Expert``: building one runs ``nn.Linear``'s initialisation even on the meta device
    (torch's Python decompositions, 0.4 ms an expert); ``Module.to_empty`` would do the
    same, but its first call imports torch's symbolic shapes (0.25 s of a quiet core)."""
    expert = copy.deepcopy(template)
    for module in expert.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(
                torch.empty(p.shape, device=device, dtype=dtype if dtype is not None else p.dtype),
                requires_grad=p.requires_grad))
    return expert


class MLPExperts(LocalExperts, nn.ModuleDict):
    """Per-expert :class:`~lazarus.moe.Expert` modules keyed by global id (``experts.<e>.``);
    an expert's initial weights depend only on ``(config.seed, e)``."""

    def __init__(self, config: MoEConfig, ids: Sequence[int]) -> None:
        LocalExperts.__init__(self, config.num_experts)
        self.config = config
        with torch.device("meta"):
            # the shape of every expert, kept out of the module tree (a plain list): built
            # now, not when a reconfiguration adds experts to this rank
            self._template: list[Expert] = [Expert(config)]
        self._layout = [(n, p.shape) for n, p in self._template[0].named_parameters()]
        for e in sorted(set(ids)):
            self[str(e)] = Expert(config, e)

    def param_layout(self) -> list[tuple[str, torch.Size]]:
        """``(name, shape)`` of an expert's parameters in parameter order, from an expert
        built on the meta device (no memory, no values)."""
        return self._layout

    @property
    def expert_ids(self) -> list[int]:
        return sorted(int(k) for k in self.keys())

    def run(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        outs, start = [], 0
        for e, n in zip(self.expert_ids, counts):
            if n:
                outs.append(self[str(e)](x[start: start + n]))
            start += n
        if not outs:
            return x.new_zeros((0, self.config.d_model)) + 0 * x.sum()
        return torch.cat(outs)

    def expert_tensors(self, e: int) -> list[torch.Tensor]:
        return list(self[str(e)].parameters())

    def expert_grads(self, e: int) -> list[torch.Tensor | None]:
        return [p.grad for p in self[str(e)].parameters()]

    def set_expert_grads(self, e: int, grads: Sequence[torch.Tensor]) -> None:
        for p, g in zip(self[str(e)].parameters(), grads):
            p.grad = g.clone()

    def _shapes_without_experts(self) -> list[torch.Size]:
        return [shape for _, shape in self.param_layout()]

    def reassign(self, ids: Sequence[int], flats: Mapping[int, torch.Tensor]) -> None:
        mine = sorted(set(ids))
        ref = next(iter(self.parameters()), None)
        for key in [k for k in self.keys() if int(k) not in mine]:
            del self[key]
        for e in mine:
            if str(e) in self:
                continue
            if e in flats:
                # Its state is given: allocated, never initialised (an initialisation thrown
                # away is 2 random fills of each weight, seconds for a large expert on a CPU).
                expert = _uninitialised_expert(self._template[0], device=ref.device if ref is not None else None,
                                               dtype=ref.dtype if ref is not None else None)
                torch.nn.utils.vector_to_parameters(flats[e].to(expert.w1.weight), expert.parameters())
            else:
                expert = Expert(self.config, e)
                if ref is not None:
                    expert = expert.to(device=ref.device, dtype=ref.dtype)
            self[str(e)] = expert

    def initial_flat(self, e: int) -> torch.Tensor:
        """Zeros, as for fused experts: a placeholder is always restored over (from a peer
        or a checkpoint), so drawing expert ``e``'s seeded initial weights would be wasted."""
        ref = next(iter(self.parameters()), None)
        return torch.zeros(self.expert_numel, dtype=ref.dtype if ref is not None else torch.get_default_dtype(),
                           device=ref.device if ref is not None else None)

    def state_to_flat(self, e: int, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        layout = self.param_layout()
        if set(state) != {n for n, _ in layout}:
            raise ValueError(f"expert state must have exactly the keys {[n for n, _ in layout]}, got {sorted(state)}")
        for n, shape in layout:
            if tuple(state[n].shape) != tuple(shape):
                raise ValueError(f"expert state {n!r} must have shape {tuple(shape)}, got {tuple(state[n].shape)}")
        return torch.cat([state[n].detach().reshape(-1) for n, _ in layout])

    def flat_to_state(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for n, shape in self.param_layout():
            size = math.prod(shape)
            out[n] = flat[offset: offset + size].view(shape)
            offset += size
        return out


class GroupedExperts(LocalExperts):
    """Experts whose weights are fused ``[local_experts, ...]`` tensors.

    Args:
        num_experts: global E.
        ids: global ids of the rows, in row order (sorted, distinct).
        tensors: parameter name -> ``[len(ids), ...]`` tensor (copied into new parameters),
            registered in the order given.

    Subclasses implement :meth:`run` (see :func:`lazarus.moe.grouped_mm`).
    """

    fused = True

    def __init__(self, num_experts: int, ids: Sequence[int], tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__(num_experts)
        ids = [int(e) for e in ids]
        if ids != sorted(set(ids)) or any(not 0 <= e < num_experts for e in ids):
            raise ValueError(f"ids must be sorted distinct expert ids in [0, {num_experts}), got {ids}")
        if not tensors:
            raise ValueError("tensors must name at least one fused expert parameter")
        self._ids = ids
        self._names = list(tensors)
        self._row_shapes = {}
        for name, t in tensors.items():
            if t.dim() < 1 or t.shape[0] != len(ids):
                raise ValueError(f"tensors[{name!r}] must have {len(ids)} rows (one per expert id), "
                                 f"got shape {tuple(t.shape)}")
            self._row_shapes[name] = t.shape[1:]
            self.register_parameter(name, nn.Parameter(t.detach().clone().contiguous()))

    @property
    def expert_ids(self) -> list[int]:
        return list(self._ids)

    @property
    def local_expert_indices(self) -> list[int]:
        """Global expert id of each row (the attribute moc reads to map rows to experts)."""
        return list(self._ids)

    @property
    def param_names(self) -> list[str]:
        return list(self._names)

    def row(self, e: int) -> int:
        try:
            return self._ids.index(e)
        except ValueError:
            raise KeyError(f"expert {e} is not held here (held: {self._ids})") from None

    def expert_tensors(self, e: int) -> list[torch.Tensor]:
        r = self.row(e)
        return [getattr(self, n)[r] for n in self._names]

    def expert_grads(self, e: int) -> list[torch.Tensor | None]:
        r = self.row(e)
        grads = [getattr(self, n).grad for n in self._names]
        return [g[r] if g is not None else None for g in grads]

    def set_expert_grads(self, e: int, grads: Sequence[torch.Tensor]) -> None:
        r = self.row(e)
        for n, g in zip(self._names, grads):
            p = getattr(self, n)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad[r].copy_(g)

    def _shapes_without_experts(self) -> list[torch.Size]:
        return [self._row_shapes[n] for n in self._names]

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for n in self._names:
            shape = self._row_shapes[n]
            k = math.prod(shape)
            out[n] = flat[offset: offset + k].view(shape)
            offset += k
        return out

    def reassign(self, ids: Sequence[int], flats: Mapping[int, torch.Tensor]) -> None:
        new = sorted(set(int(e) for e in ids))
        if new == self._ids:
            return
        missing = [e for e in new if e not in self._ids and e not in flats]
        if missing:
            raise ValueError(f"reassign: no state for experts {missing} newly held here")
        for n in self._names:
            old = getattr(self, n)
            rows = []
            for e in new:
                if e in self._ids:
                    rows.append(old.detach()[self._ids.index(e)])
                else:
                    rows.append(self.unflatten(flats[e].to(device=old.device, dtype=old.dtype))[n])
            data = torch.stack(rows) if rows else old.detach().new_empty((0,) + tuple(self._row_shapes[n]))
            setattr(self, n, nn.Parameter(data.contiguous(), requires_grad=old.requires_grad))
        self._ids = new

    def initial_flat(self, e: int) -> torch.Tensor:
        p = getattr(self, self._names[0])
        return torch.zeros(self.expert_numel, dtype=p.dtype, device=p.device)

    def state_to_flat(self, e: int, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if set(state) != set(self._names):
            raise ValueError(f"expert state must have exactly the keys {self._names}, got {sorted(state)}")
        for n in self._names:
            if tuple(state[n].shape) != tuple(self._row_shapes[n]):
                raise ValueError(f"expert state {n!r} must have shape {tuple(self._row_shapes[n])}, "
                                 f"got {tuple(state[n].shape)}")
        return torch.cat([state[n].detach().reshape(-1) for n in self._names])

    def flat_to_state(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.unflatten(flat).items()}

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, expert_ids={self._ids}"
