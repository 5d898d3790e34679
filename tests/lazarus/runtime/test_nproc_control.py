"""Controller restarts and crash loops with several workers per node (``--nproc-per-node 2``).

``lazarus controller`` + ``lazarus agent --nproc-per-node 2`` subprocesses running
``tests/helpers/workers/runtime_fake_worker.py`` (the ``Cluster`` of ``test_control``), with real
SIGKILLs: the controller restarted while the nodes' worker groups go on, one worker of a
node crashing while nobody watches, a crash loop in one rank of a node, and a node coming
back to a restarted controller with another worker count than the saved job's.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lazarus.runtime._plan import Plan  # noqa: E402
from tests.lazarus.runtime.test_control import Cluster, saved_state, wait_for  # noqa: E402
from tests.lazarus.runtime.test_nproc import _gone, _workers  # noqa: E402

G = 2


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(*ctl_args: str, nodes: tuple[str, ...] = ("a", "b", "c"), expected: int = 3) -> Cluster:
        c = Cluster(tmp_path, ["--expected-nodes", str(expected), "--slots", "4", *ctl_args])
        made.append(c)
        for n in nodes:
            c.add_agent(n, "--nproc-per-node", str(G))
        return c

    yield make
    for c in made:
        c.close()


def _log(c: Cluster, node: str) -> str:
    return (c.tmp / f"agent-{node}.log").read_text()


def _pids(c: Cluster, node: str) -> list[int]:
    """The pids of ``node``'s G running workers, by local rank."""
    got = wait_for(lambda: len(w := _workers(c.agents[node].pid)) == G and w, 10,
                   f"{node}'s {G} workers\n{c.debug()}")
    return [got[lr][0] for lr in range(G)]


def _started(c: Cluster, members: list[str]) -> dict[str, Any]:
    plan = c.wait_plan(20, reason="start")
    assert plan["members"] == members and plan["gpus_per_node"] == G and plan["world_size"] == G * len(members)
    for m in members:   # every worker of every node applied it
        wait_for(lambda m=m: len(c.events("reconfigured", node=m, generation=1)) == G, 10,
                 f"all workers of {m} reconfigured\n{c.debug()}")
    return plan


def _kill_controller(c: Cluster, nodes: tuple[str, ...] = ("a", "b", "c")) -> None:
    """SIGKILL the controller and wait until the agents know (their workers keep running)."""
    c.kill_group(c.ctl)
    c.ctl.wait(timeout=10)
    for n in nodes:
        wait_for(lambda n=n: "lost the controller connection" in _log(c, n), 10, f"agent {n} noticing")


def _check_ranks(plan: dict[str, Any], members: list[str]) -> None:
    """The plan's ranks: contiguous per node, G per node, in member order."""
    assert plan["members"] == members and plan["gpus_per_node"] == G
    typed = Plan.from_wire(plan)
    assert plan["world_size"] == typed.world == G * len(members)
    assert plan["ranks"] == {m: list(range(i * G, (i + 1) * G)) for i, m in enumerate(members)}
    assert [typed.rank(m, lr, G) for m in members for lr in range(G)] == list(range(G * len(members)))
    assert typed.to_wire() == plan


@pytest.mark.timeout(60)
def test_controller_restart_keeps_every_nodes_workers_then_a_failure_is_planned_per_node(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster("--resume-grace", "5s")
    _started(c, ["a", "b", "c"])
    before = {n: _pids(c, n) for n in ("a", "b", "c")}
    state = saved_state(c)
    assert state["gpus_per_node"] == G and state["plan"]["world_size"] == 6
    _kill_controller(c)
    time.sleep(0.5)                                   # away a while: the workers go on
    c.start_controller()
    resumed = c.wait_event("resumed", 15)
    assert sorted(resumed["back"]) == ["a", "b", "c"] and resumed["missing"] == [] and resumed["lost"] == []
    for n in ("a", "b", "c"):
        ev = c.events("node_resumed", node=n)[0]
        assert ev["same_worker"] and ev["member"] and ev["worker_alive"] and ev["worker_ready"]
        assert ev["incarnation"] == 1 and ev["nproc"] == G and ev["worker_pids"] == before[n]
        assert _pids(c, n) == before[n]               # all G workers back, none restarted
    assert not c.events("node_failed") and len(c.events("plan")) == 1
    # the restarted controller kept the job's G, and the next failure is planned with it
    c.kill_group(c.agents["b"])                       # the whole node: agent and both workers
    fail = c.wait_plan(10, reason="failure")
    assert fail["members"] == ["a", "c"] and fail["lost"] == ["b"] and fail["generation"] == 2
    assert fail["gpus_per_node"] == G and fail["world_size"] == 4
    state = saved_state(c)
    assert state["gpus_per_node"] == G and state["epoch"] == 2 and state["members"] == ["a", "c"]
    _check_ranks(state["plan"], ["a", "c"])
    assert state["plan"]["incarnations"] == {"a": 1, "c": 1}
    for m in ("a", "c"):                              # both workers of each survivor applied it
        wait_for(lambda m=m: len(c.events("reconfigured", node=m, generation=2)) == G, 10,
                 f"all workers of {m} reconfigured generation 2\n{c.debug()}")
        assert _pids(c, m) == before[m]
    assert [e["node"] for e in c.events("node_failed")] == ["b"]


@pytest.mark.timeout(60)
def test_one_worker_crash_while_the_controller_is_away_loses_the_node_then_it_rejoins(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster("--resume-grace", "5s")
    _started(c, ["a", "b", "c"])
    old = _pids(c, "b")
    others = {n: _pids(c, n) for n in ("a", "c")}
    _kill_controller(c)
    os.kill(old[1], signal.SIGKILL)                   # local rank 1 of b only
    wait_for(lambda: all(_gone(p) for p in old), 10, "b's sibling worker stopped by its agent")
    wait_for(lambda: "worker incarnation 2 started" in _log(c, "b"), 10, "b's workers restarted")
    new = _pids(c, "b")
    assert set(new).isdisjoint(old)                   # both restarted, as one incarnation
    c.start_controller()
    resumed = c.wait_event("resumed", 15)
    assert sorted(resumed["back"]) == ["a", "b", "c"] and resumed["lost"] == ["b"] and resumed["missing"] == []
    ev = c.events("node_resumed", node="b")[0]
    assert ev["incarnation"] == 2 and ev["planned_incarnation"] == 1 and not ev["same_worker"]
    assert ev["worker_pids"] == new
    assert [e["cause"] for e in c.events("node_failed")] == ["worker_lost_while_away"]
    assert c.events("node_failed")[0]["node"] == "b"
    # the crash queued by b's agent reaches the new controller: one exit of the node's
    # group, naming the rank that died
    exit_ = c.wait_event("worker_exit", 5, node="b", incarnation=1)
    assert exit_["returncode"] == -signal.SIGKILL and "local rank 1: killed by SIGKILL" in exit_["error"]
    assert len(c.events("worker_exit", node="b")) == 1
    fail = c.wait_plan(5, reason="failure")
    assert fail["members"] == ["a", "c"] and fail["lost"] == ["b"] and fail["world_size"] == 4
    join = c.wait_plan(15, reason="join")
    assert join["joined"] == ["b"] and join["generation"] == fail["generation"] + 1
    state = saved_state(c)
    _check_ranks(state["plan"], ["a", "c", "b"])
    assert state["plan"]["incarnations"] == {"a": 1, "c": 1, "b": 2}
    wait_for(lambda: len(c.events("reconfigured", node="b", generation=join["generation"])) == G, 10,
             f"both new workers of b applied the join plan\n{c.debug()}")
    assert _pids(c, "b") == new and "worker incarnation 3" not in _log(c, "b")
    assert {n: _pids(c, n) for n in ("a", "c")} == others


@pytest.mark.timeout(60)
@pytest.mark.parametrize("crash_rank", ["1", "every"])
def test_crash_loop_in_a_node_restarts_its_workers_as_a_whole_then_it_leaves(
        cluster: Callable[..., Cluster], crash_rank: str) -> None:
    """c's local rank 1 (or every rank of c) raises at its 3rd step in every incarnation:
    the node's group is restarted twice (--max-restarts 2: each crash is one restart, not
    one per worker that died), then the node leaves naming the error, with no worker of it
    left behind."""
    c = cluster(nodes=("a", "b"))
    only = ("--env", f"FAKE_CRASH_LOCAL_RANK={crash_rank}") if crash_rank != "every" else ()
    c.add_agent("c", "--nproc-per-node", str(G), "--env", "FAKE_CRASH_AT_STEP=3", *only,
                "--max-restarts", "2", "--restart-window", "1m", "--respawn-delay", "300ms")
    rank = crash_rank if crash_rank != "every" else "[0-9]"
    error = re.compile(rf"local rank {rank}: exit 1: RuntimeError: injected crash at step 3 on node c")
    _started(c, ["a", "b", "c"])
    others = {n: _pids(c, n) for n in ("a", "b")}
    assert c.agents["c"].wait(timeout=45) == 5
    log_c = _log(c, "c")
    assert "RuntimeError: injected crash at step 3 on node c" in log_c
    assert "crashed 3 times" in log_c
    assert re.search("last error: " + error.pattern, log_c)
    assert "restart 2 of at most 2" in log_c and "restart 3 of" not in log_c
    leave = c.wait_event("leave", 5, node="c")
    assert leave["reason"] == "crash_loop" and error.fullmatch(leave["error"])
    # one exit and one ready per incarnation of the node (not per worker)
    exits = [e for e in c.events("worker_exit", node="c") if not e.get("stale")]
    assert [e["incarnation"] for e in exits] == [1, 2, 3]
    assert all(e["returncode"] == 1 and error.fullmatch(e["error"]) for e in exits)
    readies = c.events("worker_ready", node="c")
    assert [e["incarnation"] for e in readies] == [1, 2, 3]
    pids = [p for e in readies for p in e["pids"]]
    assert all(len(e["pids"]) == G for e in readies) and len(set(pids)) == 3 * G
    assert all(_gone(p) for p in pids)                # siblings (local rank 0) included
    # backoff: the k-th restart waits 0.3 s * 2**k
    t_ready = {e["incarnation"]: e["t"] for e in readies}
    assert t_ready[2] - exits[0]["t"] >= 0.3 and t_ready[3] - exits[1]["t"] >= 0.6
    after = wait_for(lambda: [p for p in c.events("plan") if p["t"] >= leave["t"] and "c" not in p["members"]],
                     20, f"a plan without c after its leave\n{c.debug()}")
    assert after[-1]["members"] == ["a", "b"] and after[-1]["world_size"] == 4
    assert "c" not in c.events("plan")[-1]["members"]
    _check_ranks(saved_state(c)["plan"], ["a", "b"])
    assert c.agents["a"].poll() is None and c.agents["b"].poll() is None
    assert {n: _pids(c, n) for n in ("a", "b")} == others
    assert not c.events("node_failed", node="a") and not c.events("node_failed", node="b")


@pytest.mark.timeout(60)
def test_restarted_controller_refuses_a_node_back_with_another_worker_count(
        cluster: Callable[..., Cluster]) -> None:
    """G comes from the saved state: the refused node is the first to reach the new
    controller (a fresh controller would have let it fix G = 1)."""
    c = cluster("--resume-grace", "5s")
    _started(c, ["a", "b", "c"])
    _kill_controller(c)
    c.kill_group(c.agents["c"])                       # node c dies while nobody watches
    c.agents["c"].wait(timeout=10)
    for n in ("a", "b"):                              # hold the others' agents back (workers run on)
        os.kill(c.agents[n].pid, signal.SIGSTOP)
    try:
        t_back = time.time()
        c.start_controller()
        back = c.add_agent("c", "--nproc-per-node", "1")
        assert back.wait(timeout=30) == 1
    finally:
        for n in ("a", "b"):
            os.kill(c.agents[n].pid, signal.SIGCONT)
    reason = "--nproc-per-node 1 differs from this job's 2 workers per node"
    rejected = c.events("register_rejected", node="c")
    assert len(rejected) == 1 and reason in rejected[0]["reason"]
    assert not [e for e in c.events("node_resumed") if e["t"] <= rejected[0]["t"]]   # c came first
    assert f"controller refused us: {reason}" in _log(c, "c")
    resumed = c.wait_event("resumed", 15)
    assert resumed["missing"] == ["c"] and resumed["lost"] == ["c"] and sorted(resumed["back"]) == ["a", "b"]
    fail = c.wait_plan(5, reason="failure")
    assert fail["lost"] == ["c"] and fail["world_size"] == 4
    state = saved_state(c)
    assert state["gpus_per_node"] == G
    _check_ranks(state["plan"], ["a", "b"])
    assert not [e for e in c.events(node="c") if e["t"] >= t_back
                and e["event"] in ("node_registered", "node_resumed", "worker_ready", "join")]
