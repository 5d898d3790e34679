"""``benchmarks/peers``'s torchft and checkpoint-restart arms, a few steps with one SIGKILL
each, so that the comparison with Lazarus cannot rot: torchft's Lighthouse and Manager on
3 replica groups (real processes, gloo), the kill survived without restarting the
survivors; checkpoint-restart's DCP checkpoints with a Young/Daly interval, the job
restarted from the newest checkpoint after the kill."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

from _common import ModelSpec, analyse, young_daly_interval  # noqa: E402
from main import json_rows, run_system  # noqa: E402

SPEC = ModelSpec(layers=2, d_model=32, d_hidden=64, batch_size=6, seq_len=32, corpus_bytes=1 << 18)
NODES = ("n0", "n1", "n2")
STEPS = 40


def _commits(res: dict, fault_t: float) -> tuple[list, list]:
    before = [c for c in res["commits"] if c[0] < fault_t]
    after = [c for c in res["commits"] if c[0] >= fault_t]
    return before, after


@pytest.mark.timeout(240)
def test_torchft_arm_survives_a_kill(tmp_path: Path) -> None:
    res = run_system("torchft-tuned", tmp_path / "tft", SPEC, STEPS, ["kill"], nodes=NODES, step_timeout=150)
    (row,) = res["rows"]
    (fault,) = res["faults"]
    assert row["fault"] == "kill n2" and row["time_lost_s"] is not None and row["time_lost_s"] > 0
    # every step of the run committed, in order, with no restart (torchft keeps the survivors' state)
    assert res["steps"] == STEPS and [c[1] for c in res["commits"]] == list(range(STEPS))
    before, after = _commits(res, fault["t"])
    # all 3 groups trained before the kill (a late group may sit out a quorum: torchft's
    # choice), never more than the 2 survivors after it (but for a step in flight at the kill,
    # all-reduced before it struck and committed just after it)
    assert max(c[2] for c in before) == 3 and len(after) > 1 and max(c[2] for c in after[1:]) == 2
    assert row["redone"] == 0
    # the survivors' records: both went on to the end; the killed group did not
    from _common import read_jsonl

    recs = read_jsonl([tmp_path / "tft" / "metrics.jsonl"])
    done = sorted(r["node"] for r in recs if r["kind"] == "done")
    assert done == ["n0", "n1"], done
    assert max(r["step"] for r in recs if r["kind"] == "step" and r["node"] == "n2") < STEPS - 1
    out = json_rows([res])
    assert out["rows"] == [{"system": "torchft (tuned)", "fault": "kill n2", "time_lost_s": row["time_lost_s"],
                            "steps_lost": row["steps_lost"]}] and out["goodput"]["torchft (tuned)"] > 0


@pytest.mark.timeout(240)
def test_checkpoint_restart_arm_resumes_from_its_newest_checkpoint(tmp_path: Path) -> None:
    res = run_system("ckpt", tmp_path / "ck", SPEC, STEPS, ["kill"], nodes=NODES, step_timeout=150)
    (row,) = res["rows"]
    (fault,) = res["faults"]
    iv = res["interval"]
    assert iv["every"] == young_daly_interval(iv["save_s"], iv["step_s"], iv["mtbf_steps"] * iv["step_s"])
    assert [r["nodes"] for r in res["restarts"]] == [["n0", "n1"]]
    from _common import read_jsonl

    recs = read_jsonl([tmp_path / "ck" / "metrics.jsonl"])
    saved = sorted({r["step"] for r in recs if r["kind"] == "saved" and r["t"] < fault["t"]})
    resumed = {r["resumed_from"] for r in recs if r["kind"] == "ready" and r.get("run") == 1}
    newest = max(saved, default=0)   # the step-0 checkpoint is always there
    assert resumed == {newest}
    # the restarted job redid the steps after that checkpoint, on 2 ranks, and finished; what
    # the first run committed after the kill (a step in flight) is redone too
    before = [c for c in res["commits"] if c[3] == 0]
    after = [c for c in res["commits"] if c[3] == 1]
    assert before and after and {c[3] for c in res["commits"]} == {0, 1}
    high = max(c[1] for c in before)
    assert row["redone"] == high - newest + 1 and row["time_lost_s"] > 0
    assert after[0][1] == newest and {c[2] for c in after} == {2} and res["steps"] == STEPS
    assert row["tokens_lost"] == row["steps_lost"] * SPEC.tokens_per_step


def test_analyse_counts_redone_and_discarded_steps() -> None:
    from _common import Fault

    recs = [{"kind": "step", "t": float(s), "step": s, "world": 4} for s in range(10)]
    recs += [{"kind": "discarded", "t": 10.5, "step": 10}]
    recs += [{"kind": "step", "t": 12.0 + i, "step": 6 + i, "world": 3, "run": 1} for i in range(8)]
    res = analyse("x", recs, [Fault("kill", "n3", 10.2, 9)], tokens_per_step=100)
    (row,) = res["rows"]
    assert row["redone"] == 4 and row["discarded"] == 1 and row["steps_lost"] == 5
    assert row["time_lost_s"] == pytest.approx(16.0 - 10.2) and row["world_after"] == 3
    assert res["goodput"] == pytest.approx(14 * 100 / 19.0)
    # A restart: step 10 of the old run was in flight at the kill and committed after it; the
    # new run (from the step-4 checkpoint) redoes 5..10 and is back at its step 11.
    recs = [{"kind": "step", "t": float(s), "step": s, "world": 4, "run": 0} for s in range(10)]
    recs += [{"kind": "step", "t": 10.3, "step": 10, "world": 4, "run": 0}]
    recs += [{"kind": "step", "t": 20.0 + i, "step": 5 + i, "world": 3, "run": 1} for i in range(8)]
    (row,) = analyse("x", recs, [Fault("kill", "n3", 10.2, 9)], tokens_per_step=100)["rows"]
    assert row["redone"] == 6 and row["time_lost_s"] == pytest.approx(26.0 - 10.2)
    with pytest.raises(ValueError, match="kind"):
        Fault("reboot", "n0", 0.0, 0)
    with pytest.raises(ValueError, match="batch_size"):
        ModelSpec(batch_size=0)
