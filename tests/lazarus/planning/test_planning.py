"""Unit tests for lazarus.planning: allocation, placements, recovery odds, migration."""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys

import pytest

from lazarus.planning import (
    best_survivor_counts,
    survivor_counts,
    Migration,
    Placement,
    allocate_replicas,
    effective_min_replicas,
    minimal_owner_sets,
    mro_layout,
    place_compact,
    place_mro,
    place_mro_paper,
    place_spread,
    plan_layers,
    plan_migration,
    recovery_curve,
    recovery_estimate,
    recovery_probability,
)

# ----------------------------------------------------------------------------- allocation


def test_eq1_worked_example() -> None:
    # N*c = 12 slots, f = 1, loads sorted ascending 1,2,3,6 (sum 12):
    # r1 = floor(1/12*12)=1, r2 = floor(2/11*11)=2, r3 = floor(3/9*9)=3, r4 = rest = 6.
    assert allocate_replicas([6, 1, 3, 2], 12, 1, 1) == [6, 1, 3, 2]
    # f = 2 lifts the least loaded expert and the rest share what is left.
    r = allocate_replicas([6, 1, 3, 2], 12, 1, 2)
    assert r[1] == 2 and sum(r) == 12 and min(r) >= 2


def test_allocation_input_order_and_sum() -> None:
    loads = [10, 0, 5, 5, 80, 1]
    r = allocate_replicas(loads, 8, 3, 2)
    assert sum(r) == 24 and min(r) >= 2
    assert r[4] == max(r)  # the hot expert gets the most
    assert r[2] == r[3]  # equal loads, equal replicas here


def test_allocation_all_zero_loads_is_uniform() -> None:
    assert allocate_replicas([0, 0, 0, 0], 4, 2, 1) == [2, 2, 2, 2]
    r = allocate_replicas([0, 0, 0], 5, 2, 1)
    assert sorted(r) == [3, 3, 4] and sum(r) == 10


def test_allocation_ties_are_deterministic() -> None:
    a = allocate_replicas([1, 1, 1, 1, 1], 3, 3, 1)
    assert a == allocate_replicas([1, 1, 1, 1, 1], 3, 3, 1)
    assert sum(a) == 9 and max(a) - min(a) <= 1


def test_allocation_lowers_f_when_slots_are_short() -> None:
    # 3 nodes x 2 slots = 6 slots for 4 experts: f=3 is impossible, floor(6/4) = 1.
    assert effective_min_replicas(4, 3, 2, 3) == 1
    r = allocate_replicas([1, 2, 3, 4], 3, 2, 3)
    assert sum(r) == 6 and min(r) >= 1


def test_allocation_gives_hot_experts_more_replicas_than_nodes() -> None:
    # Plain Eq. 1: the hot expert gets 7 of 12 slots on 4 nodes (copies share a node).
    assert allocate_replicas([1000, 1, 1, 1, 1, 1], 4, 3, 1) == [7, 1, 1, 1, 1, 1]
    plan = place_mro([7, 1, 1, 1, 1, 1], 4, 3)
    assert sorted(len(row) for row in plan.nodes) == [3, 3, 3, 3]
    assert sum(row.count(0) for row in plan.nodes) == 7
    assert survivor_counts(plan.nodes, 4) == best_survivor_counts([7, 1, 1, 1, 1, 1], 4, 3)


def test_allocation_per_node_cap() -> None:
    r = allocate_replicas([1000, 1, 1, 1, 1, 1], 4, 3, 1, max_per_node=1)
    assert max(r) <= 4 and sum(r) == 12
    # With fewer experts than slots a node must hold copies: the cap is at least ceil(c/E).
    assert allocate_replicas([100, 1], 2, 4, 1, max_per_node=2) == [4, 4]


def test_allocation_exact_arithmetic() -> None:
    # 0.1 + 0.2 style float noise must not change a floor.
    r = allocate_replicas([0.1, 0.2, 0.3, 0.4], 10, 1, 1)
    assert r == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        (dict(loads=[1, 2, 3], num_nodes=1, slots_per_node=2, min_replicas=1), "slots"),
        (dict(loads=[1, -1], num_nodes=2, slots_per_node=2, min_replicas=1), "loads[1]"),
        (dict(loads=[1, float("nan")], num_nodes=2, slots_per_node=2, min_replicas=1), "loads[1]"),
        (dict(loads=[1, float("inf")], num_nodes=2, slots_per_node=2, min_replicas=1), "loads[1]"),
        (dict(loads=[1, 2], num_nodes=2, slots_per_node=2, min_replicas=3), "min_replicas"),
        (dict(loads=[1, 2], num_nodes=2, slots_per_node=2, min_replicas=0), "min_replicas"),
        (dict(loads=[1, 2], num_nodes=2, slots_per_node=0, min_replicas=1), "slots_per_node"),
        (dict(loads=[1, 2], num_nodes=0, slots_per_node=2, min_replicas=1), "num_nodes"),
        (dict(loads=[1, 2], num_nodes=2.5, slots_per_node=2, min_replicas=1), "num_nodes"),
        (dict(loads=[1, 2], num_nodes=2, slots_per_node=2, min_replicas=1.0), "min_replicas"),
        (dict(loads=[1, 2], num_nodes=True, slots_per_node=2, min_replicas=1), "num_nodes"),
        (dict(loads=[], num_nodes=2, slots_per_node=2, min_replicas=1), "loads"),
        (dict(loads="12", num_nodes=2, slots_per_node=2, min_replicas=1), "loads"),
        (dict(loads=[1, "a"], num_nodes=2, slots_per_node=2, min_replicas=1), "loads[1]"),
    ],
)
def test_allocation_bad_input(kwargs: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word.replace("[", r"\[").replace("]", r"\]")):
        allocate_replicas(**kwargs)


# ----------------------------------------------------------------------------- placements

PLACERS = [place_mro, place_mro_paper, place_spread, place_compact]


@pytest.mark.parametrize("place", PLACERS)
def test_placement_shape(place) -> None:
    r = allocate_replicas([9, 1, 4, 2, 2, 7, 3], 6, 4, 2)
    plan = place(r, 6, 4)
    assert plan.num_nodes == 6 and plan.slots_per_node == 4
    assert plan.replica_counts() == r
    assert all(len(row) == 4 for row in plan.nodes)


@pytest.mark.parametrize("place", PLACERS)
@pytest.mark.parametrize(
    ("replicas", "n", "c", "word"),
    [
        ([2, 2], 2, 3, "sum"),
        ([0, 4], 2, 2, r"replicas\[0\]"),
        ([2, 2.0], 2, 2, r"replicas\[1\]"),
        ([4], 0, 4, "num_nodes"),
        ([4], 4, 0, "slots_per_node"),
        ([], 2, 2, "replicas"),
    ],
)
def test_placement_bad_input(place, replicas, n, c, word) -> None:
    with pytest.raises(ValueError, match=word):
        place(replicas, n, c)


def test_spread_uses_distinct_nodes() -> None:
    plan = place_spread([3, 3, 2], 4, 2)
    for e, owners in enumerate(plan.owners()):
        assert len(owners) == plan.replica_counts()[e]


def test_compact_packs() -> None:
    plan = place_compact([4, 2, 2], 4, 2)
    assert plan.owners()[0] == [0, 1]
    assert plan.max_copies_per_node() == 2


def test_mro_layout_and_structure() -> None:
    r = [2, 2, 3, 3, 4, 4]  # c=2: groups {0,1},{2,3},{4,5}; blocks 2+3+4 = 9 <= N
    n, c = 9, 2
    lay = mro_layout(r, n, c)
    assert lay.groups == [[0, 1], [2, 3], [4, 5]] and lay.sizes == [2, 3, 4] and lay.full
    plan = place_mro(r, n, c)
    sets = minimal_owner_sets(plan)
    assert sorted(len(s) for s in sets) == [2, 3, 4]  # one minimal set per group
    # Inclusion-exclusion over groups, written out by hand for 2 failures (R = 7 alive):
    alive = n - 2
    sizes = [2, 3, 4]
    p = sum(
        (-1) ** len(sub) * math.comb(n - sum(sub), alive)
        for k in range(len(sizes) + 1)
        for sub in itertools.combinations(sizes, k)
    ) / math.comb(n, alive)
    assert recovery_probability(plan, 2) == pytest.approx(p)


def test_mro_counterexample_from_design() -> None:
    r = [2, 2, 2]
    paper = place_mro_paper(r, 3, 2)
    assert recovery_probability(paper, 1) == pytest.approx(2 / 3)
    better = place_mro(r, 3, 2)
    assert recovery_probability(better, 1) == 1.0
    assert sorted(map(sorted, better.nodes)) == [[0, 1], [0, 2], [1, 2]]


def test_mro_never_below_paper_on_paper_settings() -> None:
    loads = [1 / (i + 1) for i in range(8)]
    r = allocate_replicas(loads, 10, 6, 2)
    m, p = place_mro(r, 10, 6), place_mro_paper(r, 10, 6)
    for f in range(1, 10):
        assert recovery_probability(m, f) >= recovery_probability(p, f) - 1e-12


def test_mro_is_deterministic() -> None:
    r = [2, 3, 3, 3, 4]
    assert place_mro(r, 5, 3) == place_mro(r, 5, 3)


def test_mro_search_on_large_truncated_plan() -> None:
    # Above 66 nodes C(N, k) no longer fits in int64; the sampled search must not need it.
    n, c = 80, 4
    r = allocate_replicas([1 / (k + 1) for k in range(21)], n, c, 2)
    assert not mro_layout(r, n, c).full
    plan = place_mro(r, n, c)
    assert plan.replica_counts() == r
    assert all(len(o) >= 2 for o in plan.owners())
    assert recovery_probability(plan, 1) == 1.0
    assert plan == place_mro(r, n, c)


def test_gpu_slots_split_copies() -> None:
    plan = Placement([[0, 0, 1, 1], [0, 1, 1, 0]], gpus_per_node=2)
    for node in plan.gpu_slots():
        assert [sorted(g) for g in node] == [[0, 1], [0, 1]]
    with pytest.raises(ValueError, match="gpus_per_node"):
        plan.with_gpus(5)


def test_placement_validation() -> None:
    with pytest.raises(ValueError, match="slots_per_node"):
        Placement([[0, 1], [1]])
    with pytest.raises(ValueError, match="missing"):
        Placement([[0, 2], [0, 2]])
    with pytest.raises(ValueError, match="expert ids"):
        Placement([[0, 1]], num_experts=1)
    with pytest.raises(ValueError, match="non-empty"):
        Placement([])


# ----------------------------------------------------------------------------- recovery


def _brute(plan: Placement, f: int) -> float:
    n = plan.num_nodes
    owners = [set(o) for o in plan.owners()]
    ok = sum(
        all(o - set(failed) for o in owners) for failed in itertools.combinations(range(n), f)
    )
    return ok / math.comb(n, f)


def test_recovery_paper_figure4_style() -> None:
    # A plan where every expert sits on the same two nodes survives iff one of them lives.
    plan = Placement([[0, 1], [0, 1], [2, 3], [2, 3], [0, 2]])
    for f in range(6):
        assert recovery_probability(plan, f) == pytest.approx(_brute(plan, f))


def test_recovery_methods_agree() -> None:
    rnd = random.Random(3)
    r = allocate_replicas([rnd.random() for _ in range(7)], 9, 3, 2)
    for place in PLACERS:
        plan = place(r, 9, 3)
        for f in range(10):
            exact = recovery_estimate(plan, f, exact=True)
            assert exact.stderr == 0.0
            assert exact.probability == pytest.approx(_brute(plan, f))
            mc = recovery_estimate(plan, f, exact=False, samples=4000, seed=1)
            assert abs(mc.probability - exact.probability) <= 5 * mc.stderr + 1e-9
            assert mc.method == "monte-carlo" and mc.samples == 4000


def test_recovery_large_cluster_uses_sampling_with_error() -> None:
    r = allocate_replicas([1 / (i + 1) for i in range(24)], 40, 4, 2)
    slots = [e for e, k in enumerate(r) for _ in range(k)]
    random.Random(0).shuffle(slots)
    plan = Placement([slots[i * 4 : i * 4 + 4] for i in range(40)])  # overlapping owner sets
    est = recovery_estimate(plan, 20, samples=3000)
    assert est.method == "monte-carlo" and 0 < est.stderr < 0.02
    # few failures on a big cluster: exact enumeration is cheap
    assert recovery_estimate(plan, 2).method == "enumeration"
    curve = recovery_curve(place_mro(r, 40, 4), max_failed=5)
    assert [e.num_failed for e in curve] == list(range(6)) and curve[0].probability == 1.0


def test_recovery_bad_input() -> None:
    plan = place_spread([2, 2], 2, 2)
    with pytest.raises(ValueError, match="num_failed"):
        recovery_probability(plan, 3)
    with pytest.raises(ValueError, match="num_failed"):
        recovery_probability(plan, -1)
    with pytest.raises(ValueError, match="exact"):
        recovery_probability(plan, 1, exact="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="placement"):
        recovery_probability([[0, 1]], 1)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- migration


def _cost(old: dict, new: Placement, mapping: dict) -> int:
    return sum(len(set(new.nodes[q]) - set(old[p])) for p, q in mapping.items())


def test_migration_after_failure() -> None:
    loads = [5, 4, 3, 2, 1, 1]
    old_plan = place_mro(allocate_replicas(loads, 6, 3, 2), 6, 3)
    survivors = {f"host{i}": old_plan.nodes[i] for i in range(6) if i != 2}
    new = place_mro(allocate_replicas(loads, 5, 3, 2), 5, 3)
    mig = plan_migration(survivors, new)
    assert isinstance(mig, Migration)
    assert sorted(mig.mapping) == sorted(survivors) and sorted(mig.mapping.values()) == list(range(5))
    assert mig.num_fetches == _cost(survivors, new, mig.mapping)
    assert mig.num_fetches <= mig.identity_fetches
    for e, src, dst in mig.transfers:
        assert e in survivors[src] and e not in survivors[dst]
        assert e in new.nodes[mig.mapping[dst]]
    # after applying the transfers every node holds its plan node's experts
    held = {p: set(v) for p, v in survivors.items()}
    for e, _, dst in mig.transfers:
        held[dst].add(e)
    for e, dst in mig.missing:
        held[dst].add(e)
    for p, q in mig.mapping.items():
        assert set(new.nodes[q]) <= held[p]


def test_migration_reports_missing_experts() -> None:
    new = Placement([[0, 1], [0, 2], [1, 2]])
    mig = plan_migration({"a": [0, 1], "b": [0, 1], "c": []}, new)
    assert mig.restore_experts == [2]
    assert {dst for _, dst in mig.missing} <= {"a", "b", "c"}
    assert len(mig.missing) == 2  # both plan nodes holding 2 need it from the checkpoint


def test_migration_spreads_fetches_over_owners() -> None:
    # expert 0 lives on 4 nodes; 4 joiners each need it: one send per owner.
    old = {i: [0, 1] for i in range(4)} | {i: [] for i in range(4, 8)}
    new = Placement([[0, 1]] * 8)
    mig = plan_migration(old, new)
    zero_src = [src for e, src, _ in mig.transfers if e == 0]
    assert sorted(zero_src) == [0, 1, 2, 3]
    assert max(mig.sends_per_node().values()) == 2


def test_migration_identity_when_nothing_changes() -> None:
    plan = place_mro([2, 2, 3, 3, 4, 4], 9, 2)
    old = {i: row for i, row in enumerate(plan.nodes)}
    mig = plan_migration(old, plan)
    assert mig.transfers == [] and mig.mapping == {i: i for i in range(9)}


def test_migration_bad_input() -> None:
    new = Placement([[0, 1], [0, 1]])
    with pytest.raises(ValueError, match="num_nodes"):
        plan_migration({"a": [0]}, new)
    with pytest.raises(ValueError, match="old_nodes"):
        plan_migration([[0], [1]], new)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expert id"):
        plan_migration({"a": [0], "b": [-1]}, new)
    with pytest.raises(ValueError, match="new"):
        plan_migration({"a": [0], "b": [1]}, [[0, 1]])  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_migration_greedy_vs_optimum_small() -> None:
    """Greedy never loses to the identity mapping; record the gap to the optimum."""
    rnd = random.Random(7)
    worst = 0
    for _ in range(120):
        n = rnd.randint(2, 6)
        c = rnd.randint(1, 3)
        e = rnd.randint(1, n * c)
        old_n = n + rnd.randint(0, 2)
        r_old = allocate_replicas([rnd.random() for _ in range(e)], old_n, c, 1)
        old_plan = place_mro(r_old, old_n, c)
        keep = sorted(rnd.sample(range(old_n), n))
        old = {i: old_plan.nodes[i] for i in keep}
        new = place_mro(allocate_replicas([rnd.random() for _ in range(e)], n, c, 1), n, c)
        mig = plan_migration(old, new)
        phys = list(old)
        best = min(
            _cost(old, new, dict(zip(phys, perm))) for perm in itertools.permutations(range(n))
        )
        assert mig.num_fetches <= mig.identity_fetches
        assert mig.num_fetches >= best
        worst = max(worst, mig.num_fetches - best)
    assert worst <= 2


# ----------------------------------------------------------------------------- layers


def test_plan_layers_each_layer_own_loads() -> None:
    plans = plan_layers({"l0": [8, 1, 1, 1], "l1": [1, 1, 1, 8]}, 4, 2, 1, gpus_per_node=2)
    assert [p.layer for p in plans] == ["l0", "l1"]
    assert plans[0].replicas[0] == max(plans[0].replicas)
    assert plans[1].replicas[3] == max(plans[1].replicas)
    assert all(p.placement.gpus_per_node == 2 for p in plans)
    listed = plan_layers([[1, 2], [2, 1]], 2, 2, 2, strategy="spread")
    assert [p.layer for p in listed] == [0, 1] and listed[0].placement.strategy == "spread"


def test_plan_layers_bad_input() -> None:
    with pytest.raises(ValueError, match="gpus_per_node"):
        plan_layers([[1, 2]], 2, 2, 1, gpus_per_node=3)
    with pytest.raises(ValueError, match="strategy"):
        plan_layers([[1, 2]], 2, 2, 1, strategy="random")
    with pytest.raises(ValueError, match="at least one layer"):
        plan_layers([], 2, 2, 1)


def test_planning_does_not_import_torch() -> None:
    code = "import sys, lazarus.planning, lazarus.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
