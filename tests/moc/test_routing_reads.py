"""What moc reads as routing, and the layouts that are not one tensor row per expert:
DBRX's flattened experts, LongCat-Flash's zero-compute rows, JetMoE's slot permutations
and Doge's product-key experts (tiny real transformers models where the zoo builds them).

The expected counts come from the test's own hooks (or are known by construction), never
from moc's taps."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers import hf_zoo as zoo
from moc import CheckpointManager, ExpertLayout, MoCConfig, discover_units
from moc._units.routing import RouterTaps

pytest.importorskip("transformers")
E = 4


class _Router(torch.nn.Module):
    def __init__(self, out):
        super().__init__()
        self.out = out

    def forward(self, x):
        return self.out(x)


class _Layer(torch.nn.Module):
    """One MoE layer whose router returns what ``out`` makes of the input, and whose
    experts are called like transformers' (hidden, ids, weights)."""

    def __init__(self, out, ids=None):
        super().__init__()
        self.router = _Router(out)
        self.experts = torch.nn.Module()
        self.experts.gate_up_proj = torch.nn.Parameter(torch.zeros(E, 2, 3))
        self.experts.forward = lambda h, i, w: h
        self.ids = ids

    def forward(self, x):
        self.router(x)
        if self.ids is not None:
            self.experts(x, self.ids, None)
        return x


@pytest.fixture(params=["host", "device"])
def checks(request):
    """Each drain test twice: readings checked on the host (CPU tensors), and through the
    path GPU readings take (chosen and checked with tensor ops, the flags read after)."""
    return request.param


def _drain(model, widths=None, checks="host"):
    taps = RouterTaps(model, {"m": E}, top_k=2, widths=widths)
    taps.check_on_device = checks == "device"
    model.train()
    model.m(torch.zeros(3, 2))
    got = {}
    taps.drain(lambda layer, c: got.__setitem__(layer, c.tolist()))
    return got


def test_a_slot_permutation_is_not_read_as_ids_but_the_counts_beside_it_are(checks):
    """JetMoE's router returns (slot permutation, token index, gates, tokens per expert,
    logits): the list is what the experts receive; the permutation is not ids."""
    ids = torch.tensor([[0, 1], [1, 3], [1, 0]])
    per_expert = torch.bincount(ids.reshape(-1), minlength=E).tolist()
    perm = ids.reshape(-1).argsort()           # values 0..5: beyond E = 4
    model = torch.nn.Module()
    model.m = _Layer(lambda x: (perm, perm // 2, torch.ones(6), per_expert, torch.randn(3, E)))
    assert _drain(model, checks=checks) == {"m": per_expert}
    # The permutation alone: values >= E, refused by name, never truncated to [1, 1, ...].
    model.m = _Layer(lambda x: (perm, torch.randn(3, E)))
    with pytest.raises(ValueError, match=r"'m'.*m\.router \(_Router\).*values >= 4 \(not expert ids\)"):
        _drain(model, checks=checks)


def test_zero_compute_ids_count_for_no_expert_and_beyond_them_is_an_error(checks):
    ids = torch.tensor([[0, 5], [4, 3], [1, 1]])     # E = 4 experts + 2 zero-compute (ids 4, 5)
    model = torch.nn.Module()
    model.m = _Layer(lambda x: (torch.randn(3, 6), ids))
    assert _drain(model, widths={"m": 6}, checks=checks) == {"m": [1, 2, 0, 1]}
    with pytest.raises(ValueError, match=r"values >= 4"):
        _drain(model, checks=checks)                                 # no zero-compute experts declared


def test_logits_fall_back_to_the_ids_the_experts_are_called_with(checks):
    """DBRX's router returns float logits; the experts are called with the ids."""
    ids = torch.tensor([[2, 1], [2, 3], [0, 2]])
    model = torch.nn.Module()
    model.m = _Layer(lambda x: torch.randn(3, E), ids=ids)
    assert _drain(model, checks=checks) == {"m": [1, 1, 3, 1]}
    model.m = _Layer(lambda x: torch.randn(3, E))      # nothing else to read: an error naming both
    with pytest.raises(ValueError, match=r"m\.router \(_Router\): its float output.*logits"):
        _drain(model, checks=checks)


def test_flattened_experts_explicit_layout_round_trip(tmp_path):
    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bank = torch.nn.Parameter(torch.randn(3 * 2, 5))    # 3 experts x 2 rows
            self.proj = torch.nn.Linear(5, 5)

        def forward(self, x):
            return self.proj(x @ self.bank.T @ self.bank)

    model = Flat()
    found = discover_units(model, layout=ExpertLayout(r"(?P<layer>bank)", expert_dim=0, num_experts=3))
    assert found.layers == {"bank": [0, 1, 2]}
    assert found.expert_unit("bank", 1).refs[0].span == (0, 2, 2)
    assert sum(u.nbytes for u in found.units.values() if u.kind == "expert") == 6 * 5 * 4
    with pytest.raises(ValueError, match=r"'bank': a flattened expert tensor \(6 rows.*declares 4"):
        discover_units(model, layout=ExpertLayout(r"(?P<layer>bank)", expert_dim=0, num_experts=4))
    with pytest.raises(ValueError, match="num_experts .* needs expert_dim"):
        ExpertLayout(r"(?P<layer>a)(?P<expert>\d)", num_experts=2)
    cfg = MoCConfig(storage=str(tmp_path / "s"), snapshot_dir=str(tmp_path / "shm"), interval=1, k_snapshot=1,
                    k_persist=1, dynamic_k=False, expert_layout=ExpertLayout(r"(?P<layer>bank)", expert_dim=0,
                                                                            num_experts=3))
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    history = []
    with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
        for step in range(4):
            model(torch.randn(2, 5)).sum().backward()
            opt.step()
            opt.zero_grad()
            ckpt.record_routing("bank", [1, 1, 1])
            ckpt.step(step)
            ckpt.wait()
            history.append((model.bank.detach().clone(), opt.state[model.bank]["exp_avg"].clone()))
    fresh = Flat()
    opt2 = torch.optim.Adam(fresh.parameters(), lr=0.1)
    with CheckpointManager(cfg, model=fresh, optimizer=opt2) as ckpt:
        assert ckpt.restore() == 4
        versions = {int(n.split("/")[-1]): s.version for n, s in ckpt.last_restore.sources.items()
                    if n.startswith("expert/")}
    assert sorted(versions) == [0, 1, 2] and len(set(versions.values())) > 1   # K = 1: partial
    for e, v in versions.items():      # each expert's two rows from the version it was saved at
        rows = slice(2 * e, 2 * e + 2)
        assert torch.equal(fresh.bank[rows], history[v][0][rows]), e
        assert torch.equal(opt2.state[fresh.bank]["exp_avg"][rows], history[v][1][rows]), e


def _tiny(arch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zoo.build(arch)


def test_longcat_zero_compute_rows_are_saved_with_the_module():
    model = _tiny("longcat_flash")
    layout = discover_units(model)
    layer = "model.layers.0.mlp"
    key = f"{layer}.experts.gate_up_proj"
    E_, rows = model.get_submodule(f"{layer}.experts").num_routed_experts, model.state_dict()[key].shape[0]
    assert rows > E_ and layout.experts_per_layer[layer] == E_ and layout.routed_ids[layer] == rows
    module = layout.units[f"module/{layer}.experts"]
    assert [r.span for r in module.refs if r.key == key] == [(0, E_, rows - E_)]
    # every byte of the model is in exactly one unit
    state = model.state_dict()
    total = sum(v.numel() * v.element_size() for v in state.values())
    assert sum(u.nbytes for u in layout.units.values()) == total


@pytest.mark.parametrize("arch,kind,layers", [
    ("dbrx", "flattened", ["transformer.blocks.0.ffn", "transformer.blocks.1.ffn"]),
    ("jetmoe", "parallel_experts", ["model.layers.0.mlp", "model.layers.0.self_attention.experts",
                                    "model.layers.1.mlp", "model.layers.1.self_attention.experts"]),
    ("doge", "embedding_experts", ["model.layers.0.mlp", "model.layers.1.mlp"]),
])
def test_real_models_route_what_their_experts_receive(tmp_path, arch, kind, layers):
    """moc's counts after two steps equal the test's own count of what the experts are
    called with (DBRX: the ids its experts get; JetMoE: the tokens per expert its
    input_linear gets; Doge: the ids its down_embed looks up)."""
    from tests.helpers.workers import mp_zoo_worker

    model = _tiny(arch)
    layout = discover_units(model)
    assert set(layout.kinds.values()) == {kind} and sorted(layout.layers) == layers
    counts = mp_zoo_worker.expert_counters(model)
    model.train()
    cfg = MoCConfig(storage=str(tmp_path / "s"), snapshot_dir=str(tmp_path / "shm"), interval=1, top_k=zoo.TOP_K)
    with CheckpointManager(cfg, model=model) as ckpt:
        for step in range(2):
            zoo.loss_of(model, zoo.batch(arch, step)).backward()
            ckpt.step(step)
        ckpt.wait()
        assert {l: ckpt.plt_tracker.cum[l] for l in layers} == {l: counts[l].tolist() for l in layers}
        assert all(sum(counts[l].tolist()) > 0 for l in layers)


def test_a_layer_the_user_feeds_is_not_read_from_its_router_too(checks):
    """A readable router (ids [tokens, 2]) whose layer the user also feeds with
    ``record_routing``: the taps leave it alone (its counts booked once, not twice; no
    reading of its values, which on a GPU would wait for the device), other layers are
    still read."""
    ids = torch.tensor([[0, 1], [1, 2], [3, 0]])
    model = torch.nn.Module()
    model.m = _Layer(lambda x: ids)
    model.n = _Layer(lambda x: ids)
    taps = RouterTaps(model, {"m": E, "n": E}, top_k=2)
    taps.check_on_device = checks == "device"
    model.train()
    model.m(torch.zeros(3, 2))
    model.n(torch.zeros(3, 2))
    got = {}
    taps.drain(lambda layer, c: got.__setitem__(layer, c.tolist()), fed=lambda layer: layer == "m")
    assert got == {"n": [2, 2, 1, 1]}


def test_device_checks_choose_the_reading_that_holds_up_per_layer():
    """The device path over two layers at once: one whose router gives logits and whose
    experts get ids (the ids are taken), one whose router gives ids beyond the range and
    whose experts get nothing (unreadable: the error names its router); the flags of
    both travel in one copy and the error comes from the drain that reads them."""
    ids = torch.tensor([[2, 1], [2, 3], [0, 2]])
    model = torch.nn.Module()
    model.a = _Layer(lambda x: torch.randn(3, E), ids=ids)
    model.b = _Layer(lambda x: torch.tensor([[0, 9], [1, 2], [3, 3]]))
    taps = RouterTaps(model, {"a": E, "b": E}, top_k=2)
    taps.check_on_device = True
    model.train()
    model.a(torch.zeros(3, 2))
    model.b(torch.zeros(3, 2))
    got = {}
    with pytest.raises(ValueError, match=r"MoE layer 'b'.*b\.router \(_Router\): its integer output holds values >= 4"):
        taps.drain(lambda layer, c: got.__setitem__(layer, c.tolist()))
    assert taps.unreadable == {"b": "b.router (_Router): its integer output holds values >= 4 (not expert ids)"}
    model.a(torch.zeros(3, 2))
    taps.drain(lambda layer, c: got.__setitem__(layer, c.tolist()), fed=lambda layer: layer == "b")
    assert got == {"a": [1, 1, 3, 1]}
