"""moc's remote snapshot copies go to another node than the unit's holders.

With several ranks per node a node failure takes all of them: a copy on a neighbour of
the holder dies with it. Part 1 checks the choice itself (``copy_targets``) and how a
rank's node is derived; part 2 runs 4 real gloo ranks on 2 "nodes" of 2 ranks, takes a
checkpoint, and reads which units landed in which rank's shared-memory buffer.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest

from moc import MoCConfig  # noqa: E402
from moc._snapshot.plan import copy_targets  # noqa: E402
from moc._topology import check_node, default_node  # noqa: E402


# ============================================================================ part 1


def test_copy_targets_skip_the_holders_node() -> None:
    nodes = ["a", "a", "b", "b", "c", "c"]
    # rank 0 holds the unit alone: rank 1 (its neighbour on node a) is never chosen
    for owner_load in ([0] * 6, [0, 0, 5, 5, 5, 5]):
        picks = copy_targets([0], 0, 6, 2, nodes, list(owner_load))
        assert all(nodes[r] != "a" for r in picks), picks
        assert len({nodes[r] for r in picks}) == 2, picks    # two copies: two different nodes


def test_copy_targets_least_loaded_then_ring_order() -> None:
    nodes = ["a", "a", "b", "b", "c", "c"]
    assert copy_targets([0], 0, 6, 1, nodes, [0] * 6) == [2]            # next rank off node a
    assert copy_targets([0], 0, 6, 1, nodes, [0, 0, 9, 0, 0, 0]) == [3]  # rank 2 already took more
    assert copy_targets([3], 3, 6, 1, nodes, [0] * 6) == [4]


def test_copy_targets_replicas_on_two_nodes_leave_the_third() -> None:
    nodes = ["a", "a", "b", "b", "c", "c"]
    assert copy_targets([0, 3], 0, 6, 3, nodes, [0] * 6) == [4, 5]   # only node c survives both holders


def test_copy_targets_none_when_every_node_holds_it() -> None:
    nodes = ["a", "a", "b", "b"]
    assert copy_targets([1, 2], 1, 4, 1, nodes, [0] * 4) == []       # caller falls back to co-holders


def test_copy_targets_one_rank_per_node_is_the_old_rule() -> None:
    # nodes unknown (empty) or one per rank: every non-holder is a candidate, least load,
    # then ring order after the owner
    for nodes in ([], [f"rank{r}" for r in range(4)]):
        assert copy_targets([1], 1, 4, 1, nodes, [0] * 4) == [2]
        assert copy_targets([1], 1, 4, 2, nodes, [0, 0, 7, 0]) == [3, 0]


def test_default_node_from_the_launcher_environment() -> None:
    host = socket.gethostname()
    assert default_node(3, {}) == "rank3"                                   # no launcher info
    assert default_node(3, {"LOCAL_WORLD_SIZE": "1"}) == "rank3"            # one process per node
    assert default_node(3, {"LOCAL_WORLD_SIZE": "4"}) == host               # several: the host
    assert default_node(3, {"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}) == f"{host}/1"
    assert default_node(3, {"LOCAL_WORLD_SIZE": "x"}) == "rank3"


@pytest.mark.parametrize("bad", ["", 3, None, "x" * 300])
def test_check_node_names_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="node must be a non-empty string"):
        check_node(bad)


# ============================================================================ part 2


def prog_copies(rank: int, world: int, tmp: str, mode: str) -> None:
    """Rank r holds experts {2r, 2r+1} of both layers (no replicas); ranks 0, 1 are node
    a and 2, 3 node b. One checkpoint with 2 snapshot copies; write the units that landed
    in this rank's buffer."""
    import torch

    from tests.helpers.workers.mp_moc_worker import Model
    from moc import CheckpointManager
    from moc._snapshot.buffers import read_headers

    local = [2 * rank, 2 * rank + 1]
    torch.manual_seed(0)
    model = Model(local)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    cfg = MoCConfig(storage=os.path.join(tmp, "ckpt"), snapshot_dir=os.path.join(tmp, "shm"), interval=1,
                    persist_every=1000, snapshot_copies=2, coordination_timeout=timedelta(seconds=30),
                    expert_pattern=r"(?P<layer>.+)\.experts\.(?P<expert>\d+)\.")
    node = "ab"[rank // 2]
    if mode == "explicit":
        ckpt = CheckpointManager(cfg, model=model, optimizer=opt, node=node)
    else:   # what torchrun says: 2 local ranks per node, GROUP_RANK = the node's index
        os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2))
        ckpt = CheckpointManager(cfg, model=model, optimizer=opt)
    ckpt.step(0)
    ckpt.wait(flush=False)
    headers = read_headers(ckpt.snapshot_dir)
    units = sorted({p["unit"] for h in headers for p in h["pieces"] if p["unit"].startswith("expert/")})
    Path(tmp, f"units.{rank}.json").write_text(json.dumps({"node": node, "units": units,
                                                           "nodes": ckpt.inventory.nodes}))
    ckpt.close(flush=False)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["explicit", "environment"])
def test_remote_copies_land_on_the_other_node(tmp_path: Path, mode: str) -> None:
    from tests.helpers.rank_harness import run_ranks

    run_ranks(prog_copies, 4, tmp_path, str(tmp_path), mode)
    got = {r: json.loads((tmp_path / f"units.{r}.json").read_text()) for r in range(4)}
    assert len({tuple(g["nodes"]) for g in got.values()}) == 1          # every rank sees the same map
    layers = sorted({u.split("/")[1] for g in got.values() for u in g["units"]})
    assert len(layers) == 2, layers
    for r in range(4):
        own = {f"expert/{layer}/{e}" for layer in layers for e in (2 * r, 2 * r + 1)}
        assert own <= set(got[r]["units"]), (r, got[r])              # the owner's own share
        neighbour = r ^ 1                                            # the other rank of its node
        assert not own & set(got[neighbour]["units"]), (r, got)      # no copy beside the holder
        other_node = [q for q in range(4) if q // 2 != r // 2]
        for unit in own:   # each expert of rank r has its copy on a rank of the other node
            assert any(unit in got[q]["units"] for q in other_node), (unit, got)
