"""The soak's own parts (``benchmarks/soak``): its schedule, the world-size rule, the tmpfs
filler that makes ``/dev/shm`` full, the log reader and the per-kind evidence. The soak
itself runs a live job for minutes (``make soak``); these check the pieces it relies on."""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak"
sys.path.insert(0, str(SOAK))

import _soak_faults as sf  # noqa: E402
from _soak_env import Tmpfs, log_lines  # noqa: E402


def test_schedule_is_a_function_of_the_seed_and_the_kinds():
    a, b = sf.schedule(7, 10), sf.schedule(7, 10)
    assert a == b and a != sf.schedule(8, 10)
    assert all(0 < t <= 600 for t, _ in a)
    assert {k for _, k in a} <= set(sf.KINDS)
    only = sf.schedule(7, 10, ("kill_two_in_grace", "join"))
    assert {k for _, k in only} == {"kill_two_in_grace", "join"}


class _World:
    """Just what pick_kind reads."""

    def __init__(self, n: int) -> None:
        self.alive = [f"n{i}" for i in range(n)]


def test_the_network_kinds_leave_the_loopback_schedule_as_it_was():
    """make soak NETWORK=netns adds kinds; a loopback soak of a seed draws what it drew before."""
    # seed 7's first 8 kinds as the schedule drew them before the network kinds (42ab3df)
    assert [k for _, k in sf.schedule(7, 10)][:8] == ["kill_worker", "kill_node", "freeze_worker", "spot_notice",
                                                      "freeze_worker", "kill_node", "kill_during_reconfig",
                                                      "kill_controller"]
    netns = tuple(k for k in sf.KINDS if k not in sf.PROXY_KINDS) + sf.NETNS_KINDS
    kinds = {k for s in range(5) for _, k in sf.schedule(s, 10, netns)}
    assert kinds & set(sf.NETNS_KINDS) and not kinds & set(sf.PROXY_KINDS)


def test_a_peer_cut_is_accounted_only_when_the_cut_node_alone_was_dropped(tmp_path):
    t0 = 1000.0
    recs = [{"t": t0 + i * 0.5, "step": 100 + i} for i in range(40)]
    ok = [{"t": t0 + 5.0, "event": "collective_error", "node": "n1"},
          {"t": t0 + 6.1, "event": "plan", "lost": ["n2"], "joined": [], "members": ["n0", "n1", "n3"]},
          {"t": t0 + 16.0, "event": "plan", "lost": [], "joined": ["n2"], "members": ["n0", "n1", "n2", "n3"]}]
    f = sf.Fault("cut_peers_in", t0, node="n2", t_end=t0 + 10)
    sf.account(f, ok, recs, tmp_path, 0.1)
    assert f.accounted, f.evidence
    wrong = [ok[0], dict(ok[1], lost=["n1"], members=["n0", "n2", "n3"]), ok[2]]   # a healthy node dropped
    f = sf.Fault("cut_peers_in", t0, node="n2", t_end=t0 + 10)
    sf.account(f, wrong, recs, tmp_path, 0.1)
    assert not f.accounted, f.evidence


def test_a_flap_is_accounted_by_a_bounded_number_of_plans_and_the_node_back(tmp_path):
    t0, n = 1000.0, "n0"
    recs = [{"t": t0 + i * 0.5, "step": 100 + i} for i in range(400)]
    drop = {"event": "plan", "lost": [n], "joined": [], "members": ["n1", "n2", "n3"]}
    back = {"event": "plan", "lost": [], "joined": [n], "members": ["n1", "n2", "n3", n]}
    held = {"t": t0 + 130.0, "event": "join_held", "node": n}
    f = sf.Fault("flap", t0, node=n, t_end=t0 + 126.0, detail={"link_changes": 36})
    sf.account(f, [dict(drop, t=t0 + 3), held, dict(back, t=t0 + 180)], recs, tmp_path, 0.1)
    assert f.accounted, f.evidence
    # a plan per flap: past the bound
    many = [dict(p, t=t0 + 3 + 6 * i + (3 if p is back else 0)) for i in range(sf.FLAP_LIMIT + 2) for p in (drop, back)]
    f = sf.Fault("flap", t0, node=n, t_end=t0 + 126.0, detail={"link_changes": 36})
    sf.account(f, [*many, held], recs, tmp_path, 0.1)
    assert not f.accounted and f.detail["plans"] > 2 * sf.FLAP_LIMIT + 2, f.evidence


@pytest.mark.parametrize("kind", sf.KINDS)
def test_every_kind_keeps_the_world_within_3_to_5_nodes(kind):
    removes = {"kill_node": 1, "spot_notice": 1, "spot_notice_persist_hung": 1, "kill_controller_away": 1,
               "kill_during_reconfig": 2, "kill_two_in_grace": 2, "join": -1, "shm_full": -1,
               "kill_during_join": 0}
    for n in range(sf.MIN_NODES, sf.MAX_NODES + 1):
        picked = sf.Soak.pick_kind(_World(n), kind)
        after = n - removes.get(picked, 0)
        assert sf.MIN_NODES <= after <= sf.MAX_NODES, (kind, n, picked)
        if picked != kind:
            assert picked in ("join", "kill_node")


def test_tmpfs_filler_makes_allocation_fail_with_enospc_until_drained(tmp_path):
    fs = Tmpfs(tmp_path / "shm", 8 << 20)
    try:
        fs.mount()
    except RuntimeError as exc:
        pytest.fail(str(exc))   # the soak machine and CI run as root
    try:
        taken = fs.fill()
        assert taken > 7 << 20 and fs.free() < 64 << 10
        fd = os.open(fs.path / "buf0.bin", os.O_RDWR | os.O_CREAT)
        try:
            with pytest.raises(OSError) as err:
                os.posix_fallocate(fd, 0, 1 << 20)
            assert err.value.errno == errno.ENOSPC
            fs.drain()
            os.posix_fallocate(fd, 0, 1 << 20)   # room again once the filler is gone
        finally:
            os.close(fd)
    finally:
        fs.unmount()
    assert not os.path.ismount(fs.path)


def test_log_lines_reads_the_workers_timestamps(tmp_path):
    (tmp_path / "node-n3.log").write_text(
        "2026-11-25 02:43:18,700 worker n3 moc WARNING rank 1 step 240: snapshot skipped (1 so far) on this rank\n"
        "2026-11-25 02:43:19,000 worker n3 moc INFO rank 1 step 240: checkpoint persisted\n"
        "a line without a time: snapshot skipped\n")
    got = log_lines(tmp_path, "snapshot skipped")
    assert len(got) == 1 and got[0][1] == "n3"
    want = time.mktime(time.strptime("2026-11-25 02:43:18", "%Y-%m-%d %H:%M:%S")) + 0.7
    assert got[0][0] == pytest.approx(want)


def test_shm_full_needs_skipped_snapshots_inside_its_window(tmp_path):
    """shm_full is accounted only when a worker logged a skipped snapshot while the tmpfs
    was full, and training went on meanwhile."""
    t0 = time.mktime(time.strptime("2026-11-25 02:43:10", "%Y-%m-%d %H:%M:%S"))
    events = [{"t": t0 + 1, "event": "node_registered", "node": "n4"},
              {"t": t0 + 5, "event": "plan", "joined": ["n4"], "members": ["n0", "n4"], "lost": []}]
    recs = [{"t": t0 + i, "step": 100 + i} for i in range(20)]
    f = sf.Fault("shm_full", t0, node="n4", t_end=t0 + 12)
    sf.account(f, events, recs, tmp_path, 0.1)
    assert not f.accounted and any("0 'snapshot skipped'" in e for e in f.evidence)
    (tmp_path / "node-n4.log").write_text(
        "2026-11-25 02:43:18,700 worker n4 moc WARNING rank 1 step 240: snapshot skipped (1 so far) on this rank: "
        "OSError: [Errno 28] snapshot buffer cannot grow\n")
    f = sf.Fault("shm_full", t0, node="n4", t_end=t0 + 12)
    sf.account(f, events, recs, tmp_path, 0.1)
    assert f.accounted, f.evidence
    assert f.detail["rate"] == pytest.approx(13 * 0.1 / 12, abs=0.01)   # 13 steps in the 12 s window


def test_freeze_worker_is_accounted_only_by_the_watchdogs_kill_and_the_rejoin(tmp_path):
    t0 = 1000.0
    events = [{"t": t0 + 0.6, "event": "worker_exit", "node": "n2", "returncode": -9,
               "error": "killed by SIGKILL by the agent's watchdog (frozen: stopped (process state T, SIGSTOP) ..."},
              {"t": t0 + 0.6, "event": "node_failed", "node": "n2", "cause": "worker_exit"},
              {"t": t0 + 0.8, "event": "plan", "lost": ["n2"], "joined": [], "members": ["n0", "n1"]},
              {"t": t0 + 9.0, "event": "plan", "lost": [], "joined": ["n2"], "members": ["n0", "n1", "n2"]}]
    recs = [{"t": t0 + i * 0.5, "step": 100 + i} for i in range(30)]
    f = sf.Fault("freeze_worker", t0, node="n2", t_end=t0 + 4)
    sf.account(f, events, recs, tmp_path, 0.1)
    assert f.accounted, f.evidence
    # a SIGKILL the soak ordered (kill_worker) is no watchdog kill
    plain = [dict(events[0], error="killed by SIGKILL")] + events[1:]
    f = sf.Fault("freeze_worker", t0, node="n2", t_end=t0 + 4)
    sf.account(f, plain, recs, tmp_path, 0.1)
    assert not f.accounted


def test_the_matrix_passes_the_network_to_every_run(tmp_path):
    """``make soak-matrix NETWORK=netns``: each run's command carries ``--network``, and a
    bad network is refused by name before anything runs."""
    import matrix

    cmd = matrix.command(7, 2, 4.0, tmp_path / "seed7-load2", "partition,flap", "netns")
    assert cmd[cmd.index("--network") + 1] == "netns" and cmd[cmd.index("--kinds") + 1] == "partition,flap"
    assert cmd[cmd.index("--json") + 1] == str(tmp_path / "seed7-load2.json")
    assert matrix.command(7, 0, 4.0, tmp_path / "x", None, "loopback")[-2:] == ["--network", "loopback"]
    with pytest.raises(SystemExit):
        matrix.main(["--network", "ether", "--dir", str(tmp_path)])


def test_the_matrix_row_names_every_kind_the_soak_injects():
    """A run whose faults include the network's kinds makes a table row (the matrix used to
    stop on them after the first netns run, its record kept but no table written)."""
    import matrix

    kinds = (*sf.KINDS, *sf.NETNS_KINDS)
    assert [k for k in kinds if k not in matrix.SHORT] == []
    assert len(set(matrix.SHORT.values())) == len(matrix.SHORT)          # one short name per kind
    faults = [{"kind": k, "time_lost": 1.0, "steps_lost": 0, "accounted": True} for k in kinds]
    rec = {"seed": 3, "load": 0, "faults": faults, "checks": [{"name": "job finished", "passed": True}],
           "targets_missed": ["partition"]}
    line = matrix.row(rec)
    assert f"| {len(kinds)}/{len(kinds)} |" in line and "pt 1" in line and "fl 1" in line
    assert line.endswith("all pass; targets missed: pt |")
