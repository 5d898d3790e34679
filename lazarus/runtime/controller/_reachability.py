"""Who is cut off: the controller's decision from who reports whom unreachable.

A collective fails on every rank when one link between two members breaks (a cable, a
switch port, a firewall rule): every worker reports a collective error and none names the
peer it lost (gloo's timeouts do not; its connect errors name an arbitrary pair). Planning
the same members again fails the same way, forever. So on a collective error the
controller asks every member's agent to reach every other member at the address it
published (its worker's rendezvous store) and reports back which it could not
(``probe`` / ``probe_result``); :func:`cut_off` then picks the fewest nodes whose removal
leaves a group in which everyone reaches everyone: a node cut from its peers is the one
every report names; of two nodes that lost only each other, the later member goes (one
drop is enough, and the choice is the same on every replay of the same reports). A node
dropped this way joins again only after a probe both ways finds every link to it back.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, Sequence

__all__ = ["ADMIT", "PROBE_SLACK_S", "PROBE_TIMEOUT_S", "cut_off", "probe_targets"]

#: how long an agent's connect to a peer may take before the peer counts as unreachable
PROBE_TIMEOUT_S = 1.0
#: how much longer the controller waits for the reports (their way back) before it plans
#: with those it has
PROBE_SLACK_S = 0.5
#: the tag of the probe that admits a node dropped this way again (``admit:<node>``): it
#: joins only once it and every member reach each other
ADMIT = "admit:"


def probe_targets(stores: Mapping[str, Mapping[str, object] | None]) -> dict[str, list[object]]:
    """``node -> [host, port]`` of every node whose worker published a store address."""
    return {n: [s["host"], s["port"]] for n, s in stores.items() if s and "host" in s and "port" in s}


def cut_off(members: Sequence[str], reports: Mapping[str, Iterable[str]]) -> list[str]:
    """The members to drop so that no two remaining members reported each other (either
    way) unreachable: greedily the one in the most broken links, ties to the later member.
    ``reports``: reporter -> the members it could not reach (reports of non-members, and
    names that are not members, are ignored)."""
    order = {m: i for i, m in enumerate(members)}
    links = {frozenset((a, b)) for a, bad in reports.items() if a in order
             for b in bad if b in order and b != a}
    dropped: list[str] = []
    while links:
        degree = Counter(n for link in links for n in link)
        worst = max(degree, key=lambda n: (degree[n], order[n]))
        dropped.append(worst)
        links = {link for link in links if worst not in link}
    return sorted(dropped, key=order.__getitem__)
