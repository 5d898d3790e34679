"""The three compared systems as membership policies: DS, DS(FT) and Lazarus.

A system decides which nodes train, how balanced their expert work is, and what a
membership change costs; the engine (``_engine``) owns time, checkpoints and accounting.
Lazarus uses the real planner: ``allocate_replicas`` + ``place_mro`` per layer, and
``plan_migration`` to count the expert states that must move.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import math
from dataclasses import dataclass

from lazarus.planning import allocate_replicas, place_mro, plan_migration

from ._config import ModelSpec, PerfParams
from ._routing import Routing


@dataclass
class Decision:
    """What a membership change means for a system.

    kind: ``none`` (nothing to do), ``reconfig`` (in place, no lost work), ``restart``
    (checkpoint restart on the nodes now in ``active``), ``idle`` (too few nodes: roll
    back and wait), ``fallback`` (Lazarus with MoC: reconfigure and load the experts no
    survivor holds from the checkpoint store, no roll back), ``scale`` (DS growing:
    checkpoint now, then restart), ``resume`` (from idle).
    """

    kind: str
    seconds: float = 0.0  # reconfiguration + state transfer (reconfig/fallback kinds)
    missing_share: float = 0.0  # token share of experts restored from an older version
    missing_bytes: float = 0.0  # their state bytes (read from the store)


def ds_layout(model: ModelSpec) -> tuple[int, int, int]:
    """(experts per GPU, EP size in GPUs, nodes per full set of experts) for classic EP:
    the largest experts-per-GPU that divides E and fits the GPU's slots (paper 6.1)."""
    per_gpu = max(1, model.slots_per_node // model.gpus_per_node)
    s = max(d for d in range(1, min(per_gpu, model.num_experts) + 1) if model.num_experts % d == 0)
    ep_gpus = model.num_experts // s
    return s, ep_gpus, -(-ep_gpus // model.gpus_per_node)


def _ordered(alive: list[str], prefer: list[str]) -> list[str]:
    keep = set(prefer)
    return [n for n in prefer if n in set(alive)] + [n for n in alive if n not in keep]


class System(ABC):
    """Common state: the nodes in use and the routing loads."""

    name = ""
    dispatcher = False
    # a node that gets a spot notice hands its state over before it leaves (waiting, within
    # the notice, for a joiner when it is the last member) instead of dying with it
    hands_over = False

    def __init__(self, model: ModelSpec, perf: PerfParams, routing: Routing) -> None:
        self.model, self.perf, self.routing = model, perf, routing
        self.active: list[str] = []
        self._imb: dict[int, float] = {}
        self.version = 0

    @abstractmethod
    def interval_steps(self) -> int:
        ...

    @abstractmethod
    def configure(self, alive: list[str], step: int) -> None:
        ...

    @abstractmethod
    def imbalance(self, step: int) -> float:
        ...

    @abstractmethod
    def on_remove(self, gone: set[str], alive: list[str], step: int) -> Decision:
        ...

    @abstractmethod
    def on_join(self, alive: list[str], step: int) -> Decision:
        ...

    def rebalance(self, step: int) -> float:
        return 0.0

    def _join_s(self) -> float:
        """The members' stall when nodes join (``join_reconfig_s``, else ``reconfig_s``)."""
        j = self.perf.join_reconfig_s
        return self.perf.reconfig_s if j is None else j

    def _transfer_s(self, expert_states: float) -> float:
        return expert_states * self.model.expert_bytes / (self.perf.transfer_gbps * 1e9)


class DS(System):
    """Checkpoint-restart with classic expert parallelism (DeepSpeed-MoE)."""

    name = "ds"

    def __init__(self, model: ModelSpec, perf: PerfParams, routing: Routing) -> None:
        super().__init__(model, perf, routing)
        self.per_gpu, self.ep_gpus, self.ep_nodes = ds_layout(model)

    def interval_steps(self) -> int:
        return self.perf.ds_interval_steps

    def configure(self, alive: list[str], step: int) -> None:
        nodes = _ordered(alive, self.active)
        self.active = nodes[: (len(nodes) // self.ep_nodes) * self.ep_nodes]
        self.version += 1

    def imbalance(self, step: int) -> float:
        k = self.routing.epoch_of(step)
        if k not in self._imb:
            s = self.per_gpu
            vals = []
            for row in self.routing.loads(step):
                per_gpu = [sum(row[g * s:(g + 1) * s]) for g in range(self.ep_gpus)]
                mean = sum(per_gpu) / len(per_gpu)
                vals.append(max(per_gpu) / mean if mean > 0 else 1.0)
            self._imb = {k: sum(vals) / len(vals)}
        return self._imb[k]

    def on_remove(self, gone: set[str], alive: list[str], step: int) -> Decision:
        if not gone & set(self.active):
            return Decision("none")
        self.configure(alive, step)
        return Decision("restart" if self.active else "idle")

    def on_join(self, alive: list[str], step: int) -> Decision:
        if len(alive) // self.ep_nodes <= len(self.active) // self.ep_nodes:
            return Decision("none")
        was_idle = not self.active
        self.configure(alive, step)
        return Decision("resume" if was_idle else "scale")


class DSFT(DS):
    """DS with in-place reconfiguration while a full set of experts survives."""

    name = "dsft"

    def interval_steps(self) -> int:
        return self.perf.ft_interval_steps

    def _node_experts(self) -> float:
        return self.per_gpu * self.model.gpus_per_node * self.model.moe_layers

    def on_remove(self, gone: set[str], alive: list[str], step: int) -> Decision:
        if not gone & set(self.active):
            return Decision("none")
        e = self.ep_nodes
        groups = [self.active[i:i + e] for i in range(0, len(self.active), e)]
        holders: list[list[str]] = [[g[p] for g in groups if g[p] not in gone] for p in range(e)]
        survivors = [n for n in self.active if n not in gone]
        new_groups = len(survivors) // e
        if new_groups == 0 or any(not h for h in holders):
            self.configure(alive, step)  # no full set of experts left: checkpoint restart
            return Decision("restart" if self.active else "idle")
        slots: list[list[str | None]] = [[None] * e for _ in range(new_groups)]
        used: set[str] = set()
        for p in range(e):
            for gi, node in enumerate(holders[p][:new_groups]):
                slots[gi][p] = node
                used.add(node)
        kept = len(used)
        rest = [n for n in survivors if n not in used]
        for row in slots:
            for p in range(e):
                if row[p] is None:
                    row[p] = rest.pop(0)
        self.active = [n for row in slots for n in row if n is not None]
        self.version += 1
        moved = new_groups * e - kept
        return Decision("reconfig", self.perf.reconfig_s + self._transfer_s(moved * self._node_experts()))

    def on_join(self, alive: list[str], step: int) -> Decision:
        if not self.active:
            return super().on_join(alive, step)
        e = self.ep_nodes
        extra = [n for n in alive if n not in set(self.active)]
        add = (len(extra) // e) * e
        if add == 0:
            return Decision("none")
        self.active = self.active + extra[:add]
        self.version += 1
        secs = self._join_s() + self._transfer_s(add * self._node_experts())
        return Decision("reconfig", secs)


class Lazarus(System):
    """Load-based replica allocation, MRO placement, in-place reconfiguration."""

    name = "lazarus"
    dispatcher = True
    hands_over = True

    def __init__(self, model: ModelSpec, perf: PerfParams, routing: Routing) -> None:
        super().__init__(model, perf, routing)
        self.hold: list[dict[str, list[int]]] = []  # per simulated layer: node -> experts

    def interval_steps(self) -> int:
        return self.perf.lazarus_interval_steps

    def _fits(self, n: int) -> bool:
        return n * self.model.slots_per_node >= self.model.num_experts

    def _plan(self, nodes: list[str], step: int, migrate: bool, improve: bool = True) -> float:
        """Re-plan every layer over ``nodes``; returns expert states fetched (all layers).

        ``improve``: run ``place_mro``'s local search on truncated plans (failures, joins);
        periodic rebalances use the paper's MRO construction, which is 10-50x cheaper and
        identical wherever the paper's optimality theorem applies."""
        m, c = self.model, self.model.slots_per_node
        f = min(self.perf.min_replicas, len(nodes))
        fetched = 0
        new_hold = []
        for layer, loads in enumerate(self.routing.loads(step)):
            r = allocate_replicas(loads, len(nodes), c, f)
            plan = place_mro(r, len(nodes), c, improve=improve and len(nodes) <= 64)
            if migrate and self.hold:
                old = {n: self.hold[layer].get(n, []) for n in nodes}
                mig = plan_migration(old, plan)
                fetched += len(mig.transfers) + len(mig.missing)
                new_hold.append({n: plan.nodes[mig.mapping[n]] for n in nodes})
            else:
                new_hold.append({n: plan.nodes[i] for i, n in enumerate(nodes)})
        self.hold, self.active = new_hold, list(nodes)
        self.version += 1
        return fetched * m.moe_layers / m.layers_simulated

    def configure(self, alive: list[str], step: int) -> None:
        if self._fits(len(alive)):
            self._plan(list(alive), step, migrate=False)
        else:
            self.active, self.hold = [], []
            self.version += 1

    def imbalance(self, step: int) -> float:
        key = self.routing.epoch_of(step) * 1_000_003 + self.version
        if key not in self._imb:
            g = self.model.gpus_per_node
            vals = []
            for loads, hold in zip(self.routing.loads(step), self.hold):
                reps = [0] * self.model.num_experts
                for row in hold.values():
                    for x in row:
                        reps[x] += 1
                per_gpu: list[float] = []
                for row in hold.values():
                    srow = sorted(row)
                    per_gpu.extend(sum(loads[x] / reps[x] for x in srow[j::g]) for j in range(g))
                mean = sum(loads) / len(per_gpu)
                vals.append(max(per_gpu) / mean if mean > 0 else 1.0)
            self._imb = {key: sum(vals) / len(vals) if vals else 1.0}
        return self._imb[key]

    def on_remove(self, gone: set[str], alive: list[str], step: int) -> Decision:
        if not gone & set(self.active):
            return Decision("none")
        survivors = [n for n in self.active if n not in gone]
        if not self._fits(len(survivors)):
            self.configure(alive, step)
            return Decision("restart" if self.active else "idle")
        missing_share, missing = 0.0, 0
        for loads, hold in zip(self.routing.loads(step), self.hold):
            have = {x for n in survivors for x in hold[n]}
            lost = [e for e in range(self.model.num_experts) if e not in have]
            missing += len(lost)
            total = sum(loads)
            missing_share += sum(loads[e] for e in lost) / total if total > 0 else 0.0
        fetched = self._plan(survivors, step, migrate=True)
        scale = self.model.moe_layers / self.model.layers_simulated
        secs = self.perf.reconfig_s + self._transfer_s(max(0.0, fetched - missing * scale))
        if missing == 0:
            return Decision("reconfig", secs)
        return Decision("fallback", secs, missing_share / len(self.hold),
                        missing * scale * self.model.expert_bytes)

    def on_join(self, alive: list[str], step: int) -> Decision:
        if not self.active:
            if not self._fits(len(alive)):
                return Decision("none")
            self.configure(alive, step)
            return Decision("resume")
        extra = [n for n in alive if n not in set(self.active)]
        if not extra:
            return Decision("none")
        fetched = self._plan(self.active + extra, step, migrate=True)
        return Decision("reconfig", self._join_s() + self._transfer_s(fetched))

    def rebalance(self, step: int) -> float:
        if not self.active or step <= 0 or step % self.perf.rebalance_every_steps:
            return 0.0
        fetched = self._plan(self.active, step, migrate=True, improve=False)
        return self.perf.rebalance_s + self._transfer_s(fetched)


def make_system(name: str, model: ModelSpec, perf: PerfParams, routing: Routing) -> System:
    return {"ds": DS, "dsft": DSFT, "lazarus": Lazarus}[name](model, perf, routing)


def step_seconds(model: ModelSpec, perf: PerfParams, nodes: int, imbalance: float,
                 dispatcher: bool) -> float:
    """One step: ``step_s`` scaled by cluster size (or the measured ``step_s_by_nodes`` at
    this node count), expert-load imbalance and dispatcher."""
    base = dict(model.step_s_by_nodes).get(nodes)
    if base is None:
        base = model.step_s * max(0.5, 1.0 + model.comm_per_doubling * math.log2(nodes / model.ref_nodes))
    phi = model.expert_fraction
    t = base * ((1.0 - phi) + phi * imbalance)
    return t * (1.0 + perf.dispatch_overhead) if dispatcher else t


__all__ = ["DS", "DSFT", "Decision", "Lazarus", "System", "ds_layout", "make_system", "step_seconds"]
