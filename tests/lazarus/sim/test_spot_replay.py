"""The simulator's cost models that ``benchmarks/trace`` checked against a live replay of a
real spot trace (issue 41), each pinned with round numbers:

- a spot notice (SIGTERM, ``Event.notice``) costs ``notice_detect_s``, a vanished node
  (SIGKILL) ``detect_s``: the live Lazarus learns of a notice at once, of a kill only when a
  collective breaks; the old model charged every departure the NCCL timeout;
- a torchrun-style checkpoint-restart job (``save_before_scale=False``) that gains a node
  restarts from its newest checkpoint and trains the steps since it again; the old model
  always saved first (no roll back);
- a fixed global batch (``ModelSpec.fixed_batch``, strong scaling) trains the same samples
  per step whatever the nodes; a measured step time per node count (``step_s_by_nodes``);
- each system with its own costs (``SimConfig.system_overrides``, ``--config``'s
  ``systems`` section): the old model gave all systems the same detection and restart;
- ``compress`` and ``spot_kills``: a trace segment replayed 60x faster, its departures
  split per node into seeded kills and notices, as the live bench replays it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lazarus.sim import Event, Scenario, SimConfig, compress, load_overrides, load_trace, segment, simulate
from lazarus.sim import spot_kills
from lazarus.sim._cli import build
from tests.helpers.sim_specs import FLAT, PERF, TINY

TRACES = Path(__file__).resolve().parents[4] / "shared" / "traces"
if not TRACES.is_dir():
    TRACES = Path("/work/shared/traces")

# Every node may hold every expert (Lazarus and DS(FT) keep training on one node).
WIDE = replace(TINY, slots_per_node=2)


def run(system: str, scenario: Scenario, duration: float, **kw) -> dict:
    cfg = SimConfig(model=kw.pop("model", WIDE), nodes=len(scenario.initial), perf=kw.pop("perf", PERF),
                    systems=(system,), duration_s=duration, skew=FLAT, **kw)
    return simulate(cfg, scenario).to_dict()["systems"][system]


def test_a_spot_notice_costs_notice_detect_s_and_a_kill_detect_s() -> None:
    perf = replace(PERF, detect_s=5.0, notice_detect_s=0.5, reconfig_s=1.0)
    nodes = ("n0", "n1", "n2")
    killed = run("lazarus", Scenario(nodes, [Event(10.0, "remove", ("n2",))]), 30.0, perf=perf)
    noticed = run("lazarus", Scenario(nodes, [Event(10.0, "remove", ("n2",), notice=True)]), 30.0, perf=perf)
    assert killed["breakdown"]["reconfiguration"] == pytest.approx(5.0 + 1.0)
    assert noticed["breakdown"]["reconfiguration"] == pytest.approx(0.5 + 1.0)
    # a kill and a notice at the same instant: the job still waits for the kill's detection
    both = Scenario(nodes, [Event(10.0, "remove", ("n1",), notice=True), Event(10.0, "remove", ("n2",))])
    assert run("lazarus", both, 30.0, perf=perf)["breakdown"]["reconfiguration"] == pytest.approx(6.0)
    with pytest.raises(ValueError, match="notice applies to removals"):
        Event(1.0, "add", ("n9",), notice=True)
    with pytest.raises(ValueError, match="notice_detect_s"):
        replace(PERF, notice_detect_s=-1.0)


def test_a_torchrun_style_job_rolls_back_when_a_node_joins() -> None:
    # ds on 2 nodes: 1 s steps, a 1 s save every 5 steps; at 13.5 s (step 11.5, the checkpoint
    # of step 10 durable) a node joins and is taken at once (join window 0)
    sc = Scenario(("n0", "n1"), [Event(13.5, "add", ("n2",))])
    base = replace(PERF, join_window_s=0.0, restart_s=10.0)
    saving = run("ds", sc, 40.0, perf=base)
    torchrun = run("ds", sc, 40.0, perf=replace(base, save_before_scale=False))
    # both drop the half step in flight; torchrun's restart also trains step 10 -> 11 again
    assert saving["breakdown"]["lost"] == pytest.approx(0.5)
    assert torchrun["breakdown"]["lost"] == pytest.approx(1.5)
    # and saves nothing before it restarts (saves at steps 5, 10, 15, 20 against 5, 10, join, 15, 20)
    assert torchrun["breakdown"]["checkpoint"] == pytest.approx(4.0)
    assert saving["breakdown"]["checkpoint"] == pytest.approx(5.0)
    assert torchrun["counts"]["restarts"] == saving["counts"]["restarts"] == 1


def test_a_fixed_global_batch_and_a_measured_step_time_per_node_count() -> None:
    sc = Scenario(("n0", "n1"), [Event(10.0, "remove", ("n1",), notice=True)])
    perf = replace(PERF, notice_detect_s=0.0, reconfig_s=0.0, lazarus_interval_steps=10 ** 6)
    weak = run("lazarus", sc, 20.0, perf=perf)
    strong = run("lazarus", sc, 20.0, perf=perf, model=replace(WIDE, fixed_batch=True))
    # weak scaling: 10 steps of 2 samples then 10 of 1; fixed batch (ref_nodes 2): 2 samples every step
    assert weak["samples"] == pytest.approx(30.0)
    assert strong["samples"] == pytest.approx(40.0)
    # the measured step time at 1 node (0.5 s) replaces step_s there: 10 + 20 steps
    fast = run("lazarus", sc, 20.0, perf=perf, model=replace(WIDE, fixed_batch=True, step_s_by_nodes=[[1, 0.5]]))
    assert fast["steps"] == pytest.approx(30.0) and fast["samples"] == pytest.approx(60.0)
    with pytest.raises(ValueError, match="step_s_by_nodes"):
        replace(WIDE, step_s_by_nodes=[[0, 1.0]])


def test_each_system_with_its_own_costs(tmp_path: Path) -> None:
    sc = Scenario(("n0", "n1", "n2"), [Event(10.0, "remove", ("n2",))])
    over = {"lazarus": {"perf": {"detect_s": 0.25}}, "dsft": {"perf": {"detect_s": 4.0}}}
    cfg = SimConfig(model=WIDE, nodes=3, perf=PERF, systems=("lazarus", "dsft"), duration_s=30.0, skew=FLAT,
                    system_overrides=over)
    out = simulate(cfg, sc).to_dict()["systems"]
    assert out["lazarus"]["breakdown"]["reconfiguration"] == pytest.approx(0.25 + PERF.reconfig_s)
    assert out["dsft"]["breakdown"]["reconfiguration"] == pytest.approx(4.0 + PERF.reconfig_s)
    with pytest.raises(ValueError, match=r"system 'dsft'.*detect_s"):
        SimConfig(model=WIDE, nodes=3, perf=PERF, duration_s=30.0,
                  system_overrides={"dsft": {"perf": {"detect_s": -1.0}}}).for_system("dsft")
    with pytest.raises(ValueError, match="system must be one of"):
        SimConfig(model=WIDE, nodes=3, perf=PERF, duration_s=30.0, system_overrides={"torchft": {}})
    # the same through --config's systems section
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"perf": {"detect_s": 2.0}, "systems": over}))
    assert load_overrides(p)["systems"] == over


def test_compress_and_spot_kills_replay_a_real_trace() -> None:
    tr = load_trace(TRACES / "aws-p3-32nodes.csv", seed=0)
    seg = segment(tr, 4 * 3600, 3600, 3)
    fast = compress(seg, 60)
    assert fast.initial == seg.initial
    assert [e.time_s for e in fast.events] == pytest.approx([e.time_s / 60 for e in seg.events])
    assert [(e.kind, e.nodes) for e in fast.events] == [(e.kind, e.nodes) for e in seg.events]
    split = spot_kills(fast, 0.4, seed=1)
    removed = [n for e in fast.events if e.kind == "remove" for n in e.nodes]
    gone = [e for e in split.events if e.kind == "remove"]
    assert [e.nodes for e in gone] == [(n,) for n in removed]            # one event per node
    assert sum(not e.notice for e in gone) == round(0.4 * len(removed))   # the kill share
    assert [e for e in split.events if e.kind == "add"] == [e for e in fast.events if e.kind == "add"]
    assert spot_kills(fast, 0.4, seed=1).events == split.events           # seeded
    assert {tuple(e.notice for e in spot_kills(fast, 0.4, seed=s).events) for s in range(8)} != {
        tuple(e.notice for e in split.events)}
    assert all(e.notice for e in spot_kills(fast, 0.0).events if e.kind == "remove")
    with pytest.raises(ValueError, match="kill-share"):
        spot_kills(fast, 1.5)
    with pytest.raises(ValueError, match="trace-compress"):
        compress(seg, 0)


def test_the_cli_replays_the_same_compressed_split_trace() -> None:
    import argparse

    from lazarus.sim._cli import register

    root = argparse.ArgumentParser()
    register(root.add_subparsers())
    args = root.parse_args(["simulate", "--trace", str(TRACES / "aws-p3-32nodes.csv"), "--trace-start", "4h",
                            "--trace-minutes", "60", "--trace-cap", "3", "--trace-compress", "60",
                            "--kill-share", "0.3", "--seed", "0", "--duration", "60s"])
    _, sc = build(args)
    want = spot_kills(compress(segment(load_trace(TRACES / "aws-p3-32nodes.csv", seed=0), 4 * 3600, 3600, 3), 60),
                      0.3, seed=0)
    assert sc.initial == want.initial and sc.events == want.events and sc.events
    bad = root.parse_args(["simulate", "--kill-share", "0.3"])
    with pytest.raises(ValueError, match="need --trace"):
        build(bad)


def test_jsonl_trace_carries_notices(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('[0, "add", {"nodes": ["a", "b"]}]\n[1000, "remove", {"nodes": ["a"], "notice": true}]\n'
                 '[2000, "remove", {"nodes": ["b"]}]\n')
    assert [e.notice for e in load_trace(p).events] == [False, True, False]
    p.write_text('[1000, "remove", {"nodes": ["a"], "notice": "yes"}]\n')
    with pytest.raises(ValueError, match="t.jsonl:1"):
        load_trace(p)


def test_a_join_costs_the_members_join_reconfig_s_and_a_failure_reconfig_s() -> None:
    # the live Lazarus: a join stalls the members ~0.1 s, a failure's regroup more; the old
    # model charged both reconfig_s
    perf = replace(PERF, detect_s=1.0, reconfig_s=3.0, join_reconfig_s=0.25, join_window_s=2.0)
    sc = Scenario(("n0", "n1"), [Event(10.0, "add", ("n2",)), Event(20.0, "remove", ("n2",))])
    for system in ("lazarus", "dsft"):
        out = run(system, sc, 40.0, perf=perf)
        assert out["breakdown"]["reconfiguration"] == pytest.approx(0.25 + 1.0 + 3.0, abs=1e-3), system
        assert out["counts"]["reconfigs"] == 2
    same = run("lazarus", sc, 40.0, perf=replace(perf, join_reconfig_s=None))
    assert same["breakdown"]["reconfiguration"] == pytest.approx(3.0 + 1.0 + 3.0, abs=1e-3)
    with pytest.raises(ValueError, match="join_reconfig_s"):
        replace(PERF, join_reconfig_s=-0.5)


def test_the_last_node_with_a_notice_hands_its_state_to_a_joiner() -> None:
    # the live Lazarus: the last member's agent, SIGTERMed while a node joins, trains on and
    # hands the state over (no roll back); the old model restarted from the last checkpoint.
    # n1 joins at 9 s (ready 3 s later); n0, alone, gets its notice at 10 s
    perf = replace(PERF, join_window_s=3.0, notice_detect_s=0.0, reconfig_s=0.5, join_reconfig_s=0.25, min_replicas=1,
                   lazarus_interval_steps=10 ** 6)
    sc = Scenario(("n0",), [Event(9.0, "add", ("n1",)), Event(10.0, "remove", ("n0",), notice=True)])
    out = run("lazarus", sc, 30.0, perf=perf, model=replace(WIDE, fixed_batch=True))
    assert out["counts"]["restarts"] == 0 and out["breakdown"]["lost"] < 1.0
    # one between-steps plan: the joiner in, the leaver out (the departure's regroup)
    assert out["breakdown"]["reconfiguration"] == pytest.approx(0.5, abs=1e-3)
    assert out["breakdown"]["compute"] == pytest.approx(30.0 - 0.5, abs=1.0)
    # a SIGKILL cannot hand over: the job restarts from its checkpoint on the joiner
    killed = Scenario(("n0",), [Event(9.0, "add", ("n1",)), Event(10.0, "remove", ("n0",))])
    assert run("lazarus", killed, 30.0, perf=perf, model=replace(WIDE, fixed_batch=True))["counts"]["restarts"] == 1
    # nor can torchft's replica group (DS(FT)): it dies with its SIGTERM
    assert run("dsft", sc, 30.0, perf=perf, model=replace(WIDE, fixed_batch=True))["counts"]["restarts"] == 1
    # a notice longer ago than the notice period: gone before the joiner comes
    late = replace(perf, notice_period_s=1.0)
    assert run("lazarus", sc, 30.0, perf=late, model=replace(WIDE, fixed_batch=True))["counts"]["restarts"] == 1


def test_a_torchrun_style_restart_begins_anew_when_a_node_joins_during_it() -> None:
    # a kill at 10 s: detection 2 s + restart 10 s + the checkpoint's load 1 s, until 23 s; a
    # node joins at 15 s (join window 0): torchrun stops the workers it is starting and starts
    # them again with the newcomer (10 s from then), the old model let it join for free
    sc = Scenario(("n0", "n1"), [Event(10.0, "remove", ("n1",)), Event(15.0, "add", ("n2",))])
    base = replace(PERF, join_window_s=0.0, restart_s=10.0, detect_s=2.0)
    absorbed = run("ds", sc, 40.0, perf=base)
    torchrun = run("ds", sc, 40.0, perf=replace(base, save_before_scale=False))
    assert absorbed["breakdown"]["restart"] == pytest.approx(13.0)
    assert torchrun["breakdown"]["restart"] == pytest.approx(5.0 + 10.0)
    assert torchrun["counts"]["restarts"] == absorbed["counts"]["restarts"] + 1
