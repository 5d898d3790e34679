"""The typed plan (``lazarus.runtime._plan.Plan``): its wire form is the ``plan`` message
the controller has always sent and saved (a controller restarted on this code resumes from
an older state file; agents and workers read it), and every bad field is refused by name."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from lazarus.runtime._plan import MODES, Plan, rank_layout
from lazarus.runtime._wire import MalformedMessageError


def controller_plan(**over) -> dict:
    """A plan message as the controller writes it (two nodes of two workers, a GPU split)."""
    msg = {
        "type": "plan", "generation": 4, "mode": "immediate", "reason": "failure",
        "members": ["n0", "n2"], "leaving": [], "incarnations": {"n0": 1, "n2": 3},
        "store": {"host": "10.0.0.1", "port": 29500, "node": "n0", "incarnation": 1},
        "prefix": "lazarus/gen4", "slots": 4, "gpus_per_node": 2, "world_size": 4,
        "ranks": {"n0": [0, 1], "n2": [2, 3]},
        "layers": {"l0": [[0, 1, 2, 3], [0, 1, 2, 3]]}, "lost": ["n1"], "joined": [],
        "detected_at": 1700000000.25, "issued_at": 1700000000.5,
        "fetches": {"greedy": 1, "identity": 3, "same_node": 0, "same_node_round_robin": 2},
        "missing": {}, "transfers": {"l0": [[2, 0, 1]]}, "recovery_probability": {"l0": 1.0},
        "gpus": {"l0": [[[0, 1], [2, 3]], [[0, 1], [2, 3]]]},
    }
    msg.update(over)
    return msg


def test_the_wire_form_round_trips_exactly() -> None:
    msg = controller_plan()
    plan = Plan.from_wire(msg)
    assert plan.to_wire() == msg
    assert json.dumps(plan.to_wire()) == json.dumps(msg)   # the same JSON, field order included
    assert Plan.from_wire(json.loads(json.dumps(plan.to_wire()))) == plan
    no_split = controller_plan(gpus_per_node=1, world_size=2, ranks={"n0": [0], "n2": [1]})
    del no_split["gpus"]   # one worker per node: the controller sends no "gpus"
    assert Plan.from_wire(no_split).to_wire() == no_split and Plan.from_wire(no_split).gpus is None


def test_reading_a_plan_does_not_share_or_change_the_message() -> None:
    msg = controller_plan()
    before = copy.deepcopy(msg)
    plan = Plan.from_wire(msg)
    plan.to_wire()["members"].append("x")
    assert msg == before and plan.members == ["n0", "n2"]


def test_optional_fields_take_todays_defaults() -> None:
    plan = Plan.from_wire({"generation": 2, "members": ["a", "b"], "store": {"host": "h", "port": 1},
                           "prefix": "lazarus/gen2"})
    assert (plan.mode, plan.reason, plan.leaving, plan.joined, plan.lost, plan.incarnations) == \
        (None, None, [], [], [], {})
    assert (plan.gpus_per_node, plan.world, plan.layers, plan.gpus, plan.issued_at) == (1, 2, {}, None, None)
    nulls = Plan.from_wire(controller_plan(incarnations=None, gpus=None, detected_at=None, fetches=None))
    assert nulls.incarnations == {} and nulls.gpus is None and nulls.detected_at is None
    assert Plan.from_wire(controller_plan(unknown_later_field=1)) == Plan.from_wire(controller_plan())
    assert set(MODES) == {"immediate", "between_steps"}


def test_ranks_are_contiguous_per_node_and_errors_keep_their_texts() -> None:
    plan = Plan.from_wire(controller_plan())
    assert plan.world == 4 and plan.ranks == rank_layout(["n0", "n2"], 2) == {"n0": [0, 1], "n2": [2, 3]}
    assert [plan.rank(n, lr, 2) for n in plan.members for lr in (0, 1)] == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match=r"plan 4 has 2 workers per node but node n2 runs 1 "
                                           r"\(--nproc-per-node must be the same on every node\)"):
        plan.rank("n2", 0, 1)
    with pytest.raises(RuntimeError, match=r"local rank 2 outside \[0, 2\)"):
        plan.rank("n2", 2, 2)
    with pytest.raises(ValueError):
        plan.rank("n1", 0, 2)   # no member


@pytest.mark.parametrize("field, value", [
    ("type", "registered"),
    ("generation", None), ("generation", 0), ("generation", "4"), ("generation", True),
    ("members", None), ("members", "n0"), ("members", ["n0", 3]), ("members", ["n0", "n0"]),
    ("store", None), ("store", {"host": "h"}), ("store", {"host": "", "port": 1}),
    ("store", {"host": "h", "port": 70000}), ("store", {"host": "h", "port": True}),
    ("prefix", None), ("prefix", ""),
    ("mode", "later"), ("reason", 3),
    ("leaving", None), ("leaving", [1]), ("lost", "n1"), ("joined", [None]),
    ("incarnations", {"n0": "1"}), ("incarnations", [["n0", 1]]),
    ("slots", 0), ("slots", 2.0),
    ("gpus_per_node", 0), ("gpus_per_node", "2"),
    ("world_size", 5), ("ranks", {"n0": [0, 2], "n2": [1, 3]}),
    ("layers", []), ("layers", {"l0": [[0, 1, 2, 3]]}), ("layers", {"l0": [[0, -1], [1, 2]]}),
    ("layers", {"l0": [[0, "1"], [1, 2]]}),
    ("detected_at", "now"), ("issued_at", False),
    ("fetches", 3), ("missing", None), ("transfers", []), ("recovery_probability", 1.0),
    ("gpus", {"l0": [[[0, 1], [2, 3]]]}), ("gpus", [1]),
])
def test_a_bad_field_is_refused_by_name_and_value(field: str, value) -> None:
    with pytest.raises(MalformedMessageError) as err:
        Plan.from_wire(controller_plan(**{field: value}))
    assert f"plan field {field!r} must be" in str(err.value)
    assert repr(value)[:40] in str(err.value)


@pytest.mark.parametrize("field", ["generation", "members", "store", "prefix"])
def test_a_required_field_missing_is_named(field: str) -> None:
    msg = controller_plan()
    del msg[field]
    with pytest.raises(MalformedMessageError, match=f"plan field {field!r} must be"):
        Plan.from_wire(msg)


def test_a_plan_that_is_no_object_is_refused() -> None:
    with pytest.raises(MalformedMessageError, match="a plan must be an object"):
        Plan.from_wire([1, 2])   # type: ignore[arg-type]


def test_the_plan_module_is_pure_python() -> None:
    # the agent reads plans: neither torch nor numpy may come with them
    code = ("import sys, lazarus.runtime._plan, lazarus.runtime.agent._agent; "
            "print('torch' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def _old_state(plan: dict) -> dict:
    """A state file as the controller wrote it before plans were typed."""
    return {"version": 1, "epoch": 2, "port": 29400, "store_port": 29401, "generation": plan["generation"],
            "plan": plan, "members": plan["members"], "stalled": False, "applied_gen": plan["generation"],
            "holdings": {"n0": {"l0": [0, 1, 2, 3]}, "n2": {"l0": [0, 1, 2, 3]}}, "gpu_holdings": {},
            "model": {"layers": {"l0": 4}}, "routing": {}, "last_step": 40, "last_rebalance_step": 20,
            "done": [], "left": [], "finished": False, "gpus_per_node": 2, "saved_at": 1700000001.0}


def test_a_controller_resumes_from_a_state_written_before_plans_were_typed(tmp_path) -> None:
    from lazarus.runtime import Controller, ControllerConfig

    (tmp_path / "state.json").write_text(json.dumps(_old_state(controller_plan())))
    ctl = Controller(ControllerConfig(secret=b"s" * 32, port=0, store_port=0, state_dir=tmp_path))
    assert ctl._load_state() is not None
    assert ctl.plan == controller_plan() and ctl._state_dict()["plan"] == controller_plan()
    assert ctl._membership.plan == Plan.from_wire(controller_plan())

    (tmp_path / "state.json").write_text(json.dumps(_old_state(controller_plan(store={"host": "h"}))))
    with pytest.raises(ValueError, match="field 'plan': plan field 'store' must be"):
        Controller(ControllerConfig(secret=b"s" * 32, port=0, store_port=0, state_dir=tmp_path))._load_state()
