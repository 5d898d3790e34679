"""Spreading a node's slots over its GPUs: ``deal_gpus``, ``Placement.gpus`` and the
controller planner's use of them (experts stay on the GPU that holds them)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lazarus.moe import rank_slots
from lazarus.planning import Placement, deal_gpus, round_robin_gpus, same_node_moves
from lazarus.runtime.controller._planner import LayerSpec, applied_holdings, compute_plan


@st.composite
def node_cases(draw: st.DrawFn) -> tuple[list[int], int, list[list[int]] | None]:
    g = draw(st.integers(2, 8))
    c = draw(st.integers(g, 4 * g + g - 1))
    e = draw(st.integers(1, 3 * c))
    row = draw(st.lists(st.integers(0, e - 1), min_size=c, max_size=c))
    prev = draw(st.none() | st.lists(st.integers(0, e - 1), min_size=c, max_size=c))
    held = None if prev is None else deal_gpus(prev, g, round_robin_gpus(prev, g) if draw(st.booleans()) else None)
    return row, g, held


@settings(max_examples=400, deadline=None)
@given(node_cases())
def test_deal_is_balanced_exact_and_separates_copies(case: tuple[list[int], int, list[list[int]] | None]) -> None:
    row, g, held = case
    out = deal_gpus(row, g, held)
    c = len(row)
    assert len(out) == g
    assert sorted(x for gpu in out for x in gpu) == sorted(row)                 # exactly the node's slots
    assert sorted(len(gpu) for gpu in out) == sorted(len(gpu) for gpu in round_robin_gpus(row, g))
    assert all(c // g <= len(gpu) <= -(-c // g) for gpu in out)
    if max(Counter(row).values()) <= g:                                         # copies on distinct GPUs
        assert all(len(set(gpu)) == len(gpu) for gpu in out)
    assert deal_gpus(row, g, held) == out                                       # deterministic
    if held is not None:                                                        # never worse than the default
        assert same_node_moves(out, held) <= same_node_moves(round_robin_gpus(row, g), held)


@settings(max_examples=300, deadline=None)
@given(node_cases(), st.data())
def test_experts_the_node_keeps_stay_on_their_gpu(case: tuple[list[int], int, list[list[int]] | None],
                                                  data: st.DataObject) -> None:
    """A node whose set of experts changes by swapping some out and others in keeps every
    other expert on the GPU that holds it: no same-node move at all."""
    _, g, held = case
    if held is None or max(Counter(x for gpu in held for x in gpu).values()) > 1:
        return
    flat = [x for gpu in held for x in gpu]
    k = data.draw(st.integers(0, len(flat)))
    out_idx = set(data.draw(st.lists(st.integers(0, len(flat) - 1), max_size=k, unique=True)))
    fresh = iter(range(max(flat) + 1, max(flat) + 1 + len(out_idx)))
    row = [next(fresh) if i in out_idx else x for i, x in enumerate(flat)]
    out = deal_gpus(row, g, held)
    assert same_node_moves(out, held) == 0
    for j, gpu in enumerate(held):
        assert {x for x in gpu if x in row} <= set(out[j])


def test_unchanged_node_keeps_its_split_and_round_robin_would_not() -> None:
    held = [[0, 5, 9, 12], [1, 2, 3, 4], [6, 7, 8, 10], [11, 13, 14, 15]]
    assert deal_gpus(list(range(16)), 4, held) == held
    row = [x for x in range(16) if x != 3] + [20]                               # 3 out, 20 in
    out = deal_gpus(row, 4, held)
    assert out == [[0, 5, 9, 12], [1, 2, 4, 20], [6, 7, 8, 10], [11, 13, 14, 15]]
    assert same_node_moves(out, held) == 0
    assert same_node_moves(round_robin_gpus(row, 4), held) >= 10                # one insert shifts the rest


def test_a_node_without_holdings_gets_the_round_robin_deal() -> None:
    row = [7, 1, 4, 4, 2, 9]
    assert round_robin_gpus(row, 3) == [[1, 4], [2, 7], [4, 9]]
    for held in (None, [], [[], [], []], [[1, 2], [4, 7]]):                    # the last: another GPU count
        assert deal_gpus(row, 3, held) == round_robin_gpus(row, 3)
    assert deal_gpus(row, 1, [[1, 2, 3]]) == [sorted(row)]
    with pytest.raises(ValueError, match=r"gpus_per_node must be in \[1, 6\]"):
        deal_gpus(row, 7)


def test_same_node_moves_counts_only_copies_the_node_already_had() -> None:
    held = [[0, 1], [2, 3]]
    assert same_node_moves([[0, 1], [2, 3]], held) == 0
    assert same_node_moves([[0, 2], [1, 3]], held) == 2                         # 2 and 1 change GPU
    assert same_node_moves([[0, 8], [2, 3]], held) == 0                         # 8 comes from elsewhere


def test_placement_takes_an_explicit_split_and_validates_it() -> None:
    rows = [[0, 1, 2, 3], [0, 1, 2, 3]]
    p = Placement(rows, gpus_per_node=2, gpus=[[[3, 0], [1, 2]], [[0, 1], [2, 3]]])
    assert p.gpu_slots() == [[[3, 0], [1, 2]], [[0, 1], [2, 3]]]
    assert rank_slots(p) == [[3, 0], [1, 2], [0, 1], [2, 3]]
    assert Placement(rows, gpus_per_node=2).gpu_slots() == [[[0, 2], [1, 3]], [[0, 2], [1, 3]]]
    assert p.with_gpus(2).gpus is None
    assert p.to_dict()["gpus"] == [[[3, 0], [1, 2]], [[0, 1], [2, 3]]]
    bad = {
        "one list of per-GPU lists for each of the 2 nodes": [[[0, 1], [2, 3]]],
        r"gpus\[1\] must hold gpus_per_node = 2 lists": [[[0, 1], [2, 3]], [[0, 1, 2, 3]]],
        r"gpus\[0\]\[0\] holds 3 slots; every GPU holds 2 of the node's 4": [[[0, 1, 2], [3]], [[0, 1], [2, 3]]],
        r"gpus\[1\] must split exactly node 1's slots \[0, 1, 2, 3\]": [[[0, 1], [2, 3]], [[0, 1], [2, 2]]],
        r"gpus\[0\]\[1\] must be a list of expert ids": [[[0, 1], "23"], [[0, 1], [2, 3]]],
        "non-negative integer expert ids": [[[0, 1], [2, -3]], [[0, 1], [2, 3]]],
    }
    for match, split in bad.items():
        with pytest.raises(ValueError, match=match):
            Placement(rows, gpus_per_node=2, gpus=split)


def _apply(res, members: list[str]) -> dict[str, dict[str, list[list[int]]]]:
    """The controller's per-GPU holdings once a plan is applied."""
    return applied_holdings(members, res.layers, res.gpus)[1]


def _node_holdings(res, members: list[str]) -> dict[str, dict[str, list[int]]]:
    return applied_holdings(members, res.layers, res.gpus)[0]


def _fail_one(e: int, slots: int):
    members = [f"n{i}" for i in range(6)]
    layers = [LayerSpec("l0", e)]
    loads = {"l0": [1 / (k + 1) for k in range(e)]}                      # Zipf: uneven replica counts
    res = compute_plan(members, {}, layers, loads, slots=slots, min_replicas=2, gpus_per_node=8)
    survivors = members[:2] + members[3:]
    after = compute_plan(survivors, _node_holdings(res, members), layers, loads, slots=slots, min_replicas=2,
                         gpus_per_node=8, gpu_holdings=_apply(res, members))
    return members, res, survivors, after


def test_a_failure_does_not_reshuffle_the_survivors_gpus() -> None:
    """6 nodes x 8 GPUs, 40 experts in 16 slots per node, f = 2, one node fails: no GPU
    of a survivor fetches an expert its node holds (an expert with one copy on the node
    stays on its GPU), while the round-robin deal of
    the same plan would move dozens between GPUs of one node."""
    members, res, survivors, after = _fail_one(40, 16)
    assert res.gpu_moves == res.gpu_moves_round_robin == 0
    for layer, split in res.gpus.items():                  # a fresh job: the round-robin deal
        assert split == [round_robin_gpus(row, 8) for row in res.layers[layer]]
    assert after.gpu_moves == 0 and after.gpu_moves_round_robin >= 20
    before = _apply(res, members)
    placement = Placement(after.layers["l0"], gpus_per_node=8, gpus=after.gpus["l0"])
    for i, m in enumerate(survivors):
        assert placement.gpu_slots()[i] == after.gpus["l0"][i]
        row, old = after.layers["l0"][i], [x for gpu in before[m]["l0"] for x in gpu]
        single = {x for x in row if row.count(x) == 1 and old.count(x) == 1}   # one copy, before and after
        for j, gpu in enumerate(before[m]["l0"]):
            assert set(gpu) & single <= set(after.gpus["l0"][i][j])


@pytest.mark.parametrize("e, slots", [(48, 16), (64, 16), (32, 8)])
def test_after_a_failure_fewer_same_node_moves_than_round_robin(e: int, slots: int) -> None:
    _, _, _, after = _fail_one(e, slots)
    assert after.gpu_moves_round_robin > 0
    assert after.gpu_moves <= after.gpu_moves_round_robin // 2


def test_plans_for_one_gpu_per_node_carry_no_split() -> None:
    res = compute_plan(["a", "b"], {}, [LayerSpec("l", 4)], None, slots=2, min_replicas=1)
    assert res.gpus == {} and res.gpu_moves == 0
