"""``ElasticConfig.lost_experts``: its validation, and a real Lazarus job (controller, 3
agents and their workers as processes, gloo) in exact mode that loses the only replica of
some experts to a SIGKILL: the survivors roll back to the newest committed window's first
step and replay it instead of booking PLT."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from examples.local_cluster import LocalCluster
from lazarus.runtime import ElasticConfig
from moc import CheckpointStore, MoCConfig
from storage_backends import open_store

STEPS = 36
NODES = ["n0", "n1", "n2"]


def _exact(tmp_path: Path) -> MoCConfig:
    return MoCConfig(storage=str(tmp_path), interval=1, k_snapshot=2, exact=True)


def test_lost_experts_follows_moc_when_unset(tmp_path: Path) -> None:
    assert ElasticConfig().lost_experts == "restore"
    assert ElasticConfig(moc=MoCConfig(storage=str(tmp_path))).lost_experts == "restore"
    assert ElasticConfig(moc=_exact(tmp_path)).lost_experts == "replay"
    assert ElasticConfig(moc=_exact(tmp_path), lost_experts="replay").lost_experts == "replay"


@pytest.mark.parametrize("value", ["Replay", "rollback", "", 1, True])
def test_lost_experts_bad_value_names_the_field_and_the_choices(tmp_path: Path, value: object) -> None:
    with pytest.raises(ValueError, match=r"ElasticConfig\.lost_experts must be one of 'restore', 'replay' or None"):
        ElasticConfig(moc=_exact(tmp_path), lost_experts=value)  # type: ignore[arg-type]


def test_replay_needs_an_exact_moc_and_restore_refuses_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"lost_experts='replay' needs moc=MoCConfig\(exact=True.*moc is None"):
        ElasticConfig(lost_experts="replay")
    with pytest.raises(ValueError, match=r"lost_experts='replay' needs .*moc is not exact"):
        ElasticConfig(moc=MoCConfig(storage=str(tmp_path)), lost_experts="replay")
    with pytest.raises(ValueError, match=r"lost_experts='restore' cannot go with an exact moc"):
        ElasticConfig(moc=_exact(tmp_path), lost_experts="restore")
    cfg = ElasticConfig(moc=_exact(tmp_path), collective_timeout=timedelta(seconds=5))
    assert cfg.moc is not None and cfg.moc.exact


def _singleton_holder(plan: dict) -> tuple[str, list[str]]:
    """The member holding the most experts that have no other replica."""
    best, units = "", []
    for i, node in enumerate(plan["members"]):
        mine = [f"expert/{layer}/{e}" for layer, slots in plan["layers"].items() for e in sorted(set(slots[i]))
                if sum(1 for s in slots if e in s) == 1]
        if len(mine) > len(units):
            best, units = node, mine
    assert best, f"no expert with a single replica in {plan['layers']}"
    return best, units


@pytest.mark.timeout(300)
def test_sigkill_of_the_only_replica_rolls_back_and_replays_without_plt(tmp_path: Path) -> None:
    store = tmp_path / "store"
    worker = ["--steps", str(STEPS), "--storage", str(store), "--layers", "2", "--experts", "4", "--d-model", "32",
              "--d-hidden", "64", "--batch-size", "6", "--seq-len", "32", "--corpus-bytes", str(1 << 20),
              "--exact", "--k-snapshot", "1", "--persist-every", "1", "--collective-timeout", "4s",
              "--rendezvous-timeout", "20s", "--report-every", "5", "--digests", str(tmp_path / "digest-{node}.json")]
    controller = ["--slots", "2", "--min-replicas", "1", "--expected-nodes", "3", "--heartbeat-timeout", "2s",
                  "--join-window", "1s"]
    with LocalCluster(tmp_path / "job", worker_args=worker, controller_args=controller,
                      agent_args=["--heartbeat-interval", "250ms"]) as c:
        c.start(NODES)
        # W = 4 (4 experts, k_snapshot=1): windows 0-3, 4-7, ...; the kill comes once one is committed
        c.wait_for(lambda: store.exists() and CheckpointStore(open_store(str(store))).steps(), 180,
                   "an exact window committed to storage")
        c.wait_step(10, timeout=120)
        victim, singles = _singleton_holder(c.latest_plan())
        c.kill_node(victim)
        recs = c.wait_for(lambda: [r for r in c.reconfigurations() if r["reason"] in ("failure", "collective_error")],
                          60, "the reconfiguration after the kill")
        rec = recs[0]
        survivors = [n for n in NODES if n != victim]
        assert rec["world_size"] == 2 and sorted(rec["members"]) == survivors
        assert set(singles) <= set(rec["lost_experts"])
        assert rec["recovery"] == "replay" and rec["plt"] == 0.0
        rb = rec["rollback"]
        start, end = rb["window"]
        # back to the committed window's first step + 1 (the state after its first step)
        assert end == start + 3 and rb["to_step"] == start + 1 == rec["step"], rb
        assert rb["steps"] == rb["from_step"] - rb["to_step"] >= 1 and rb["cause"] == "lost_experts", rb
        assert rb["checked"] is False    # another world: no bit-identity, the check is off
        assert rb["units"]["storage"] >= len(singles) and rb["source"] == "storage", rb
        assert c.wait(timeout=240) == 0, (tmp_path / "job" / "controller.log").read_text()[-3000:]
        for node in survivors:
            c.agents[node].wait(timeout=60)
        digests = c.read_digests(str(tmp_path / "digest-{node}.json"), survivors)
        assert c.final_state_problems(digests, survivors, STEPS, expert_units=2 * 4) == [], c.dir
        # every step trained; those from the window's second one to the kill twice (rank 0
        # records a step once applied: the ranks are at most a step apart when one dies)
        steps = [m["step"] for m in c.steps()]
        assert sorted(set(steps)) == list(range(STEPS))
        redone = sorted(s for s in set(steps) if steps.count(s) > 1)
        assert redone and redone[0] == rb["to_step"] and redone[-1] <= rb["from_step"], (redone, rb)
        assert redone == list(range(redone[0], redone[-1] + 1)) and len(redone) >= rb["steps"] - 2, (redone, rb)
        assert all(steps.count(s) <= 2 for s in set(steps))
