"""Several workers (GPUs) per node: ``lazarus agent --nproc-per-node G``.

Part 1: the plan's rank mapping (contiguous per node), the placement over a node's ranks,
input validation. Part 2: a controller in a thread refusing nodes that do not fit the job.
Part 3: ``lazarus controller`` + ``lazarus agent --nproc-per-node 2`` subprocesses running
``tests/helpers/workers/runtime_fake_worker.py``: one node, one plan, G ranks; one worker's crash restarts
the node's workers together; a SIGTERM takes all of them. Part 4: a controller SIGKILLed and
restarted keeps every node's GPU split (more restart cases: test_nproc_control.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from lazarus.moe._placement import rank_slots  # noqa: E402
from lazarus.planning import Placement  # noqa: E402
from lazarus.runtime import AgentChannel, AgentConfig, Controller, ControllerConfig  # noqa: E402
from lazarus.runtime._plan import Plan, rank_layout  # noqa: E402
from lazarus.runtime._wire import recv_frame, send_frame  # noqa: E402
from lazarus.runtime.controller._planner import InsufficientSlots, LayerSpec, compute_plan  # noqa: E402
from tests.lazarus.runtime.test_control import SECRET, Cluster, wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]

# ============================================================================ part 1


def test_ranks_are_contiguous_per_node() -> None:
    assert rank_layout(["n0", "n1", "n2"], 2) == {"n0": [0, 1], "n1": [2, 3], "n2": [4, 5]}
    assert rank_layout(["x", "y"], 1) == {"x": [0], "y": [1]}
    plan = _plan(["n0", "n1", "n2"], gpus_per_node=2)
    assert plan.world == 6 and plan.ranks == rank_layout(plan.members, 2)
    assert [plan.rank(n, lr, 2) for n in plan.members for lr in (0, 1)] == list(range(6))
    assert _plan(["a", "b"]).world == 2 and _plan(["a", "b"]).rank("b", 0, 1) == 1


def _plan(members: list[str], **fields) -> Plan:
    """A plan message's required fields, and ``fields``."""
    return Plan.from_wire({"generation": 3, "members": members, "store": {"host": "127.0.0.1", "port": 1},
                           "prefix": "lazarus/gen3", **fields})


def test_a_plan_for_another_worker_count_is_refused() -> None:
    plan = _plan(["n0", "n1"], gpus_per_node=2)
    with pytest.raises(RuntimeError, match="2 workers per node but node n1 runs 4"):
        plan.rank("n1", 0, 4)
    with pytest.raises(RuntimeError, match="local rank 2"):
        plan.rank("n1", 2, 2)


def test_plan_spreads_node_slots_over_its_ranks_and_replicas_over_nodes() -> None:
    members = ["n0", "n1", "n2"]
    res = compute_plan(members, {}, [LayerSpec("l0", 4), LayerSpec("l1", 6)], None, slots=4, min_replicas=2,
                       gpus_per_node=2)
    for name, rows in res.layers.items():
        e = 4 if name == "l0" else 6
        assert len(rows) == 3 and all(len(r) == 4 for r in rows)          # per node: c = 4 slots
        placement = Placement(rows, num_experts=e, gpus_per_node=2)
        assert all(len(owners) >= 2 for owners in placement.owners())      # f = 2 distinct nodes
        per_rank = rank_slots(placement)
        assert len(per_rank) == 6 and all(len(r) == 2 for r in per_rank)   # 2 slots per rank
        for i, row in enumerate(rows):                                     # a node's ranks split its row
            assert sorted(per_rank[2 * i] + per_rank[2 * i + 1]) == sorted(row)
            assert not set(per_rank[2 * i]) & set(per_rank[2 * i + 1]) or len(set(row)) < len(row)


def test_fewer_slots_than_workers_cannot_be_planned() -> None:
    with pytest.raises(InsufficientSlots, match="2 slots per node < 4 workers per node"):
        compute_plan(["a", "b"], {}, [LayerSpec("l", 2)], None, slots=2, min_replicas=1, gpus_per_node=4)


@pytest.mark.parametrize("kwargs,match", [
    ({"nproc_per_node": 0}, r"nproc_per_node must be an integer \[1, 1024\], got 0"),
    ({"nproc_per_node": True}, "nproc_per_node must be an integer"),
    ({"nproc_per_node": "2"}, "nproc_per_node must be an integer"),
    ({"nproc_per_node": 4, "slots": 2}, r"slots \(2\) must be >= nproc_per_node \(4\)"),
])
def test_agent_config_validates_nproc_per_node(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AgentConfig(secret=SECRET, worker_command=["true"], **kwargs)


def test_agent_config_accepts_workers_up_to_its_slots() -> None:
    assert AgentConfig(secret=SECRET, worker_command=["true"], nproc_per_node=4, slots=4).nproc_per_node == 4


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_cli_nproc_per_node_must_be_a_positive_integer(value: str) -> None:
    r = subprocess.run([sys.executable, "-m", "lazarus.cli", "agent", "--controller", "127.0.0.1:1",
                        "--nproc-per-node", value, "--", "true"], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert r.returncode == 2
    assert f"--nproc-per-node must be a positive integer, got '{value}'" in r.stderr


def test_channel_local_rank_validation() -> None:
    a, b = socket.socketpair()
    try:
        with pytest.raises(ValueError, match=r"local_rank must be an integer in \[0, 2\)"):
            AgentChannel(b, SECRET, node_id="n0", local_rank=2, local_world_size=2, on_agent_lost=None)
        with pytest.raises(ValueError, match="local_world_size must be an integer >= 1"):
            AgentChannel(b, SECRET, node_id="n0", local_rank=0, local_world_size=0, on_agent_lost=None)
    finally:
        a.close()
        b.close()


# ============================================================================ part 2


def _register(port: int, node: str, **fields: object) -> dict:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        send_frame(sock, SECRET, {"type": "register", "node": node, "incarnation": 1, "pid": os.getpid(), **fields})
        return recv_frame(sock, SECRET)


@pytest.mark.timeout(30)
def test_controller_refuses_nodes_that_do_not_fit_the_jobs_workers_per_node(tmp_path: Path) -> None:
    cfg = ControllerConfig(secret=SECRET, port=0, store_port=0, slots_per_node=2,
                           heartbeat_timeout=timedelta(seconds=30), events_path=tmp_path / "events.jsonl")
    ctl = Controller(cfg)
    ctl.start_in_thread()
    try:
        assert ctl.gpus_per_node is None
        assert _register(ctl.port, "a", nproc=2)["type"] == "registered"     # the first node fixes G = 2
        assert ctl.gpus_per_node == 2
        other = _register(ctl.port, "b", nproc=1)
        assert other["type"] == "error" and "--nproc-per-node 1 differs from this job's 2" in other["reason"]
        assert _register(ctl.port, "c", nproc=2, slots=4)["type"] == "registered"
        assert _register(ctl.port, "d")["type"] == "error"                   # no nproc: 1 worker
    finally:
        ctl.stop()
    ctl2 = Controller(ControllerConfig(secret=SECRET, port=0, store_port=0, slots_per_node=2,
                                       heartbeat_timeout=timedelta(seconds=30)))
    ctl2.start_in_thread()
    try:
        few = _register(ctl2.port, "a", nproc=4)
        assert few["type"] == "error" and "2 slots per node < --nproc-per-node 4" in few["reason"]
        assert ctl2.gpus_per_node is None                                    # a refused node fixes nothing
    finally:
        ctl2.stop()


# ============================================================================ part 3


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(*ctl_args: str, nodes: tuple[str, ...] = ("a", "b")) -> Cluster:
        c = Cluster(tmp_path, ["--expected-nodes", str(len(nodes)), "--slots", "4", *ctl_args])
        made.append(c)
        for n in nodes:
            c.add_agent(n, "--nproc-per-node", "2")
        return c

    yield make
    for c in made:
        c.close()


def _workers(agent_pid: int) -> dict[int, tuple[int, dict[str, str]]]:
    """local rank -> (pid, environment) of an agent's worker processes."""
    from examples.local_cluster import _children

    out = {}
    for pid in _children(agent_pid):
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        env = dict(kv.decode().split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)
        out[int(env["LOCAL_RANK"])] = (pid, env)
    return out


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _started(c: Cluster) -> dict:
    plan = c.wait_plan(20, reason="start")
    assert plan["members"] == ["a", "b"] and plan["gpus_per_node"] == 2 and plan["world_size"] == 4
    for m in ("a", "b"):   # both workers of both nodes applied it
        wait_for(lambda m=m: len(c.events("reconfigured", node=m, generation=1)) == 2, 10,
                 f"both workers of {m} reconfigured\n{c.debug()}")
    return plan


@pytest.mark.timeout(90)
def test_one_node_two_ranks_and_one_worker_crash_restarts_the_nodes_workers(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster()
    _started(c)
    # one worker_ready per node, once both of its workers said hello
    readies = c.events("worker_ready", node="b")
    assert len(readies) == 1 and readies[0]["incarnation"] == 1
    workers = wait_for(lambda: len(_workers(c.agents["b"].pid)) == 2 and _workers(c.agents["b"].pid), 10,
                       "b's two workers")
    for lr, (_, env) in workers.items():   # as torchrun sets them
        assert env["LOCAL_RANK"] == str(lr) and env["LOCAL_WORLD_SIZE"] == "2" and env["LAZARUS_NODE_ID"] == "b"
    # SIGKILL local rank 1 only: the agent stops local rank 0 too, reports the node's
    # exit naming the rank, and the controller drops both ranks in one failure plan
    os.kill(workers[1][0], signal.SIGKILL)
    exit_ = c.wait_event("worker_exit", 10, node="b", incarnation=1)
    assert exit_["returncode"] == -signal.SIGKILL and "local rank 1: killed by SIGKILL" in exit_["error"]
    wait_for(lambda: _gone(workers[0][0]), 10, "the sibling worker stopped")
    failed = c.wait_event("node_failed", 5, node="b")
    assert failed["cause"] == "worker_exit"
    plan = c.wait_plan(10, reason="failure")
    assert plan["members"] == ["a"] and plan["lost"] == ["b"] and plan["world_size"] == 2
    # both workers come back as incarnation 2 and rejoin as one node
    c.wait_event("worker_ready", 20, node="b", incarnation=2)
    join = c.wait_plan(20, reason="join")
    assert join["members"] == ["a", "b"] and join["world_size"] == 4 and join["joined"] == ["b"]
    new = wait_for(lambda: len(_workers(c.agents["b"].pid)) == 2 and _workers(c.agents["b"].pid), 10, "respawn")
    assert {pid for pid, _ in new.values()}.isdisjoint({pid for pid, _ in workers.values()})
    assert not c.events("node_failed", node="a")


@pytest.mark.timeout(90)
def test_sigterm_takes_all_workers_of_the_node(cluster: Callable[..., Cluster]) -> None:
    c = cluster()
    _started(c)
    workers = wait_for(lambda: len(_workers(c.agents["b"].pid)) == 2 and _workers(c.agents["b"].pid), 10,
                       "b's two workers")
    c.agents["b"].send_signal(signal.SIGTERM)   # the agent only: a spot notice
    plan = c.wait_plan(15, reason="leave")
    assert plan["members"] == ["a"] and plan["leaving"] == ["b"] and plan["world_size"] == 2
    assert c.agents["b"].wait(timeout=30) == 0
    assert all(_gone(pid) for pid, _ in workers.values())
    exits = [e for e in c.events("worker_exit", node="b")]
    assert [e["returncode"] for e in exits] == [0]           # one clean exit of the node's workers
    assert not c.events("node_failed")
    time.sleep(0.5)
    assert c.agents["a"].poll() is None


# ============================================================================ part 4


@pytest.mark.timeout(120)
def test_controller_restart_keeps_the_gpu_splits_and_the_jobs_workers_per_node(tmp_path: Path) -> None:
    """3 nodes x 2 workers; the controller is SIGKILLed and restarted. The workers are not
    touched; the restarted controller knows the job's G and the GPU split of every node,
    and plans the next failure from it (test_nproc_control.py has the rest of the
    restart cases)."""
    from tests.lazarus.runtime.test_control import saved_state

    from lazarus.planning import split_node

    c = Cluster(tmp_path, ["--expected-nodes", "3", "--slots", "4", "--resume-grace", "5s"], {"FAKE_EXPERTS": "6"})
    try:
        nodes = ("a", "b", "c")
        for n in nodes:
            c.add_agent(n, "--nproc-per-node", "2")
        plan = c.wait_plan(20, reason="start")
        assert plan["world_size"] == 6 and set(plan["gpus"]) == set(plan["layers"])
        for m in nodes:
            wait_for(lambda m=m: len(c.events("reconfigured", node=m, generation=1)) == 2, 10,
                     f"both workers of {m} reconfigured\n{c.debug()}")
        workers = {n: wait_for(lambda n=n: len(_workers(c.agents[n].pid)) == 2 and _workers(c.agents[n].pid), 10,
                               f"{n}'s two workers") for n in nodes}
        split = {m: {layer: s[i] for layer, s in plan["gpus"].items()} for i, m in enumerate(plan["members"])}
        state = wait_for(lambda: (s := saved_state(c))["applied_gen"] == 1 and s, 10, "plan 1 applied in the state")
        assert state["gpus_per_node"] == 2 and state["gpu_holdings"] == split

        c.kill_group(c.ctl)
        c.ctl.wait(timeout=10)
        time.sleep(0.5)
        c.start_controller()
        resumed = c.wait_event("resumed", 15)
        assert sorted(resumed["back"]) == list(nodes) and resumed["lost"] == []
        for n in nodes:                                  # no worker was restarted
            assert {lr: pid for lr, (pid, _) in _workers(c.agents[n].pid).items()} == \
                {lr: pid for lr, (pid, _) in workers[n].items()}
        assert saved_state(c)["gpu_holdings"] == split and saved_state(c)["epoch"] == 2

        # a failure after the restart: planned from the restored splits
        c.kill_group(c.agents["b"])
        fail = c.wait_plan(15, reason="failure")
        assert fail["members"] == ["a", "c"] and fail["world_size"] == 4
        sent = saved_state(c)["plan"]                   # the plan message as sent
        assert sent["generation"] == fail["generation"] and sent["ranks"] == {"a": [0, 1], "c": [2, 3]}
        assert sent["gpus"] == fail["gpus"]
        for layer, rows in fail["layers"].items():
            for i, m in enumerate(fail["members"]):
                assert fail["gpus"][layer][i] == split_node(rows[i], 2, split[m][layer]).split
        assert fail["fetches"]["same_node"] <= fail["fetches"]["same_node_round_robin"]
        for m in ("a", "c"):
            wait_for(lambda m=m: len(c.events("reconfigured", node=m, generation=fail["generation"])) == 2, 10,
                     f"both workers of {m} applied the failure plan\n{c.debug()}")
    finally:
        c.close()

