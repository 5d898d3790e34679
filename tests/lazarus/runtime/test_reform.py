"""Shrink or re-initialise an NCCL group (lazarus/runtime/worker/_reform.py) and
``ElasticConfig.reform``, on the host.

The decision is plain values in, a choice out: every rule of torch's ``shrink_group`` and
of NCCL's ``ncclCommShrink`` that the plan decides is checked here. The members' agreement
on the store (every member's shrink succeeded, or all fall back to a new communicator)
runs in three real processes through the real ``Reconfigurer`` on a real store and gloo
group; the shrunk NCCL communicator itself exists only on a GPU (tests/gpu,
``mp_nccl_shrink.py``), so the one rank that "shrank" here holds a stand-in whose abort is
recorded.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lazarus.runtime import ElasticConfig
from lazarus.runtime.worker._reform import (REFORM_MODES, SHRINK_MIN_NCCL, ReformChoice, choose_reform,
                                            local_shrink_available, shrink_available)

OK = (True, "NCCL 2.27.3 with ncclCommShrink")


def _choose(mode: str = "auto", *, backend: str = "nccl", available=OK, old=("a", "b", "c"), new=("a", "c"),
            old_g: int = 1, new_g: int = 1, intact: bool = True) -> ReformChoice:
    return choose_reform(mode, backend=backend, available=available, old_members=list(old), new_members=list(new),
                         old_gpus_per_node=old_g, new_gpus_per_node=new_g, parent_intact=intact)


def test_a_leave_on_nccl_shrinks_excluding_the_leavers_ranks() -> None:
    c = _choose()
    assert (c.how, c.exclude, c.shrink) == ("shrink", [1], True)
    assert "excluding rank(s) [1] of 3" in c.why
    # G ranks per node: node b's ranks 2 and 3 of 6 go, the others keep their order
    c = _choose(old=("a", "b", "c"), new=("a", "c"), old_g=2, new_g=2)
    assert (c.how, c.exclude) == ("shrink", [2, 3])
    # two nodes leave at once, and 2 -> 1
    assert _choose(old=("a", "b", "c", "d"), new=("b",)).exclude == [0, 2, 3]
    assert _choose(old=("a", "b"), new=("a",)).exclude == [1]
    # "shrink" decides the same way for a plan that allows it
    assert _choose("shrink").exclude == [1]


@pytest.mark.parametrize("kwargs, why", [
    ({"mode": "reinit"}, "ElasticConfig.reform='reinit'"),
    ({"backend": "gloo"}, "the gloo backend cannot shrink"),
    ({"available": (False, "NCCL 2.21.5 has no ncclCommShrink")}, "NCCL 2.21.5 has no ncclCommShrink"),
    ({"intact": False}, "was aborted"),
    ({"new": ("a", "c", "d")}, "1 joiner(s) (d)"),
    ({"new": ("c", "a")}, "reorders the surviving nodes"),
    ({"old_g": 2, "new_g": 1}, "GPUs per node change (2 -> 1)"),
    ({"new": ("a", "b", "c")}, "no rank leaves the group"),
    ({"new": ()}, "no rank remains"),
])
def test_everything_a_shrink_cannot_express_forms_a_new_communicator(kwargs: dict, why: str) -> None:
    c = _choose(**kwargs)
    assert (c.how, c.exclude, c.shrink) == ("reinit", [], False)
    assert why in c.why


def test_shrink_needs_torch_shrink_group_and_nccl_2_27() -> None:
    assert SHRINK_MIN_NCCL == (2, 27, 0)
    assert shrink_available(True, (2, 27, 0))[0] and shrink_available(True, (2, 28, 3))[0]
    ok, why = shrink_available(True, (2, 26, 6))
    assert not ok and why == "NCCL 2.26.6 has no ncclCommShrink (needs >= 2.27.0)"
    assert shrink_available(False, (2, 27, 3)) == (False, "this torch has no torch.distributed.shrink_group")
    assert shrink_available(True, None) == (False, "this torch build has no NCCL")
    # this process: torch 2.13 has shrink_group; a CPU build has no NCCL
    ok, why = local_shrink_available()
    if not (dist.is_nccl_available() and torch.cuda.is_available()):
        assert not ok and why == "this torch build has no NCCL"


def test_reform_is_validated_naming_the_field_and_the_values() -> None:
    assert ElasticConfig().reform == "auto"
    for mode in REFORM_MODES:
        assert ElasticConfig(reform=mode).reform == mode
    for bad in ("Shrink", "", None, 1):
        with pytest.raises(ValueError, match=r"ElasticConfig\.reform must be one of 'auto', 'shrink', 'reinit', got"):
            ElasticConfig(reform=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got .sometimes."):
        choose_reform("sometimes", backend="nccl", available=OK, old_members=["a"], new_members=["a"],
                      old_gpus_per_node=1, new_gpus_per_node=1, parent_intact=True)


def _reconfigurer(node: str, reform: str = "auto", backend: str = "gloo"):
    from lazarus.runtime.worker._reconfigure import Reconfigurer
    from lazarus.runtime.worker._worker_state import WorkerContext

    config = ElasticConfig(device="cpu", reform=reform, collective_timeout=timedelta(seconds=10),
                           rendezvous_timeout=timedelta(seconds=30))
    context = WorkerContext(node=node, local_rank=0, local_world=1, where=node,
                            backend=SimpleNamespace(backend=backend, init_backend=backend), layout={"layers": {}},
                            channel=SimpleNamespace(latest_plan=lambda: None))
    return Reconfigurer(config, context=context, build_model=None, make_optimizer=None)


def test_reform_shrink_refuses_a_trainer_that_cannot_shrink() -> None:
    with pytest.raises(ValueError, match=r"ElasticConfig\.reform='shrink' needs the NCCL backend .* but the gloo "
                                         r"backend cannot shrink \(NCCL only\); use reform='auto'"):
        _reconfigurer("n1", reform="shrink")
    assert _reconfigurer("n1", reform="auto").shrink_available[0] is False


NODES = ["n1", "n2", "n3"]


class _StandIn:
    """Where n1's shrunk NCCL communicator would be (none exists on a CPU): records its abort."""

    def __init__(self, out: dict) -> None:
        self.out = out

    def abort(self) -> None:
        self.out["stand_in_aborted"] = True


def _member(node: str, port: int, out: str) -> None:
    from lazarus.runtime._plan import Plan
    from lazarus.runtime.worker._worker_state import StateDraft, WorkerState

    result: dict = {"node": node}
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("lazarus.reconfigure").addHandler(Keep())
    logging.getLogger("lazarus.reconfigure").setLevel(logging.INFO)
    try:
        torch.set_num_threads(1)
        r = _reconfigurer(node)
        plan = Plan.from_wire({"generation": 5, "members": NODES, "prefix": "lazarus/gen5",
                               "store": {"host": "127.0.0.1", "port": port}})
        # every member chose a shrink; only n1's succeeded (n2 and n3 report failure)
        choice = ReformChoice("shrink", "test", [3])
        shrunk = _StandIn(result) if node == "n1" else None
        r._rendezvous(StateDraft(WorkerState(generation=4, step=17)), plan, shrink=choice, shrunk=shrunk)
        t = torch.ones(1)
        dist.all_reduce(t)
        result["world"], result["sum"] = dist.get_world_size(), float(t)
        result["fallback_logs"] = [m for m in records if "falling back" in m]
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        result["error"] = traceback.format_exc()
    finally:
        Path(out).write_text(json.dumps(result))
        os._exit(0)


@pytest.mark.timeout(180)
def test_one_members_failed_shrink_makes_every_member_form_a_new_communicator(tmp_path: Path) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    outs = {n: str(tmp_path / f"{n}.json") for n in NODES}
    procs = {n: ctx.Process(target=_member, args=(n, server.port, outs[n]), daemon=True) for n in NODES}
    try:
        for p in procs.values():
            p.start()
        for n, p in procs.items():
            p.join(150)
            assert p.exitcode == 0, (n, p.exitcode)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(5)
    results = {n: json.loads(Path(outs[n]).read_text()) for n in NODES}
    for n, r in results.items():
        assert "error" not in r, r["error"]
        assert (r["world"], r["sum"]) == (3, 3.0), r     # a new group, formed the ordinary way
        # the fallback is logged with the node, rank, step and which ranks failed
        assert len(r["fallback_logs"]) == 1, r
        rank = NODES.index(n)
        assert f"node {n} rank {rank} step 17 gen 5: the shrink of the NCCL communicator failed on rank(s) [1, 2]" \
            in r["fallback_logs"][0], r
    assert results["n1"].get("stand_in_aborted") is True      # n1 dropped its own shrunk communicator
    assert "stand_in_aborted" not in results["n2"]
