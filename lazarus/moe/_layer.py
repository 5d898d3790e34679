"""Lazarus MoE layers: replicated experts, balanced dispatch, one uneven all-to-all each way.

The work is split between what Lazarus owns and what the model owns:

* Lazarus (:class:`ElasticMoE`): the placement (which rank holds which experts), the
  token dispatch of Algorithm 1, the uneven all-to-all both ways, the gate-weighted
  combine, replica gradient sync and :meth:`ElasticMoE.set_placement`;
* the model: a router returning ``(expert ids [tokens, k], gates [tokens, k])`` and the
  expert computation over this rank's experts (:class:`~lazarus.moe.LocalExperts`:
  per-expert modules, or fused ``[local_experts, ...]`` tensors run as grouped matmuls).

:meth:`ElasticMoE.dispatch` is the seam: given tokens and the router's choice it returns
``sum_k gates[:, k] * expert(token)``, wherever the experts live. Per call, on every rank
of ``group``:

1. all-gather the per-expert token counts of every rank (E int64 per rank);
2. ``dispatch_counts(R, T, rank)``: how many tokens of each expert go to each rank, so that
   every replica serves an equal share and local tokens stay local;
3. permute token slots into send order and exchange them with one ``all_to_all_single``
   with uneven splits (no padding);
4. run the local experts on the rows received, grouped by expert;
5. send the results back with the reverse all-to-all and combine them with the gates.

Host syncs: the split sizes of the all-to-alls must reach the host, so a call reads the
device back exactly once (:func:`to_host`: the splits, the received counts, the routing
counts and the validity flags in one tensor); everything else known on the device stays
there (the dispatch plan, the permutation, the grouped-matmul offsets, copied host to
device from page-locked memory without waiting).

Both all-to-alls are differentiable. After ``backward`` call :meth:`ElasticMoE.sync_gradients`
(or :func:`lazarus.moe.sync_moe_gradients` on the model) so that every replica of an
expert gets the same gradient and the replicated parameters (router, shared experts) get
the data-parallel average.

:class:`MoELayer` is one instance: a softmax top-k router and two-layer MLP experts
(``experts.<e>.w1/w2``). :func:`lazarus.adapters.hf.make_elastic` builds others from
transformers models.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lazarus.dispatch import dispatch_device
from lazarus.dispatch._api import dispatch_permutation_trusted, dispatch_rank_trusted
from lazarus.dispatch._log import get_logger
from lazarus.planning import Placement

from ._comm import all_gather_rows, all_to_all_uneven, world
from ._config import GRAD_REDUCTIONS, MoEConfig
from ._experts import LocalExperts, MLPExperts
from ._host import to_device, to_host
from ._placement import holder_ranks, rank_slots, replica_matrix
from ._router import SoftmaxRouter
from ._sync import fetch_experts, fetch_plan, reduce_replicas

log = get_logger("lazarus.moe")

RoutingHook = Callable[[torch.Tensor], None]



class ElasticMoE(nn.Module):
    """The Lazarus half of an MoE layer (see the module docstring).

    Subclasses register the model's modules (``experts`` must be a
    :class:`~lazarus.moe.LocalExperts` holding this rank's experts under the placement),
    then call :meth:`_init_placement`. ``forward`` routes with :meth:`route` (the
    ``router`` module by default) and dispatches; models whose block does more (shared
    experts, another output) override ``forward`` and call :meth:`dispatch`.

    Args:
        num_experts: E, global expert ids ``0..E-1``.
        group: process group of the expert-parallel ranks (default: the world).
        grad_reduction: ``"mean"``: synchronised gradients are divided by the world size
            (DDP's average, so a step equals single-model training on the mean of the
            per-rank losses); ``"sum"`` leaves them summed.

    Attributes:
        routing_counts: int64 [E] tokens routed to each expert in the last training
            forward, summed over all ranks (identical on every rank).
        routing_hook: optional ``fn(counts)`` called with ``routing_counts`` after every
            training forward (see :func:`lazarus.moe.record_routing_to`).
        last_received: tokens this rank's experts processed in the last forward.
        last_received_per_expert: int64 [E], the same per expert.
    """

    #: moc's routing protocol (moc._units.routing.GLOBAL_ROUTING_ATTR): ``routing_hook`` gets the
    #: global counts after each forward, so moc needs no import of lazarus to wire it up.
    reports_global_routing = True


    experts: LocalExperts
    replicas: torch.Tensor                   # buffer R[E, W] of the placement (_init_placement)
    _replicas_cache: torch.Tensor | None

    def __init__(self, num_experts: int, *, group: Any = None, grad_reduction: str = "mean") -> None:
        super().__init__()
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be an integer >= 1, got {num_experts!r}")
        if grad_reduction not in GRAD_REDUCTIONS:
            raise ValueError(f"grad_reduction must be one of {list(GRAD_REDUCTIONS)}, got {grad_reduction!r}")
        self.num_experts = num_experts
        self.grad_reduction = grad_reduction
        self.group = group
        self.routing_counts: torch.Tensor | None = None
        self.routing_hook: RoutingHook | None = None
        self.last_received = 0
        self.last_received_per_expert: torch.Tensor | None = None
        self._slots: list[list[int]] = []
        self._holders: list[list[int]] = []

    def _init_placement(self, placement: Placement) -> None:
        """Record the initial placement (``experts`` must already hold this rank's experts)."""
        slots = self._check_placement(placement)
        mine = sorted(set(slots[self.rank]))
        if self.experts.expert_ids != mine:
            raise ValueError(f"experts hold {self.experts.expert_ids} but the placement gives rank {self.rank} {mine}")
        self._set_slots(slots)

    # ----- placement -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return world(self.group)[0]

    @property
    def world_size(self) -> int:
        return world(self.group)[1]

    @property
    def local_experts(self) -> list[int]:
        """Sorted global ids of the experts this rank holds (one copy each)."""
        return self.experts.expert_ids

    @property
    def slots(self) -> list[list[int]]:
        """Expert ids per rank of the current placement."""
        return [list(r) for r in self._slots]

    @property
    def holders(self) -> list[list[int]]:
        """Sorted distinct ranks holding each expert."""
        return [list(h) for h in self._holders]

    def _check_placement(self, placement: Placement) -> list[list[int]]:
        slots = rank_slots(placement)
        if placement.num_experts != self.num_experts:
            raise ValueError(f"placement has num_experts = {placement.num_experts}, the layer {self.num_experts}")
        if len(slots) != self.world_size:
            raise ValueError(
                f"placement has {len(slots)} ranks (nodes x gpus_per_node) but the process group has "
                f"{self.world_size}; they must be equal"
            )
        return slots

    def _set_slots(self, slots: list[list[int]]) -> None:
        self._slots = slots
        self._holders = holder_ranks(slots, self.num_experts)
        old = getattr(self, "replicas", None)   # stays on the layer's device across placements
        device = old.device if isinstance(old, torch.Tensor) else torch.device("cpu")
        self.register_buffer("replicas", replica_matrix(slots, self.num_experts).to(device), persistent=False)
        self._replicas_cache = None

    def _reference(self) -> torch.Tensor:
        """A tensor of the layer's dtype and device (for empty buffers)."""
        for p in self.parameters():
            return p
        return torch.empty(0)

    def set_placement(
        self, placement: Placement, expert_states: Mapping[int, Mapping[str, torch.Tensor]] | None = None
    ) -> tuple[list[int], list[int]]:
        """Re-drive the layer with a new placement, keeping the module (and, for per-expert
        modules, the parameters of the experts this rank keeps, with their optimizer state).

        Args:
            placement: the new plan, same number of experts and ranks.
            expert_states: ``None`` (collective: call on every rank): experts newly assigned
                to a rank are copied from their old holders with one all-to-all. Otherwise a
                mapping ``expert id -> state dict`` (names relative to the expert:
                ``w1.weight`` for :class:`~lazarus.moe.MLPExperts`, ``gate_up_proj`` rows for
                fused experts) covering every expert newly assigned to THIS rank; no
                communication.

        Returns:
            ``(added, removed)`` expert ids on this rank. Parameters of added experts are new
            tensors (all expert parameters, for fused experts): rebuild the optimizer.
        """
        new = self._check_placement(placement)
        old = self._slots
        # What this process holds now, not ``old[self.rank]``: after a process-group
        # rebuild the rank number may have changed while the modules stayed.
        held = set(self.local_experts)
        added = sorted(set(new[self.rank]) - held)
        removed = sorted(held - set(new[self.rank]))
        ref = self._reference()
        if expert_states is None:
            flats = {e: self.experts.flat_state(e) for e in self.local_experts}
            plan = fetch_plan(old, new, self.num_experts)
            states = fetch_experts(plan, flats, self.experts.expert_numel, self.rank, self.world_size, self.group,
                                   ref.dtype, ref.device)
        else:
            missing = [e for e in added if e not in expert_states]
            if missing:
                raise ValueError(f"expert_states lacks experts {missing} newly assigned to rank {self.rank}")
            states = {e: self.experts.state_to_flat(e, expert_states[e]) for e in added}
        with torch.no_grad():
            self.experts.reassign(sorted(set(new[self.rank])), states)
        self._set_slots(new)
        log.debug("set_placement: added %s, removed %s", added, removed)
        return added, removed

    def initial_expert_states(self, experts: Sequence[int]) -> dict[int, dict[str, torch.Tensor]]:
        """Placeholder states for ``set_placement(..., expert_states=...)`` of experts whose
        real state is restored afterwards (from a peer or a checkpoint)."""
        return {e: self.experts.flat_to_state(self.experts.initial_flat(e)) for e in experts}

    # ----- forward -----------------------------------------------------------------------------
    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(expert ids [tokens, k], gates [tokens, k])`` for ``h`` [tokens, d]: the
        model's ``router`` attribute (a :class:`SoftmaxRouter` or any module returning
        that pair). Override it, or ``forward``, for routing that is not one call."""
        router = getattr(self, "router", None)
        if not callable(router):
            raise TypeError(f"{type(self).__name__} has no `router` to route with: register one as "
                            "self.router, or override route() or forward() and call dispatch()")
        return router(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        ids, gates = self.route(h)
        return self.dispatch(h, ids, gates).reshape(x.shape)

    def dispatch(self, h: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """``out[t] = sum_k gates[t, k] * expert_{ids[t, k]}(h[t])`` with the experts wherever
        the placement put them (collective over ``group``: every rank calls it, with any
        number of tokens, zero included).

        Args:
            h: [tokens, d] inputs.
            expert_ids: [tokens, k] integer expert ids in ``[0, E)``.
            gates: [tokens, k] weights (any float dtype; the product promotes like torch).
        Returns:
            [tokens, d] in ``h``'s dtype.
        """
        if h.dim() != 2:
            raise ValueError(f"h must be [tokens, d], got shape {tuple(h.shape)}")
        if expert_ids.dim() != 2 or expert_ids.shape[0] != h.shape[0] or gates.shape != expert_ids.shape:
            raise ValueError(f"expert_ids and gates must both be [tokens={h.shape[0]}, k], got "
                             f"{tuple(expert_ids.shape)} and {tuple(gates.shape)}")
        rank, size = self.rank, self.world_size
        n_tok, d = h.shape
        k = expert_ids.shape[1]
        num = self.num_experts
        dev = h.device
        slot_expert = expert_ids.reshape(-1).long()
        slot_token = torch.arange(n_tok, device=dev).repeat_interleave(k)

        # Counts per expert by a scatter of ones (bincount would sync for its size); ids out
        # of range land in an extra bin E, gathered with the counts, so that every rank sees
        # any rank's bad ids after the one sync below and all raise (none hangs).
        in_range = (slot_expert >= 0) & (slot_expert < num)
        bins = torch.where(in_range, slot_expert, torch.full_like(slot_expert, num))
        local_counts = torch.zeros(num + 1, dtype=torch.int64, device=dev).scatter_add_(
            0, bins, torch.ones_like(bins))
        gathered = all_gather_rows(local_counts, self.group, size)  # [W, E + 1]
        where = dispatch_device(dev)  # the CUDA kernel on the device, else the host
        if where != dev:
            gathered = to_host(gathered)  # the one host read of this path (no kernel on the GPU)
        tokens = gathered[:, :num].t()  # T[E, W]
        replicas = self._replicas_on(where)
        send, recv = dispatch_rank_trusted(replicas, tokens.contiguous(), rank)
        orphan = ((replicas.sum(1) == 0) & (tokens.sum(1) > 0)).sum()
        packed = torch.cat([gathered[:, num].sum().reshape(1), orphan.reshape(1), send.sum(1), recv.flatten(),
                            tokens.sum(1)])
        if where == dev:
            packed = to_host(packed)  # the one host read of this path
        bad_ids, orphans = int(packed[0]), int(packed[1])
        in_splits = packed[2: 2 + size].tolist()
        recv_host = packed[2 + size: 2 + size + size * num].view(size, num)
        routed = packed[2 + size + size * num:]
        if bad_ids:
            raise ValueError(f"expert ids must be in [0, {num}): {bad_ids} routed token slot(s) outside "
                             f"(on this rank: {int(to_host(~in_range).sum())})")
        if orphans:
            raise ValueError(f"tokens routed to {orphans} expert(s) with no replica in the placement")
        out_splits = recv_host.sum(1).tolist()
        perm = dispatch_permutation_trusted(slot_expert, to_device(send, dev))

        x_recv = all_to_all_uneven(h[slot_token[perm]], out_splits, in_splits, self.group)
        y_recv = self._run_local(x_recv, recv_host, recv)
        y_back = all_to_all_uneven(y_recv, in_splits, out_splits, self.group)

        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        y_slots = y_back[inverse] * gates.reshape(-1, 1)
        out = y_slots.view(n_tok, k, d).sum(1).to(h.dtype)

        self.last_received = int(sum(out_splits))
        self.last_received_per_expert = recv_host.sum(0)
        if self.training:
            self.routing_counts = routed.clone()
            if self.routing_hook is not None:
                self.routing_hook(self.routing_counts)
        return out

    def _replicas_on(self, device: torch.device) -> torch.Tensor:
        """R[E, W] of the current placement on ``device`` (cached: no copy per call)."""
        if self.replicas.device == device:
            return self.replicas
        cached: torch.Tensor | None = getattr(self, "_replicas_cache", None)
        if cached is None or cached.device != device:
            cached = self.replicas.to(device)   # once per placement (set_placement drops it)
            self._replicas_cache = cached
        return cached

    def _run_local(self, x: torch.Tensor, recv: torch.Tensor, recv_dev: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the local expert of every received row (rows arrive grouped by source rank,
        then expert; ``recv[src, e]`` rows of expert e from rank src, on the host;
        ``recv_dev`` the same counts wherever the dispatcher ran): sort them by expert
        (unless they already are), run the experts, put them back."""
        held = self.local_experts
        per_expert = recv.sum(0).tolist()
        foreign = [e for e, n in enumerate(per_expert) if n and e not in held]
        if foreign:  # the dispatcher never sends a rank foreign experts
            raise RuntimeError(f"rank {self.rank} received tokens of experts {foreign}, which it does not hold")
        if x.shape[0] == 0:
            # Keep the result in the autograd graph even with no rows, so that the reverse
            # all-to-all's backward runs here too (every rank must join that collective).
            anchor = sum(p.sum() for p in self.parameters() if p.requires_grad)
            return x.new_zeros((0, x.shape[1])) + 0 * (x.sum() + anchor)
        counts = [int(per_expert[e]) for e in held]
        # Source-major order is already expert-major when the experts met, source by
        # source, never go back (one source, typically): no gather needed then.
        seq = [e for row in recv.tolist() for e, n in enumerate(row) if n]
        if all(a <= b for a, b in zip(seq, seq[1:])):
            return self.experts.run(x, counts)
        sizes = to_device(recv, x.device) if recv_dev is None else to_device(recv_dev, x.device)
        expert_ids = torch.repeat_interleave(
            torch.arange(sizes.shape[1], device=x.device).repeat(sizes.shape[0]), sizes.flatten(),
            output_size=x.shape[0])
        order = torch.sort(expert_ids, stable=True).indices
        y_sorted = self.experts.run(x[order], counts)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return y_sorted[inverse]

    # ----- gradients -----------------------------------------------------------------------
    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every rank holds a copy of (router, shared experts, ...): everything
        of the layer outside ``experts``, in ``named_parameters`` order."""
        expert = {id(p) for p in self.experts.parameters()}
        return [p for p in self.parameters() if id(p) not in expert]

    def sync_gradients(self, *, include_router: bool = True) -> None:
        """Make replica gradients identical and equal to single-model training.

        The gradient of the sum of all ranks' losses w.r.t. expert e is the sum of the
        gradients its replicas computed; a replicated parameter's is the sum over all ranks.
        Both are then divided by the world size when ``grad_reduction == "mean"`` (what DDP
        does to dense gradients), so a step optimises the mean of the per-rank losses:
        with equal per-rank batches and per-rank mean losses, exactly the mean loss over
        the global batch. Experts that saw no tokens here contribute zeros.

        ``include_router``: also average the replicated parameters (router, shared
        experts) with one flat all-reduce; pass False when a model-wide sync does it.
        """
        rank, size = self.rank, self.world_size
        scale = 1.0 / size if self.grad_reduction == "mean" else 1.0
        flats = {e: self.experts.flat_grad(e) for e in self.local_experts}
        summed = reduce_replicas(flats, self._holders, rank, size, self.group)
        for e, flat in summed.items():
            self.experts.set_flat_grad(e, flat * scale)
        if include_router:
            params = self.replicated_parameters()
            if not params:
                return
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            if size > 1:
                dist.all_reduce(flat, group=self.group)
            flat.mul_(scale)
            offset = 0
            for p in params:
                p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
                offset += p.numel()

    def expert_grad_sq(self) -> torch.Tensor:
        """Squared norm of this rank's share of the expert gradients: each local expert's
        squared gradient norm divided by its number of holders, so that the all-reduced
        sum counts every expert once (gradient clipping over the whole model). A float64
        0-dim tensor where the experts are: summed there, never read on the host here (on a
        GPU each read would wait for the device, once per expert per layer per step)."""
        parts = [self.experts.flat_grad(e).double().pow(2).sum() / len(self._holders[e]) for e in self.local_experts]
        if not parts:
            device = next((p.device for p in self.parameters()), torch.device("cpu"))
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack(parts).sum()


class MoELayer(ElasticMoE):
    """Mixture-of-Experts layer whose experts are replicated across ranks by a placement:
    a softmax top-k router (:class:`~lazarus.moe.SoftmaxRouter`) and two-layer MLP experts
    (:class:`~lazarus.moe.MLPExperts`).

    Args:
        config: layer shape and gradient semantics.
        placement: ``lazarus.planning.Placement``; rank ``j`` of ``group`` hosts the experts
            of plan node ``j`` (or of GPU ``j % g`` of node ``j // g`` when the plan has
            ``gpus_per_node = g > 1``). Without an initialised process group the plan must
            have a single rank.
        group: process group of the expert-parallel ranks (default: the world).

    Attributes:
        router: the :class:`SoftmaxRouter` (parameter ``router.weight``).
        experts: :class:`MLPExperts` keyed by GLOBAL expert id, so parameters are named
            ``experts.<e>.w1.weight`` on every placement (moc's default expert pattern).
    """

    def __init__(self, config: MoEConfig, placement: Placement, *, group: Any = None) -> None:
        if not isinstance(config, MoEConfig):
            raise ValueError(f"config must be a MoEConfig, got {type(config).__name__}")
        super().__init__(config.num_experts, group=group, grad_reduction=config.grad_reduction)
        self.config = config
        slots = self._check_placement(placement)
        self.router = SoftmaxRouter(config.d_model, config.num_experts, config.top_k, seed=config.seed,
                                    score_dtype=config.router_dtype)
        self.experts = MLPExperts(config, slots[self.rank])
        self._init_placement(placement)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.config.d_model:
            raise ValueError(f"x must have last dimension d_model = {self.config.d_model}, got shape {tuple(x.shape)}")
        return super().forward(x)
