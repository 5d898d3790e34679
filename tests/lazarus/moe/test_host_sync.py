"""The MoE layer's dispatch reads the device back once per call: the split sizes of the
all-to-alls (with the received and routing counts and the validity flags, packed into one
tensor). Everything else known on the device stays there. Counted on the CPU with
:class:`sync_audit.SyncAudit` (host reads of device tensors and value-sized ops), on one
rank and on two gloo ranks with fused experts (grouped matmul offsets) and rows arriving
out of expert order (the re-sort on the device). ``tests/gpu`` checks the same on a GPU
with ``torch.cuda.set_sync_debug_mode``.

Bad expert ids are found on the device too and reported with that one read, on every rank
(none is left waiting in the all-to-all).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lazarus.dispatch import load_ops
from lazarus.moe import MoEConfig, MoELayer
from lazarus.planning import Placement
from tests.helpers.rank_harness import run_ranks
from tests.helpers.sync_audit import SyncAudit


def test_one_rank_forward_reads_the_device_once() -> None:
    cfg = MoEConfig(d_model=16, d_hidden=32, num_experts=6, top_k=2, seed=3)
    layer = MoELayer(cfg, Placement([list(range(6))]))
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    load_ops()      # once per process (its probe reads back a tiny result): not per call
    with SyncAudit() as audit:
        y = layer(x)
    assert audit.to_host_calls == 1 and audit.device_reads == ["to_host"], audit.device_reads
    assert audit.sync_ops == [], audit.sync_ops
    assert audit.syncs == 1
    with SyncAudit() as back:
        y.square().sum().backward()
    assert back.syncs == 0, (back.device_reads, back.sync_ops)
    assert x.grad is not None and layer.routing_counts.sum() == 80


def test_the_audit_sees_the_syncs_it_must() -> None:
    """The instrument itself: host reads of device tensors and value-sized ops are seen,
    reads of what to_host returned are free."""
    from lazarus.moe import _layer

    t = torch.arange(6)
    with SyncAudit() as a:
        t.tolist()
        int(t[2])
        torch.bincount(t)
        t.nonzero()
        h = _layer.to_host(t + 1)
        h.tolist()
        int(h.sum())
        torch.repeat_interleave(t, t, output_size=15)
    assert a.device_reads == ["tolist", "__int__", "to_host"], a.device_reads
    assert a.sync_ops == ["aten.bincount.default", "aten.nonzero.default"], a.sync_ops


def _two_ranks(rank: int, world: int) -> None:
    import torch.nn.functional as F

    from lazarus.dispatch import load_ops

    from lazarus.moe import ElasticMoE, GroupedExperts, SoftmaxRouter, grouped_mm

    E, D, FF = 4, 8, 12

    class SwiGLU(GroupedExperts):
        def run(self, x, counts):
            gate, up = grouped_mm(x, self.gate_up_proj.transpose(-2, -1), counts).chunk(2, dim=-1)
            return grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), counts)

    class Toy(ElasticMoE):
        def __init__(self, placement):
            super().__init__(E)
            mine = sorted(set(self._check_placement(placement)[self.rank]))
            g = torch.Generator().manual_seed(6)
            w = {"gate_up_proj": torch.randn(E, 2 * FF, D, generator=g),
                 "down_proj": torch.randn(E, D, FF, generator=g)}
            self.router = SoftmaxRouter(D, E, 2, seed=5)
            self.experts = SwiGLU(E, mine, {n: t[mine] for n, t in w.items()})
            self._init_placement(placement)

    # every expert on both ranks: each rank serves half of every expert's tokens, so rank r
    # receives experts 0..3 from rank 0 and then 0..3 from rank 1 (out of expert order)
    layer = Toy(Placement([[0, 1, 2, 3], [0, 1, 2, 3]]))
    load_ops()
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(64, D, generator=g, requires_grad=True)
    ids = torch.randint(0, E, (64, 2), generator=g)
    gates = torch.rand(64, 2, generator=g)
    with SyncAudit() as audit:
        y = layer.dispatch(x, ids, gates)
    assert audit.device_reads == ["to_host"] and audit.sync_ops == [], (audit.device_reads, audit.sync_ops)
    assert layer.last_received_per_expert.sum() == layer.last_received
    received = layer.last_received_per_expert
    assert (received > 0).all(), received            # rows of every expert from both ranks: the re-sort ran
    y.sum().backward()
    assert x.grad is not None
    # A bad expert id on rank 0 only: both ranks raise, naming the range (nobody hangs).
    bad = ids.clone()
    if rank == 0:
        bad[3, 1] = E + 2
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 4\): 1 routed token slot"):
        layer.dispatch(x.detach(), bad, gates)


@pytest.mark.timeout(240)
def test_two_ranks_fused_experts_read_the_device_once_and_agree_on_bad_ids(tmp_path: Path) -> None:
    run_ranks(_two_ranks, 2, tmp_path)
