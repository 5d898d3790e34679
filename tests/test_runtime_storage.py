"""A real Lazarus job whose checkpoint storage (moto's S3 behind a proxy) hangs while the
membership changes: storage never holds a reconfiguration up (issue 28's soak found a join
during a hung persist failing plan after plan until the leaving node's agent gave up)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lazarus._local_cluster import LocalCluster
from moc import CheckpointStore
from storage_backends import open_store
from storage_backends.testing import StorageProxy

STEPS = 400


def _events(c: LocalCluster, name: str, **match) -> list[dict]:
    return [e for e in c.events() if e.get("event") == name and all(e.get(k) == v for k, v in match.items())]


@pytest.mark.timeout(420)
def test_join_then_spot_notice_while_storage_hangs(tmp_path: Path, s3) -> None:
    proxy = StorageProxy(s3.port).start()
    env = {"AWS_ENDPOINT_URL": proxy.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": "us-east-1"}
    worker = ["--steps", str(STEPS), "--storage", "s3://ckpt/run", "--layers", "2", "--experts", "4",
              "--d-model", "32", "--d-hidden", "64", "--batch-size", "8", "--seq-len", "32",
              "--corpus-bytes", str(1 << 20), "--interval", "5", "--k-snapshot", "2", "--k-persist", "1",
              "--persist-every", "2", "--snapshot-copies", "2", "--collective-timeout", "4s",
              "--rendezvous-timeout", "20s", "--report-every", "5", "--digests", str(tmp_path / "digest-{node}.json")]
    controller = ["--slots", "2", "--min-replicas", "2", "--expected-nodes", "3", "--heartbeat-timeout", "2s",
                  "--join-window", "1s"]
    agent = ["--heartbeat-interval", "250ms", "--stop-timeout", "3s", "--leave-timeout", "60s"]
    try:
        with LocalCluster(tmp_path / "job", worker_args=worker, controller_args=controller, agent_args=agent,
                          env=env) as c:
            c.start(["n0", "n1", "n2"])
            c.wait_step(20, timeout=180)
            committed = CheckpointStore(open_store("s3://ckpt/run", **s3.options)).steps()
            assert committed, "nothing reached storage before it hung"

            before = proxy.requests
            proxy.hang()
            c.wait_for(lambda: proxy.requests > before, 60, "a persist stuck in a request")
            c.add_node("n3")
            # the joiner starts, probes storage (which hangs) for at most --rendezvous-timeout
            # before it says hello, and joins
            plan = c.wait_for(lambda: [p for p in _events(c, "plan") if "n3" in p.get("joined", [])], 120,
                              "the join plan")[0]
            # applied while storage still hangs (before, every plan failed: the joiner opened
            # storage inside the reconfiguration, past the others' collective timeout)
            c.wait_for(lambda: [e for e in _events(c, "reconfigured") if e["t"] >= plan["t"]
                                and "n3" in e.get("members", [])], 60, "a plan with the joiner applied")
            step = c.current_step()
            c.wait_step(step + 10, timeout=60)   # training goes on while storage still hangs
            assert proxy.requests > before and not committed[-1] > max(
                CheckpointStore(open_store("s3://ckpt/run", **s3.options)).steps())

            t_leave = c.leave("n1")                 # a spot notice while a persist hangs
            assert c.agents["n1"].wait(timeout=45) == 0
            assert time.time() - t_leave < 40
            leave = c.wait_for(lambda: [p for p in _events(c, "plan") if "n1" in p.get("leaving", [])], 10,
                               "the leave plan")[0]
            assert leave["members"] == ["n0", "n2", "n3"]
            c.wait_step(c.current_step() + 10, timeout=60)

            proxy.heal()
            assert c.wait(timeout=300) == 0
            alive = ["n0", "n2", "n3"]
            for node in alive:
                c.agents[node].wait(timeout=60)
            digests = c.read_digests(str(tmp_path / "digest-{node}.json"), alive)
            assert c.final_state_problems(digests, alive, STEPS, expert_units=8) == [], c.dir
            crashed = [e for e in _events(c, "worker_exit") if e.get("returncode") not in (0, -9, -15)]
            assert not crashed, crashed
        cs = CheckpointStore(open_store("s3://ckpt/run", **s3.options))
        assert cs.steps()[-1] > committed[-1] and cs.verify(cs.steps()[-1]) == []
    finally:
        proxy.close()
