"""The split MoE layer: a model-owned router and fused (grouped) experts under Lazarus.

``ToyMoE`` is an :class:`ElasticMoE` with a softmax router and SwiGLU experts stored as
fused ``[local_experts, ...]`` tensors (:class:`GroupedExperts`, run with ``grouped_mm``).
It is checked against a dense single-process reference computed with the full ``[E, ...]``
weights: in one process, and on 2 and 4 gloo ranks (real processes) with replicated
experts, before and after moving experts with ``set_placement``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lazarus.moe import (ElasticMoE, GroupedExperts, SoftmaxRouter, grouped_mm, grouped_mm_available,
                         sync_moe_gradients)
from lazarus.planning import Placement
from tests.helpers.rank_harness import run_ranks

E, D, FF, K = 4, 8, 12, 2


def full_weights(seed: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"gate_up_proj": torch.randn(E, 2 * FF, D, generator=g) * 0.3,
            "down_proj": torch.randn(E, D, FF, generator=g) * 0.3}


class SwiGLUExperts(GroupedExperts):
    def run(self, x: torch.Tensor, counts) -> torch.Tensor:
        gate, up = grouped_mm(x, self.gate_up_proj.transpose(-2, -1), counts).chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), counts)


class ToyMoE(ElasticMoE):
    def __init__(self, placement: Placement, weights: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__(E)
        slots = self._check_placement(placement)
        mine = sorted(set(slots[self.rank]))
        weights = weights or full_weights()
        self.router = SoftmaxRouter(D, E, K, seed=5)
        self.experts = SwiGLUExperts(E, mine, {n: w[mine] for n, w in weights.items()})
        self._init_placement(placement)

    def route(self, h: torch.Tensor):
        return self.router(h)


def reference(router_w: torch.Tensor, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    probs = F.softmax(x @ router_w.t(), dim=-1)
    gates, idx = probs.topk(K, dim=-1)
    gates = gates / gates.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(E):
        for k in range(K):
            rows = (idx[:, k] == e).nonzero().flatten()
            if rows.numel():
                gate, up = (x[rows] @ w["gate_up_proj"][e].t()).chunk(2, dim=-1)
                y = (F.silu(gate) * up) @ w["down_proj"][e].t()
                out = out.index_add(0, rows, gates[rows, k, None] * y)
    return out


def batch(world: int, per_rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(world * per_rank, D, generator=g), torch.randn(world * per_rank, D, generator=g)


def check_step(layer: ToyMoE, weights: dict[str, torch.Tensor], rank: int, world: int, per_rank: int,
               seed: int) -> None:
    """Output and synced gradients of this rank's slice equal the dense reference's."""
    for p in layer.parameters():
        p.grad = None
    router_w = layer.router.weight.detach().clone().requires_grad_(True)
    ref_w = {n: t.clone().requires_grad_(True) for n, t in weights.items()}
    x, target = batch(world, per_rank, seed)
    ref = reference(router_w, ref_w, x)
    (ref * target).sum().div(world).backward()
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    out = layer(x[lo:hi])
    torch.testing.assert_close(out, ref[lo:hi].detach())
    (out * target[lo:hi]).sum().backward()
    sync_moe_gradients(torch.nn.ModuleDict({"moe": layer}))
    torch.testing.assert_close(layer.router.weight.grad, router_w.grad)
    for name in ("gate_up_proj", "down_proj"):
        held = getattr(layer.experts, name)
        for row, e in enumerate(layer.local_experts):
            torch.testing.assert_close(held.detach()[row], weights[name][e])
            torch.testing.assert_close(held.grad[row], ref_w[name].grad[e], msg=lambda m, e=e: f"expert {e}: {m}")


# ----- grouped_mm ----------------------------------------------------------------------------------
def _loop(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return grouped_mm(x, w, counts, force_loop=True)


@pytest.mark.parametrize("counts", [[3, 0, 7], [0, 0, 5], [4, 4, 4], [1, 9, 0]])
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_mm_kernel_matches_loop_values_and_gradients(counts: list[int], transposed: bool) -> None:
    g = torch.Generator().manual_seed(sum(counts))
    x = torch.randn(sum(counts), 16, generator=g, requires_grad=True)
    base = torch.randn(3, 12, 16, generator=g) if transposed else torch.randn(3, 16, 12, generator=g)
    base.requires_grad_(True)
    w = base.transpose(-2, -1) if transposed else base
    assert grouped_mm_available(x, w)
    y = grouped_mm(x, w, counts)
    ref = _loop(x, w, counts)
    torch.testing.assert_close(y, ref)
    gx, gw = torch.autograd.grad(y.sum(), [x, base])   # an expanded gradient, too
    rx, rw = torch.autograd.grad(ref.sum(), [x, base])
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


def test_grouped_mm_falls_back_to_a_loop_on_misaligned_operands() -> None:
    x = torch.randn(7, 3, requires_grad=True)
    w = torch.randn(2, 3, 5, requires_grad=True)
    assert not grouped_mm_available(x, w)      # 12-byte rows: no kernel, the loop runs
    y = grouped_mm(x, w, [4, 3])
    torch.testing.assert_close(y, torch.cat([x[:4] @ w[0], x[4:] @ w[1]]))
    y.sum().backward()
    assert w.grad is not None and x.grad is not None


def test_grouped_mm_bad_counts() -> None:
    with pytest.raises(ValueError, match="counts"):
        grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 4), [2, 2])
    with pytest.raises(ValueError, match="one entry per group"):
        grouped_mm(torch.randn(4, 4), torch.randn(2, 4, 4), [4])


# ----- single process -----------------------------------------------------------------------------
def test_single_process_grouped_layer_matches_reference() -> None:
    layer = ToyMoE(Placement([list(range(E))], E))
    assert layer.local_experts == list(range(E)) and layer.experts.local_expert_indices == list(range(E))
    assert {n for n, _ in layer.named_parameters()} == {"router.weight", "experts.gate_up_proj", "experts.down_proj"}
    check_step(layer, full_weights(), 0, 1, per_rank=20, seed=1)
    assert layer.replicated_parameters() == [layer.router.weight]


def test_grouped_experts_validation() -> None:
    w = full_weights()
    with pytest.raises(ValueError, match="sorted distinct"):
        SwiGLUExperts(E, [2, 1], {n: t[:2] for n, t in w.items()})
    with pytest.raises(ValueError, match="rows"):
        SwiGLUExperts(E, [0, 1], {n: t[:3] for n, t in w.items()})
    with pytest.raises(ValueError, match="in \\[0, 4\\)"):
        SwiGLUExperts(E, [0, 4], {n: t[:2] for n, t in w.items()})
    ex = SwiGLUExperts(E, [1, 3], {n: t[[1, 3]] for n, t in w.items()})
    with pytest.raises(ValueError, match="exactly the keys"):
        ex.state_to_flat(2, {"gate_up_proj": w["gate_up_proj"][2]})
    with pytest.raises(ValueError, match="no state for experts \\[2\\]"):
        ex.reassign([1, 2], {})
    old_gu = ex.gate_up_proj
    ex.reassign([1, 3], {})
    assert ex.gate_up_proj is old_gu               # same set: the parameters stay
    ex.reassign([0, 3], {0: ex.state_to_flat(0, {n: t[0] for n, t in w.items()})})
    assert ex.expert_ids == [0, 3] and ex.gate_up_proj is not old_gu
    torch.testing.assert_close(ex.gate_up_proj.detach(), w["gate_up_proj"][[0, 3]])
    torch.testing.assert_close(ex.flat_state(3), torch.cat([w["gate_up_proj"][3].reshape(-1),
                                                            w["down_proj"][3].reshape(-1)]))


# ----- 2 and 4 gloo ranks ---------------------------------------------------------------------------
def prog_grouped(rank: int, world: int, old: list[list[int]], new: list[list[int]]) -> None:
    weights = full_weights()
    layer = ToyMoE(Placement(old, E), weights)
    assert layer.local_experts == sorted(set(old[rank]))
    assert layer.experts.gate_up_proj.shape == (len(set(old[rank])), 2 * FF, D)
    check_step(layer, weights, rank, world, per_rank=16, seed=2)
    check_step(layer, weights, rank, world, per_rank=5, seed=3)
    # Replicas identical after sync: every holder of expert e has the same gradient bits.
    sums = torch.zeros(E, dtype=torch.float64)
    for e in layer.local_experts:
        sums[e] = layer.experts.flat_grad(e).double().sum()
    gathered = [torch.zeros(E, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, sums)
    for e in layer.local_experts:
        assert len({float(gathered[j][e]) for j in range(world) if e in old[j]}) == 1, f"expert {e} diverged"
    # Move experts (collective): new holders fetch their rows from old holders.
    added, removed = layer.set_placement(Placement(new, E))
    assert added == sorted(set(new[rank]) - set(old[rank])) and removed == sorted(set(old[rank]) - set(new[rank]))
    assert layer.experts.local_expert_indices == sorted(set(new[rank]))
    check_step(layer, weights, rank, world, per_rank=12, seed=4)


# 2 ranks: expert 0 on both (replicas share its tokens), 3 only on rank 1.
OLD_2, NEW_2 = [[0, 1, 2], [0, 3, 3]], [[0, 3, 1], [2, 2, 0]]
# 4 ranks: expert 0 on three ranks, rank 3 holds two replicas of expert 3.
OLD_4, NEW_4 = [[0, 1], [0, 2], [0, 1], [3, 3]], [[2, 3], [0, 1], [1, 3], [0, 2]]


@pytest.mark.timeout(200)
def test_two_ranks_grouped_experts_match_reference_and_move(tmp_path: Path) -> None:
    run_ranks(prog_grouped, 2, tmp_path, OLD_2, NEW_2)


@pytest.mark.timeout(250)
def test_four_ranks_grouped_experts_match_reference_and_move(tmp_path: Path) -> None:
    run_ranks(prog_grouped, 4, tmp_path, OLD_4, NEW_4)


def test_a_layer_without_router_says_how_to_route() -> None:
    class NoRouter(ElasticMoE):
        def __init__(self) -> None:
            super().__init__(E)
            self.experts = SwiGLUExperts(E, list(range(E)), {n: w for n, w in full_weights().items()})
            self._init_placement(Placement([list(range(E))], num_experts=E))

    with pytest.raises(TypeError, match="no `router`"):
        NoRouter()(torch.randn(3, D))
