"""moc._policy.CheckpointPolicy driven alone through its step interface: ``open`` (what a step
brings to the round), ``decide`` (what the agreed round makes of it) and ``checkpointed``."""

from __future__ import annotations

import pytest
import torch

from moc import MoCConfig
from moc._dist import Comm
from moc._policy import CheckpointPolicy, Opening, SnapshotDecision
from moc._run_state import RunState


def _policy(tmp_path, **kw) -> CheckpointPolicy:
    cfg = MoCConfig(storage=str(tmp_path), top_k=1, **kw)
    return CheckpointPolicy(cfg, num_experts={"l0": 4, "l1": 4}, run=RunState(rank=0, world=1), comm=Comm())


def _checkpoint(p: CheckpointPolicy, step: int, *, has_base: bool) -> SnapshotDecision:
    opening = p.open(step)
    assert opening is not None and opening.due
    assert opening.routing is not None
    decision = p.decide(k_snapshot=opening.k_snapshot, interval=opening.interval, routing=opening.routing,
                        first=not has_base)
    assert decision is not None
    p.run.first_done = True
    return decision


def test_open_only_at_checkpoints_and_decision_points(tmp_path):
    p = _policy(tmp_path, interval=8, k_snapshot=1)
    first = p.open(3)
    assert isinstance(first, Opening) and first.due          # the run's first checkpoint, whatever the step
    p.run.first_done = True
    opened = {s: p.open(s) for s in range(4, 17)}
    assert {s for s, o in opened.items() if o is not None and o.due} == {8, 16}
    # decision points every interval // 4 steps: a round without a checkpoint, no routing taken
    assert {s for s, o in opened.items() if o is not None and not o.due} == {4, 6, 10, 12, 14}
    assert all(o.routing is None for o in opened.values() if o is not None and not o.due)


def test_open_takes_the_routing_counts_once(tmp_path):
    p = _policy(tmp_path, interval=2, k_snapshot=1)
    p.record_routing("l0", [1, 2, 3, 4])
    p.record_routing("l1", [4, 3, 2, 1])
    o = p.open(0)
    assert o is not None
    assert o.routing is not None and o.routing.tolist() == [1, 2, 3, 4, 4, 3, 2, 1]
    p.run.first_done = True
    o2 = p.open(2)
    assert o2 is not None and o2.routing is not None and o2.routing.tolist() == [0] * 8


def test_decide_selects_books_the_snapshot_and_records_meta(tmp_path):
    p = _policy(tmp_path, interval=1, k_snapshot=1, persist_every=2)
    first = _checkpoint(p, 0, has_base=False)
    assert first.selection == {"l0": ([0, 1, 2, 3], [0, 1, 2, 3]), "l1": ([0, 1, 2, 3], [0, 1, 2, 3])}
    assert first.designated and first.meta["checkpoints"] == 1 and p.checkpoints == 1
    p.run.has_base = True
    second = _checkpoint(p, 1, has_base=True)
    # K=1 per layer, staggered over layers; every persist_every-th snapshot goes to storage
    assert [len(v[0]) for v in second.selection.values()] == [1, 1]
    assert second.selection["l0"][0] != second.selection["l1"][0]
    assert not second.designated and second.meta["checkpoints"] == 2
    third = _checkpoint(p, 2, has_base=True)
    assert third.designated and p.persist_rounds == 2


def test_decide_books_the_routing_into_plt(tmp_path):
    p = _policy(tmp_path, interval=1, k_snapshot=1)
    _checkpoint(p, 0, has_base=False)
    p.run.has_base = True
    p.record_routing("l0", [10, 0, 0, 0])
    p.record_routing("l1", [0, 0, 0, 10])
    d = _checkpoint(p, 1, has_base=True)
    assert p.tracker.cum["l0"] == [10, 0, 0, 0] and p.tracker.cum["l1"] == [0, 0, 0, 10]
    # the snapshot is taken at the counters before it is booked as saved
    assert d.plt["cum"]["l0"] == [10, 0, 0, 0]


def test_decide_without_a_checkpoint_only_adopts_rank0s_proposals(tmp_path):
    p = _policy(tmp_path, interval=8, k_snapshot=1)
    before = p.checkpoints
    assert p.decide(k_snapshot=3, interval=5, routing=None, first=False) is None
    assert (p.k_snapshot, p.interval, p.checkpoints) == (3, 5, before)


def test_checkpointed_feeds_auto_interval_and_k(tmp_path, monkeypatch):
    p = _policy(tmp_path, interval="auto", k_snapshot="auto", k_persist=1)
    clock = iter(range(0, 1000, 2))            # 2 s per step
    monkeypatch.setattr("moc._policy.time.perf_counter", lambda: float(next(clock)))
    for s in range(5):
        o = p.open(s)
        assert o is not None                   # interval 1: every step is due
        p.decide(k_snapshot=o.k_snapshot, interval=o.interval, routing=o.routing, first=s == 0)
        p.run.first_done = True
    assert p.open(5) is not None
    p.checkpointed(blocking_seconds=0.5, copy_seconds=0.8)
    o = p.open(6)
    assert o is not None
    assert o.interval is not None and o.interval >= 1
    assert o.k_snapshot is not None and 1 <= o.k_snapshot <= 4
    assert p.save_overhead == 0.5
    again = p.open(7)                          # each proposal is sent once
    assert again is not None and again.k_snapshot is None and again.interval is None


def test_routing_counts_of_the_wrong_length_are_refused(tmp_path):
    p = _policy(tmp_path)
    with pytest.raises(ValueError, match="layer 'l0' has 4 experts, got 3 counts"):
        p.record_routing("l0", torch.tensor([1, 2, 3]))
