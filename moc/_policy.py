"""What each checkpoint saves and how often: expert selection, K per level, the interval,
and the proportion of lost tokens (PLT) that partial checkpoints cost.

Owned by :class:`moc.CheckpointManager`. Decisions that must agree across ranks (routing
sums, rank 0's tuning proposals) travel in the manager's rounds (:mod:`moc._coordination`);
everything else here is a deterministic function of what the ranks agreed on.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ._config import MoCConfig
from ._cuda import LateCopies
from ._dist import Comm
from ._plt import PLTTracker
from ._run_state import RunState
from ._selection import load_aware_selection
from ._units import parse_expert

__all__ = ["CheckpointPolicy", "Opening", "Selection", "SnapshotDecision"]

log = logging.getLogger("moc")

# layer -> (experts to snapshot, experts to persist if this snapshot is persisted)
Selection = dict[str, tuple[list[int], list[int]]]


@dataclass(frozen=True)
class Opening:
    """What the policy brings to a step's round (:meth:`CheckpointPolicy.open`).

    Attributes:
        step: the step.
        due: a checkpoint is due at this step (else it is only a decision point).
        k_snapshot: this rank's proposal for K (``k_snapshot="auto"``); rank 0's is adopted.
        interval: this rank's proposal for the interval (``interval="auto"``).
        routing: this rank's routing counts since the last round, flat in layer order
            (:attr:`CheckpointPolicy.routing_len`), when ``due``; summed over ranks by the round.
    """

    step: int
    due: bool
    k_snapshot: int | None = None
    interval: int | None = None
    routing: torch.Tensor | None = None


@dataclass(frozen=True)
class SnapshotDecision:
    """What a due checkpoint saves, decided from the round (:meth:`CheckpointPolicy.decide`).

    Attributes:
        selection: per layer, the experts to snapshot and those to persist.
        designated: this snapshot also goes to storage.
        meta: what its header and manifest record of the policy (counts after it).
        plt: the PLT counters it is taken at.
    """

    selection: Selection
    designated: bool
    meta: dict[str, Any]
    plt: dict[str, Any]


def _initial_k(field: str, value: Any, e_min: int) -> int:
    if value is None or value == "auto":
        return e_min if value is None else 1
    if not 1 <= int(value) <= e_min:
        raise ValueError(f"MoCConfig.{field} must be in [1, {e_min}] (experts per MoE layer), got {value}")
    return int(value)


class CheckpointPolicy:
    """Selection, K, interval and PLT of one manager.

    Args:
        cfg: the manager's configuration.
        num_experts: experts per MoE layer (global ids), in layer order.
        run: the shared run bookkeeping (its lock guards the tracker).
        comm: collectives for routing sums and tuning decisions.
    """

    def __init__(self, cfg: MoCConfig, *, num_experts: Mapping[str, int], run: RunState, comm: Comm) -> None:
        self.cfg = cfg
        self.run = run
        self.comm = comm
        self.num_experts = dict(num_experts)
        e_min = min(self.num_experts.values())
        self.k_snapshot = _initial_k("k_snapshot", cfg.k_snapshot, e_min)
        self.k_persist = _initial_k("k_persist", cfg.k_persist if cfg.k_persist is not None else self.k_snapshot,
                                    e_min)
        if self.k_persist > self.k_snapshot:
            raise ValueError(f"MoCConfig.k_persist ({self.k_persist}) must be <= k_snapshot ({self.k_snapshot})")
        self.interval = 1 if cfg.interval == "auto" else int(cfg.interval)
        self.tracker = PLTTracker(self.num_experts, cfg.top_k or 1)   # (the manager resolved None)
        # Routing counts since the last sync: this rank's tokens ("local", summed over ranks
        # at the sync) and counts already summed over the job ("global", the same on every
        # rank, so any survivor can hand them to the next manager).
        self._pending = {layer: torch.zeros(n, dtype=torch.int64) for layer, n in self.num_experts.items()}
        self._pending_global = {layer: torch.zeros(n, dtype=torch.int64) for layer, n in self.num_experts.items()}
        # Counts given as device tensors, summed there until the next sync: (scope, layer) ->
        # tensor; then copied to the host without waiting, booked once arrived.
        self._on_device: dict[tuple[str, str], torch.Tensor] = {}
        self._in_flight: LateCopies[tuple[str, str]] = LateCopies(torch.cat)
        self.checkpoints = 0        # snapshots taken by the job
        self.persist_rounds = 0     # of which designated for storage
        self.recoveries = 0
        self.save_overhead: float | None = None   # blocking part of the newest checkpoint
        self._step_times: list[float] = []
        self._proposal: dict[str, int] = {}
        self._last_step_wall: float | None = None
        self._started = time.time()

    # -- routing ---------------------------------------------------------------------------
    @property
    def layers(self) -> list[str]:
        return list(self._pending)

    def record_routing(self, layer: str, counts: Any, *, scope: str = "local") -> None:
        """See :meth:`moc.CheckpointManager.record_routing`."""
        if scope not in ("local", "global"):
            raise ValueError(f"scope must be 'local' or 'global', got {scope!r}")
        if layer not in self._pending:
            raise KeyError(f"unknown MoE layer {layer!r}; known: {sorted(self._pending)}")
        t = torch.as_tensor(counts).reshape(-1)
        if t.numel() != self._pending[layer].numel():
            raise ValueError(f"layer {layer!r} has {self._pending[layer].numel()} experts, got {t.numel()} counts")
        t = t.to(torch.int64)
        if t.device.type != "cpu":
            # Summed where they are and read at the next sync: a copy to the host here would
            # make every step wait for the device (one call per layer per step).
            prev = self._on_device.get((scope, layer))
            self._on_device[(scope, layer)] = t.clone() if prev is None else prev.add_(t.to(prev.device))
            return
        if scope == "global":
            self._pending_global[layer] += t   # counted once over the job (not summed over ranks)
        else:
            self._pending[layer] += t

    def _fetch_device_counts(self, *, wait: bool) -> None:
        """Book the counts summed on devices. Their copy to the host is issued here without
        waiting (pinned memory, an event behind it) and booked once the event has passed:
        at this call when ``wait`` (or when the copy is already done), else at a later one.
        Reading them at once would make the checkpoint step wait for every kernel queued
        before it. A count booked one decision late was routed before a snapshot it is
        booked after: PLT then counts it as unsaved, erring on the safe side."""
        self._in_flight.send((t, key) for key, t in self._on_device.items())
        self._on_device.clear()
        for host, keys in self._in_flight.arrived(wait=wait):
            pos = 0
            for scope, layer in keys:
                n = self._pending[layer].numel()
                (self._pending_global if scope == "global" else self._pending)[layer] += host[pos: pos + n]
                pos += n

    @property
    def routing_len(self) -> int:
        """Length of the flat routing-count vector (every layer's experts, in layer order)."""
        return sum(t.numel() for t in self._pending.values())

    def take_routing(self, drain: Callable[[Callable[..., None]], None] | None = None, *,
                     wait: bool = False) -> torch.Tensor:
        """This rank's pending routing counts, flat in layer order, and zero them
        (``drain`` first hands over counts gathered elsewhere: router taps). Counts given
        on a GPU are in it once their copy to the host is done (``wait``: now)."""
        if drain is not None:
            drain(self.record_routing)
        self._fetch_device_counts(wait=wait)
        flat = torch.cat([self._pending[l] for l in self._pending])
        if self.run.rank == 0:
            # Counted once over the job: only rank 0 brings them to the sum over ranks.
            flat += torch.cat([self._pending_global[l] for l in self._pending])
        for l in self._pending:
            self._pending[l].zero_()
            self._pending_global[l].zero_()
        return flat

    def fold_routing(self, flat: torch.Tensor) -> None:
        """Book routing counts summed over ranks (a :meth:`take_routing` vector) into PLT."""
        pos = 0
        layers = list(self._pending)
        with self.run.lock:
            for l in layers:
                n = self._pending[l].numel()
                self.tracker.record(l, flat[pos: pos + n])
                pos += n
            first = flat[: self._pending[layers[0]].numel()]
            self.tracker.add_tokens(int(first.sum()) // self.tracker.top_k)

    def pending_state(self) -> dict[str, dict[str, list[int]]]:
        """Routing counts not yet synced, for the manager that replaces this one."""
        self._fetch_device_counts(wait=True)
        return {"local": {l: [int(x) for x in t.tolist()] for l, t in self._pending.items()},
                "global": {l: [int(x) for x in t.tolist()] for l, t in self._pending_global.items()}}

    def adopt_pending(self, states: list[Any]) -> None:
        """Take over the unsynced routing counts of the managers this one replaces
        (``states``: every rank's :meth:`pending_state`, None for ranks without one, in
        rank order). Local counts of the survivors are summed into rank 0's (the next
        sync sums over ranks; a dead rank's are lost with it), global ones come from the
        first survivor (they are the same on every rank)."""
        given = [s for s in states if isinstance(s, Mapping)]
        if not given:
            return
        for layer, row in self._pending.items():
            if self.run.rank == 0:
                for st in given:
                    v = (st.get("local") or {}).get(layer)
                    if isinstance(v, list) and len(v) == row.numel():
                        row += torch.tensor(v, dtype=torch.int64)
            v = (given[0].get("global") or {}).get(layer)
            if isinstance(v, list) and len(v) == row.numel():
                self._pending_global[layer] += torch.tensor(v, dtype=torch.int64)

    def sync_routing(self, drain: Callable[[Callable[..., None]], None] | None = None) -> None:
        """Fold the pending per-rank routing counts into the global PLT counters
        (collective: one all-reduce; checkpoints carry the counts in their round instead)."""
        flat = self.take_routing(drain, wait=True)
        self.comm.sum_int64(flat)
        self.fold_routing(flat)

    # -- a step, as the manager's mode sees it ---------------------------------------------
    def open(self, step: int, drain: Callable[[Callable[..., None]], None] | None = None) -> Opening | None:
        """Called at every ``step()``: None when this step has no round; else what the policy
        brings to it (whether a checkpoint is due, its proposals, the routing counts).

        The same steps open a round on every rank, so the rounds line up."""
        self._observe_step()
        due = self._due(step)
        if not (due or self._decision_point(step)):
            return None
        proposal, self._proposal = self._proposal, {}
        return Opening(step=step, due=due, k_snapshot=proposal.get("k_snapshot"),
                       interval=proposal.get("interval"),
                       routing=self.take_routing(drain) if due else None)

    def decide(self, *, k_snapshot: int | None, interval: int | None, routing: torch.Tensor | None,
               first: bool) -> SnapshotDecision | None:
        """After the round: adopt rank 0's proposals (``k_snapshot``, ``interval``); with the
        job's summed ``routing`` (a due checkpoint) book it into PLT and decide what this
        checkpoint saves (``first``: no checkpoint holding every unit is committed yet),
        booking the snapshot. None when no checkpoint is taken."""
        self._adopt(k_snapshot, interval)
        if routing is None:
            return None
        self.fold_routing(routing)
        # Until one checkpoint holding every unit is committed, save (and persist) every
        # expert; afterwards every persist_every-th snapshot also goes to storage.
        designated = self._designated()
        selection = self.select(first, designated)
        meta = self.meta()
        plt = self._mark_snapshot(selection, designated)
        return SnapshotDecision(selection=selection, designated=designated, meta=meta, plt=plt)

    def checkpointed(self, *, blocking_seconds: float, copy_seconds: float | None) -> None:
        """A checkpoint was taken: its blocking part (``step()`` plus the stall it caused)
        and its copy time feed ``interval="auto"`` / ``k_snapshot="auto"``."""
        self.save_overhead = blocking_seconds
        self.tune(copy_seconds)

    # -- when ------------------------------------------------------------------------------
    def _observe_step(self) -> None:
        """Called at every ``step()``: the step time feeds ``interval="auto"`` / ``k="auto"``."""
        now = time.perf_counter()
        if self._last_step_wall is not None:
            self._step_times = (self._step_times + [now - self._last_step_wall])[-50:]
        self._last_step_wall = now

    def _due(self, step: int) -> bool:
        return not self.run.first_done or step % self.interval == 0

    def _decision_point(self, step: int) -> bool:
        """Steps (the same on every rank) where ranks agree on SIGTERM and retry persists."""
        return step % max(1, self.interval // 4) == 0

    def _designated(self) -> bool:
        """Does the next snapshot go to storage too?"""
        return not self.run.has_base or self.checkpoints % self.cfg.persist_every == 0

    # -- what ------------------------------------------------------------------------------
    def select(self, first: bool, designated: bool) -> Selection:
        """Per layer: (experts to snapshot, experts to persist if this snapshot is persisted).

        Sequential: persisted snapshots rotate by ``k_persist`` per persisted checkpoint and
        snapshot the persisted experts plus the next ones; memory-only snapshots rotate by
        ``k_snapshot`` per snapshot. Both are staggered across layers by the layer index.
        A memory-only snapshot that ends up flushed (SIGTERM, close) persists all it holds.
        """
        out = {}
        for li, (layer, num) in enumerate(self.num_experts.items()):
            if first:
                out[layer] = (list(range(num)), list(range(num)))
                continue
            ks, kp = min(self.k_snapshot, num), min(self.k_persist, num)
            if self.cfg.selection == "sequential":
                k, n = (kp, self.persist_rounds) if designated else (ks, self.checkpoints)
                base = (n * k + li * k) % num
                order = [(base + j) % num for j in range(num)]
            else:
                with self.run.lock:
                    unsaved_p = self.tracker.unsaved("persist", layer)
                    unsaved_s = self.tracker.unsaved("snapshot", layer)
                persist = load_aware_selection(unsaved_p, kp) if designated else []
                rest = [e for e in sorted(range(num), key=lambda e: (-unsaved_s[e], e)) if e not in persist]
                order = persist + rest
            snap = sorted(order[:ks])
            out[layer] = (snap, sorted(order[:kp]) if designated else snap)
        return out

    def _mark_snapshot(self, selection: Selection, designated: bool) -> dict[str, Any]:
        """Book a snapshot of ``selection``; returns the PLT state it is taken at."""
        with self.run.lock:
            plt_state = self.tracker.state()
            for layer, (snap, _) in selection.items():
                self.tracker.mark_saved("snapshot", layer, snap)
        self.checkpoints += 1
        if designated:
            self.persist_rounds += 1
        return plt_state

    def mark_persisted(self, selection: Mapping[str, list[int]], cum: Mapping[str, list[int]]) -> None:
        """A snapshot taken when the counters were ``cum`` is committed (caller holds the lock)."""
        for layer, experts in selection.items():
            self.tracker.mark_saved("persist", layer, experts, cum=cum[layer])

    # -- how many, how often ---------------------------------------------------------------
    def tune(self, snapshot_seconds: float | None) -> None:
        """``k_snapshot="auto"`` and ``interval="auto"``: this rank's proposals, from its
        step times and copy time; rank 0's are adopted by every rank at the next round
        (:meth:`open`, :meth:`decide`), so there is no collective here."""
        step_time = sorted(self._step_times)[len(self._step_times) // 2] if self._step_times else None
        if self.cfg.k_snapshot == "auto" and step_time and snapshot_seconds:
            # Largest K whose copy fits in one forward+backward (copy time ~ linear in K).
            per_expert = snapshot_seconds / max(1, self._snapshotted_experts())
            e_min = min(self.num_experts.values())
            fit = int(step_time / max(per_expert * len(self.num_experts), 1e-9))
            self._proposal["k_snapshot"] = max(self.k_persist, min(e_min, fit), 1)
        if self.cfg.interval == "auto" and step_time and self.save_overhead is not None:
            self._proposal["interval"] = self.young_daly_interval(step_time)

    def _adopt(self, k_snapshot: int | None, interval: int | None) -> None:
        """Rank 0's proposals, agreed in a round."""
        if k_snapshot is not None:
            self.k_snapshot = max(int(k_snapshot), 1)
        if interval is not None:
            self.interval = int(interval)

    def _snapshotted_experts(self) -> int:
        return sum(min(self.k_snapshot, n) for n in self.num_experts.values()) if self.checkpoints > 1 else \
            sum(self.num_experts.values())

    def young_daly_interval(self, step_time: float) -> int:
        """Steps between checkpoints: I* = sqrt(2 * save_overhead / failure_rate)."""
        elapsed = max(time.time() - self._started, 1.0)
        observed = self.recoveries / elapsed if self.recoveries else 0.0
        rate = max(observed, 1.0 / self.cfg.mtbf.total_seconds())
        seconds = math.sqrt(2.0 * max(self.save_overhead or 0.0, 1e-6) / rate)
        return int(min(max(1, round(seconds / max(step_time, 1e-9))), 100_000))

    def apply_dynamic_k(self) -> None:
        """Double K of every level whose own PLT passed the threshold; if only the total
        did, double K of the level that lost the most tokens (caller holds the lock)."""
        if not self.cfg.dynamic_k:
            return
        tracker, thr = self.tracker, self.cfg.plt_threshold
        levels = {lv for lv in ("snapshot", "persist") if tracker.value(lv) > thr}
        if not levels and tracker.value() > thr:
            levels = {max(("snapshot", "persist"), key=tracker.lost_tokens)}
        e_min = min(self.num_experts.values())
        before = {"snapshot": self.k_snapshot, "persist": self.k_persist}
        if "snapshot" in levels:
            self.k_snapshot = min(2 * self.k_snapshot, e_min)
        if "persist" in levels:
            self.k_persist = min(2 * self.k_persist, e_min)
            self.k_snapshot = max(self.k_snapshot, self.k_persist)
        after = {"snapshot": self.k_snapshot, "persist": self.k_persist}
        changed = [f"{lv} {before[lv]} -> {after[lv]}" for lv in ("snapshot", "persist") if before[lv] != after[lv]]
        if levels:   # say what changed, and the K left as it was (already at E)
            same = [f"{lv} {after[lv]}" for lv in ("snapshot", "persist") if before[lv] == after[lv]]
            log.warning("rank %d: PLT %.4f%% > %.4f%% (%s): %s%s", self.run.rank, 100 * tracker.value(), 100 * thr,
                        " and ".join(sorted(levels)) + " level" + ("s" if len(levels) > 1 else ""),
                        f"K raised: {', '.join(changed)}" if changed else f"K already at E = {e_min}",
                        f" (unchanged: {', '.join(same)})" if changed and same else "")

    # -- recovery bookkeeping --------------------------------------------------------------
    def book_restored(self, name: str, level: str, cum: int | None, *, rewind: bool) -> int:
        """An expert unit now equals a saved version taken when its token counter was
        ``cum``: book the tokens it saw since as lost (caller holds the lock). ``rewind``
        (a whole-job restore) also moves the expert's counters back to that version;
        otherwise (one lost expert) the live counters stand and the expert counts as
        saved from here on. Returns the lost tokens."""
        if cum is None or not name.startswith("expert/"):
            return 0
        layer, e = parse_expert(name)
        t = self.tracker
        lost = max(0, t.cum[layer][e] - cum)
        if lost:
            t.book_loss(level, layer, lost)
        if rewind:
            t.cum[layer][e] = cum
            t.saved["snapshot"][layer][e] = cum
            t.saved["persist"][layer][e] = min(t.saved["persist"][layer][e], cum)
        else:
            t.mark_saved("snapshot", layer, [e])
            t.mark_saved("persist", layer, [e])
        return lost

    def meta(self) -> dict[str, Any]:
        """What a snapshot header / manifest records of the policy (counts after this one)."""
        return {"k_snapshot": self.k_snapshot, "k_persist": self.k_persist, "checkpoints": self.checkpoints + 1,
                "persist_rounds": self.persist_rounds + 1, "interval": self.interval,
                "recoveries": self.recoveries}

    def load_meta(self, meta: Mapping[str, Any]) -> None:
        """Continue from a restored checkpoint's :meth:`meta` (the restore is one more recovery)."""
        self.k_snapshot = int(meta.get("k_snapshot", self.k_snapshot))
        self.k_persist = int(meta.get("k_persist", self.k_persist))
        self.checkpoints = int(meta.get("checkpoints", 0))
        self.persist_rounds = int(meta.get("persist_rounds", 0))
        self.recoveries = int(meta.get("recoveries", 0)) + 1

    def state(self) -> dict[str, Any]:
        """JSON-able state handed to a successor manager (caller holds the lock)."""
        return {"k_snapshot": self.k_snapshot, "k_persist": self.k_persist, "interval": self.interval,
                "checkpoints": self.checkpoints, "persist_rounds": self.persist_rounds,
                "recoveries": self.recoveries, "plt": self.tracker.state()}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.k_snapshot, self.k_persist = int(state["k_snapshot"]), int(state["k_persist"])
        self.interval = int(state["interval"])
        self.checkpoints, self.persist_rounds = int(state["checkpoints"]), int(state["persist_rounds"])
        self.recoveries = int(state["recoveries"])
        self.tracker.load_state(state["plt"])
