"""The Lazarus MoE layer: replicated experts, balanced dispatch, one uneven all-to-all.

Forward on every rank of ``group``:

1. route: softmax router, top-1 or top-2 (top-2 gates renormalised);
2. all-gather the per-expert token counts of every rank (E int64 per rank);
3. ``dispatch_counts(R, T, rank)``: how many tokens of each expert go to each rank, so that
   every replica serves an equal share and local tokens stay local;
4. permute token slots into send order and exchange them with one ``all_to_all_single``
   with uneven splits (no padding);
5. run the local experts: a rank with several replicas of one expert holds one copy of the
   weights and simply receives the larger share;
6. send the results back with the reverse all-to-all and combine them with the gates.

Both all-to-alls are differentiable. After ``backward`` call :meth:`MoELayer.sync_gradients`
(or :func:`lazarus.moe.sync_moe_gradients` on the model) so that every replica of an
expert gets the same gradient and the router gets the data-parallel average.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from lazarus.dispatch import dispatch_counts, dispatch_device, dispatch_permutation
from lazarus.dispatch._log import get_logger
from lazarus.planning import Placement

from ._comm import all_gather_rows, all_to_all_uneven, world
from ._config import MoEConfig
from ._expert import Expert, init_linear_, seeded_generator
from ._placement import holder_ranks, rank_slots, replica_matrix
from ._sync import fetch_experts, fetch_plan, reduce_replicas

log = get_logger("lazarus.moe")

RoutingHook = Callable[[torch.Tensor], None]


class MoELayer(nn.Module):
    """Mixture-of-Experts layer whose experts are replicated across ranks by a placement.

    Args:
        config: layer shape and gradient semantics.
        placement: ``lazarus.planning.Placement``; rank ``j`` of ``group`` hosts the experts
            of plan node ``j`` (or of GPU ``j % g`` of node ``j // g`` when the plan has
            ``gpus_per_node = g > 1``). Without an initialised process group the plan must
            have a single rank.
        group: process group of the expert-parallel ranks (default: the world).

    Attributes:
        experts: ``ModuleDict`` keyed by GLOBAL expert id, so parameters are named
            ``experts.<e>.w1.weight`` on every placement (moc's default expert pattern).
        routing_counts: int64 [E] tokens routed to each expert in the last training
            forward, summed over all ranks (identical on every rank).
        routing_hook: optional ``fn(counts)`` called with ``routing_counts`` after every
            training forward (see :func:`lazarus.moe.record_routing_to`).
        last_received: tokens this rank's experts processed in the last forward.
    """

    def __init__(self, config: MoEConfig, placement: Placement, *, group: Any = None) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise ValueError(f"config must be a MoEConfig, got {type(config).__name__}")
        self.config = config
        self.group = group
        self.router = nn.Linear(config.d_model, config.num_experts, bias=False)
        init_linear_(self.router, seeded_generator(config.seed, 0))
        self.experts = nn.ModuleDict()
        self.routing_counts: torch.Tensor | None = None
        self.routing_hook: RoutingHook | None = None
        self.last_received = 0
        self._slots: list[list[int]] = []
        self._apply_placement(self._check_placement(placement), initial=True)

    # ----- placement ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return world(self.group)[0]

    @property
    def world_size(self) -> int:
        return world(self.group)[1]

    @property
    def local_experts(self) -> list[int]:
        """Sorted global ids of the experts this rank holds (one copy each)."""
        return sorted(int(k) for k in self.experts.keys())

    @property
    def slots(self) -> list[list[int]]:
        """Expert ids per rank of the current placement."""
        return [list(r) for r in self._slots]

    def _check_placement(self, placement: Placement) -> list[list[int]]:
        slots = rank_slots(placement)
        if placement.num_experts != self.config.num_experts:
            raise ValueError(
                f"placement has num_experts = {placement.num_experts}, the layer {self.config.num_experts}"
            )
        if len(slots) != self.world_size:
            raise ValueError(
                f"placement has {len(slots)} ranks (nodes x gpus_per_node) but the process group has "
                f"{self.world_size}; they must be equal"
            )
        return slots

    def _apply_placement(self, slots: list[list[int]], initial: bool = False,
                         states: Mapping[int, torch.Tensor] | None = None) -> None:
        mine = sorted(set(slots[self.rank]))
        ref = self.router.weight
        for key in [k for k in self.experts.keys() if int(k) not in mine]:
            del self.experts[key]
        for e in mine:
            if str(e) in self.experts:
                continue
            expert = Expert(self.config, e).to(device=ref.device, dtype=ref.dtype)
            if states is not None:
                torch.nn.utils.vector_to_parameters(states[e].to(ref.device, ref.dtype), expert.parameters())
            self.experts[str(e)] = expert
        self._slots = slots
        self._holders = holder_ranks(slots, self.config.num_experts)
        self.register_buffer("replicas", replica_matrix(slots, self.config.num_experts), persistent=False)
        if not initial:
            log.info("placement applied: local experts %s", mine)

    def set_placement(
        self, placement: Placement, expert_states: Mapping[int, Mapping[str, torch.Tensor]] | None = None
    ) -> tuple[list[int], list[int]]:
        """Re-drive the layer with a new placement, keeping the module (and the parameters
        of experts this rank keeps, with their optimizer state).

        Args:
            placement: the new plan, same number of experts and ranks.
            expert_states: ``None`` (collective: call on every rank): experts newly assigned
                to a rank are copied from their old holders with one all-to-all. Otherwise a
                mapping ``expert id -> state dict`` (``w1.weight``, ...) covering every expert
                newly assigned to THIS rank; no communication.

        Returns:
            ``(added, removed)`` expert ids on this rank. Parameters of added experts are new
            tensors: add them to the optimizer (and drop the removed ones).
        """
        new = self._check_placement(placement)
        old = self._slots
        # What this process holds now, not ``old[self.rank]``: after a process-group
        # rebuild the rank number may have changed while the modules stayed.
        held = set(self.local_experts)
        added = sorted(set(new[self.rank]) - held)
        removed = sorted(held - set(new[self.rank]))
        ref = self.router.weight
        if expert_states is None:
            flats = {e: torch.nn.utils.parameters_to_vector(self.experts[str(e)].parameters()).detach()
                     for e in self.local_experts}
            numel = sum(p.numel() for p in Expert(self.config).parameters())
            plan = fetch_plan(old, new, self.config.num_experts)
            states = fetch_experts(plan, flats, numel, self.rank, self.world_size, self.group, ref.dtype, ref.device)
        else:
            missing = [e for e in added if e not in expert_states]
            if missing:
                raise ValueError(f"expert_states lacks experts {missing} newly assigned to rank {self.rank}")
            states = {}
            for e in added:
                holder = Expert(self.config)
                holder.load_state_dict(dict(expert_states[e]))
                states[e] = torch.nn.utils.parameters_to_vector(holder.parameters()).detach()
        with torch.no_grad():
            self._apply_placement(new, states=states)
        log.info("set_placement: added %s, removed %s", added, removed)
        return added, removed

    # ----- forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if x.shape[-1] != cfg.d_model:
            raise ValueError(f"x must have last dimension d_model = {cfg.d_model}, got shape {tuple(x.shape)}")
        rank, size = self.rank, self.world_size
        h = x.reshape(-1, cfg.d_model)
        n_tok = h.shape[0]
        probs = F.softmax(self.router(h), dim=-1)
        gates, idx = probs.topk(cfg.top_k, dim=-1)
        if cfg.top_k > 1:
            gates = gates / gates.sum(-1, keepdim=True)
        slot_expert = idx.reshape(-1)
        slot_token = torch.arange(n_tok, device=h.device).repeat_interleave(cfg.top_k)

        local_counts = torch.bincount(slot_expert, minlength=cfg.num_experts).to(torch.int64)
        gathered = all_gather_rows(local_counts, self.group, size)  # [W, E]
        where = dispatch_device(h.device)  # the CUDA kernel on device, else the host
        tokens = gathered.t().to(where)  # T[E, W]
        send, recv = dispatch_counts(self.replicas.to(where), tokens, rank)
        perm = dispatch_permutation(slot_expert.to(where), send).to(h.device)
        in_splits = send.sum(1).tolist()
        out_splits = recv.sum(1).tolist()
        tokens, recv = tokens.cpu(), recv.cpu()

        x_recv = all_to_all_uneven(h[slot_token[perm]], out_splits, in_splits, self.group)
        recv_expert = torch.repeat_interleave(
            torch.arange(cfg.num_experts).repeat(size), recv.flatten(), output_size=sum(out_splits)
        ).to(h.device)
        y_recv = self._run_local(x_recv, recv_expert, recv.sum(0))
        y_back = all_to_all_uneven(y_recv, in_splits, out_splits, self.group)

        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        y_slots = y_back[inverse] * gates.reshape(-1, 1).to(y_back.dtype)
        out = y_slots.view(n_tok, cfg.top_k, cfg.d_model).sum(1)

        self.last_received = int(sum(out_splits))
        if self.training:
            self.routing_counts = tokens.sum(1)
            if self.routing_hook is not None:
                self.routing_hook(self.routing_counts)
        return out.reshape(x.shape)

    def _run_local(self, x: torch.Tensor, expert_ids: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """Apply the local expert of every received row (rows arrive grouped by source rank,
        then expert)."""
        order = torch.sort(expert_ids, stable=True).indices
        xs = x[order]
        outs = []
        start = 0
        for e, n in enumerate(per_expert.tolist()):
            if n == 0:
                continue
            if str(e) not in self.experts:  # the dispatcher never sends a rank foreign experts
                raise RuntimeError(f"rank {self.rank} received {n} tokens of expert {e}, which it does not hold")
            outs.append(self.experts[str(e)](xs[start : start + n]))
            start += n
        if not outs:
            # Keep the result in the autograd graph even with no rows, so that the reverse
            # all-to-all's backward runs here too (every rank must join that collective).
            return x.new_zeros((0, self.config.d_model)) + 0 * (x.sum() + self.router.weight.sum())
        y_sorted = torch.cat(outs)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return y_sorted[inverse]

    # ----- gradients ---------------------------------------------------------------------
    def sync_gradients(self, *, include_router: bool = True) -> None:
        """Make replica gradients identical and equal to single-model training.

        The gradient of the sum of all ranks' losses w.r.t. expert e is the sum of the
        gradients its replicas computed; the router's is the sum over all ranks. Both are
        then divided by the world size when ``config.grad_reduction == "mean"`` (what DDP
        does to dense gradients), so a step optimises the mean of the per-rank losses:
        with equal per-rank batches and per-rank mean losses, exactly the mean loss over
        the global batch. Experts that saw no tokens here contribute zeros.
        """
        rank, size = self.rank, self.world_size
        scale = 1.0 / size if self.config.grad_reduction == "mean" else 1.0
        flats: dict[int, torch.Tensor] = {}
        for e in self.local_experts:
            params = list(self.experts[str(e)].parameters())
            flats[e] = torch.cat([
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params
            ])
        summed = reduce_replicas(flats, self._holders, rank, size, self.group)
        for e, flat in summed.items():
            offset = 0
            for p in self.experts[str(e)].parameters():
                g = flat[offset : offset + p.numel()].view_as(p) * scale
                p.grad = g.clone()
                offset += p.numel()
        if include_router:
            for p in self.router.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if size > 1:
                    torch.distributed.all_reduce(p.grad, group=self.group)
                p.grad.mul_(scale)
