"""Who is dropped after a collective error, from who reports whom unreachable
(lazarus.runtime.controller._reachability), the agent's probe (agent/_probe.py) against real
sockets, and the membership acting on the reports (a fake port, a fake clock)."""

from __future__ import annotations

import asyncio
import socket
from datetime import timedelta

import pytest

from lazarus.runtime._wire import MalformedMessageError
from lazarus.runtime.agent._probe import parse_targets, unreachable
from lazarus.runtime.controller._reachability import cut_off, probe_targets

from .test_membership import started

M = ["n0", "n1", "n2", "n3"]


def test_two_nodes_that_lost_each_other_one_goes_the_later() -> None:
    assert cut_off(M, {"n2": ["n3"], "n3": ["n2"], "n0": [], "n1": []}) == ["n3"]
    assert cut_off(M, {"n2": ["n3"]}) == ["n3"]     # one side's report is enough


def test_a_node_cut_from_every_peer_is_the_one_dropped() -> None:
    reports = {"n0": ["n2"], "n1": ["n2"], "n3": ["n2"], "n2": ["n0", "n1", "n3"]}
    assert cut_off(M, reports) == ["n2"]
    assert cut_off(M, {"n0": ["n2"], "n1": ["n2"]}) == ["n2"]   # n2's own report lost on the way


def test_no_broken_link_drops_nobody_and_strangers_are_ignored() -> None:
    assert cut_off(M, {}) == [] and cut_off(M, {m: [] for m in M}) == []
    assert cut_off(M, {"n0": ["n9", "n0"], "n9": ["n1"]}) == []


def test_probe_targets_are_the_published_addresses() -> None:
    assert probe_targets({"a": {"host": "192.0.2.1", "port": 5}, "b": None, "c": {}}) == {"a": ["192.0.2.1", 5]}


@pytest.mark.timeout(30)
def test_the_agent_probe_finds_a_closed_port() -> None:
    # (a silent peer, whose packets vanish, is test_netns's cut: this machine's own network
    # may answer for any outside address)
    with socket.socket() as live, socket.socket() as closed:
        live.bind(("127.0.0.1", 0))
        live.listen()
        closed.bind(("127.0.0.1", 0))   # bound, not listening: refused
        msg = {"type": "probe", "timeout_s": 0.5, "targets": {
            "me": ["127.0.0.1", 1], "up": ["127.0.0.1", live.getsockname()[1]],
            "refused": ["127.0.0.1", closed.getsockname()[1]]}}
        targets, timeout = parse_targets(msg, exclude="me")
        assert sorted(targets) == ["refused", "up"] and timeout == 0.5
        assert asyncio.run(unreachable(targets, timeout)) == ["refused"]


@pytest.mark.parametrize("bad, field", [({"targets": {}}, "timeout_s"),
                                        ({"targets": [], "timeout_s": 1}, "targets"),
                                        ({"targets": {"a": ["h", 0]}, "timeout_s": 1}, "'a'")])
def test_a_bad_probe_names_its_field(bad: dict, field: str) -> None:
    with pytest.raises(MalformedMessageError, match=field):
        parse_targets({"type": "probe", **bad}, exclude="x")


def _with_stores(c, nodes) -> None:
    for i, n in enumerate(nodes):
        c.m.nodes[n].store = {"host": f"192.0.2.{20 + i}", "port": 4000 + i}


def test_membership_drops_the_node_the_probes_name_not_the_majority() -> None:
    c = started("a", "b", "c", failure_grace=timedelta(milliseconds=200))
    _with_stores(c, ["a", "b", "c"])
    for n in ("a", "b", "c"):
        c.worker(n, type="collective_error", generation=1, error="timeout")
    probes = [(n, m) for n, m in c.sent if m.get("type") == "probe"]
    assert sorted(n for n, _ in probes) == ["a", "b", "c"]   # once, to every member, with every address
    assert probes[0][1]["targets"] == {"a": ["192.0.2.20", 4000], "b": ["192.0.2.21", 4001], "c": ["192.0.2.22", 4002]}
    c.loop.advance(0.3)
    assert len(c.plans()) == 1, "planned before the probe reports came"
    c.m.on_message("a", {"type": "probe_result", "generation": 1, "unreachable": ["c"]})
    c.m.on_message("b", {"type": "probe_result", "generation": 1, "unreachable": []})
    c.m.on_message("c", {"type": "probe_result", "generation": 1, "unreachable": ["a"]})
    c.loop.advance(0.1)
    plan = c.plans()[-1]
    assert plan["reason"] == "collective_error" and plan["members"] == ["a", "b"] and plan["lost"] == ["c"]
    assert [e["dropped"] for e in c.named("peers_unreachable")] == [["c"]]


def test_membership_plans_with_the_reports_it_has_when_one_never_comes() -> None:
    c = started("a", "b", "c", failure_grace=timedelta(milliseconds=200))
    _with_stores(c, ["a", "b", "c"])
    c.worker("a", type="collective_error", generation=1, error="timeout")
    c.m.on_message("a", {"type": "probe_result", "generation": 1, "unreachable": ["b"]})
    c.m.on_message("c", {"type": "probe_result", "generation": 1, "unreachable": ["b"]})
    c.loop.advance(1.0)
    assert len(c.plans()) == 1
    c.loop.advance(1.0)   # past the probe timeout and its slack: b never answered
    assert c.plans()[-1]["members"] == ["a", "c"]


def test_a_dropped_node_joins_again_only_once_every_link_to_it_is_back() -> None:
    c = started("a", "b", "c", failure_grace=timedelta(milliseconds=200))
    _with_stores(c, ["a", "b", "c"])
    c.worker("a", type="collective_error", generation=1, error="timeout")
    for n, lost in (("a", ["c"]), ("b", []), ("c", ["a"])):
        c.m.on_message(n, {"type": "probe_result", "generation": 1, "unreachable": lost})
    c.loop.advance(0.3)
    assert c.plans()[-1]["members"] == ["a", "b"] and c.named("evicted")
    c.applied(2)
    # its agent restarts the worker, which registers and is ready again: probed, not planned
    c.sent.clear()
    c.register("c", store={"host": "192.0.2.22", "port": 4100})
    admit = [(n, m) for n, m in c.sent if m.get("type") == "probe"]
    assert sorted(n for n, _ in admit) == ["a", "b", "c"] and {m["generation"] for _, m in admit} == {"admit:c"}
    assert dict(admit)["a"]["targets"] == {"c": ["192.0.2.22", 4100]}
    assert not [p for p in c.plans() if "c" in p["members"] and p["generation"] > 1]
    for n, lost in (("a", ["c"]), ("b", []), ("c", ["a"])):   # still cut
        c.m.on_message(n, {"type": "probe_result", "generation": "admit:c", "unreachable": lost})
    assert c.named("join_deferred")[-1]["unreachable"] == ["a"]
    c.loop.advance(3.6)   # probed again after 2 s; no answer at all defers again (4 s)
    assert len(c.named("join_deferred")) == 2 and c.named("join_deferred")[-1]["no_answer"] == ["a", "b", "c"]
    assert all(len(p["members"]) == 2 for p in c.plans()[1:])
    c.loop.advance(4.0)   # the third probe: every link is back
    for n in ("a", "b", "c"):
        c.m.on_message(n, {"type": "probe_result", "generation": "admit:c", "unreachable": []})
    assert c.named("reachable_again") and c.named("join")[-1]["node"] == "c"
    c.loop.advance(2.0)
    assert c.plans()[-1]["members"] == ["a", "b", "c"] and c.plans()[-1]["reason"] == "join"
