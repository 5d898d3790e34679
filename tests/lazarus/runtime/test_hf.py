"""Elastic training of a Hugging Face MoE model under real faults.

A controller and 4 agents as processes on this machine (gloo), each agent running
``python -m examples.train_hf`` (a tiny random transformers Qwen3-MoE made elastic
by ``make_elastic``, fused experts). One node is SIGKILLed (every expert keeps a replica:
f = 2); on the 3 nodes left some experts have a single holder, and that node is SIGKILLed
next, so its experts come back from moc (peer memory or storage) with their lost tokens
booked as PLT. The job then finishes on the 2 survivors: every replica identical
(weights and optimizer state), dense state identical, loss down, and the final moc
checkpoint exports to safetensors that ``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from examples.local_cluster import LocalCluster

transformers = pytest.importorskip("transformers")

STEPS = 80
NODES = ["n0", "n1", "n2", "n3"]
EXPERTS, LAYERS = 4, 2


def _cluster(tmp_path: Path) -> LocalCluster:
    job = tmp_path / "job"
    worker = [sys.executable, "-m", "examples.train_hf", "--metrics", str(job / "metrics.jsonl"),
              "--steps", str(STEPS), "--storage", str(tmp_path / "store"), "--layers", str(LAYERS),
              "--experts", str(EXPERTS), "--d-model", "32", "--d-expert", "32", "--batch-size", "12",
              "--seq-len", "32", "--corpus-bytes", str(1 << 20), "--interval", "5", "--k-snapshot", "2",
              "--k-persist", "1", "--persist-every", "2", "--collective-timeout", "4s", "--rendezvous-timeout", "20s",
              "--report-every", "5", "--digests", str(tmp_path / "digest-{node}.json"),
              "--hf-config-out", str(tmp_path / "hf-config")]
    controller = ["--slots", "2", "--min-replicas", "2", "--expected-nodes", "4", "--heartbeat-timeout", "2s",
                  "--join-window", "1s"]
    return LocalCluster(job, worker_command=worker, controller_args=controller,
                        agent_args=["--heartbeat-interval", "250ms"])


def _failures(c: LocalCluster) -> list[dict]:
    return [r for r in c.reconfigurations() if r["reason"] in ("failure", "collective_error")]


def _only_holder(plan: dict) -> tuple[str, list[str]]:
    """A member that is the only holder of some expert, and those expert units."""
    for node in plan["members"]:
        i = plan["members"].index(node)
        lost = []
        for layer, slots in sorted(plan["layers"].items()):
            for e in sorted(set(slots[i])):
                if sum(e in s for s in slots) == 1:
                    lost.append(f"expert/{layer}/{e}")
        if lost:
            return node, lost
    raise AssertionError(f"every expert has several holders in {plan['layers']}")


@pytest.mark.timeout(480)
def test_hf_model_survives_a_node_then_the_only_holder_of_experts(tmp_path: Path) -> None:
    with _cluster(tmp_path) as c:
        c.start(NODES)
        c.wait_step(15, timeout=240)
        c.kill_node("n2")
        c.wait_for(lambda: _failures(c), 90, "reconfiguration after the first kill")
        first = _failures(c)[0]
        assert first["world_size"] == 3 and "n2" not in first["members"]
        assert first["lost_experts"] == []                     # f = 2: the peers hold every expert
        plan = c.latest_plan()
        assert plan["members"] == first["members"]
        victim, lost = _only_holder(plan)
        c.wait_step(first["step"] + 8, timeout=120)            # snapshots on the 3-node world
        c.kill_node(victim)
        c.wait_for(lambda: len(_failures(c)) >= 2, 90, "reconfiguration after killing the only holder")
        second = _failures(c)[1]
        survivors = [n for n in NODES if n not in ("n2", victim)]
        assert second["world_size"] == 2 and sorted(second["members"]) == survivors
        assert set(lost) <= set(second["lost_experts"]), (lost, second["lost_experts"])
        assert second["sources"]["memory"] + second["sources"]["storage"] == len(second["lost_experts"])
        assert second["plt"] > 0                               # the lost tokens are booked
        assert c.wait(timeout=300) == 0, (c.dir / "controller.log").read_text()[-3000:]
        for node in survivors:
            c.agents[node].wait(timeout=60)

    digests = {}
    for node in survivors:
        path = tmp_path / f"digest-{node}.json"
        assert path.exists(), f"node {node} did not finish; see {c.dir}/node-{node}.log"
        digests[node] = json.loads(path.read_text())
    assert {d["step"] for d in digests.values()} == {STEPS}
    assert {d["world"] for d in digests.values()} == {2}
    by_unit: dict[str, set[str]] = {}
    for d in digests.values():
        for unit, h in d["experts"].items():
            by_unit.setdefault(unit, set()).add(h)
    assert len(by_unit) == LAYERS * EXPERTS, sorted(by_unit)  # every expert held somewhere
    assert all(len(h) == 1 for h in by_unit.values()), {u: h for u, h in by_unit.items() if len(h) > 1}
    assert len({d["dense"] for d in digests.values()}) == 1
    losses = [m["loss"] for m in sorted(c.steps(), key=lambda m: m["step"])]
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.5, (losses[:10], losses[-10:])

    # The job's last moc checkpoint is a transformers checkpoint once exported.
    from moc.cli import main as moc_main

    out = tmp_path / "hf"
    assert moc_main(["export", str(tmp_path / "store"), "--format", "safetensors", "-o", str(out),
                     "--hf-config", str(tmp_path / "hf-config" / "config.json")]) == 0
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == EXPERTS
