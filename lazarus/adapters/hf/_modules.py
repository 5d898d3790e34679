"""A transformers experts module of one module per expert, cut down to this rank's experts.

Switch Transformers and NLLB-MoE keep ``experts.expert_<e>`` modules (``wi`` / ``wo``,
``fc1`` / ``fc2``) and call ``experts(hidden, routing_mask, weights)``.
:class:`ModuleExperts` keeps the modules of the experts this rank holds, under their own
names (so the state dict and moc's per-expert units are the original's), runs each on its
rows, and turns the mask into token slots for the owning Lazarus layer's dispatch.
"""

from __future__ import annotations

import copy
import math
import weakref
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from lazarus.moe import LocalExperts

__all__ = ["ModuleExperts"]


def _unbound() -> None:
    return None


class ModuleExperts(LocalExperts):
    """The ``expert_<e>`` modules of the experts ``ids`` of ``original`` (taken over, not
    copied). Other children (NLLB's ``token_dropout``) and plain attributes are carried over.
    """

    def __init__(self, original: nn.Module, ids: Sequence[int], *, num_experts: int) -> None:
        super().__init__(num_experts)
        self.original_class = type(original)
        mine = sorted(set(int(e) for e in ids))
        keys = {f"expert_{e}" for e in range(num_experts)}
        missing = sorted(keys - {n for n, _ in original.named_children()})
        if missing:
            raise ValueError(f"{type(original).__name__} has no {missing[:3]}: expected one module per expert")
        template = copy.deepcopy(original.get_submodule("expert_0")).to("meta")
        self._template: list[nn.Module] = [template]   # a plain list: not a submodule
        self._layout = [(n, p.shape) for n, p in template.named_parameters()]
        for name, child in original.named_children():
            if name not in keys:
                if any(True for _ in child.parameters()):
                    raise ValueError(f"{type(original).__name__}.{name} has parameters: not supported")
                self.add_module(name, child)
            elif int(name[len("expert_"):]) in mine:
                self.add_module(name, child)
        for key, value in vars(original).items():
            if not key.startswith("_") and key not in ("training", "num_experts") and key not in self.__dict__:
                self.__dict__[key] = value
        self._owner: Callable[[], Any] = _unbound
        # Tokens each expert was routed (all ranks) since the last gradient sync: an expert
        # none were routed to keeps no gradient (None, not zeros), as in the original, whose
        # unused expert modules an optimizer with momentum then leaves alone.
        self._routed: torch.Tensor | None = None
        self._synced = False
        self.train(original.training)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_owner"] = _unbound
        return state

    def bind(self, owner: Any) -> None:
        self._owner = weakref.ref(owner)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        owner = self._owner()
        if owner is None:
            raise RuntimeError("ModuleExperts is not bound to a Lazarus layer (use lazarus.adapters.hf.make_elastic)")
        return owner.dispatch_mask(hidden_states, mask, weights)

    def count_routed(self, counts: torch.Tensor | None) -> None:
        """Add one training forward's global routing counts (the owner calls it)."""
        if counts is None:
            return
        if self._routed is None or self._synced:
            self._routed, self._synced = torch.zeros_like(counts), False
        self._routed = self._routed + counts

    def expert(self, e: int) -> nn.Module:
        return self.get_submodule(f"expert_{e}")

    # -- LocalExperts ---------------------------------------------------------------------------
    @property
    def expert_ids(self) -> list[int]:
        return sorted(int(n[len("expert_"):]) for n, _ in self.named_children() if n.startswith("expert_"))

    def run(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        outs, start = [], 0
        for e, n in zip(self.expert_ids, counts):
            if n:
                outs.append(self.expert(e)(x[start: start + n]).to(x.dtype))
            start += n
        if not outs:
            return x.new_zeros(x.shape) + 0 * x.sum()
        return torch.cat(outs)

    def expert_tensors(self, e: int) -> list[torch.Tensor]:
        return list(self.expert(e).parameters())

    def expert_grads(self, e: int) -> list[torch.Tensor | None]:
        return [p.grad for p in self.expert(e).parameters()]

    def set_expert_grads(self, e: int, grads: Sequence[torch.Tensor]) -> None:
        self._synced = True
        unused = self._routed is not None and int(self._routed[e]) == 0
        for p, g in zip(self.expert(e).parameters(), grads):
            p.grad = None if unused else g.clone()

    def _shapes_without_experts(self) -> list[torch.Size]:
        return [shape for _, shape in self._layout]

    def reassign(self, ids: Sequence[int], flats: Mapping[int, torch.Tensor]) -> None:
        mine = sorted(set(int(e) for e in ids))
        missing = [e for e in mine if e not in self.expert_ids and e not in flats]
        if missing:
            raise ValueError(f"reassign: no state for experts {missing} newly held here")
        ref = next(iter(self.parameters()), None)
        for e in [e for e in self.expert_ids if e not in mine]:
            delattr(self, f"expert_{e}")
        for e in mine:
            if e in self.expert_ids:
                continue
            expert = copy.deepcopy(self._template[0]).to_empty(device=ref.device if ref is not None else "cpu")
            if ref is not None:
                expert = expert.to(dtype=ref.dtype)
            torch.nn.utils.vector_to_parameters(flats[e].to(next(expert.parameters())), expert.parameters())
            expert.train(self.training)
            self.add_module(f"expert_{e}", expert)

    def initial_flat(self, e: int) -> torch.Tensor:
        ref = next(iter(self.parameters()), None)
        return torch.zeros(self.expert_numel, dtype=ref.dtype if ref is not None else torch.get_default_dtype(),
                           device=ref.device if ref is not None else None)

    def state_to_flat(self, e: int, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        names = [n for n, _ in self._layout]
        if set(state) != set(names):
            raise ValueError(f"expert state must have exactly the keys {names}, got {sorted(state)}")
        for n, shape in self._layout:
            if tuple(state[n].shape) != tuple(shape):
                raise ValueError(f"expert state {n!r} must have shape {tuple(shape)}, got {tuple(state[n].shape)}")
        return torch.cat([state[n].detach().reshape(-1) for n in names])

    def flat_to_state(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for n, shape in self._layout:
            size = math.prod(shape)
            out[n] = flat[offset: offset + size].view(shape).clone()
            offset += size
        return out

    def extra_repr(self) -> str:
        return f"{self.original_class.__name__}, num_experts={self.num_experts}, expert_ids={self.expert_ids}"
