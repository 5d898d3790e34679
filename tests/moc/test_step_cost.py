"""The synchronous cost of ``CheckpointManager.step()``: cached unit plans and one round.

* Plans are cached per unit and must never go stale: every snapshot equals a fresh capture
  of the live model and optimizer, across the optimizer state created by the first
  ``optimizer.step()``, ``optimizer.load_state_dict``, ``model.load_state_dict`` (in place
  and with ``assign=True``), a dtype change (units change size mid-run), non-tensor state
  (module extra state, an optimizer's Python-int counter), FSDP2 DTensor shards; and the
  cache is used (no unit is re-planned while nothing changed).
* A tensor whose shard or expert rows moved since the manager was built is refused by
  name, on every rank together.
* Collectives: a real 2-rank FSDP2 gloo job, every ``torch.distributed`` collective issued
  by the training thread inside ``step()`` counted: one per checkpoint and per decision
  point in steady state, two when unit sizes change (the first checkpoint, Adam state
  appearing).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import layout_models as lm
from moc import CheckpointError, CheckpointManager, MoCConfig
from moc._units.capture import capture_unit
from moc._units.layouts import local_tensor
from tests.helpers.rank_harness import run_ranks


def cfg_for(root: Path, **kw: Any) -> MoCConfig:
    kw.setdefault("interval", 1)
    kw.setdefault("dynamic_k", False)
    return MoCConfig(storage=str(root / "ckpt"), snapshot_dir=str(root / "shm"), top_k=lm.TOP_K, **kw)


def assert_same_tree(saved: Any, live: Any, where: str) -> None:
    if isinstance(live, torch.Tensor):
        assert isinstance(saved, torch.Tensor), where
        live = local_tensor(live.detach())
        assert saved.dtype == live.dtype and saved.shape == live.shape, (where, saved.dtype, live.dtype)
        assert torch.equal(saved, live), where
    elif isinstance(live, dict):
        assert isinstance(saved, dict) and set(saved) == set(live), (where, sorted(saved), sorted(live))
        for k in live:
            assert_same_tree(saved[k], live[k], f"{where}.{k}")
    elif isinstance(live, (list, tuple)):
        assert type(saved) is type(live) and len(saved) == len(live), where
        for i, (a, b) in enumerate(zip(saved, live)):
            assert_same_tree(a, b, f"{where}[{i}]")
    else:
        assert saved == live, (where, saved, live)


def assert_snapshot_is_live(ckpt: CheckpointManager, model: torch.nn.Module, opt: Any, step: int) -> int:
    """The newest snapshot is of ``step`` and each of this rank's whole units in it equals
    a fresh (uncached) capture of the live state; returns how many units were compared."""
    ckpt.wait(flush=False)
    got, trees = ckpt.snapshot_state()
    assert got == step
    n = 0
    for name, spec in ckpt.layout.units.items():
        if name in trees:
            assert_same_tree(trees[name], capture_unit(spec, model, opt), name)
            n += 1
    assert trees[f"extra/rank{ckpt.rank}"]["extra"]["step"] == step
    return n


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int = 0) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(3, lm.VOCAB, (2, 9), generator=g)
    opt.zero_grad()
    lm.loss_of(model, ids).backward()
    opt.step()


# -- the round's decisions ---------------------------------------------------------------------
def test_persist_decision_needs_idle_ranks_and_one_candidate():
    from moc._coordination import Agreement

    def agreed(busy: bool, steps: list) -> Agreement:
        return Agreement(sigterm=False, failed=False, broken=False, persist_busy=busy, no_buffer=False,
                         retry_steps=steps, finished_seq=0, routing=None, k_snapshot=None, interval=None, collectives=1)

    assert agreed(False, [None, None]).persist_step(True, 12) == 12      # the new snapshot
    assert agreed(True, [8, 8]).persist_step(True, 12) is None           # a persist thread still busy
    assert agreed(False, [8, 8]).persist_step(False, 12) == 8            # every rank has step 8 ready
    assert agreed(False, [8, 4]).persist_step(False, 12) is None         # ranks disagree: none
    assert agreed(False, [8, None]).persist_step(False, 12) is None


def test_published_sizes_merge_and_flag_disagreeing_holders():
    from moc._snapshot.plan import PublishedSizes

    sizes = PublishedSizes(3)
    sizes.update(0, {"expert/l0/1": 64, "module/a": 32, "extra/rank0": 8})
    sizes.update(1, {"expert/l0/1": 64, "expert/l0/2": 64, "module/a": 48, "extra/rank1": 8})
    size_of, disagree, experts, others = sizes.merged()
    assert disagree == {"module/a"} and size_of["expert/l0/2"] == 64
    assert experts == {("l0", 1): ["expert/l0/1"], ("l0", 2): ["expert/l0/2"]}
    assert sorted(others) == ["extra/rank0", "extra/rank1", "module/a"]
    sizes.update(2, {"module/a": 32})
    assert sizes.merged()[1] == {"module/a"} and sizes.merged() is sizes.merged()   # rebuilt once per change


# -- one process -----------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_plans_follow_lazy_optimizer_state_and_are_reused(tmp_path):
    model = lm.build("torchtitan")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with CheckpointManager(cfg_for(tmp_path, k_snapshot=1, k_persist=1), model=model, optimizer=opt) as ckpt:
        units = len(ckpt.layout.units)
        ckpt.step(0)                        # before any optimizer.step(): no Adam state yet
        assert assert_snapshot_is_live(ckpt, model, opt, 0) == units   # the first checkpoint holds all
        assert ckpt.plans.replanned == units
        _, trees = ckpt.snapshot_state()
        assert not any("optimizer" in t for n, t in trees.items() if not n.startswith("extra/"))
        train(model, opt, 1)                # Adam creates its state: every unit changes
        ckpt.step(1)
        assert assert_snapshot_is_live(ckpt, model, opt, 1) > 0
        _, trees = ckpt.snapshot_state()
        assert all("optimizer" in t for n, t in trees.items() if not n.startswith("extra/"))
        assert ckpt.plans.replanned == 2 * units
        for step in range(2, 6):            # in-place updates: the cached plans serve every snapshot
            train(model, opt, step)
            ckpt.step(step)
            assert_snapshot_is_live(ckpt, model, opt, step)
        assert ckpt.plans.replanned == 2 * units
        assert ckpt.coordinator.rounds == 6


@pytest.mark.timeout(120)
def test_plans_follow_reloads_and_dtype_changes(tmp_path):
    model = lm.build("torchtitan")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    other = lm.build("torchtitan", seed=7)
    other_opt = torch.optim.Adam(other.parameters(), lr=1e-2)
    for step in range(3):
        train(other, other_opt, step, rank=5)
    with CheckpointManager(cfg_for(tmp_path, k_snapshot=2, k_persist=1), model=model, optimizer=opt) as ckpt:
        for step in range(3):
            train(model, opt, step)
            ckpt.step(step)
        base = ckpt.plans.replanned

        opt.load_state_dict(other_opt.state_dict())   # new state tensors, other values
        ckpt.step(3)
        assert assert_snapshot_is_live(ckpt, model, opt, 3) > 0
        assert ckpt.plans.replanned > base

        model.load_state_dict(other.state_dict())     # copied in place: same memory, new values
        before = ckpt.plans.replanned
        ckpt.step(4)
        assert assert_snapshot_is_live(ckpt, model, opt, 4) > 0
        assert ckpt.plans.replanned == before         # nothing to re-plan, values read live

        fresh = {k: v.detach().clone() + 1 for k, v in model.state_dict().items()}
        model.load_state_dict(fresh, assign=True)     # new parameter objects
        ckpt.step(5)
        assert assert_snapshot_is_live(ckpt, model, opt, 5) > 0
        _, trees = ckpt.snapshot_state()
        saved = trees["module/head"]["model"]["head.weight"]
        assert torch.equal(saved, fresh["head.weight"])

        model.to(torch.float64)                       # every unit grows: new sizes are agreed on
        ckpt.step(6)
        assert assert_snapshot_is_live(ckpt, model, opt, 6) > 0
        _, trees = ckpt.snapshot_state()
        assert trees["module/head"]["model"]["head.weight"].dtype == torch.float64
        assert ckpt.coordinator.sizes.tables[0]["module/head"] > 2 * fresh["head.weight"].numel() * 4


class _Counter(torch.nn.Module):
    """A module whose state is a Python object (``get_extra_state``), changed every step."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def get_extra_state(self) -> Any:
        return {"n": self.n, "seen": list(range(self.n % 3))}

    def set_extra_state(self, state: Any) -> None:
        self.n = int(state["n"])


class _CountingSGD(torch.optim.SGD):
    """SGD that keeps a Python ``int`` in its per-parameter state."""

    def step(self, closure=None):  # type: ignore[override]
        out = super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["updates"] = self.state[p].get("updates", 0) + 1
        return out


@pytest.mark.timeout(120)
def test_non_tensor_state_is_never_stale(tmp_path):
    model = lm.build("torchtitan")
    model.counter = _Counter()
    opt = _CountingSGD(model.parameters(), lr=1e-2, momentum=0.9)
    with CheckpointManager(cfg_for(tmp_path, k_snapshot=1, k_persist=1), model=model, optimizer=opt) as ckpt:
        for step in range(5):
            train(model, opt, step)
            model.counter.n = step * 7
            ckpt.step(step)
            assert_snapshot_is_live(ckpt, model, opt, step)
            _, trees = ckpt.snapshot_state()
            assert trees["module/counter"]["model"]["counter._extra_state"]["n"] == step * 7
            assert trees["module/head"]["optimizer"]["state"]["head.weight"]["updates"] == step + 1


@pytest.mark.timeout(120)
def test_moved_expert_rows_are_refused_by_name(tmp_path):
    model = lm.build("torchtitan")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with CheckpointManager(cfg_for(tmp_path), model=model, optimizer=opt) as ckpt:
        train(model, opt, 0)
        ckpt.step(0)
        experts = model.layers[0].mlp.experts
        experts.w1 = torch.nn.Parameter(torch.randn(lm.EXPERTS + 1, *experts.w1.shape[1:]))
        with pytest.raises(ValueError, match=r"'layers\.0\.mlp\.experts\.w1'.*build a new CheckpointManager"):
            ckpt.step(1)


# -- two ranks -------------------------------------------------------------------------------
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
                "broadcast_object_list", "all_to_all", "all_to_all_single", "barrier", "gather", "scatter",
                "reduce", "reduce_scatter", "reduce_scatter_tensor", "send", "recv", "isend", "irecv")


class CollectiveCounter:
    """Counts the ``torch.distributed`` collectives the main thread issues while armed
    (moc calls them through the module, so wrapping the module's functions sees them all)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.armed = False
        self.names: list[str] = []
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.armed and threading.current_thread() is threading.main_thread():
                self.names.append(name)
            return fn(*args, **kwargs)
        return counted

    def during(self, call: Any) -> list[str]:
        self.names, self.armed = [], True
        try:
            call()
        finally:
            self.armed = False
        return self.names


def prog_fsdp_counts(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    counter = CollectiveCounter()
    model = lm.build("torchtitan")
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # interval 4: checkpoints at 0, 4, 8, ...; decision points (SIGTERM, persist retries) every step.
    cfg = cfg_for(Path(root), interval=4, k_snapshot=1, k_persist=1, keep_last=50)
    counts: dict[int, list[str]] = {}
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        units = len(ckpt.layout.units)
        assert any("#p" in n for n in ckpt.layout.units), "FSDP2 shards make unit pieces"
        counts[0] = counter.during(lambda: ckpt.step(0))     # before any optimizer.step()
        assert_snapshot_is_live(ckpt, model, opt, 0)
        for step in range(1, 17):
            train(model, opt, step, rank)
            counts[step] = counter.during(lambda: ckpt.step(step))
            if step % 4 == 0:
                assert assert_snapshot_is_live(ckpt, model, opt, step) > 0
                _, trees = ckpt.snapshot_state()
                other = [n for n in trees if n not in ckpt.layout.units and not n.startswith(f"extra/rank{rank}")]
                assert other, "the other rank's shares arrived as remote copies, with their descriptions"
        assert ckpt.plans.replanned == 2 * units      # once at step 0, once when Adam's state appeared
        assert ckpt.coordinator.rounds == 17
    # Unit sizes change at the first checkpoint and when Adam's state appears (step 4's
    # checkpoint): one all-reduce plus one all-gather of the new sizes. Otherwise one
    # all-reduce, at checkpoints and decision points alike.
    expected = {s: ["all_reduce", "all_gather"] if s in (0, 4) else ["all_reduce"] for s in range(17)}
    assert counts == expected, {s: c for s, c in counts.items() if c != expected[s]}


def prog_moved_shard(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    model = lm.build("torchtitan")
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:      # expert parallel: fused expert tensors as DTensor Shard(0)
        mod = layer.mlp.experts
        for pname, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(pname, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    with CheckpointManager(cfg_for(Path(root)), model=model, optimizer=None) as ckpt:
        ckpt.step(0)
        if rank == 1:   # this rank's piece now covers every expert: the layout is stale
            w = model.layers[1].mlp.experts.w2
            whole = DTensor.from_local(torch.zeros(w.shape), mesh, [Replicate()], run_check=False)
            model.layers[1].mlp.experts.w2 = torch.nn.Parameter(whole)
            with pytest.raises(ValueError, match=r"'layers\.1\.mlp\.experts\.w2'"):
                ckpt.step(1)
        else:           # every rank stops at the same checkpoint, none hangs in a collective
            with pytest.raises(CheckpointError, match="another rank could not plan its units"):
                ckpt.step(1)


@pytest.mark.timeout(300)
def test_fsdp2_one_collective_per_steady_state_checkpoint(tmp_path):
    run_ranks(prog_fsdp_counts, 2, tmp_path, str(tmp_path), join_s=250)


@pytest.mark.timeout(200)
def test_a_moved_shard_stops_every_rank_together(tmp_path):
    run_ranks(prog_moved_shard, 2, tmp_path, str(tmp_path), join_s=150)
