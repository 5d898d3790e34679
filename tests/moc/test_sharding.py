"""Who saves what: expert bytes split over holders, modules spread equal / adaptive."""

from __future__ import annotations

from moc._sharding import plan_shares, split_range


def test_split_range_tiles_and_aligns():
    for n in (0, 1, 63, 64, 1000, 4096 + 7):
        for parts in (1, 2, 3, 4):
            rs = split_range(n, parts)
            assert rs[0][0] == 0 and rs[-1][1] == n and len(rs) == parts
            assert all(a[1] == b[0] for a, b in zip(rs, rs[1:]))
            assert all(a % 64 == 0 for a, _ in rs[1:] if a != n)


def test_expert_bytes_split_over_holders():
    shares = plan_shares({"expert/l/0": 1000}, {}, {"expert/l/0": [1, 3]}, 4, "adaptive")
    assert [(s.rank, s.start, s.end) for s in shares] == [(1, 0, 448), (3, 448, 1000)]
    none = plan_shares({"expert/l/0": 1000}, {}, {"expert/l/0": [1, 3]}, 4, "none")
    assert [(s.rank, s.start, s.end) for s in none] == [(1, 0, 1000)]


def test_adaptive_balances_bytes_counting_expert_shares():
    experts = {"expert/l/0": 900}  # rank 0 alone holds it
    modules = {"module/a": 500, "module/b": 400, "module/c": 300, "module/d": 100}
    holders = {"expert/l/0": [0], **{m: [0, 1, 2] for m in modules}}
    shares = plan_shares(experts, modules, holders, 3, "adaptive")
    load = [0, 0, 0]
    for s in shares:
        load[s.rank] += s.nbytes
    assert max(load) == 900  # rank 0 keeps only its expert; modules go to ranks 1 and 2
    equal = plan_shares(experts, modules, holders, 3, "equal")
    eload = [0, 0, 0]
    for s in equal:
        eload[s.rank] += s.nbytes
    assert max(eload) > max(load)
    assert sorted(s.unit for s in shares) == sorted(s.unit for s in equal)
