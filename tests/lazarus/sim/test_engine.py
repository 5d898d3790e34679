"""Tests of :mod:`lazarus.sim._engine` (``SystemRun``: the event loop and time accounting of
one simulated system), built directly from a system, a routing and a scenario.

Pinned here: events are applied in time order whatever order the scenario lists them in;
failures and joins change the nodes the timeline computes on; the buckets tile the
simulated time; ETTR stays in [0, 1] and falls as failures get more frequent; compute
that a roll back discards is relabelled ``lost``; a run is a function of its seed.
"""

from __future__ import annotations

import math
import random

import pytest

from lazarus.sim import BUCKETS, Event, ModelSpec, PerfParams, Scenario, SimConfig, SkewSpec, SystemRun
from lazarus.sim import bamboo, fail_every
from lazarus.sim._routing import ZipfRouting
from lazarus.sim._systems import make_system
from tests.helpers.sim_specs import FLAT, PERF, TINY

# Small enough to simulate hours in well under a second, with skewed routing and replicas.
MID = ModelSpec(name="mid", num_experts=8, moe_layers=2, expert_params=0.1e9, non_expert_params=0.2e9,
                bytes_per_param=12.0, gpus_per_node=1, slots_per_node=2, samples_per_node_step=8,
                step_s=1.0, ref_nodes=8, expert_fraction=0.3)


def build(system: str, scenario: Scenario, *, model: ModelSpec = TINY, perf: PerfParams = PERF,
          skew: SkewSpec = FLAT, checkpoint: str = "full", duration: float = 60.0, seed: int = 0) -> SystemRun:
    cfg = SimConfig(model=model, nodes=len(scenario.initial), perf=perf, systems=(system,), checkpoint=checkpoint,
                    duration_s=duration, skew=skew, seed=seed)
    routing = ZipfRouting(model.num_experts, model.layers_simulated, perf.skew_epoch_steps, skew, seed)
    return SystemRun(cfg, make_system(system, model, perf, routing), scenario)


def ran(system: str, scenario: Scenario, **kw) -> SystemRun:
    run = build(system, scenario, **kw)
    run.run()
    return run


def nodes(n: int) -> tuple[str, ...]:
    return tuple(f"n{i}" for i in range(n))


def check_tiling(run: SystemRun, end: float) -> None:
    """Segments follow each other without gap or overlap from 0 to the end, one bucket each."""
    tl = run.timeline()
    assert tl[0][0] == 0.0
    for (_, t1, _, _), (t0, _, _, _) in zip(tl, tl[1:]):
        assert t0 == pytest.approx(t1, abs=1e-9)
    assert tl[-1][1] == pytest.approx(end, abs=1e-6)
    assert all(b in BUCKETS and t1 > t0 for t0, t1, b, _ in tl)
    assert math.fsum(run.totals().values()) == pytest.approx(end, abs=1e-6)


def test_a_run_without_events_computes_and_checkpoints_only() -> None:
    run = ran("ds", Scenario(nodes(4)), duration=22.0)
    check_tiling(run, 22.0)
    out = run.result()
    # 1 s steps, a blocking 1 s full checkpoint after steps 5, 10 and 15; 19 steps by 22 s
    assert run.timeline()[:2] == [(0.0, 5.0, "compute", 4), (5.0, 6.0, "checkpoint", 4)]
    assert out["breakdown"]["compute"] == pytest.approx(19.0) and out["breakdown"]["checkpoint"] == pytest.approx(3.0)
    assert out["steps"] == pytest.approx(19.0) and out["samples"] == pytest.approx(19 * 4)
    assert out["counts"]["checkpoints"] == 3 and out["counts"]["failures_seen"] == 0
    assert out["ettr"] == pytest.approx(19 / 22, abs=1e-6)
    assert {n for *_, n in run.timeline()} == {4}


def test_events_are_applied_in_time_order_whatever_order_they_are_listed_in() -> None:
    events = [Event(6.5, "remove", ("n0",)), Event(17.0, "add", ("n4",)), Event(31.0, "remove", ("n2",)),
              Event(44.0, "add", ("n5",))]
    ordered = ran("lazarus", Scenario(nodes(4), events), checkpoint="pec")
    shuffled = list(events)
    random.Random(3).shuffle(shuffled)
    assert shuffled != events
    mixed = ran("lazarus", Scenario(nodes(4), shuffled), checkpoint="pec")
    assert mixed.timeline() == ordered.timeline()
    assert mixed.result() == ordered.result()
    # and the order is the one of time: the first failure is handled at 6.5 s (the half
    # step in progress, 6.0-6.5 s, is lost), the join of n4 at 17 + 4 s, the next failure at 31 s
    tl = ordered.timeline()
    assert next(t0 for t0, _, b, _ in tl if b == "lost") == pytest.approx(6.0)
    reconfigs = [t0 for t0, _, b, _ in tl if b == "reconfiguration"]
    assert reconfigs[:3] == [pytest.approx(6.5), pytest.approx(21.0), pytest.approx(31.0)]


def test_failures_and_joins_change_the_nodes_computing() -> None:
    # Lazarus keeps every expert while one replica survives: n0 dies -> 3 nodes; n9 joins
    # at 20 s, applied after the 4 s join window -> 4 nodes again.
    events = [Event(6.5, "remove", ("n0",)), Event(20.0, "add", ("n9",))]
    run = ran("lazarus", Scenario(nodes(4), events), checkpoint="pec", duration=50.0)
    check_tiling(run, 50.0)
    computing = [(t0, t1, n) for t0, t1, b, n in run.timeline() if b == "compute"]
    assert {n for t0, t1, n in computing if t1 <= 6.5 + 1e-9} == {4}
    assert {n for t0, t1, n in computing if 6.5 < t0 < 24.0 - 1e-9} == {3}
    assert {n for t0, t1, n in computing if t0 >= 24.0 + PERF.reconfig_s} == {4}
    counts = run.result()["counts"]
    assert counts["failures_seen"] == 1 and counts["reconfigs"] == 2 and counts["restarts"] == 0


def test_a_roll_back_relabels_the_discarded_compute_as_lost() -> None:
    # DS rolls back to the checkpoint of step 10 (taken 11-12 s) when n1 dies at 14.5 s:
    # the steps computed from 12 s on are lost.
    run = ran("ds", Scenario(nodes(4), [Event(14.5, "remove", ("n1",))]), duration=40.0)
    check_tiling(run, 40.0)
    tl = run.timeline()
    lost = [(t0, t1) for t0, t1, b, _ in tl if b == "lost"]
    assert lost[0][0] == pytest.approx(12.0) and lost[-1][1] == pytest.approx(14.5)
    assert all(a[1] == pytest.approx(b[0]) for a, b in zip(lost, lost[1:]))      # one stretch
    assert run.result()["breakdown"]["lost"] == pytest.approx(2.5)
    assert run.result()["steps"] == pytest.approx(10 + 10.5)                    # rewound to step 10
    assert not any(b == "compute" and t0 < 14.5 < t1 for t0, t1, b, _ in tl)
    after = [b for t0, _, b, _ in tl if t0 >= 14.5 - 1e-9]
    assert after[0] == "restart"
    assert run.result()["counts"]["restarts"] == 1


def test_losing_every_node_idles_until_one_joins() -> None:
    events = [Event(3.0, "remove", nodes(4)), Event(10.0, "add", ("n7", "n8"))]
    run = ran("ds", Scenario(nodes(4), events), duration=30.0)
    check_tiling(run, 30.0)
    idle = [(t0, t1, n) for t0, t1, b, n in run.timeline() if b == "idle"]
    assert idle and all(n == 0 for *_, n in idle)
    assert idle[0][0] == pytest.approx(3.0) and idle[-1][1] == pytest.approx(14.0)   # join at 10 s + 4 s window
    assert run.result()["counts"]["idle_periods"] == 1
    assert {n for _, _, b, n in run.timeline() if b == "compute" and _ > 14.0} == {2}


def test_a_restart_waits_for_nodes_that_are_still_starting() -> None:
    # n2 and n3 arrive at 10 s and are up at 14 s (the 4 s join window); n0 dies at 11 s, which
    # leaves too few running nodes for a full set of experts: the job waits idle for the
    # joiners, then restarts on them (it cannot restart on nodes that are still starting)
    events = [Event(10.0, "add", ("n2", "n3")), Event(11.0, "remove", ("n0",))]
    run = ran("ds", Scenario(nodes(2), events), duration=40.0)
    check_tiling(run, 40.0)
    tl = [(t0, t1, b) for t0, t1, b, _ in run.timeline()]
    assert [(pytest.approx(11.0), pytest.approx(14.0))] == [(t0, t1) for t0, t1, b in tl if b == "idle"]
    first_restart = min(t0 for t0, _, b in tl if b == "restart")
    assert first_restart == pytest.approx(14.0)
    assert run.result()["counts"]["idle_periods"] == 1


def test_a_run_with_nothing_left_and_no_event_ends_idle() -> None:
    run = ran("ds", Scenario(nodes(2), [Event(4.0, "remove", nodes(2))]), duration=20.0)
    check_tiling(run, 20.0)
    assert run.timeline()[-1][2] == "idle" and run.result()["ettr"] < 4.0 / 20.0


@pytest.mark.parametrize("system", ["ds", "dsft", "lazarus"])
def test_ettr_is_bounded_and_falls_as_failures_get_more_frequent(system) -> None:
    horizon = 2 * 3600.0
    ettrs, failures = [], []
    for every in (math.inf, 1800.0, 600.0, 200.0):
        sc = Scenario(nodes(8)) if math.isinf(every) else fail_every(8, every, horizon, seed=1, replace=True)
        run = ran(system, sc, model=MID, perf=PerfParams(), skew=SkewSpec(), duration=horizon, checkpoint="pec")
        out = run.result()
        assert 0.0 <= out["ettr"] <= 1.0
        assert out["ettr"] == pytest.approx(out["breakdown"]["compute"] / out["sim_time_s"], abs=1e-5)
        ettrs.append(out["ettr"])
        failures.append(out["counts"]["failures_seen"])
    assert failures[0] == 0 and failures[1] < failures[2] < failures[3], failures
    assert ettrs[0] > ettrs[1] > ettrs[2] > ettrs[3], ettrs


@pytest.mark.parametrize("mode", ["full", "two-level"])
def test_a_run_is_a_function_of_its_seed(mode) -> None:
    horizon = 2 * 3600.0

    def once(seed: int) -> SystemRun:
        return ran("lazarus", bamboo(10, 0.6, 0.9, horizon, seed=seed), model=MID, perf=PerfParams(), skew=SkewSpec(),
                   duration=horizon, checkpoint=mode, seed=seed)

    a, b, c = once(4), once(4), once(5)
    assert a.timeline() == b.timeline() and a.result() == b.result()
    assert a.timeline() != c.timeline()
    assert a.result()["counts"]["failures_seen"] > 0     # the churn did reach the run
    check_tiling(a, horizon)
