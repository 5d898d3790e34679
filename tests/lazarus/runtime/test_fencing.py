"""Fencing on a real Lazarus job (a controller, 3 agents and their gloo workers as
processes on loopback): the workers write as their plan's generation, a new generation
fences the older ones in the store, and a node frozen past its lease (agent and worker
SIGSTOPped, like a paused VM) and woken after the others re-formed writes nothing that
is read: every write it tries is refused and logged, the store stays verifiable and no
committed checkpoint is lost."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.local_cluster import LocalCluster
from moc import CheckpointStore

NODES = ["n0", "n1", "n2"]
STEPS = 60
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def _cluster(tmp_path: Path) -> LocalCluster:
    worker = ["--steps", str(STEPS), "--storage", str(tmp_path / "store"), "--layers", "2", "--experts", "4",
              "--d-model", "32", "--d-hidden", "64", "--batch-size", "8", "--seq-len", "32",
              "--corpus-bytes", str(1 << 20), "--interval", "2", "--k-snapshot", "2", "--k-persist", "2",
              "--persist-every", "1", "--snapshot-copies", "2", "--collective-timeout", "4s",
              "--rendezvous-timeout", "20s", "--report-every", "5", "--digests", str(tmp_path / "digest-{node}.json")]
    controller = ["--slots", "2", "--min-replicas", "2", "--expected-nodes", "3", "--heartbeat-timeout", "2s",
                  "--join-window", "1s"]
    return LocalCluster(tmp_path / "job", worker_args=worker, controller_args=controller,
                        agent_args=["--heartbeat-interval", "250ms"])


def _fences(store: Path) -> list[dict]:
    d = store / "fence"
    return [json.loads(p.read_text()) for p in sorted(d.glob("g*.json"))] if d.is_dir() else []


@pytest.mark.timeout(300)
def test_a_node_frozen_past_its_lease_is_fenced_and_writes_nothing_that_is_read(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with _cluster(tmp_path) as c:
        c.start(NODES)
        c.wait_step(8, timeout=180)
        first_gen = c.latest_plan()["generation"]
        # the first generation fenced nothing older than itself, but wrote its marker
        c.wait_for(lambda: [f for f in _fences(store) if f["generation"] == first_gen], 30, "the first fence")
        c.freeze_node("n2")
        c.wait_for(lambda: [r for r in c.reconfigurations() if r["reason"] in ("failure", "collective_error")
                            and "n2" not in r["members"]], 60, "the others re-formed without the frozen node")
        new_gen = c.latest_plan()["generation"]
        assert new_gen > first_gen
        fence = c.wait_for(lambda: [f for f in _fences(store) if f["generation"] == new_gen], 30,
                           "the new generation's fence")[0]
        c.wait_step(c.current_step() + 6, timeout=120)      # the others commit on the new generation
        c.thaw_node("n2")
        # woken, it does not train on its stale generation: its agent is evicted and its
        # worker replaced by a fresh joiner of the current generation
        n2_log = tmp_path / "job" / "node-n2.log"
        c.wait_for(lambda: "evicted by the controller" in n2_log.read_text(errors="replace"), 60,
                   "the woken node's eviction")
        assert c.wait(timeout=240) == 0, (tmp_path / "job" / "controller.log").read_text()[-3000:]
    log = n2_log.read_text(errors="replace")
    refusals = re.findall(r"rank \d+ step \d+: write refused, generation (\d+) is fenced by generation (\d+)", log)
    # whatever the woken node tried to write was refused, each refusal logged as such
    assert all(int(old) < int(new) for old, new in refusals), refusals
    cs = CheckpointStore(str(store))
    index, _hidden = cs.manifest_index()
    # every manifest read at or after the takeover is of the new generation or a later one
    assert index and all(g >= new_gen for s, (g, _) in index.items() if s >= fence["resume_step"]), index
    assert all(g >= first_gen for g, _ in index.values())
    assert cs.verify() == []
    cli = subprocess.run([sys.executable, "-m", "moc.cli", "verify", str(store)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert cli.returncode == 0, cli.stdout + cli.stderr
    print(f"\nfrozen n2 woken after generation {new_gen} fenced {first_gen} from step {fence['resume_step']}: "
          f"{len(refusals)} write(s) refused; {len(index)} steps readable, last {max(index)}; "
          f"{time.strftime('%H:%M:%S')}")
