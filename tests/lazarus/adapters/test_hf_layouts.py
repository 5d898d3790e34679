"""``make_elastic`` on the transformers MoE blocks with layouts of their own
(``lazarus/adapters/hf/_layouts.py``): Llama 4 (experts called with one dense, pre-scaled
input), DBRX (flattened experts), JetMoE (parallel experts), LongCat-Flash (zero-compute
identity experts), Switch Transformers and NLLB-MoE (one module per expert, called with a
mask; seq2seq). All six were refused before these layouts.

Tiny random models from the zoo's configs (``tests/helpers/hf_zoo.py``, nothing
downloaded), dropout, layer drop and router jitter off (random draws differ between
processes):

* 2 and 4 gloo ranks (real processes), experts placed with replicas by Lazarus: each step's
  loss (mean over ranks) equals the single-process model's on the same data (each rank's
  rows a forward of their own, as data parallelism runs them: NLLB-MoE's expert capacity is
  per forward), and after three SGD-with-momentum steps every weight equals the
  single-process model's (experts by row, in the elastic layout);
* moc checkpoints the elastic models: its units are exactly the experts each rank holds;
* ``set_placement`` moves experts between ranks mid-training (fused rows and per-expert
  modules alike) and the job still equals the single-process model.

The single-process comparison of every architecture (loss, every gradient, the state dict
loading into the original class) is ``tests/moc/test_hf_zoo.py::test_make_elastic_equals_the_original``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lazarus.adapters.hf import ElasticHFBlock, make_elastic, moe_blocks, original_state_dict
from lazarus.adapters.hf._layouts import LAYOUTS, layout_of
from lazarus.moe import moe_layers, sync_moe_gradients
from lazarus.planning import Placement
from tests.helpers import hf_zoo as zoo
from tests.helpers.dense_sync import sync_dense
from tests.helpers.rank_harness import run_ranks

transformers = pytest.importorskip("transformers")

ARCHS = ("llama4_text", "dbrx", "jetmoe", "longcat_flash", "switch_transformers", "nllb-moe")
STEPS, PER_RANK = 3, 2


def build(arch: str, seed: int) -> torch.nn.Module:
    """The zoo's tiny model with dropout, layer drop and router jitter off, in training mode."""
    model = zoo.build(arch, seed=seed)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for key, value in list(vars(m).items()):
            if isinstance(value, float) and any(w in key for w in ("dropout", "jitter", "layerdrop")):
                setattr(m, key, 0.0)
    return model.train()


def test_every_layout_is_tested_here() -> None:
    assert sorted(ARCHS) == sorted(layout.arch for layout in LAYOUTS.values())
    for arch in ARCHS:
        model = build(arch, 0)
        blocks = moe_blocks(model)
        assert blocks and all(layout_of(b) is not None and layout_of(b).arch == arch for b in blocks.values())
        make_elastic(model)
        assert all(isinstance(m, ElasticHFBlock) for _, m in moe_layers(model))


def test_original_state_dict_needs_every_expert() -> None:
    model = make_elastic(build("dbrx", 0))
    block = next(m for _, m in moe_layers(model))
    block.experts.reassign([0, 1], {})                      # as a rank holding two of four experts
    with pytest.raises(ValueError, match=r"holds experts \[0, 1\] of 4"):
        original_state_dict(model)


def _expected(ref: torch.nn.Module, model: torch.nn.Module, key: str, ref_state: dict) -> torch.Tensor:
    """``key`` of the elastic ``model`` as the single-process ``ref`` holds it."""
    if key in ref_state and ref_state[key].shape == model.state_dict()[key].shape:
        return ref_state[key]
    layer, name = key.rsplit(".experts.", 1)
    ids = model.get_submodule(layer).experts.local_expert_indices
    if key in ref_state:                                    # fused rows in the original's names (Llama 4)
        return ref_state[key][ids]
    block = ref.get_submodule(layer)                        # held in another layout (DBRX, JetMoE, LongCat)
    spec = layout_of(block).experts(block)
    return spec.tensors[name][ids] if name in spec.tensors else spec.buffers[name]


def _train(rank: int, world: int, arch: str, slots: list[list[int]], tmp: Path,
           move_to: list[list[int]] | None = None) -> None:
    """Train ``ref`` in one process and the elastic model on ``world`` ranks side by side;
    ``move_to``: after the first step every layer moves to that placement (experts copied
    between ranks by ``set_placement``; plain SGD, as the moved tensors are new)."""
    from moc import CheckpointManager, MoCConfig, discover_units

    ref = build(arch, 5)
    model = make_elastic(build(arch, 5), Placement(slots, num_experts=zoo.EXPERTS))
    layers = dict(moe_layers(model))
    assert layers and all(layer.local_experts == sorted(set(slots[rank])) for layer in layers.values())
    units = discover_units(model).layers
    for name, layer in layers.items():                      # moc sees exactly this rank's experts
        assert sorted(units[name]) == layer.local_experts, (arch, name, units.get(name))
    momentum = 0.9 if move_to is None else 0.0
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=momentum)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=momentum)
    ckpt = None
    if move_to is None:
        ckpt = CheckpointManager(MoCConfig(storage=str(tmp / f"ckpt-{arch}"), interval=1,
                                           snapshot_dir=str(tmp / f"shm-{arch}-{rank}")), model=model, optimizer=opt)
    for step in range(STEPS):
        if move_to is not None and step == 1:
            for layer in layers.values():
                layer.set_placement(Placement(move_to, num_experts=zoo.EXPERTS))
                assert layer.local_experts == sorted(set(move_to[rank]))
                assert layer.experts.expert_ids == layer.local_experts
            opt = torch.optim.SGD(model.parameters(), lr=0.2)
        inputs = zoo.batch(arch, step, rows=world * PER_RANK)
        parts = [{k: v[r * PER_RANK:(r + 1) * PER_RANK] for k, v in inputs.items()} for r in range(world)]
        opt_ref.zero_grad()
        loss_ref = sum(zoo.loss_of(ref, part) for part in parts) / world
        loss_ref.backward()
        opt_ref.step()
        opt.zero_grad()
        loss = zoo.loss_of(model, parts[rank])
        loss.backward()
        sync_moe_gradients(model)                           # experts over replicas, routers averaged
        sync_dense(model, world)
        opt.step()
        if ckpt is not None:
            ckpt.step(step)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, loss_ref.detach(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, s=step: f"{arch} step {s}: {m}")
        routed = [layer.routing_counts for layer in layers.values()]
        assert all(c is not None and int(c.sum()) > 0 for c in routed), (arch, step)
    if ckpt is not None:
        ckpt.close()
    ref_state = ref.state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, _expected(ref, model, key, ref_state), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, k=key: f"{arch} {k}: {m}")


def prog_train(rank: int, world: int, slots: list[list[int]], tmp: str,
               moves: tuple[list[list[int]] | None, ...] = (None,)) -> None:
    """Every architecture, once per entry of ``moves`` (None: no move; see :func:`_train`)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    for arch in ARCHS:
        for move_to in moves:
            _train(rank, world, arch, slots, Path(tmp), move_to)


# 2 ranks: expert 0 on both; rank 0 has two slots of expert 1; 3 only on rank 1.
SLOTS_2 = [[0, 1, 1], [0, 2, 3]]
# ... and after the move (set_placement): fused rows and per-expert modules change ranks
MOVED_2 = [[1, 2, 3], [0, 3, 0]]
# 4 ranks, 2 slots each: every expert twice.
SLOTS_4 = [[0, 1], [2, 3], [0, 2], [1, 3]]


@pytest.mark.timeout(500)
def test_two_ranks_equal_one_process_and_experts_move_between_ranks(tmp_path: Path) -> None:
    """On 2 ranks the job equals the single-process model; and so it does when
    set_placement moves the experts of every layout (fused rows, per-expert modules)
    between ranks mid-training. Both in one run of the ranks (their start-up costs more
    than the training)."""
    run_ranks(prog_train, 2, tmp_path, SLOTS_2, str(tmp_path), (None, MOVED_2), join_s=450)


@pytest.mark.timeout(500)
def test_four_ranks_equal_one_process(tmp_path: Path) -> None:
    run_ranks(prog_train, 4, tmp_path, SLOTS_4, str(tmp_path), join_s=450)
