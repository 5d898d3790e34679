"""A transformers 5.x sparse-MoE block as a Lazarus layer.

transformers' MoE blocks (``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``,
``OlmoeSparseMoeBlock``, ``DeepseekV3MoE``, ``GptOssMLP``, ...) all do the same thing
around different routers: ``_, weights, ids = self.gate(h)`` (``self.router`` for GPT-OSS),
then ``self.experts(h, ids, weights)``, plus whatever else the model adds (shared experts,
router jitter, a second output). :class:`ElasticHFBlock` keeps the block's own modules --
the router object itself, shared experts -- under their own names, replaces ``experts``
with :class:`~lazarus.adapters.hf._experts.HFExperts` (this rank's rows), and runs the
block class's own ``forward`` on itself. Only the ``experts(...)`` call changes: it goes
through :meth:`lazarus.moe.ElasticMoE.dispatch`. Router math, gate normalisation, scaling
factors, shared experts and outputs are the model's code, not a copy of it.

Blocks built otherwise (Llama 4's dense pre-scaled input, DBRX's flattened and JetMoE's
parallel experts, LongCat-Flash's zero-compute experts, Switch Transformers' and
NLLB-MoE's per-expert modules called with a mask) have an entry in
:data:`~lazarus.adapters.hf._layouts.LAYOUTS` saying how their experts are held and called.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn

from lazarus.moe import ElasticMoE
from lazarus.planning import Placement

from ._experts import HFExperts, is_hf_experts
from ._layouts import LAYOUTS, BlockLayout, layout_of
from ._modules import ModuleExperts

__all__ = ["ElasticHFBlock", "ROUTER_NAMES", "is_hf_moe_block", "router_of", "top_k_of"]

ROUTER_NAMES = ("gate", "router")


def top_k_of(router: nn.Module) -> int | None:
    """A router's top-k: its ``top_k`` attribute, else its config's ``top_k_experts`` /
    ``num_experts_per_tok`` (Gemma 4's router reads ``config.top_k_experts``)."""
    k = getattr(router, "top_k", None)
    if isinstance(k, int) and not isinstance(k, bool):
        return k
    cfg = getattr(router, "config", None)
    for field in ("top_k_experts", "num_experts_per_tok"):
        k = getattr(cfg, field, None)
        if isinstance(k, int) and not isinstance(k, bool):
            return k
    return None


def router_of(block: nn.Module) -> tuple[str, nn.Module] | None:
    """``(name, router)`` of a transformers MoE block: its ``gate`` or ``router`` child
    with a top-k (see :func:`top_k_of`)."""
    for name in ROUTER_NAMES:
        mod = getattr(block, name, None)
        if isinstance(mod, nn.Module) and top_k_of(mod) is not None:
            return name, mod
    return None


def num_experts_of(block: nn.Module) -> int:
    """The expert count of a transformers MoE block (:func:`is_hf_moe_block`)."""
    layout = layout_of(block)
    if layout is not None:
        return layout.num_experts(block)
    experts: Any = block.experts   # the model's own module: transformers declares no attribute types
    return int(experts.num_experts)


def block_top_k(block: nn.Module) -> int | None:
    """Slots per token of a transformers MoE block (its layout's, else its router's)."""
    layout = layout_of(block)
    if layout is not None:
        return layout.top_k(block)
    found = router_of(block)
    return top_k_of(found[1]) if found is not None else None


def is_hf_moe_block(module: nn.Module) -> bool:
    if isinstance(module, ElasticMoE):
        return False
    if layout_of(module) is not None:
        return True
    experts = getattr(module, "experts", None)
    return isinstance(experts, nn.Module) and is_hf_experts(experts) and router_of(module) is not None


def _check_supported(block: nn.Module) -> None:
    """Refuse, naming what differs, a block whose own forward would compute something else
    once made elastic."""
    if layout_of(block) is not None:
        return
    cls = type(block).__name__
    experts: Any = block.experts   # the model's own module: transformers declares no attribute types
    params = [p for p in inspect.signature(type(experts).forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) < 4:    # self, hidden_states, top_k_index, top_k_weights
        raise ValueError(f"{cls}: its experts ({type(experts).__name__}) take one dense, pre-scaled input "
                         "(experts(routed_in), every token for every expert) instead of (hidden_states, "
                         "top_k_index, top_k_weights): Lazarus cannot dispatch tokens to them without changing "
                         "the model")
    own = getattr(block, "num_experts", None)
    if own is not None and own != experts.num_experts:
        raise ValueError(f"{cls}.num_experts is {own!r}, not its experts' count ({experts.num_experts}); the "
                         "elastic layer's num_experts would replace it in the block's own forward")


class ElasticHFBlock(ElasticMoE):
    """A transformers MoE block whose experts are placed, dispatched and synchronised by
    Lazarus. ``state_dict()`` has the block's own names; ``experts.*`` tensors hold this
    rank's experts as ``[local_experts, ...]`` rows (``[E, ...]``, the original tensors,
    on one rank holding every expert).

    Args:
        block: the transformers block (its modules are taken over, not copied, except the
            experts' rows this rank keeps).
        placement: where every expert lives; rank ``j`` of ``group`` holds ``placement``'s
            slots of rank ``j``.
        group: the expert-parallel process group (default: the world).
        grad_reduction: ``"mean"`` or ``"sum"``, see :class:`lazarus.moe.ElasticMoE`.
    """

    experts: HFExperts | ModuleExperts

    def __init__(self, block: nn.Module, placement: Placement, *, group: Any = None,
                 grad_reduction: str = "mean") -> None:
        if not is_hf_moe_block(block):
            raise ValueError(f"{type(block).__name__} is not a transformers MoE block (an `experts` module with "
                             f"fused expert tensors and a `gate`/`router` with top_k)")
        _check_supported(block)
        super().__init__(num_experts_of(block), group=group, grad_reduction=grad_reduction)
        self.block_class = type(block)
        self._layout_key = type(block).__name__     # a key, not the entry: layouts hold functions
        found = router_of(block)
        self.router_name = found[0] if found is not None else "router"
        self.top_k = int(block_top_k(block))  # type: ignore[arg-type]
        slots = self._check_placement(placement)
        mine = sorted(set(slots[self.rank]))
        layout = self.layout
        replaced = layout.replaced if layout is not None else ()
        for name, child in block.named_children():   # the block's order, so state_dict keys keep it
            if name == "experts" or (replaced and name == replaced[0]):
                self.experts = self._take_experts(block, mine)
            elif name not in replaced:
                self.add_module(name, child)
        for name, p in block.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in block.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in block._non_persistent_buffers_set)
        for key, value in vars(block).items():
            if not key.startswith("_") and key != "training" and key not in self.__dict__:
                self.__dict__[key] = value
        # Class-level settings the block's forward reads (a GradientCheckpointingLayer's
        # ``gradient_checkpointing``: Gemma 4's MoE block is its whole decoder layer).
        for klass in reversed(type(block).__mro__[:-1]):
            if klass in nn.Module.__mro__:
                continue
            for key, value in vars(klass).items():
                if (not key.startswith("_") and isinstance(value, (bool, int, float, str)) and key not in self.__dict__
                        and not hasattr(type(self), key)):
                    self.__dict__[key] = value
        self.experts.bind(self)
        self._router_scores: torch.Tensor | None = None
        if layout is not None and layout.call == "dense":
            getattr(self, self.router_name).register_forward_hook(self._keep_scores)
        self._init_placement(placement)
        self.train(block.training)

    @property
    def layout(self) -> BlockLayout | None:
        """This block's entry in :data:`~lazarus.adapters.hf._layouts.LAYOUTS` (None: a
        standard block)."""
        return LAYOUTS.get(self._layout_key)

    def _take_experts(self, block: nn.Module, mine: list[int]) -> Any:
        layout = self.layout
        original: Any = getattr(block, "experts", None) if layout is None or not layout.replaced else block
        if layout is None:
            return HFExperts(original, mine)
        if layout.call == "mask":
            return ModuleExperts(original, mine, num_experts=self.num_experts)
        assert layout.experts is not None
        return HFExperts(original, mine, layout.experts(block), call=layout.call)

    def dispatch_dense(self, routed_in: torch.Tensor) -> torch.Tensor:
        """Llama 4's ``experts(routed_in)``: ``routed_in`` [E * T, d] holds every token for
        every expert, pre-scaled by its router score (zero where not routed). The routed rows
        (the top-k scores the router just returned) are dispatched as tokens; the others
        stay zero, as the experts' output of a zero row is."""
        scores = self._router_scores
        self._router_scores = None
        if scores is None:
            raise RuntimeError(f"{self.block_class.__name__}: the experts were called before the router")
        n_tok, num = scores.shape
        d = routed_in.shape[-1]
        ids = scores.detach().topk(self.top_k, dim=1).indices                 # [T, k]
        rows = (ids * n_tok + torch.arange(n_tok, device=ids.device)[:, None]).reshape(-1)
        y = self.dispatch(routed_in[rows], ids.reshape(-1, 1), torch.ones_like(rows, dtype=routed_in.dtype)[:, None])
        return routed_in.new_zeros((num * n_tok, d)).index_copy(0, rows, y)

    def dispatch_identity(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """LongCat-Flash's experts: slots with ids ``>= E`` are zero-compute identity experts
        (``h * weight``, added here); the others are dispatched to the E real experts."""
        real = ids < self.num_experts
        t, j = real.nonzero(as_tuple=True)
        y = self.dispatch(h[t], ids[t, j][:, None], weights[t, j][:, None])
        out = torch.zeros_like(h).index_add(0, t, y.to(h.dtype))
        ti, ji = (~real).nonzero(as_tuple=True)
        return out.index_add(0, ti, (h[ti] * weights[ti, ji][:, None]).to(h.dtype))

    def dispatch_mask(self, h: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Per-expert modules called with a routing mask (Switch Transformers, NLLB-MoE):
        every slot ``(t, j)`` the mask sends to expert ``e`` with a non-zero weight is one
        dispatched row ``h[t]`` weighted ``weights[t, j]``; slots with weight 0 (dropped
        over capacity) add 0, as in the original."""
        assert self.layout is not None and self.layout.mask is not None
        onehot, w = self.layout.mask(self.experts, mask, weights)
        onehot = onehot.reshape(h.shape[0], -1, self.num_experts)
        w = w.reshape(h.shape[0], -1)
        t, j, e = ((onehot != 0) & (w != 0)[..., None]).nonzero(as_tuple=True)
        y = self.dispatch(h[t], e[:, None], w[t, j][:, None])
        if self.training and isinstance(self.experts, ModuleExperts):
            self.experts.count_routed(self.routing_counts)
        if self.layout.post_slot is not None:
            y = self.layout.post_slot(self.experts, y)
        return torch.zeros_like(h).index_add(0, t, y.to(h.dtype))

    def __getattr__(self, name: str) -> Any:
        """The block class's own methods (DBRX's ``route_tokens_to_experts``), bound to this
        module, where nn.Module has no such attribute."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            klass = self.__dict__.get("block_class")
            fn = getattr(klass, name, None) if klass is not None and not name.startswith("_") else None
            if callable(fn) and not isinstance(fn, type):
                return fn.__get__(self, type(self))
            raise

    def _keep_scores(self, module: nn.Module, args: Any, out: Any) -> None:
        self._router_scores = out[0]

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's router (``gate`` or ``router``) on ``h`` [tokens, d]: ``(top-k ids,
        top-k weights)``."""
        out = getattr(self, self.router_name)(h)
        return out[2], out[1]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The block class's own forward, run on this module (its ``experts(...)`` call
        dispatches through Lazarus)."""
        self.experts._owner = weakref.ref(self)
        if self.layout is not None and self.layout.forward is not None:
            return self.layout.forward(self, *args, **kwargs)
        return self.block_class.forward(self, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.block_class.__name__}, num_experts={self.num_experts}, top_k={self.top_k}"
