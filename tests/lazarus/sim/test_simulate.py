"""Tests of the failure simulator (``lazarus simulate``): accounting on hand-computed
traces, system decisions, trace parsing, CLI shape and determinism."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import lazarus.cli as lazarus_cli
from lazarus.sim import (
    BUCKETS,
    Event,
    PerfParams,
    Scenario,
    SimConfig,
    bamboo,
    load_trace,
    parse_duration,
    preset,
    segment,
    simulate,
)
from lazarus.sim._routing import ZipfRouting
from lazarus.sim._systems import Lazarus
from tests.helpers.sim_specs import FLAT, PERF, TINY

TRACES = Path(__file__).resolve().parents[4] / "shared" / "traces"
if not TRACES.exists():  # the checkout may sit elsewhere; fall back to the shared copy
    TRACES = Path("/work/shared/traces")



def _run(system: str, events: list[Event], *, nodes: int = 4, duration: float = 40.0,
         checkpoint: str = "full") -> dict:
    cfg = SimConfig(model=TINY, nodes=nodes, perf=PERF, systems=(system,), checkpoint=checkpoint,
                    duration_s=duration, skew=FLAT)
    sc = Scenario(tuple(f"n{i}" for i in range(nodes)), events)
    out = simulate(cfg, sc).to_dict()["systems"][system]
    assert math.isclose(sum(out["breakdown"].values()), out["sim_time_s"], abs_tol=0.01)
    return out


def _close(got: dict, want: dict) -> None:
    full = {b: 0.0 for b in BUCKETS} | want
    assert got == pytest.approx(full, abs=1e-6)


def test_ds_one_failure_hand_computed() -> None:
    # steps of 1 s on 4 nodes (2 EP groups); checkpoints at steps 5, 10 (1 s each).
    # n0 dies at 14.5 s (step 12.5): roll back to step 10 (2.5 s lost), restart
    # 2 + 10 + 1 s, then one EP group (2 nodes) from step 10 at 27.5 s: steps 10-15,
    # checkpoint, steps 15-20, checkpoint, half a step by 40 s.
    out = _run("ds", [Event(14.5, "remove", ("n0",))])
    _close(out["breakdown"], {"compute": 20.5, "checkpoint": 4.0, "restart": 13.0, "lost": 2.5})
    assert out["samples"] == pytest.approx(10 * 4 + 10.5 * 2)
    assert out["steps"] == pytest.approx(20.5)
    assert out["counts"]["restarts"] == 1


def test_ds_ignores_failure_of_an_unused_node() -> None:
    # 5 nodes: DS uses 4 (EP size 2); n4 idles and its loss costs nothing.
    out = _run("ds", [Event(3.0, "remove", ("n4",))], nodes=5, duration=12.0)
    _close(out["breakdown"], {"compute": 10.0, "checkpoint": 2.0})
    assert out["counts"]["failures_seen"] == 0


def test_dsft_reconfigures_then_restarts_when_a_position_is_lost() -> None:
    # Groups [n0,n1] [n2,n3]. n0 dies at 2.5 s: n2 still holds position 0, so DS(FT)
    # reconfigures in place (2 + 3 s; half a step lost) onto one group [n2, n1].
    # n2 dies at 20 s: no node holds position 0 -> roll back to step 10 and restart.
    ev = [Event(2.5, "remove", ("n0",)), Event(20.0, "remove", ("n2",))]
    out = _run("dsft", ev)
    _close(out["breakdown"], {"compute": 16.0, "checkpoint": 3.0, "restart": 13.0,
                              "reconfiguration": 5.0, "lost": 3.0})
    assert out["counts"]["reconfigs"] == 1 and out["counts"]["restarts"] == 1
    assert out["samples"] == pytest.approx(2 * 4 + 14 * 2)


def _holders_of_expert0(nodes: int) -> tuple[str, ...]:
    sys = Lazarus(TINY, PERF, ZipfRouting(2, 1, PERF.skew_epoch_steps, FLAT, 0))
    sys.configure([f"n{i}" for i in range(nodes)], 0)
    return tuple(sorted(n for n, row in sys.hold[0].items() if 0 in row))


def test_lazarus_reconfigures_when_a_replica_survives() -> None:
    holders = _holders_of_expert0(4)
    assert len(holders) == 2  # f = 2 replicas each, one slot per node
    out = _run("lazarus", [Event(14.5, "remove", (holders[0],))])
    # checkpoints at steps 5 and 10; at 14.5 s (step 12.5) half a step is lost, detect +
    # reconfig = 5 s (no roll back); from 19.5 s on 3 nodes: steps 12-15, checkpoint,
    # 15-20, checkpoint, 20-25, checkpoint, 4.5 s of steps -> 29.5 steps by 40 s.
    _close(out["breakdown"], {"compute": 29.5, "checkpoint": 5.0, "reconfiguration": 5.0, "lost": 0.5})
    assert out["steps"] == pytest.approx(29.5)
    assert out["counts"] == {**out["counts"], "reconfigs": 1, "restarts": 0, "fallbacks": 0}


def test_lazarus_falls_back_when_every_replica_dies() -> None:
    holders = _holders_of_expert0(4)
    ev = [Event(14.5, "remove", holders)]
    full = _run("lazarus", ev)
    # full checkpoints: roll back to step 10 and restart on the 2 survivors (as DS above)
    _close(full["breakdown"], {"compute": 20.5, "checkpoint": 4.0, "restart": 13.0, "lost": 2.5})
    assert full["counts"]["restarts"] == 1
    pec = _run("lazarus", ev, checkpoint="pec")
    # MoC: reconfigure (5 s) and read only the lost expert (0.5 GB at 1 GB/s): no roll back
    assert pec["counts"]["fallbacks"] == 1 and pec["counts"]["restarts"] == 0
    assert pec["breakdown"]["lost"] == pytest.approx(0.5)
    assert pec["breakdown"]["restart"] == pytest.approx(0.5)
    assert pec["breakdown"]["reconfiguration"] == pytest.approx(5.0)
    assert pec["plt"] > 0  # the lost expert came back from an older version
    assert pec["samples"] > full["samples"]


def test_idle_until_a_join_then_resume() -> None:
    # DS needs 2 nodes; 3 of 4 die at 3 s -> idle; n9 joins at 10 s, applied 4 s later.
    ev = [Event(3.0, "remove", ("n0", "n1", "n2")), Event(10.0, "add", ("n9",))]
    out = _run("ds", ev, duration=30.0)
    b = out["breakdown"]
    assert b["idle"] == pytest.approx(11.0)  # 3 s .. 14 s
    assert b["lost"] == pytest.approx(3.0)  # nothing was checkpointed yet
    assert b["restart"] == pytest.approx(10.0)  # relaunch; step 0 needs no restore
    assert out["steps"] == pytest.approx(30 - 24 - 1)  # 6 s of steps incl. one 1 s checkpoint


@pytest.mark.parametrize("mode", ["full", "pec", "two-level", "exact"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_buckets_cover_time_exactly_under_churn(mode: str, seed: int) -> None:
    model, perf = preset("gpt-l")
    cfg = SimConfig(model=model, perf=perf, nodes=10, duration_s=3 * 3600, checkpoint=mode, seed=seed)
    res = simulate(cfg, bamboo(10, 0.3, 0.6, 3 * 3600, seed=seed))
    for name, run in res.runs.items():
        out = run.result()
        assert math.fsum(run.totals().values()) == pytest.approx(3 * 3600, abs=1e-6), name
        assert sum(out["breakdown"].values()) == pytest.approx(3 * 3600, abs=0.01)
        segs = run.timeline()
        assert segs[0][0] == 0.0 and segs[-1][1] == pytest.approx(3 * 3600)
        assert all(abs(a[1] - b[0]) < 1e-6 for a, b in zip(segs, segs[1:]))  # no gap, no overlap
        kept = sum(s.samples for s in run.segs if s.bucket == "compute")
        assert kept == pytest.approx(run.samples, rel=1e-9, abs=1e-6)


def test_jct_mode_stops_at_target() -> None:
    cfg = SimConfig(model=TINY, nodes=4, perf=PERF, systems=("ds",), target_samples=40, horizon_s=1000,
                    skew=FLAT)
    out = simulate(cfg, Scenario(("n0", "n1", "n2", "n3"))).to_dict()["systems"]["ds"]
    assert out["jct_s"] == pytest.approx(10.0 + 1.0)  # 10 steps of 4 samples + one checkpoint
    assert out["samples"] == pytest.approx(40)


# ----------------------------------------------------------------------------- traces


def test_p3_trace_segment_and_cap() -> None:
    tr = load_trace(TRACES / "aws-p3-32nodes.csv", seed=0)
    assert tr.max_nodes() == 32 and all(len(e.nodes) == 1 for e in tr.events)
    seg = segment(tr, 50 * 60, 80 * 60, 10)
    assert len(seg.initial) == 10
    assert seg.events and all(0 <= e.time_s < 80 * 60 for e in seg.events)
    alive, low = set(seg.initial), 10
    for e in seg.events:
        alive = alive | set(e.nodes) if e.kind == "add" else alive - set(e.nodes)
        assert len(alive) <= 10
        low = min(low, len(alive))
    assert low < 10  # preemptions of the job's nodes shrink it
    assert segment(tr, 50 * 60, 80 * 60, 10).events == seg.events  # deterministic


def test_g4dn_step_function_trace() -> None:
    tr = load_trace(TRACES / "aws-g4dn-12nodes.csv")
    assert tr.max_nodes() == 12
    assert any(len(e.nodes) > 1 for e in tr.events)  # the count jumps by several nodes
    assert tr.events[0].time_s == pytest.approx(21529)


def test_jsonl_trace_and_cap(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in [
        [0, "add", {"nodes": ["a", "b", "c"]}],
        [60000, "remove", {"nodes": ["a"]}],
        [90000, "add", {"nodes": ["d"]}],
        [120000, "remove", {"nodes": ["c"]}],
    ]) + "\n")
    tr = load_trace(p)
    assert [(e.time_s, e.kind, e.nodes) for e in tr.events][1] == (60.0, "remove", ("a",))
    seg = segment(tr, 30, None, 2)  # cap 2: c is not part of the job
    assert seg.initial == ("a", "b")
    assert [(e.time_s, e.kind, e.nodes) for e in seg.events] == [(30.0, "remove", ("a",)), (60.0, "add", ("d",))]


def test_trace_errors_name_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('[0, "add", {"nodes": ["a"]}]\n[5, "explode", {"nodes": ["a"]}]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_trace(bad)
    csv_bad = tmp_path / "bad.csv"
    csv_bad.write_text("ms,num_nodes\n0,1\nx,2\n")
    with pytest.raises(ValueError, match=r"bad.csv:3"):
        load_trace(csv_bad)


def test_parse_duration() -> None:
    assert parse_duration("30m") == 1800 and parse_duration("2h") == 7200
    assert parse_duration("90s") == 90 and parse_duration("45") == 45
    with pytest.raises(ValueError, match="--fail-every"):
        parse_duration("5 parsecs", "--fail-every")


def test_config_validation_names_field() -> None:
    with pytest.raises(ValueError, match="checkpoint"):
        SimConfig(model=TINY, nodes=4, checkpoint="half", duration_s=1)
    with pytest.raises(ValueError, match="restart_s"):
        PerfParams(restart_s=-1)
    with pytest.raises(ValueError, match="unknown performance parameter"):
        PERF.with_overrides({"warp_speed": 9})


# ----------------------------------------------------------------------------- CLI


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(lazarus_cli, "SUBCOMMANDS", {"simulate": lazarus_cli._register_simulate})
    return lazarus_cli.main


def test_cli_json_shape(cli, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli(["simulate", "--model", "gpt-l", "--nodes", "10", "--slots", "6", "--duration", "30m",
              "--fail-every", "5m", "--systems", "ds,dsft,lazarus", "--seed", "0", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["systems"]) == {"ds", "dsft", "lazarus"}
    for r in out["systems"].values():
        assert {"samples", "jct_s", "breakdown"} <= set(r)
        assert set(r["breakdown"]) == set(BUCKETS)
        assert sum(r["breakdown"].values()) == pytest.approx(1800, abs=0.01)
    s = out["systems"]
    assert s["lazarus"]["samples"] > s["dsft"]["samples"] > s["ds"]["samples"]


def test_cli_trace_png_and_config(cli, capsys, tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text("restart_s = 120.0\n")
    png = tmp_path / "t.png"
    args = ["simulate", "--model", "gpt-s", "--trace", str(TRACES / "aws-p3-32nodes.csv"),
            "--trace-start", "50m", "--trace-minutes", "20", "--trace-cap", "10", "--png", str(png),
            "--json", "--systems", "ds"]
    assert cli(args) == 0
    base = json.loads(capsys.readouterr().out)["systems"]["ds"]
    assert png.stat().st_size > 1000
    assert cli(args + ["--config", str(conf)]) == 0
    slow = json.loads(capsys.readouterr().out)["systems"]["ds"]
    assert slow["breakdown"]["restart"] > base["breakdown"]["restart"]


def test_cli_routing_trace(cli, capsys, tmp_path: Path) -> None:
    rt = tmp_path / "routing.jsonl"
    ratios = []
    for hot in (1, 100):
        rt.write_text("\n".join(json.dumps({"step": s, "layer": lay, "counts": [hot] + [1] * 7})
                                for s in (0, 100) for lay in (0, 1)) + "\n")
        argv = ["simulate", "--model", "gpt-s", "--duration", "10m", "--routing-trace", str(rt), "--json"]
        assert cli(argv) == 0
        out = json.loads(capsys.readouterr().out)["systems"]
        ratios.append(out["lazarus"]["samples"] / out["ds"]["samples"])
    # one expert taking 93% of the tokens slows classic EP (one GPU holds it), not Lazarus
    assert ratios[1] > ratios[0] + 0.1
    rt.write_text('{"step": 0, "layer": 0, "counts": [1, 2]}\n')
    assert cli(["simulate", "--model", "gpt-s", "--routing-trace", str(rt)]) == 2
    assert "routing.jsonl:1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, option", [
    (["--duration", "5 parsecs"], "--duration"),
    (["--systems", "ds,foo"], "--systems"),
    (["--model", "gpt-xxl"], "--model"),
    (["--fail-every", "0"], "--fail-every"),
    (["--preempt-prob", "1.5"], "--preempt-prob"),
    (["--trace", "/nonexistent/trace.csv"], "--trace"),
    (["--checkpoint", "half"], "--checkpoint"),
])
def test_cli_bad_input_exits_2_with_one_line(cli, capsys, argv: list[str], option: str) -> None:
    assert cli(["simulate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("lazarus simulate: error:") and option in err


def test_cli_seeded_and_reproducible(cli, capsys) -> None:
    argv = ["simulate", "--model", "gpt-m", "--duration", "2h", "--preempt-prob", "0.3",
            "--alloc-prob", "0.5", "--checkpoint", "two-level", "--json"]
    outs = []
    for seed in ("0", "0", "1"):
        assert cli(argv + ["--seed", seed]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]


# ----------------------------------------------------------------------------- exact mode
# W = 2; bytes per step (docs/exact.md): P/W * (B + (W-1-i) * B_w) = 0.5e9 * (1 + 0.5), 0.5e9 * 1:
# 0.75 GB and 0.5 GB, a window 1.25 GB; copies of 0.19 GB per node hide in a 1 s step.
EXACT = PERF.with_overrides({"exact_window_steps": 2, "exact_weight_bytes": 0.5, "persist_every": 1})


def _run_exact(system: str, events: list[Event], perf: PerfParams = EXACT, duration: float = 40.0) -> dict:
    cfg = SimConfig(model=TINY, nodes=4, perf=perf, systems=(system,), checkpoint="exact",
                    duration_s=duration, skew=FLAT)
    out = simulate(cfg, Scenario(tuple(f"n{i}" for i in range(4)), events)).to_dict()["systems"][system]
    assert math.isclose(sum(out["breakdown"].values()), out["sim_time_s"], abs_tol=0.01)
    return out


def _near(got: dict, want: dict) -> None:
    """``_close`` at the 3 decimals ``result()`` rounds to."""
    assert got == pytest.approx({b: 0.0 for b in BUCKETS} | want, abs=1e-3)


def test_exact_step_bytes_formula() -> None:
    assert TINY.exact_step_bytes(2, 0.5) == pytest.approx([0.75e9, 0.5e9])
    m, _ = preset("deepseek-16b")
    per_step = m.exact_step_bytes(8, 4.0)
    # mean per step = full / W + weights * (W - 1) / (2 W): 12.5% + 4/14 * 7/16 = 25.0% of a full checkpoint
    assert sum(per_step) / 8 / m.state_bytes() == pytest.approx(1 / 8 + 4 / 14 * 7 / 16)
    assert per_step[0] > per_step[-1] == pytest.approx(m.state_bytes() / 8)


def test_exact_ds_restart_rolls_back_to_the_window_start_and_replays() -> None:
    # windows end at steps 2, 4, ..., 14 (no stall: the copies hide in the step). n0 dies at
    # 14.5 s: the newest window (13-14) is loaded, 3/4 of it from memory on the 2 nodes DS
    # keeps, 1/4 from storage: 0.75 * 1.25 / 2 + 0.25 * 1.25 = 0.78125 s; progress goes back
    # to step 13 (1.5 s lost: half a step + the step replayed), restart 2 + 10 + 0.78125 s.
    out = _run_exact("ds", [Event(14.5, "remove", ("n0",))])
    _near(out["breakdown"], {"compute": 40 - 1.5 - 12.78125, "restart": 12.78125, "lost": 1.5})
    assert out["steps"] == pytest.approx(13 + 40 - 14.5 - 12.78125, abs=1e-3)
    assert out["plt"] == 0.0 and out["counts"]["restarts"] == 1
    assert out["ettr"] == pytest.approx((40 - 1.5 - 12.78125) / 40, abs=1e-6)
    # windows 2-14 before the failure; after it step 14 is replayed (no capture), then
    # windows end at 16, ..., 24
    assert out["counts"]["checkpoints"] == 7 + 5


def test_exact_stall_when_the_copy_outgrows_the_step() -> None:
    # snapshot copies at 0.1 GB/s: 0.75 / 4 / 0.1 = 1.875 s and 1.25 s per step, 1 s of
    # each hidden by the step: 0.875 + 0.25 = 1.125 s per window of 2 steps
    slow = EXACT.with_overrides({"snapshot_gbps": 0.1})
    out = _run_exact("ds", [], perf=slow, duration=3.125 * 4)
    _near(out["breakdown"], {"compute": 8.0, "checkpoint": 4 * 1.125})


def test_exact_lazarus_fallback_replays_instead_of_booking_plt() -> None:
    holders = _holders_of_expert0(4)
    ev = [Event(14.5, "remove", holders)]
    out = _run_exact("lazarus", ev)
    # reconfigure (2 + 3 s), then load the window 13-14 (half from memory on 2 nodes, half
    # from storage: 0.3125 + 0.625 s) and replay from step 13: 1.5 s lost, no PLT
    assert out["counts"]["fallbacks"] == 1 and out["counts"]["restarts"] == 0
    assert out["breakdown"]["reconfiguration"] == pytest.approx(5.0, abs=1e-6)
    assert out["breakdown"]["restart"] == pytest.approx(0.9375, abs=1e-3)
    assert out["breakdown"]["lost"] == pytest.approx(1.5)
    assert out["plt"] == 0.0
    pec = _run("lazarus", ev, checkpoint="pec")
    assert pec["plt"] > 0 and pec["breakdown"]["lost"] == pytest.approx(0.5)


def test_cli_exact_replace_reports_ettr(cli, capsys) -> None:
    argv = ["simulate", "--model", "deepseek-16b", "--nodes", "8", "--duration", "2h", "--fail-every", "10m",
            "--replace", "--systems", "ds", "--zipf", "0", "--json"]
    ettr = {}
    for mode in ("full", "exact"):
        assert cli(argv + ["--checkpoint", mode]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["scenario"]["name"] == "fail-every-600s-replaced" and out["scenario"]["max_nodes"] == 8
        r = out["systems"]["ds"]
        assert r["counts"]["restarts"] == 11            # one failure every 10 min, each replaced
        assert r["ettr"] == pytest.approx(r["breakdown"]["compute"] / 7200, abs=1e-5)
        ettr[mode] = r["ettr"]
    assert r["plt"] == 0.0
    assert ettr["exact"] > ettr["full"]                 # no 23 s blocking saves, less rolled back
    assert cli(["simulate", "--replace"]) == 2
    assert "--replace needs --fail-every" in capsys.readouterr().err
