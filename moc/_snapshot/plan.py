"""Who holds what and who saves what: the job's unit inventory, and each checkpoint's
plan of shares (which byte ranges of which units this rank copies, persists, and sends to
another rank's memory).

The inventory is gathered once, collectively. A checkpoint's plan is then pure: it is
computed from what every rank agreed on (the selection and every rank's published unit
sizes, see :mod:`moc._coordination`), so the ranks plan without talking. No tensor bytes
move here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .._config import MoCConfig
from .._dist import Comm
from .._policy import Selection
from .._sharding import plan_shares
from .._store import TreePlan
from .._units import UnitLayout, UnitSpec, expert_unit_name, parse_expert, unit_base

__all__ = ["Inventory", "PublishedSizes", "SnapshotPlan", "copy_targets", "plan_snapshot", "unit_meta"]

log = logging.getLogger("moc")


def _expert_count(names: list[str], known: Mapping[str, int]) -> dict[str, int]:
    counts: dict[str, int] = dict(known)
    for name in names:
        if name.startswith("expert/"):
            layer, e = parse_expert(name)
            counts[layer] = max(counts.get(layer, 0), e + 1)
    return dict(sorted(counts.items()))


@dataclass
class Inventory:
    """The units of the job and which ranks hold each (gathered once, collectively).

    Attributes:
        layout: this rank's units (the layout found in its model).
        holders: unit name -> ranks holding it (``extra/rank<r>``: rank r only).
        num_experts: experts per MoE layer over the whole job.
        units_with_buffers: module units with non-parameter state (running stats...),
            copied synchronously in ``step()`` since the next forward may change them.
        info: the layout's description (log line, status, manifests).
        nodes: ``nodes[r]`` names the node (failure domain) rank ``r`` runs on; remote
            snapshot copies go to other nodes than the holders' (:func:`copy_targets`).
            Empty: every rank its own node.
    """

    layout: UnitLayout
    holders: dict[str, list[int]]
    num_experts: dict[str, int]
    units_with_buffers: set[str] = field(default_factory=set)
    info: dict[str, Any] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)

    @staticmethod
    def describe_rank(layout: UnitLayout, comm: Comm, node: str | None = None) -> dict[str, Any]:
        """This rank's part of :meth:`gather` (JSON), for a caller that gathers it along
        with its own fields in one collective (:meth:`from_gathered`)."""
        return {"units": sorted(layout.units), "node": node if node is not None else f"rank{comm.rank}",
                "experts_per_layer": dict(layout.experts_per_layer)}

    @classmethod
    def gather(cls, model: torch.nn.Module, layout: UnitLayout, comm: Comm, node: str | None = None) -> "Inventory":
        """Collective: every rank's units and node (``None``: ``rank<r>``, its own)."""
        return cls.from_gathered(model, layout, comm.gather_json(cls.describe_rank(layout, comm, node)))

    @classmethod
    def from_gathered(cls, model: torch.nn.Module, layout: UnitLayout, ranks: list[dict[str, Any]]) -> "Inventory":
        """The inventory from every rank's :meth:`describe_rank`, in rank order."""
        params = {n for n, _ in model.named_parameters()}
        with_buffers = {spec.name for spec in layout.modules() if any(k not in params for k in spec.keys)}
        holders: dict[str, list[int]] = {}
        nodes: list[str] = []
        for r, mine in enumerate(ranks):
            nodes.append(str(mine["node"]))
            for name in mine["units"]:
                holders.setdefault(name, []).append(r)
        for r in range(len(ranks)):
            holders[f"extra/rank{r}"] = [r]
        num_experts = _expert_count(list(holders), {l: n for d in ranks for l, n in d["experts_per_layer"].items()})
        if not num_experts:
            raise ValueError("no MoE layer found on any rank")
        layout.experts_per_layer = dict(num_experts)
        return cls(layout=layout, holders=holders, num_experts=num_experts, units_with_buffers=with_buffers,
                   info=layout.describe(), nodes=nodes)

    def node_of(self, rank: int) -> str:
        return self.nodes[rank] if rank < len(self.nodes) else f"rank{rank}"

    def needs(self, world: int) -> dict[int, list[str]]:
        """rank -> the units it holds (what a restore must give it)."""
        out: dict[int, list[str]] = {r: [] for r in range(world)}
        for name, ranks in self.holders.items():
            for r in ranks:
                out[r].append(name)
        return {r: sorted(v) for r, v in out.items()}


# (unit, plan, start, end, spec, owner): one share of a unit this rank copies.
Entry = tuple[str, TreePlan, int, int, "UnitSpec | None", bool]
# (unit, start, end, src, dst): a share copied to another rank's memory.
Remote = tuple[str, int, int, int, int]


@dataclass
class SnapshotPlan:
    """This rank's part of one checkpoint."""

    entries: list[Entry]
    sync_entries: set[str]       # copied in step(), before the next forward can change them
    persist_units: set[str]      # units that go to storage if this snapshot is persisted
    remote: list[Remote]         # every remote copy of the job, in one global order

    def incoming(self, rank: int) -> list[Remote]:
        return [r for r in self.remote if r[4] == rank]

    def nbytes(self, rank: int) -> int:
        """Buffer bytes this rank needs: its entries, then the copies it receives."""
        return sum(e[3] - e[2] for e in self.entries) + sum(r[2] - r[1] for r in self.incoming(rank))


def unit_meta(plan: TreePlan, spec: UnitSpec | None) -> dict[str, Any]:
    """How a unit's bytes decode (recorded in snapshot headers and manifests)."""
    return {
        "kind": "extra" if spec is None else spec.kind, "layer": getattr(spec, "layer", None),
        "expert": getattr(spec, "expert", None), "unit_nbytes": plan.nbytes, "skeleton": plan.skeleton,
        "tensors": [t.to_json() for t in plan.tensors], "itemsize": plan.itemsize,
    }


def copy_targets(holders: list[int], owner: int, world: int, count: int, nodes: list[str],
                 load: list[int]) -> list[int]:
    """Ranks that receive a remote copy of a share ``owner`` snapshots (at most ``count``).

    A copy must survive what kills the unit's replicas: a node failure takes all its
    ranks, so candidates are the ranks on nodes where no holder of the unit runs (with one
    rank per node: the ranks not holding it). Each pick prefers a node not picked yet for
    this share, then the least copy ``load`` (bytes already received, updated by the
    caller), then the rank after ``owner`` in ring order. Fewer candidates than ``count``:
    the caller keeps the remaining copies on co-holders (they survive a process crash,
    not a node failure)."""
    node_of = (lambda r: nodes[r]) if len(nodes) == world else (lambda r: f"rank{r}")
    held_on = {node_of(r) for r in holders}
    candidates = [r for r in range(world) if node_of(r) not in held_on]
    picked: list[int] = []
    used: set[str] = set()
    while candidates and len(picked) < count:
        r = min(candidates, key=lambda q: (node_of(q) in used, load[q], (q - owner) % world))
        picked.append(r)
        used.add(node_of(r))
        candidates.remove(r)
    return picked


class PublishedSizes:
    """Every rank's unit sizes (unit name -> bytes as that rank serialises it), as
    published in the rounds, and the merged view planning reads (rebuilt only when a rank
    publishes new sizes, which in steady state it does not)."""

    def __init__(self, world: int) -> None:
        self.tables: list[dict[str, int]] = [{} for _ in range(world)]
        self._merged: tuple[dict[str, int], set[str], dict[tuple[str, int], list[str]], list[str]] | None = None

    def update(self, rank: int, sizes: Mapping[str, int]) -> None:
        self.tables[rank].update(sizes)
        self._merged = None

    def merged(self) -> tuple[dict[str, int], set[str], dict[tuple[str, int], list[str]], list[str]]:
        """(size of each unit, units whose holders disagree on it, expert (layer, e) -> its
        unit names, the other units' names)."""
        if self._merged is None:
            size_of: dict[str, int] = {}
            disagree: set[str] = set()
            experts: dict[tuple[str, int], list[str]] = {}
            others: list[str] = []
            for table in self.tables:
                for n, nb in table.items():
                    if n not in size_of:
                        if n.startswith("expert/"):
                            experts.setdefault(parse_expert(n), []).append(n)
                        else:
                            others.append(n)
                    elif size_of[n] != nb:
                        disagree.add(n)
                    size_of[n] = nb
            self._merged = (size_of, disagree, experts, others)
        return self._merged


def plan_snapshot(cfg: MoCConfig, inventory: Inventory, *, rank: int, world: int, step: int, selection: Selection,
                  plans: Mapping[str, TreePlan], extra: TreePlan, sizes: PublishedSizes) -> SnapshotPlan:
    """This rank's share of the checkpoint of ``step``: a pure function of what every rank
    agrees on (the selection, every rank's published unit ``sizes``) and this rank's own
    unit ``plans`` and ``extra`` plan, so the ranks plan without talking."""
    layout = inventory.layout
    mine: dict[str, tuple[TreePlan, UnitSpec | None]] = {}
    for layer, (chosen, _) in selection.items():
        for e in chosen:
            spec = layout.expert_unit(layer, e)
            if spec is not None:
                mine[spec.name] = (plans[spec.name], spec)
    for spec in layout.modules():
        mine[spec.name] = (plans[spec.name], spec)
    extra_name = f"extra/rank{rank}"
    mine[extra_name] = (extra, None)
    missing = [n for n, (p, _) in mine.items() if sizes.tables[rank].get(n) != p.nbytes]
    if missing:
        raise RuntimeError(f"rank {rank} step {step}: units {missing[:4]} are planned with sizes this rank has "
                           "not published")

    all_sizes, all_disagree, by_expert, others = sizes.merged()
    names = [n for layer, (chosen, _) in selection.items() for e in chosen for n in by_expert.get((layer, e), ())]
    size_of = {n: all_sizes[n] for n in names + others}
    disagree = all_disagree & set(size_of)
    if disagree:
        # Replicas of one unit must serialise identically, or split shares would not
        # tile it; keep such units whole on their first holder.
        log.error("rank %d step %d: holders disagree on the size of %s; not splitting them",
                  rank, step, sorted(disagree)[:4])
    experts = {n: s for n, s in size_of.items() if n.startswith("expert/")}
    modules = {n: s for n, s in size_of.items() if not n.startswith("expert/")}
    holders = {n: (sorted(r)[:1] if n in disagree else r) for n, r in inventory.holders.items()}
    shares = plan_shares(experts, modules, holders, world, cfg.sharding)
    persist_bases = {expert_unit_name(l, e) for l, (_, p) in selection.items() for e in p}
    persist_units = {n for n in experts if unit_base(n) in persist_bases} | set(modules)
    entries: list[Entry] = []
    sync_entries = {extra_name}
    remote: list[Remote] = []
    copy_load = [0] * world
    for sh in shares:
        unit_holders = sorted(inventory.holders[sh.unit])
        # The owner snapshots (and persists) the share. The other copies go first to
        # ranks on nodes where no holder runs: a copy on a co-holder (or beside one, on
        # its node) dies with the replicas it would replace (an expert is lost only when
        # all its holders are), while a copy on another node survives them. Co-holders
        # (copied from their own replica, no network) fill up when there are not enough
        # other nodes.
        extra_copies = cfg.snapshot_copies - 1
        targets = copy_targets(unit_holders, sh.rank, world, extra_copies, inventory.nodes, copy_load)
        for r in targets:
            copy_load[r] += sh.end - sh.start
            remote.append((sh.unit, sh.start, sh.end, sh.rank, r))
        i = unit_holders.index(sh.rank)
        copies = {unit_holders[(i + j) % len(unit_holders)]
                  for j in range(min(1 + extra_copies - len(targets), len(unit_holders)))}
        if rank not in copies:
            continue
        plan, spec = mine[sh.unit]
        entries.append((sh.unit, plan, sh.start, sh.end, spec, sh.rank == rank))
        if sh.unit in inventory.units_with_buffers:
            sync_entries.add(sh.unit)
    return SnapshotPlan(entries=entries, sync_entries=sync_entries, persist_units=persist_units, remote=remote)
