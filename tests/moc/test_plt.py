"""PLT bookkeeping: the per-layer denominator, and counters that stay consistent with the
versions a commit records when persists overlap checkpoints.

The ground truth comes from the test's own hooks on the experts modules (the expert ids
each experts call receives), never from moc's router taps."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from tests.helpers import layout_models as lm
from moc import CheckpointManager, CheckpointStore, MoCConfig
from moc._plt import PLTTracker
from storage_backends import open_store


def test_per_layer_denominator_is_the_layers_own_slots():
    """A layer routed twice as many slots (run twice per forward) loses a fraction of its
    own slots, not of the first layer's."""
    t = PLTTracker({"a": 2, "b": 2}, top_k=2)
    t.record("a", [300, 400])          # 350 tokens x top_k 2
    t.record("b", [900, 500])          # the same tokens, the layer ran twice: 1,400 slots
    t.add_tokens(350)
    t.book_loss("persist", "a", 70)
    t.book_loss("persist", "b", 700)
    assert t.per_layer() == {"a": pytest.approx(0.1), "b": pytest.approx(0.5)}
    assert t.value() == pytest.approx(0.3)
    assert t.value("snapshot") == 0.0
    # Round trip, and a state written before the per-layer count (tokens x top_k each).
    u = PLTTracker({"a": 2, "b": 2}, top_k=2)
    u.load_state(t.state())
    assert u.value() == pytest.approx(0.3)
    old = {k: v for k, v in t.state().items() if k != "routed"}
    v = PLTTracker({"a": 2, "b": 2}, top_k=2)
    v.load_state(old)
    assert v.routed == {"a": 700, "b": 700}
    assert v.per_layer()["b"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="must be >= 0"):
        t.record("a", [1, -1])
    assert t.routed["a"] == 700          # a refused record books nothing


class _SlowCommits:
    """Each commit of a partial checkpoint waits until the training loop has taken the
    next checkpoint: every persist overlaps the checkpoint after it, whatever the load."""

    def __init__(self, store: CheckpointStore) -> None:
        self.cond = threading.Condition()
        self.taken = -1
        self.closing = False
        self.overlapped = 0
        orig = store.commit

        def commit(step, *args, **kwargs):
            if step > 0:
                with self.cond:
                    ok = self.cond.wait_for(lambda: self.taken > step or self.closing, timeout=60)
                    assert ok, "the training loop never took the next checkpoint"
                    self.overlapped += self.taken > step
            return orig(step, *args, **kwargs)

        store.commit = commit

    def checkpoint_taken(self, step: int) -> None:
        with self.cond:
            self.taken = step
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()


@pytest.mark.timeout(120)
def test_overlapping_persists_book_counters_of_the_versions_they_record(tmp_path):
    torch.manual_seed(0)
    model = lm.build("qwen3_moe")
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # The test's own count: expert ids each experts module receives, per step.
    step_counts: dict[str, torch.Tensor] = {}
    layers = {}
    for name, mod in model.named_modules():
        if name.endswith("mlp.experts"):
            layer = name[: -len(".experts")]
            layers[layer] = mod

            def hook(mod, args, out, layer=layer):
                ids = args[1].reshape(-1)
                step_counts[layer] = step_counts.get(layer, 0) + torch.bincount(ids, minlength=lm.EXPERTS)

            mod.register_forward_hook(hook)
    cum_at: dict[int, dict[str, list[int]]] = {}
    running = {l: torch.zeros(lm.EXPERTS, dtype=torch.int64) for l in layers}

    store = str(tmp_path / "store")
    cfg = MoCConfig(storage=store, snapshot_dir=str(tmp_path / "shm"), interval=2, k_snapshot=1, k_persist=1,
                    dynamic_k=False, keep_last=50, top_k=lm.TOP_K, persist_timeout=timedelta(seconds=60))
    ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    slow = _SlowCommits(ckpt.store)
    try:
        for step in range(12):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(3, lm.VOCAB, (2, 9), generator=g)
            step_counts.clear()
            lm.loss_of(model, ids).backward()
            opt.step()
            opt.zero_grad()
            for l in layers:
                running[l] += step_counts[l]
            cum_at[step] = {l: running[l].tolist() for l in layers}
            ckpt.step(step)
            if step == 0:
                ckpt.wait()                 # the full first checkpoint is the base
            if step % 2 == 0:
                slow.checkpoint_taken(step)
            if step % 2 == 0 and step >= 4:
                # The persist that was waiting for this checkpoint may go on now: let it
                # end before the next decision point, which then retries this step's
                # snapshot (busy at its own round). Whatever the load, the persists are
                # 0, 2 and every later even step, each overlapping the checkpoint after it.
                deadline = time.monotonic() + 60
                while ckpt.status()["persist_in_flight"]:
                    assert time.monotonic() < deadline, "the persist released by this checkpoint never ended"
                    time.sleep(0.005)
        slow.close()
        ckpt.close()
    finally:
        slow.close()
    assert slow.overlapped >= 3, "every partial persist should have overlapped the next checkpoint"

    cs = CheckpointStore(open_store(store))
    steps = cs.steps()
    assert steps[-1] >= 8
    for s in steps:
        m = cs.read_manifest(s)
        saved = m.plt["saved"]["persist"]
        for layer, recs in m.layers().items():
            for e, rec in recs.items():
                assert saved[layer][e] == cum_at[rec.step][layer][e], \
                    f"step {s}: {layer} expert {e} is at version {rec.step} but booked another counter"
                assert m.plt["unsaved"][layer][e] == cum_at[s][layer][e] - cum_at[rec.step][layer][e]

    # A restore from storage alone charges exactly the slots the stale experts received.
    S = steps[-1]
    m = cs.read_manifest(S)
    fresh = lm.build("qwen3_moe", seed=7)
    opt2 = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    cfg2 = MoCConfig(storage=store, snapshot_dir=str(tmp_path / "shm-new"), interval=2, k_snapshot=1,
                     k_persist=1, dynamic_k=False, top_k=lm.TOP_K)
    with CheckpointManager(cfg2, model=fresh, optimizer=opt2) as ck2:
        assert ck2.restore() == S + 1
        per_layer = ck2.plt_tracker.per_layer()
        plt = ck2.plt()
    expected = {}
    for layer, recs in m.layers().items():
        lost = sum(cum_at[S][layer][e] - cum_at[rec.step][layer][e] for e, rec in recs.items())
        expected[layer] = lost / sum(cum_at[S][layer])
    assert any(v > 0 for v in expected.values())
    assert per_layer == pytest.approx(expected, rel=1e-12)
    assert plt == pytest.approx(sum(expected.values()) / len(expected), rel=1e-12)
