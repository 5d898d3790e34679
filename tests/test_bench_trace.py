"""``benchmarks/trace``: a real spot trace turned into a live schedule (compression, the cap
on nodes, the seeded SIGTERM/SIGKILL split, arrivals), what the bench measures from a
replay's records (progress, ETTR, time lost and recovery per event, steps redone), the
simulator config it derives, and its whole analysis path end to end (``--raw``: the
records of a replay, the simulator run on the same trace, the tables and the timeline).

The live arms themselves are tests/test_bench_peers.py's (a replay of three systems does
not fit in a minute on two shared cores)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
sys.path.insert(0, str(ROOT / "benchmarks" / "trace"))

from _measure import measure, sim_config  # noqa: E402
from _schedule import Action, TraceSpec, actions, availability  # noqa: E402

from lazarus.sim import load_trace, segment  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces"
if not TRACES.is_dir():
    TRACES = Path("/work/shared/traces")
P3 = str(TRACES / "aws-p3-32nodes.csv")
G4DN = str(TRACES / "aws-g4dn-12nodes.csv")


def test_a_trace_segment_becomes_a_compressed_capped_schedule() -> None:
    spec = TraceSpec(P3, start_s=4 * 3600, minutes=60, cap=3, compress=60, kill_share=0.3, seed=0)
    assert spec.duration_s == 60.0
    sc = spec.scenario()
    seg = segment(load_trace(P3, seed=0), 4 * 3600, 3600, 3)
    # compression: every event at its trace time / 60, none past the replay's end
    removed = [(e.time_s, n) for e in seg.events if e.kind == "remove" for n in e.nodes]
    added = [(e.time_s, n) for e in seg.events if e.kind == "add" for n in e.nodes]
    acts = actions(sc)
    assert [(round(a.t * 60, 3), a.node) for a in acts if a.kind == "join"] == [(round(t, 3), n) for t, n in added]
    assert sorted((round(a.t * 60, 3), a.node) for a in acts if a.kind != "join") == sorted(
        (round(t, 3), n) for t, n in removed)
    assert all(0 <= a.t < 60 for a in acts) and acts == sorted(acts, key=lambda a: a.t)
    # the cap: never more than 3 nodes, and the segment really churns
    avail = availability(sc, spec.duration_s)
    assert avail[0] == (0.0, len(sc.initial)) and max(n for _, n in avail) <= 3 and min(n for _, n in avail) >= 1
    assert len(acts) >= 6 and {a.kind for a in acts} == {"join", "term", "kill"}
    # the SIGKILL share, seeded: round(0.3 x departures) kills, the same for the same seed
    kills = [a for a in acts if a.kind == "kill"]
    assert len(kills) == round(0.3 * len(removed))
    assert actions(TraceSpec(P3, 4 * 3600, 60, 3, 60, 0.3, 0).scenario()) == acts
    others = {tuple(a.kind for a in actions(TraceSpec(P3, 4 * 3600, 60, 3, 60, 0.3, s).scenario()))
              for s in range(1, 8)}
    assert any(o != tuple(a.kind for a in acts) for o in others)
    assert all(a.kind != "kill" for a in actions(TraceSpec(P3, 4 * 3600, 60, 3, 60, 0.0, 0).scenario()))
    assert all(a.kind != "term" for a in actions(TraceSpec(P3, 4 * 3600, 60, 3, 60, 1.0, 0).scenario()))
    # another compression: the same events, twice as far apart
    slow = actions(TraceSpec(P3, 4 * 3600, 60, 3, 30, 0.3, 0).scenario())
    assert [(a.t, a.kind, a.node) for a in slow] == [(2 * a.t, a.kind, a.node) for a in acts]
    # the rebuild flags of the simulator
    assert spec.sim_args()[:2] == ["--trace", P3] and "--trace-compress" in spec.sim_args()


def test_a_multi_node_drop_is_one_action_per_node() -> None:
    spec = TraceSpec(G4DN, start_s=6 * 3600, minutes=60, cap=4, compress=60, kill_share=0.5, seed=0)
    sc = spec.scenario()
    acts = actions(sc)
    assert all(len(e.nodes) == 1 for e in sc.events if e.kind == "remove")
    assert len({a.node for a in acts if a.kind != "join"}) == len([a for a in acts if a.kind != "join"])
    alive = set(sc.initial)
    for a in acts:   # a node leaves only while it is in the job, joins only while it is not
        assert (a.node in alive) == (a.kind != "join")
        alive = alive | {a.node} if a.kind == "join" else alive - {a.node}


def test_bad_replay_settings_name_the_setting() -> None:
    with pytest.raises(ValueError, match="no such file"):
        TraceSpec("/nonexistent.csv")
    with pytest.raises(ValueError, match="nodes.*got 0"):
        TraceSpec(P3, cap=0)
    with pytest.raises(ValueError, match="kill share.*got 2"):
        TraceSpec(P3, kill_share=2)
    with pytest.raises(ValueError, match="compress must be > 0"):
        TraceSpec(P3, compress=0)
    with pytest.raises(ValueError, match="starts with no node"):
        TraceSpec(G4DN, start_s=0, minutes=10).scenario()
    with pytest.raises(ValueError, match="Action.kind"):
        Action(1.0, "reboot", "n0")


def _steps(t_first: float, step0: int, n: int, world: int, run: int = 0, dt: float = 0.1) -> list[dict]:
    return [{"kind": "step", "t": t_first + i * dt, "step": step0 + i, "world": world, "run": run, "node": "n0"}
            for i in range(n)]


def _raw() -> dict[str, dict]:
    """Two replays of 30 s from t0 = 100: one in-place recovery from a kill (0.55 s), one
    restart from a checkpoint 10 steps back (2.95 s); 0.1 s steps; one 0.5 s save."""
    lazarus = _steps(99.0, 0, 11, 2) + _steps(100.1, 11, 100, 2) + _steps(110.6, 111, 194, 1)
    ckpt = _steps(99.0, 0, 11, 2) + _steps(100.1, 11, 100, 2) + _steps(112.0, 101, 10, 1, run=1)
    ckpt += _steps(113.0, 111, 170, 1, run=1)
    ckpt += [{"kind": "saved", "t": 120.0, "step": 180, "seconds": 0.5, "run": 1, "node": "n0"}]
    ev = [{"t": 110.05, "kind": "kill", "node": "n1"}]
    return {"lazarus": {"records": lazarus, "events": ev, "t0": 100.0, "t_end": 130.0, "interval": None,
                        "restarts": None},
            "ckpt": {"records": ckpt, "events": ev, "t0": 100.0, "t_end": 130.0,
                     "interval": {"every": 20, "save_s": 0.5, "step_s": 0.1, "mtbf_steps": 300}, "restarts": 1}}


def test_what_a_replay_measures() -> None:
    raw = _raw()
    laz = measure(raw["lazarus"]["records"], raw["lazarus"]["events"], 100.0, 130.0, tokens_per_step=10)
    assert laz["steps"] == 100 + 194 and laz["tokens"] == 2940 and laz["goodput"] == pytest.approx(2940 / 30)
    assert laz["typical_step_s"] == {2: pytest.approx(0.1), 1: pytest.approx(0.1)}
    assert laz["ettr"] == pytest.approx(294 * 0.1 / 30)
    (kill,) = laz["per_event"]
    assert kill["recovery_s"] == pytest.approx(0.55) and kill["redone"] == 0
    assert kill["lost_s"] == pytest.approx(19.95 - 194 * 0.1)
    assert laz["baseline_lost_s"] == pytest.approx(10.05 - 100 * 0.1, abs=1e-9)
    ck = measure(raw["ckpt"]["records"], raw["ckpt"]["events"], 100.0, 130.0, tokens_per_step=10)
    # the restart redid steps 101..110 (not progress), was back at step 111 at 113.0
    (kill,) = ck["per_event"]
    assert kill["recovery_s"] == pytest.approx(2.95) and kill["redone"] == 10
    assert ck["steps"] == 100 + 170 and ck["checkpoint_s"] == pytest.approx(0.5)
    assert ck["ettr"] == pytest.approx(270 * 0.1 / 30)
    assert kill["lost_s"] == pytest.approx(19.95 - 170 * 0.1 - 0.5)   # the save is checkpoint time
    # the simulator's costs: what the simulator does not book itself
    cfg = sim_config({"lazarus": laz, "ckpt": {**ck, "interval": raw["ckpt"]["interval"]}}, experts=8, layers=4,
                     expert_params=1e4, non_expert_params=1e5, batch=16, nodes=2)
    # an event kind's cost: what the job lost after it, less the half step the simulator drops
    assert cfg["systems"]["lazarus"]["perf"]["detect_s"] == pytest.approx(0.55 - 0.05)
    assert cfg["systems"]["lazarus"]["perf"]["notice_detect_s"] == 0.0   # no notice in this replay
    assert cfg["systems"]["ds"]["perf"]["restart_s"] == pytest.approx(2.95 - 11 * 0.1)
    assert cfg["systems"]["ds"]["perf"]["ds_interval_steps"] == 20
    assert cfg["systems"]["ds"]["perf"]["save_before_scale"] is False
    assert cfg["systems"]["ds"]["model"]["step_s_by_nodes"] == [[1, pytest.approx(0.1)], [2, pytest.approx(0.1)]]


def test_a_job_that_lost_everything_holds_only_what_it_trained_since() -> None:
    # steps 0..50 (0.1 s each from t0 = 100), a kill at 105.05 takes every replica, the job
    # starts again from step 0 at 108 and is at step 30 at the end: the model at the end holds
    # 31 steps, all trained after t0; the first 50 were committed, then lost
    records = _steps(100.0, 0, 51, 1) + _steps(108.0, 0, 31, 1, run=1)
    ev = [{"t": 105.05, "kind": "kill", "node": "n0"}]
    res = measure(records, ev, 100.0, 112.0, tokens_per_step=10)
    assert res["steps"] == 31 and res["tokens"] == 310
    assert res["ettr"] == pytest.approx(31 * 0.1 / 12.0)
    # the kill's cost runs until new progress (never here: the run ends below step 50)
    (kill,) = res["per_event"]
    assert kill["recovery_s"] is None and kill["lost_s"] == pytest.approx(112.0 - 105.05)


@pytest.mark.timeout(120)
def test_the_analysis_path_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # by path, under a name of its own: benchmarks/peers has a main.py too, and whichever
    # test imported `main` first would otherwise win (sys.modules)
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_trace_main", ROOT / "benchmarks" / "trace" / "main.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main = module.main

    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps(_raw()))
    out = tmp_path / "out"
    assert main(["--raw", str(raw), "--systems", "lazarus,ckpt", "--minutes", "30", "--nodes", "2",
                 "--out", str(out)]) == 0
    text = (out / "results.md").read_text()
    assert "| Lazarus | 301,056 |" in text and "| checkpoint-restart (DCP, Young/Daly) | 276,480 |" in text
    assert "| ETTR lazarus | 0.980 |" in text and "| goodput lazarus / ckpt | 1.089 |" in text and "| yes |" in text
    assert "lazarus simulate --model gpt-s --config" in text and (out / "timeline.png").stat().st_size > 10_000
    cfg = json.loads((out / "sim_config.json").read_text())
    assert set(cfg["systems"]) == {"lazarus", "ds"}
    assert "rerun:" in capsys.readouterr().out
