"""MoELayer on 2 and 4 gloo ranks vs a single-process dense reference.

Each test spawns its ranks with ``rank_harness.run_ranks`` (separate processes, FileStore
rendezvous, finite gloo timeouts); every rank checks its own outputs and gradients with
assert_close against the reference computed on the full global batch, and the parent kills
any rank still alive when the test ends, passed or not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lazarus.moe import Expert, MoEConfig, MoELayer, record_routing_to, sync_moe_gradients
from lazarus.planning import Placement
from tests.helpers.rank_harness import run_ranks

JOIN_S = 150


# ----- reference ----------------------------------------------------------------------------
def reference(cfg: MoEConfig, router_w: torch.Tensor, experts: dict[int, Expert], x: torch.Tensor) -> torch.Tensor:
    """Dense single-process MoE: every token through its top-k experts, weighted by gates."""
    probs = F.softmax(x @ router_w.t(), dim=-1)
    gates, idx = probs.topk(cfg.top_k, dim=-1)
    if cfg.top_k > 1:
        gates = gates / gates.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for k in range(cfg.top_k):
        for e, expert in experts.items():
            mask = idx[:, k] == e
            if mask.any():
                out = out.index_add(0, mask.nonzero().flatten(), gates[mask, k, None] * expert(x[mask]))
    return out


def global_batch(cfg: MoEConfig, router_w: torch.Tensor, world: int, per_rank: int, seed: int):
    """Same on every rank; biased toward expert 0 so it is the popular one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * per_rank, cfg.d_model, generator=g) + 1.5 * router_w[0] / router_w[0].norm()
    target = torch.randn(world * per_rank, cfg.d_model, generator=g)
    return x, target


def custom_expert(cfg: MoEConfig, e: int) -> Expert:
    """Expert e with weights unlike its seeded init (used to see that moved weights arrive)."""
    expert = Expert(cfg)
    g = torch.Generator().manual_seed(500 + e)
    with torch.no_grad():
        for p in expert.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return expert


def check_step(layer: MoELayer, cfg: MoEConfig, rank: int, world: int, per_rank: int, seed: int,
               make_expert=None) -> None:
    """One forward/backward/sync on the layer and on a reference built independently with
    ``make_expert(cfg, e)`` (default: the seeded init): outputs, then gradients."""
    for p in layer.parameters():
        p.grad = None
    router_w = layer.router.weight.detach().clone().requires_grad_(True)
    make_expert = make_expert or (lambda c, e: Expert(c, e))
    ref_experts = {e: make_expert(cfg, e) for e in range(cfg.num_experts)}
    x, target = global_batch(cfg, router_w.detach(), world, per_rank, seed)
    ref_out = reference(cfg, router_w, ref_experts, x)
    (ref_out * target).sum().div(world).backward()

    lo, hi = rank * per_rank, (rank + 1) * per_rank
    xi = x[lo:hi].clone().requires_grad_(True)
    out = layer(xi)
    torch.testing.assert_close(out, ref_out[lo:hi].detach())
    (out * target[lo:hi]).sum().backward()
    sync_moe_gradients(torch.nn.ModuleDict({"moe": layer}))
    torch.testing.assert_close(layer.router.weight.grad, router_w.grad)
    for e in layer.local_experts:
        for name, p in layer.experts[str(e)].named_parameters():
            ref_p = dict(ref_experts[e].named_parameters())[name]
            ref_g = ref_p.grad if ref_p.grad is not None else torch.zeros_like(ref_p)  # expert saw no token
            torch.testing.assert_close(p.grad, ref_g, msg=lambda m, e=e, n=name: f"expert {e} {n}: {m}")
    # Replicas identical: every holder of an expert has the same gradient bits.
    flat = torch.cat([torch.cat([p.grad.flatten() for p in layer.experts[str(e)].parameters()]) for e in
                      range(cfg.num_experts) if str(e) in layer.experts] or [torch.zeros(0)])
    gathered = [torch.zeros(cfg.num_experts, 1) for _ in range(world)]
    sums = torch.zeros(cfg.num_experts, 1)
    for e in layer.local_experts:
        sums[e] = torch.cat([p.grad.flatten() for p in layer.experts[str(e)].parameters()]).double().sum().float()
    dist.all_gather(gathered, sums)
    for e in layer.local_experts:
        vals = {float(gathered[j][e]) for j in range(world) if e in layer.slots[j]}
        assert len(vals) == 1, f"replicas of expert {e} diverged: {vals}"
    assert flat.numel() > 0


# ----- rank programs ------------------------------------------------------------------------
def prog_correctness(rank: int, world: int, nodes: list[list[int]], num_experts: int) -> None:
    for top_k in (1, 2):
        _correctness(rank, world, nodes, num_experts, top_k)


def _correctness(rank: int, world: int, nodes: list[list[int]], num_experts: int, top_k: int) -> None:
    cfg = MoEConfig(d_model=12, d_hidden=20, num_experts=num_experts, top_k=top_k, seed=7)
    layer = MoELayer(cfg, Placement(nodes, num_experts))
    assert set(layer.local_experts) == set(nodes[rank])
    names = {n for n, _ in layer.named_parameters()}
    assert {f"experts.{e}.w1.weight" for e in set(nodes[rank])} <= names
    wrapper = torch.nn.ModuleDict({"moe": layer})
    seen: list[tuple[str, list[int]]] = []
    record_routing_to(wrapper, lambda name, counts: seen.append((name, counts.tolist())))
    check_step(layer, cfg, rank, world, per_rank=24, seed=3)
    # Routing counts: global, one call per training forward, top_k slots per token.
    assert len(seen) == 1 and seen[0][0] == "moe" and sum(seen[0][1]) == 24 * world * top_k
    # A rank without a replica of the popular expert must have routed tokens to it.
    assert seen[0][1][0] == max(seen[0][1])
    # Ranks take tokens in proportion to their replicas: within one token per expert.
    counts = torch.tensor(seen[0][1], dtype=torch.float64)
    R = layer.replicas.double()
    expected = float((counts * R[:, rank] / R.sum(1)).sum())
    assert abs(layer.last_received - expected) <= num_experts, (layer.last_received, expected, seen)
    check_step(layer, cfg, rank, world, per_rank=9, seed=4)  # a second step, other batch size


def prog_set_placement(rank: int, world: int, old: list[list[int]], new: list[list[int]], num_experts: int) -> None:
    cfg = MoEConfig(d_model=10, d_hidden=14, num_experts=num_experts, top_k=2, seed=11)
    layer = MoELayer(cfg, Placement(old, num_experts))
    # Give every expert distinctive weights on its old holders only: the new holders can
    # get them only by fetching them.
    with torch.no_grad():
        for e in layer.local_experts:
            layer.experts[str(e)].load_state_dict(custom_expert(cfg, e).state_dict())
    kept = {e: layer.experts[str(e)].w1.weight for e in layer.local_experts}
    added, removed = layer.set_placement(Placement(new, num_experts))
    assert added == sorted(set(new[rank]) - set(old[rank]))
    assert removed == sorted(set(old[rank]) - set(new[rank]))
    for e, w in kept.items():
        if e in layer.local_experts:
            assert layer.experts[str(e)].w1.weight is w  # kept experts keep their Parameter
    for e in layer.local_experts:
        for name, p in custom_expert(cfg, e).named_parameters():
            torch.testing.assert_close(dict(layer.experts[str(e)].named_parameters())[name].detach(), p.detach())
    check_step(layer, cfg, rank, world, per_rank=16, seed=5, make_expert=custom_expert)
    # Caller-provided states: back to the old plan, no communication for weights.
    states = {e: custom_expert(cfg, e).state_dict() for e in range(num_experts)}
    layer.set_placement(Placement(old, num_experts), expert_states=states)
    check_step(layer, cfg, rank, world, per_rank=16, seed=6, make_expert=custom_expert)


def prog_fused_sync(rank: int, world: int) -> None:
    """Three layers synced together (sync_moe_gradients: two all-to-alls and one all-reduce
    for the model) give every expert the bits each layer's own sync gives it."""
    plans = [[[0, 1], [1, 2], [2, 3]], [[0, 0], [1, 2], [3, 1]], [[3, 2], [1, 0], [0, 3]]]
    cfgs = [MoEConfig(d_model=8, d_hidden=10 + 2 * i, num_experts=4, top_k=2, seed=20 + i) for i in range(3)]

    def build() -> torch.nn.ModuleDict:
        return torch.nn.ModuleDict({f"l{i}": MoELayer(c, Placement(p, 4)) for i, (c, p) in enumerate(zip(cfgs, plans))})

    fused, alone = build(), build()
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(100 + rank))
    for model in (fused, alone):
        sum((layer(x) * (i + 1)).sum() for i, layer in enumerate(model.values())).backward()
    sync_moe_gradients(fused)
    for layer in alone.values():
        layer.sync_gradients()
    for name in fused:
        a, b = fused[name], alone[name]
        for e in a.local_experts:
            assert torch.equal(a.experts.flat_grad(e), b.experts.flat_grad(e)), (name, e)
        torch.testing.assert_close(a.router.weight.grad, b.router.weight.grad)


def prog_mixed_dtype_replicas(rank: int, world: int) -> None:
    """reduce_replicas moves bytes: units of different dtypes and sizes in one exchange,
    each summed over its holders in its own dtype."""
    from lazarus.moe._sync import reduce_replicas
    holders = {("a", 0): [0, 1, 2], ("a", 1): [1, 2], ("b", 0): [0, 2], ("b", 1): [0, 1, 2], ("c", 0): [1]}
    dtypes = {"a": torch.float32, "b": torch.float64, "c": torch.bfloat16}
    sizes = {"a": 7, "b": 5, "c": 3}

    def value(k, r):
        g = torch.Generator().manual_seed(ord(k[0][0]) * 10 + k[1] + 17 * r)   # (hash() varies by process)
        return torch.randn(sizes[k[0]], generator=g).to(dtypes[k[0]])

    mine = {k: value(k, rank) for k, hs in holders.items() if rank in hs}
    out = reduce_replicas(mine, holders, rank, world, None)
    assert sorted(out) == sorted(mine)
    for k, got in out.items():
        expected = value(k, holders[k][0])
        for r in holders[k][1:]:
            expected = expected + value(k, r)
        assert got.dtype == dtypes[k[0]] and torch.equal(got, expected), (k, got, expected)


# ----- tests ---------------------------------------------------------------------------------
# 2 ranks, E=3, 2 slots: rank 0 holds two replicas of expert 0, rank 1 none of it.
PLAN_2 = [[0, 0], [1, 2]]
# 4 ranks, E=4, 2 slots: expert 0 on ranks 0 (x2), 1 and 2; rank 3 holds none of it.
PLAN_4 = [[0, 0], [0, 1], [0, 2], [3, 3]]


@pytest.mark.timeout(170)
def test_two_ranks_match_reference_top1_top2(tmp_path: Path) -> None:
    run_ranks(prog_correctness, 2, tmp_path, PLAN_2, 3, join_s=JOIN_S)


@pytest.mark.timeout(170)
def test_four_ranks_match_reference_top1_top2(tmp_path: Path) -> None:
    run_ranks(prog_correctness, 4, tmp_path, PLAN_4, 4, join_s=JOIN_S)


@pytest.mark.timeout(170)
def test_set_placement_moves_experts(tmp_path: Path) -> None:
    # Expert 3 moves from rank 3 onto ranks 0 and 1; expert 0 leaves rank 1.
    new = [[0, 3], [3, 1], [0, 2], [1, 2]]
    run_ranks(prog_set_placement, 4, tmp_path, PLAN_4, new, 4, join_s=JOIN_S)


# ----- single-process checks ----------------------------------------------------------------
def test_single_process_layer_matches_reference() -> None:
    cfg = MoEConfig(d_model=8, d_hidden=16, num_experts=4, top_k=2)
    layer = MoELayer(cfg, Placement([[0, 1, 2, 3]]))
    x = torch.randn(13, 8)
    ref = reference(cfg, layer.router.weight, {e: layer.experts[str(e)] for e in range(4)}, x)
    torch.testing.assert_close(layer(x), ref)
    assert layer(x.view(13, 1, 8)).shape == (13, 1, 8)


def test_identical_initial_weights_per_expert_everywhere() -> None:
    cfg = MoEConfig(d_model=4, d_hidden=6, num_experts=3, seed=2)
    a = MoELayer(cfg, Placement([[0, 1, 2]]))
    b = Expert(cfg, 1)
    torch.testing.assert_close(a.experts["1"].w1.weight, b.w1.weight)
    assert not torch.equal(a.experts["0"].w1.weight, b.w1.weight)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_k=3), r"MoEConfig.top_k must be one of \[1, 2\]"),
        (dict(top_k=2, num_experts=1), "MoEConfig.top_k must be <= num_experts"),
        (dict(activation="tanh"), "MoEConfig.activation must be one of"),
        (dict(grad_reduction="avg"), "MoEConfig.grad_reduction must be one of"),
        (dict(d_model=0), "MoEConfig.d_model must be an integer >= 1"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    base = dict(d_model=4, d_hidden=4, num_experts=2)
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**base, **kwargs})


def test_placement_must_fit_the_group() -> None:
    cfg = MoEConfig(d_model=4, d_hidden=4, num_experts=2)
    with pytest.raises(ValueError, match="placement has 2 ranks"):
        MoELayer(cfg, Placement([[0], [1]]))
    with pytest.raises(ValueError, match="num_experts"):
        MoELayer(cfg, Placement([[0, 1, 2]]))
    with pytest.raises(ValueError, match="d_model"):
        MoELayer(cfg, Placement([[0, 1]]))(torch.randn(3, 5))


def test_rank_slots_with_several_gpus_per_node() -> None:
    from lazarus.moe import rank_slots, replica_matrix

    plan = Placement([[0, 0, 1, 2], [1, 2, 3, 3]], gpus_per_node=2)
    slots = rank_slots(plan)  # rank = node * 2 + gpu; a node's copies land on different GPUs
    assert slots == [[0, 1], [0, 2], [1, 3], [2, 3]]
    assert replica_matrix(slots, 4).sum().item() == 8


def test_moc_discovers_expert_units() -> None:
    from moc import discover_units

    cfg = MoEConfig(d_model=4, d_hidden=4, num_experts=3)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].moe = MoELayer(cfg, Placement([[2, 0, 1]]))
    layout = discover_units(model)
    assert sorted(layout.layers["layers.0.moe"]) == [0, 1, 2]  # global ids, moc's default pattern


def test_building_for_a_rank_before_the_group_exists_holds_that_ranks_experts() -> None:
    # Lazarus's joiner builds its model while the members still train: no process group yet.
    from lazarus.moe._comm import building_for, world

    assert not dist.is_initialized()
    cfg = MoEConfig(d_model=8, d_hidden=16, num_experts=4, top_k=1)
    placement = Placement([[0, 1], [2, 3], [1, 2]], num_experts=4)
    with building_for(2, 3):
        layer = MoELayer(cfg, placement)
        assert layer.rank == 2 and layer.world_size == 3
    assert layer.local_experts == [1, 2]
    assert world(None) == (0, 1)   # outside the block: a single process again
    with pytest.raises(ValueError, match="placement has 3 ranks"):
        MoELayer(cfg, placement)
    for rank, size, field in ((3, 3, "rank"), (0, 0, "size"), (True, 2, "rank"), (0, 2.0, "size")):
        with pytest.raises(ValueError, match=field):
            with building_for(rank, size):
                pass


@pytest.mark.timeout(170)
def test_the_model_wide_sync_matches_each_layers_own(tmp_path: Path) -> None:
    run_ranks(prog_fused_sync, 3, tmp_path, join_s=JOIN_S)


@pytest.mark.timeout(170)
def test_replica_sums_of_mixed_dtypes_travel_in_one_exchange(tmp_path: Path) -> None:
    run_ranks(prog_mixed_dtype_replicas, 3, tmp_path, join_s=JOIN_S)


def test_experts_given_their_state_are_never_initialised(monkeypatch) -> None:
    """A reconfiguration hands a rank its new experts' states (from peers or moc): building
    them must not draw initial weights only to overwrite them (for a large expert that is
    seconds of CPU per expert, every join). The state given is what the layer then holds."""
    from lazarus.moe._comm import building_for

    cfg = MoEConfig(d_model=8, d_hidden=16, num_experts=4, top_k=1)
    given = {e: {n: torch.full(t.shape, float(e + 1)) + torch.arange(t.numel()).view(t.shape) / 100
                 for n, t in Expert(cfg, e).state_dict().items()} for e in range(4)}
    fills: list[str] = []
    real_uniform = torch.Tensor.uniform_
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *a, **k: (   # meta tensors hold no values
        fills.append("uniform_") if self.device.type != "meta" else None, real_uniform(self, *a, **k))[1])
    with building_for(0, 2):   # rank 0 of 2, no process group: set_placement with states given
        layer = MoELayer(cfg, Placement([[0, 1], [2, 3]], num_experts=4))
        assert fills, "a new layer draws its experts' initial weights"
        fills.clear()
        placeholders = layer.initial_expert_states([2, 3])
        layer.set_placement(Placement([[2, 3], [0, 1]], num_experts=4), expert_states=placeholders)
        assert fills == [] and layer.local_experts == [2, 3]
        assert all(float(t.abs().sum()) == 0 for e in (2, 3) for t in layer.experts[str(e)].state_dict().values())
        layer.set_placement(Placement([[0, 1], [2, 3]], num_experts=4), expert_states=given)
        layer.set_placement(Placement([[2, 3], [0, 1]], num_experts=4), expert_states=given)
    assert fills == []
    assert layer.local_experts == [2, 3]
    for e in (2, 3):
        for n, t in layer.experts[str(e)].state_dict().items():
            torch.testing.assert_close(t, given[e][n])
    with pytest.raises(ValueError, match=r"expert state must have exactly the keys"):
        layer.experts.state_to_flat(2, {"w1.weight": given[2]["w1.weight"]})
    with pytest.raises(ValueError, match=r"'w1.weight' must have shape"):
        layer.experts.state_to_flat(2, {**given[2], "w1.weight": torch.zeros(3, 3)})
