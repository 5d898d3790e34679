"""Pure pieces of the elastic runtime: transfer planning, moc's per-unit restore plan,
the hard abort of a group's sockets, failure classification, configuration checks."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest

from lazarus.runtime import ElasticConfig, is_collective_error
from lazarus.runtime.worker._abort import SocketTracker
from lazarus.runtime.controller._state import STATE_FILE, read_state, write_state
from lazarus.runtime.agent._agent_worker import RestartPolicy, describe_exit, exit_status, last_error_line
from lazarus.runtime.worker._transfer import Move, choose_moves
from moc import MoCConfig
from moc._restore import plan_units


def test_fetches_of_one_expert_rotate_over_its_holders() -> None:
    needs = {3: ["expert/l/0"], 4: ["expert/l/0"], 5: ["expert/l/0"], 6: ["expert/l/0", "expert/l/1"]}
    holders = {"expert/l/0": [0, 1, 2], "expert/l/1": [0]}
    moves, missing = choose_moves(needs, holders)
    srcs = [m.src for m in moves if m.unit == "expert/l/0"]
    assert len(srcs) == 4 and len(set(srcs[:3])) == 3   # the first three fetches use three owners
    assert Move("expert/l/1", 0, 6) in moves
    assert missing == []
    assert [m.dst for m in moves] == sorted(m.dst for m in moves)   # all_to_all layout


def test_needs_without_a_holder_are_missing() -> None:
    moves, missing = choose_moves({1: ["expert/l/0", "expert/l/1"]}, {"expert/l/0": [0], "expert/l/1": [1]})
    assert moves == [Move("expert/l/0", 0, 1)]
    assert missing == [("expert/l/1", 1)]              # only the destination itself "holds" it


def _header(rank: int, step: int, units: dict[str, int], cum: int = 0) -> dict:
    return {"rank": rank, "step": step, "buffer": 0,
            "units": {u: {"unit_nbytes": n, "skeleton": {}, "tensors": []} for u, n in units.items()},
            "pieces": [{"unit": u, "start": 0, "end": n, "offset": 0, "checksum": ""} for u, n in units.items()],
            "plt": {"cum": {"l": [cum, cum]}}, "meta": {}}


def test_plan_units_takes_the_newest_version_from_memory_or_storage() -> None:
    snapshots = [_header(0, 30, {"expert/l/0": 8}, cum=300), _header(1, 10, {"expert/l/1": 8}, cum=100)]
    manifest = {"step": 20, "units": {"expert/l/0": {"step": 20}, "expert/l/1": {"step": 20}},
                "plt": {"saved": {"persist": {"l": [200, 200]}}}, "meta": {}}
    plan = plan_units(snapshots, manifest, ["expert/l/0", "expert/l/1", "expert/l/9"])
    assert plan.sources["expert/l/0"].level == "snapshot" and plan.sources["expert/l/0"].version == 30
    assert plan.sources["expert/l/0"].cum == 300
    assert plan.sources["expert/l/1"].level == "persist" and plan.sources["expert/l/1"].version == 20
    assert plan.sources["expert/l/1"].cum == 200
    assert "expert/l/9" not in plan.sources
    # A memory copy split over two ranks counts only when its pieces cover the whole unit.
    half = _header(2, 40, {"expert/l/1": 8})
    half["pieces"][0]["end"] = 4
    assert plan_units(snapshots + [half], manifest, ["expert/l/1"]).sources["expert/l/1"].version == 20


@pytest.mark.timeout(20)
def test_socket_tracker_interrupts_a_blocked_peer_but_leaves_listeners_alone() -> None:
    tracker = SocketTracker()
    with tracker.track():
        listener = socket.create_server(("127.0.0.1", 0))
        ours = socket.create_connection(listener.getsockname())
        theirs, _ = listener.accept()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(theirs.recv(10)))
    reader.start()                  # the "peer" blocks in a receive
    assert tracker.shutdown_all() >= 1
    reader.join(timeout=5)
    assert not reader.is_alive() and got == [b""]       # EOF at once, not a timeout
    late = socket.create_connection(listener.getsockname())   # the listener still accepts
    late.close()
    for s in (listener, ours, theirs):
        s.close()


def test_collective_errors_are_told_apart_from_bugs() -> None:
    assert is_collective_error(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    assert is_collective_error(RuntimeError("Timed out waiting 5000ms for recv operation to complete"))
    assert is_collective_error(ConnectionResetError())
    assert not is_collective_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)"))
    assert not is_collective_error(ValueError("bad value"))


@pytest.mark.parametrize("kwargs, field", [
    ({"collective_timeout": timedelta(0)}, "collective_timeout"),
    ({"collective_timeout": timedelta(seconds=30), "rendezvous_timeout": timedelta(seconds=10)}, "rendezvous_timeout"),
    ({"report_every": 0}, "report_every"),
    ({"memory_key": "a/b"}, "memory_key"),
    ({"grad_clip": -1.0}, "grad_clip"),
    ({"moc": {"storage": "x"}}, "moc"),
])
def test_elastic_config_names_the_bad_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ElasticConfig(**kwargs)


def test_elastic_config_accepts_a_moc_config() -> None:
    cfg = ElasticConfig(moc=MoCConfig(storage="memory://x"), collective_timeout=timedelta(seconds=2))
    assert cfg.rendezvous_timeout > cfg.collective_timeout


def test_restart_policy_caps_restarts_in_a_sliding_window_with_doubling_delays() -> None:
    now = [0.0]
    policy = RestartPolicy(3, timedelta(seconds=60), timedelta(milliseconds=500), clock=lambda: now[0])
    assert [policy.next_delay() for _ in range(3)] == [0.5, 1.0, 2.0]
    assert policy.next_delay() is None            # the 4th crash within the window: give up
    now[0] = 61.0                                 # the window slid past all three
    assert policy.recent() == 0 and policy.next_delay() == 0.5
    many = RestartPolicy(100, timedelta(hours=1), timedelta(seconds=1), clock=lambda: 0.0)
    assert max(many.next_delay() for _ in range(20)) == 60.0   # capped
    assert RestartPolicy(0, timedelta(seconds=1), timedelta(0)).next_delay() is None
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(-1, timedelta(seconds=1), timedelta(0))


def test_last_error_is_the_last_exception_line_of_stderr() -> None:
    tail = (b"step 3 loss 2.1\nTraceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
            b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\nexiting\n")
    assert last_error_line(tail) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"
    assert last_error_line(b"just a message\n\n") == "just a message"
    assert last_error_line(b"") is None
    assert describe_exit(1) == "exit 1" and describe_exit(-9) == "killed by SIGKILL"
    assert exit_status(-15) == 143 and exit_status(7) == 7


def _state(**over):
    base = {"epoch": 2, "port": 29400, "store_port": 29401, "generation": 3, "plan": {"generation": 3},
            "members": ["a", "b"], "stalled": False, "applied_gen": 3, "holdings": {"a": {"l": [0, 1]}},
            "model": {"layers": {"l": 4}}, "routing": {"l": [[1.0, 2.0, 3.0, 4.0]]}, "last_step": 40,
            "last_rebalance_step": 20, "done": [], "left": [], "finished": False}
    base.update(over)
    return base


def test_controller_state_round_trips_and_is_replaced_atomically(tmp_path) -> None:
    assert read_state(tmp_path) is None
    path = write_state(tmp_path / "st", _state())
    assert path.name == STATE_FILE and read_state(tmp_path / "st")["members"] == ["a", "b"]
    write_state(tmp_path / "st", _state(generation=4))
    assert read_state(tmp_path / "st")["generation"] == 4
    assert [p.name for p in (tmp_path / "st").iterdir()] == [STATE_FILE]   # no temporaries left
    # a writer killed before its rename leaves only a temporary: the old state stands
    (tmp_path / "st" / ".state-x.tmp").write_text('{"torn":')
    assert read_state(tmp_path / "st")["generation"] == 4


@pytest.mark.parametrize("text, match", [
    ("{not json", "is not JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"version": 99}', "has version 99"),
])
def test_unreadable_controller_state_is_named(tmp_path, text: str, match: str) -> None:
    (tmp_path / STATE_FILE).write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        read_state(tmp_path)
    assert str(tmp_path / STATE_FILE) in str(err.value)


@pytest.mark.parametrize("field, value", [("generation", "3"), ("members", [1, 2]), ("finished", 1),
                                          ("plan", 5), ("epoch", None)])
def test_controller_state_fields_are_checked(tmp_path, field: str, value) -> None:
    write_state(tmp_path, _state(**{field: value}))
    with pytest.raises(ValueError, match=repr(field)):
        read_state(tmp_path)


def test_choose_moves_prefers_a_holder_on_the_destinations_node() -> None:
    holders = {"expert/l/0": [0, 2], "expert/l/1": [0, 2]}
    nodes = ["a", "a", "b", "b"]
    # rank 3 (node b) takes both from rank 2 (node b), rank 1 (node a) from rank 0
    moves, missing = choose_moves({1: ["expert/l/0", "expert/l/1"], 3: ["expert/l/0", "expert/l/1"]}, holders, nodes)
    assert missing == []
    assert {(m.unit, m.src, m.dst) for m in moves} == {("expert/l/0", 0, 1), ("expert/l/1", 0, 1),
                                                       ("expert/l/0", 2, 3), ("expert/l/1", 2, 3)}
    # without nodes the fetches of one expert rotate over its holders
    moves, _ = choose_moves({1: ["expert/l/0"], 3: ["expert/l/0"]}, holders)
    assert sorted(m.src for m in moves) == [0, 2]
    # no holder on the destination's node: the rotation as before
    moves, _ = choose_moves({1: ["expert/l/0"], 3: ["expert/l/0"]}, {"expert/l/0": [4, 5]},
                            ["a", "a", "b", "b", "c", "d"])
    assert sorted(m.src for m in moves) == [4, 5]


def _on_ranks(n: int, fn) -> None:
    """``fn(rank)`` for ranks ``0..n-1`` at once, one thread each (a collective needs all)."""
    threads = [threading.Thread(target=fn, args=(r,)) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)


def _on_both_ranks(fn) -> None:
    _on_ranks(2, fn)


def _count_gathers(comms) -> dict[int, int]:
    """Count each comm's all-gather rounds (by rank) from now on."""
    rounds = {rank: 0 for rank in comms}
    for rank, c in comms.items():
        inner = c._all_gather

        def counted(out, t, group, _inner=inner, _rank=rank) -> None:
            rounds[_rank] += 1
            _inner(out, t, group)
        c._all_gather = counted
    return rounds


def _private_comm_pair(store, form_timeout: timedelta = timedelta(seconds=20)):
    from moc._dist import Comm
    out: dict[int, Comm] = {}

    def form(rank: int) -> None:
        out[rank] = Comm.create_private(store, rank, 2, timedelta(seconds=5), form_timeout=form_timeout)

    _on_both_ranks(form)
    return out


@pytest.mark.timeout(60)
def test_private_moc_groups_run_every_collective_and_stay_out_of_torch_distributed() -> None:
    import torch
    import torch.distributed as dist
    comms = _private_comm_pair(dist.HashStore())
    assert sorted(comms) == [0, 1] and all(c.private and c.world == 2 for c in comms.values())
    results: dict[int, dict] = {}

    def run(rank: int) -> None:
        c = comms[rank]
        send = torch.tensor([rank * 10 + d for d in range(2)], dtype=torch.uint8)
        results[rank] = {"json": c.gather_json({"r": rank}), "persist": c.gather_json(rank, persist=True),
                         "any": c.any_true(rank == 1), "sum": c.sum_int64(torch.tensor([rank + 1])).tolist(),
                         "bytes": c.gather_bytes(b"x" * (rank + 1), [1, 2]),
                         "bcast": c.broadcast_json(f"from {rank}", src=1),
                         "x": c.exchange(send, [1, 1], [1, 1]).tolist()}
        c.barrier()

    _on_both_ranks(run)
    for rank in range(2):
        r = results[rank]
        assert r["json"] == [{"r": 0}, {"r": 1}] and r["persist"] == [0, 1] and r["any"] is True
        assert r["sum"] == [3] and r["bytes"] == [b"x", b"xx"] and r["bcast"] == "from 1"
        assert r["x"] == [rank, 10 + rank]   # element d of every rank's send goes to rank d
    assert not dist.is_initialized()   # no default group, no registered group
    for c in comms.values():
        c.destroy()


@pytest.mark.timeout(60)
def test_gather_json_takes_one_round_when_small_and_two_when_any_rank_is_long() -> None:
    import torch.distributed as dist
    from moc._dist import GATHER_INLINE_MAX, gather_inline
    assert gather_inline(2) == GATHER_INLINE_MAX and gather_inline(1 << 20) == 4096   # held near 1 MiB a round
    comms = _private_comm_pair(dist.HashStore())
    rounds = _count_gathers(comms)
    long_value = {"s": "\u00e9x" * gather_inline(2), "n": list(range(500))}   # longer than the inline size
    small = {0: {"r": 0}, 1: ""}
    results: dict[int, list] = {}

    def run(rank: int) -> None:
        c = comms[rank]
        results[rank] = [c.gather_json(small[rank])]
        results[rank].append(rounds[rank])
        results[rank].append(c.gather_json(long_value if rank == 1 else None, persist=True))
        results[rank].append(rounds[rank])

    _on_both_ranks(run)
    for rank in range(2):
        first, after_small, second, after_long = results[rank]
        assert first == [{"r": 0}, ""] and after_small == 1        # both fit: one round
        assert second == [None, long_value] and after_long == 3    # one rank's is long: two rounds
    for c in comms.values():
        c.destroy()


@pytest.mark.timeout(60)
def test_a_newer_plan_abandons_moc_groups_that_wait_for_a_dead_peer() -> None:
    # A peer died while moc's groups connected: gloo would wait for it up to 5x the connect
    # timeout and nothing can interrupt that wait. A newer plan must not: the groups'
    # thread is left behind (its private groups touch no torch.distributed state).
    import time

    import torch.distributed as dist
    from types import SimpleNamespace

    from lazarus.runtime._plan import Superseded
    from lazarus.runtime.worker._moc_groups import MocGroups
    from lazarus.runtime.worker._rendezvous_store import StoreClients
    from moc._dist import Comm
    store = dist.HashStore()
    box: dict = {"sockets": SocketTracker()}

    def form() -> None:   # rank 0 of 2; rank 1 never comes
        try:
            box["comm"] = Comm.create_private(store, 0, 2, timedelta(seconds=2), form_timeout=timedelta(seconds=3))
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    th = threading.Thread(target=form, daemon=True)
    th.start()
    config = SimpleNamespace(rendezvous_timeout=timedelta(seconds=30))
    stores = StoreClients(config, where="n0", channel=None)   # its store is not a rendezvous client here
    r = MocGroups(config, where="n0", sockets=SocketTracker(), superseded=threading.Event(), stores=stores)
    r._pending, r.waited = (th, box), 0.0
    threading.Timer(0.3, r.superseded.set).start()
    t0 = time.monotonic()
    with pytest.raises(Superseded):
        r.wait(step=7, generation=3)
    assert time.monotonic() - t0 < 2.0 and th.is_alive() and r._pending is None
    th.join(30)   # it fails on its own later, without a trace in torch.distributed
    assert "error" in box and not dist.is_initialized()


@pytest.mark.timeout(60)
def test_a_store_connect_is_given_up_on_at_once_even_inside_torchs_retry_sleeps() -> None:
    # A listener that accepts but never answers: torch's client times out, sleeps its
    # backoff, retries; connect_store watches it and gives up when told (or at its wall).
    import time

    import torch.distributed as dist
    from lazarus.runtime.worker._store_connect import GaveUp, connect_store
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(16)
    port = mute.getsockname()[1]
    try:
        t0 = time.monotonic()
        stop = threading.Timer(0.3, lambda: None)
        stop.start()
        with pytest.raises(GaveUp):
            connect_store("127.0.0.1", port, timeout=timedelta(seconds=5), give_up=lambda: not stop.is_alive())
        assert time.monotonic() - t0 < 1.5
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="did not accept a client within 0.5 s"):
            connect_store("127.0.0.1", port, timeout=timedelta(seconds=5), wall=0.5)
        assert time.monotonic() - t0 < 1.5
    finally:
        mute.close()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    client = connect_store("127.0.0.1", server.port, timeout=timedelta(seconds=5), tracker=SocketTracker())
    client.set("k", "v")
    assert server.get("k") == b"v"


def test_a_stale_survivor_keeps_its_own_copy_of_an_expert_nobody_holds_at_the_newest_step() -> None:
    """A node died mid-step: rank 0 finished step 11, ranks 1 and 2 are still at 10 (stale).
    Expert 3 of layer L survives only on rank 1 (its other replica died with the node): rank 1
    keeps its copy, one step behind, instead of asking for it and finding no other holder
    (``lost`` before the fix: restored from a checkpoint; seen once in make test, the
    controller-away fault test, 4 experts lost). Rank 2, which gets expert 3 in the plan, is
    served by rank 1; expert 0, held at step 11 by rank 0, is taken from there, not from the
    stale copies; the dense units go to the stale ranks; a joiner keeps nothing and its
    placeholder experts serve nobody."""
    from lazarus.runtime.worker._transfer import choose_moves, unit_needs

    inv = [{"step": 11, "experts": {"L": [0, 1]}, "modules": ["dense/a", "dense/b"]},
           {"step": 10, "experts": {"L": [0, 3]}, "modules": ["dense/a", "dense/b"]},
           {"step": 10, "experts": {"L": [2, 1]}, "modules": ["dense/a", "dense/b"]},
           {"step": -1, "experts": {"L": [2]}, "modules": []}]
    slots = {0: {"L": [0, 1]}, 1: {"L": [0, 3]}, 2: {"L": [2, 3]}, 3: {"L": [2, 1]}}
    needs, holders = unit_needs(inv, 11, slots)
    assert holders["expert/L/0"] == [0] and holders["expert/L/3"] == [1] and holders["expert/L/2"] == [2]
    assert 0 not in needs
    assert needs[1] == ["dense/a", "dense/b", "expert/L/0"]                 # keeps 3, refreshes 0
    assert needs[2] == ["dense/a", "dense/b", "expert/L/3"]                 # keeps 2 (nobody fresh has it)
    assert needs[3] == ["dense/a", "dense/b", "expert/L/1", "expert/L/2"]   # a joiner keeps nothing
    moves, missing = choose_moves(needs, holders)
    assert missing == []
    src = {(m.unit, m.dst): m.src for m in moves}
    assert src[("expert/L/3", 2)] == 1 and src[("expert/L/0", 1)] == 0 and src[("expert/L/2", 3)] == 2


_EXIT_AFTER_RELEASE = """
import sys, threading
from datetime import timedelta
import torch.distributed as dist
from moc._dist import Comm
from lazarus.runtime.worker._abort import release_in_background

retired = []
for k in range(5):
    store, comms = dist.PrefixStore(str(k), dist.HashStore()), {}

    def form(rank):
        comms[rank] = Comm.create_private(store, rank, 2, timedelta(seconds=10))
        comms[rank].gather_json(rank)   # both ranks: the groups connected and used

    threads = [threading.Thread(target=form, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for c in comms.values():
        c.destroy()
    retired += comms.values()
release_in_background(retired, name="release")
sys.exit(0)   # at once, as a worker leaving the job right after retiring its groups
"""


@pytest.mark.timeout(120)
def test_a_process_exiting_right_after_releasing_groups_exits_cleanly() -> None:
    """The retired groups are destroyed in a thread; a worker that leaves the job exits
    right after. The interpreter must wait for that thread: exiting while a gloo group's
    destructor ran in it aborted the process (SIGABRT, seen in the soak on a spot notice)."""
    import subprocess
    import sys

    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", _EXIT_AFTER_RELEASE], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and "terminate called" not in out.stderr, (out.returncode, out.stderr[-2000:])


class _CountingBoard:
    """A StoreBoard that records which ranks each reader asked for."""

    def __init__(self, store, prefix: str) -> None:
        from lazarus.runtime.worker._transfer import StoreBoard
        self.inner = StoreBoard(store, prefix, timedelta(seconds=20))
        self.reads: dict[int, list[int]] = {}
        self.posts: list[int] = []

    def post(self, rank: int, text: str) -> None:
        self.posts.append(rank)
        self.inner.post(rank, text)

    def read(self, ranks):
        self.reads[threading.get_ident()] = list(ranks)
        return self.inner.read(ranks)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("via", ["board", "gather"])
def test_units_move_with_their_descriptions_from_each_sender(via: str) -> None:
    """Two holders send a unit of the same name (different contents and shapes) to two
    receivers: each receiver decodes what its own sender described. With a board no
    all-gather runs and a receiver reads only its senders' posts."""
    import torch
    import torch.distributed as dist
    from moc._dist import Comm
    from lazarus.runtime.worker._transfer import exchange_units

    store = dist.HashStore()
    comms: dict[int, Comm] = {}
    _on_ranks(4, lambda r: comms.__setitem__(r, Comm.create_private(dist.PrefixStore("g", store), r, 4,
                                                                    timedelta(seconds=10))))
    rounds = _count_gathers(comms)
    moves = [Move("u", 0, 2), Move("v", 0, 2), Move("u", 1, 3)]          # sorted by destination
    trees = {0: {"u": {"model": {"w": torch.zeros(2)}}, "v": {"model": {"w": torch.arange(4.0).view(2, 2)},
                                                               "step": 7}},
             1: {"u": {"model": {"w": torch.ones(3)}}}, 2: {}, 3: {}}
    board = _CountingBoard(dist.PrefixStore("b", store), "units") if via == "board" else None
    got: dict[int, dict] = {}
    _on_ranks(4, lambda r: got.__setitem__(r, exchange_units(moves, trees[r], comms[r], board=board)))
    assert sorted(got) == [0, 1, 2, 3] and got[0] == {} and got[1] == {}
    assert torch.equal(got[2]["u"]["model"]["w"], torch.zeros(2)) and got[2]["v"]["step"] == 7
    assert torch.equal(got[2]["v"]["model"]["w"], torch.arange(4.0).view(2, 2))
    assert torch.equal(got[3]["u"]["model"]["w"], torch.ones(3))    # its sender's, not rank 0's "u"
    if via == "board":
        assert rounds == {r: 0 for r in range(4)}                    # no all-gather
        assert sorted(board.posts) == [0, 1] and sorted(board.reads.values()) == [[0], [1]]
    else:
        assert all(n == 1 for n in rounds.values())
    for c in comms.values():
        c.destroy()


@pytest.mark.timeout(60)
def test_a_retired_gloo_group_is_handed_back_for_its_destructor_to_run_elsewhere() -> None:
    """``GroupAborter.retire`` tears the groups down and returns them still referenced (a
    gloo group's destructor waits ~10 ms for its I/O loop): the caller frees them off the
    training thread, and torch.distributed is free for the next generation at once."""
    import torch
    import torch.distributed as dist
    from lazarus.runtime.worker._abort import GroupAborter, registered_groups, release_in_background

    for gen in range(2):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{gen}", dist.HashStore()), rank=0, world_size=1)
        sub = dist.new_group([0])
        world = dist.group.WORLD
        assert {id(g) for g in registered_groups()} == {id(world), id(sub)}
        aborter = GroupAborter("gloo")
        report = aborter.retire()
        assert report.teardown == "destroy" and not dist.is_initialized()
        groups = aborter.take_retired()
        assert {id(g) for g in groups} == {id(world), id(sub)} and aborter.take_retired() == []
        del world, sub
        th = release_in_background(groups, name="release-test")
        assert groups == []
        th.join(10)
        assert not th.is_alive()
    t = torch.ones(1)
    dist.init_process_group("gloo", store=dist.PrefixStore("after", dist.HashStore()), rank=0, world_size=1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    assert t.item() == 1.0


@pytest.mark.timeout(30)
def test_an_idle_daemon_executor_holds_nothing_of_its_finished_jobs() -> None:
    """A moc persist thread (a daemon) must not hold the last reference to a retired
    manager: dropped there while the interpreter exits, a process group's destructor
    aborted a worker leaving the job (SIGABRT at exit)."""
    import time
    import weakref
    from moc._daemon import DaemonExecutor

    class Owner:
        def work(self, x: int) -> int:
            return x + 1

    ex = DaemonExecutor("test-executor")
    owner = Owner()
    ref = weakref.ref(owner)
    assert ex.submit(owner.work, 1).result(timeout=10) == 2
    del owner
    deadline = time.monotonic() + 5
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ref() is None     # the job's bound method died with the job, not at the next one
    ex.shutdown(wait=False)
    assert ex.join(5)
