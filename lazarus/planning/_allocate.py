"""Load-aware replica allocation (Eq. 1 of the Lazarus paper).

Popular experts receive more replicas so that per-replica work evens out, while every
expert keeps at least ``f`` replicas so that any ``f - 1`` node failures are survivable.
The rule walks the experts from the least to the most loaded one and hands each a share
of the slots that are still free, proportional to its part of the load that is still
unassigned; the most loaded expert takes whatever is left, so the slots add up exactly.

Optional per-node cap: ``max_per_node`` limits the copies of one expert a node may hold
(``max_per_node * num_nodes`` replicas in all). By default there is no cap, exactly as in
Eq. 1: several replicas of a hot expert on one node are how that node takes a larger share
of its tokens (the dispatcher gives a rank holding two replicas twice the share), which is
what keeps per-replica work even under heavy skew. Fault tolerance is unaffected either
way, since placement spreads each expert over distinct nodes first. With a cap, an
expert's count is clamped to ``[rest - cap * (experts after it), cap]`` inside the same
sweep, so the result still sums to ``N * c`` and never drops below ``f``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from decimal import Decimal

from ._validate import check_int, check_loads


def _exact_ratio(x: float) -> tuple[int, int]:
    """``x`` as written (shortest decimal ``repr``) as an integer ratio ``(p, q)``.

    ``q`` is a product of powers of 2 and 5, so a common denominator is cheap.
    """
    if type(x) is float:
        return Decimal(repr(x)).as_integer_ratio()
    if isinstance(x, numbers.Integral):
        return int(x), 1
    return Decimal(repr(float(x))).as_integer_ratio()


def effective_min_replicas(
    num_experts: int, num_nodes: int, slots_per_node: int, min_replicas: int
) -> int:
    """The ``f`` actually used: ``min(f, floor(N*c / E))``.

    With few nodes left there may not be ``f`` slots per expert; the paper then lowers the
    threshold rather than refusing to train. Below one slot per expert training cannot run
    and :func:`allocate_replicas` raises instead.
    """
    e = check_int("num_experts", num_experts, lo=1)
    n = check_int("num_nodes", num_nodes, lo=1)
    c = check_int("slots_per_node", slots_per_node, lo=1)
    f = check_int("min_replicas", min_replicas, lo=1, hi=n)
    if n * c < e:
        raise ValueError(
            f"num_nodes*slots_per_node = {n * c} slots cannot hold {e} experts; "
            f"need num_nodes*slots_per_node >= {e}"
        )
    return min(f, (n * c) // e)


def allocate_replicas(
    loads: Sequence[float],
    num_nodes: int,
    slots_per_node: int,
    min_replicas: int,
    *,
    max_per_node: int | None = None,
) -> list[int]:
    """Number of replicas per expert, in the input order of ``loads``.

    Args:
        loads: tokens routed to each expert (any non-negative finite numbers; only ratios
            matter). All-zero loads allocate uniformly.
        num_nodes: N, nodes in the cluster (>= 1).
        slots_per_node: c, expert replica slots per node (>= 1).
        min_replicas: f, fault-tolerance threshold, in ``[1, num_nodes]``; lowered to
            ``floor(N*c / E)`` when the slots are short.
        max_per_node: copies of one expert a node may hold, in
            ``[ceil(c / E), c]`` (default ``c``: no cap, plain Eq. 1).

    Returns:
        ``r`` with ``sum(r) == N*c`` and ``f_eff <= r[e] <= max_per_node * N``.
        Experts are processed in ascending load order; ties are broken by expert index,
        so the result is deterministic.
    """
    t = check_loads("loads", loads)
    n = check_int("num_nodes", num_nodes, lo=1)
    c = check_int("slots_per_node", slots_per_node, lo=1)
    e_count = len(t)
    if n * c < e_count:
        raise ValueError(
            f"loads has {e_count} experts but num_nodes*slots_per_node = {n * c} slots; "
            f"need at least one slot per expert (num_nodes*slots_per_node >= {e_count})"
        )
    f = effective_min_replicas(e_count, n, c, min_replicas)
    k_min = -(-c // e_count)
    k = c if max_per_node is None else check_int("max_per_node", max_per_node, lo=k_min, hi=c)
    cap = k * n

    order = sorted(range(e_count), key=lambda i: (t[i], i))
    # Exact arithmetic on the shortest decimal form of each load (what the user wrote):
    # 0.3 / (0.3 + 0.4) * 7 must floor to 3, which binary floats get wrong. All loads are
    # put on one common denominator D, so ``floor(t_j * rest / sum_{k >= j} t_k)`` is an
    # integer division of the numerators (the D cancels).
    ratios = [_exact_ratio(t[i]) for i in order]
    den = math.lcm(*(q for _, q in ratios))
    exact = [p * (den // q) for p, q in ratios]
    suffix = [0] * (e_count + 1)
    for j in range(e_count - 1, -1, -1):
        suffix[j] = suffix[j + 1] + exact[j]

    out = [0] * e_count
    rest = n * c
    for j, idx in enumerate(order):
        after = e_count - j - 1
        if suffix[j] > 0:
            share = exact[j] * rest // suffix[j]
        else:  # every remaining expert has zero load: split what is left evenly
            share = rest // (after + 1)
        r = max(share, f)
        r = min(max(r, rest - cap * after), cap)
        if j == e_count - 1:
            r = rest
        out[idx] = r
        rest -= r
    return out
