"""Membership and plan logic of the controller (a mixin of :class:`Controller`).

Everything here runs on the controller's event loop thread and never blocks: message
handlers update the view of the cluster, timers coalesce failures (``failure_grace``) and
batch joins (``join_window``, which closes as soon as no other registered node is still
warming up: a lone joiner is planned at once), and :meth:`Membership._issue` computes and
sends plans.

Plan ordering rules:

* failures and collective errors -> an *immediate* plan (it supersedes whatever plan is
  in flight; the survivors are blocked and wait for it);
* joins, graceful leaves, rebalances -> *between-steps* plans, one at a time: the next
  waits until the newest plan was applied (first ``reconfigured`` report for its
  generation) or superseded. Joins and leaves never share a plan; leaves go first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._plan import Plan
from .._wire import MalformedMessageError, store_address
from ._planner import InsufficientSlots, LayerSpec, applied_holdings, compute_plan, max_replica_load

if TYPE_CHECKING:
    from .._config import ControllerConfig
    from ._controller import _Conn

__all__ = ["Membership"]


@dataclass(eq=False)
class _Node:
    node_id: str
    conn: _Conn
    slots: int
    incarnation: int
    pid: int | None
    last_seen: float
    dead: bool = False          # declared failed (disconnect / heartbeat timeout)
    evict_sent: bool = False
    ready: bool = False         # the current worker incarnation said hello and is alive
    worker_pid: int | None = None
    leaving: bool = False
    step: int | None = None
    registered_at: float = field(default_factory=time.time)
    nproc: int = 1              # workers (GPUs, ranks) the agent runs: --nproc-per-node
    store: dict[str, Any] | None = None   # the rendezvous store its worker hosts (worker_ready)


def _req(msg: dict[str, Any], name: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
    v = msg.get(name)
    if v is None and optional:
        return None
    if isinstance(v, bool) and kind is not bool and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise MalformedMessageError(f"{msg['type']}: field {name!r} has the wrong type")
    if not isinstance(v, kind):
        raise MalformedMessageError(f"{msg['type']}: field {name!r} missing or of the wrong type")
    return v


class Membership(ABC):
    """Cluster view + planning; mixed into :class:`~lazarus.runtime.Controller`."""

    config: ControllerConfig
    epoch: int
    store_port: int | None
    _loop: asyncio.AbstractEventLoop | None
    _stop: asyncio.Event | None
    _nodes: dict[str, _Node]

    def _init_membership(self) -> None:
        self.generation = 0
        self._plan: Plan | None = None
        self._members: list[str] = []
        self._holdings: dict[str, dict[str, list[int]]] = {}
        # several GPUs per node: node -> layer -> per-GPU expert lists of the applied plan
        self._gpu_holdings: dict[str, dict[str, list[list[int]]]] = {}
        self._applied_gen = 0
        self._stalled = False
        self._model: dict[str, Any] | None = None
        self._routing: dict[str, deque[list[float]]] = {}
        self._last_step: int | None = None
        self._last_rebalance_step = 0
        self._rebalance_due = False
        # pending work
        self._lost: dict[str, str] = {}
        self._detected_at: float | None = None
        self._collective_at: float | None = None
        self._failure_timer: asyncio.TimerHandle | None = None
        self._collective_timer: asyncio.TimerHandle | None = None
        self._start_timer: asyncio.TimerHandle | None = None
        self._pending_joins: set[str] = set()
        self._join_timer: asyncio.TimerHandle | None = None
        self._join_deadline: float | None = None
        self._pending_leaves: set[str] = set()
        self._leave_timer: asyncio.TimerHandle | None = None
        self._left: set[str] = set()          # nodes a leave plan was issued for
        self._inflight: Plan | None = None  # between-steps plan not yet applied
        self._done: set[str] = set()
        self._finished = False
        self._resuming = False          # a restarted controller waiting for its members (_resume)
        self._resume_collective = False
        # Workers per node of this job (every node runs the same number): fixed by the
        # first node that registers, kept across controller restarts.
        self.gpus_per_node: int | None = None

    def _save_state(self, now: bool = False) -> None:
        """Persist the state (see :mod:`._resume`); nothing here."""

    @property
    def members(self) -> list[str]:
        """Members of the newest plan, in rank order."""
        return list(self._members)

    @property
    def plan(self) -> dict[str, Any] | None:
        """The newest plan message (:meth:`Plan.to_wire`)."""
        return None if self._plan is None else self._plan.to_wire()

    @abstractmethod
    def _event(self, name: str, level: int = logging.INFO, **fields: Any) -> None:
        ...

    @abstractmethod
    def _send(self, node_id: str, msg: dict[str, Any]) -> bool:
        ...

    @abstractmethod
    def _resume_broken(self) -> None:
        """Resuming after a restart, a member that is back reported a broken collective
        (:class:`._resume.Resumable` shortens the wait for the missing ones)."""

    def _on_worker_ready(self, node: _Node, msg: dict[str, Any]) -> None:
        inc = _req(msg, "incarnation", int)
        model = _req(msg, "model", dict)
        layers = model.get("layers")
        if not isinstance(layers, dict) or not layers or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 1
            for k, v in layers.items()
        ):
            raise MalformedMessageError("worker_ready: model.layers must map layer names to expert counts >= 1")
        if self._model is None:
            self._model = {"layers": dict(layers), "top_k": model.get("top_k")}
        elif dict(layers) != self._model["layers"]:
            self._event("model_mismatch", level=logging.ERROR, node=node.node_id, layers=layers)
            return
        node.incarnation = inc
        node.ready = True
        node.worker_pid = _req(msg, "pid", int, optional=True)
        pids = _req(msg, "pids", list, optional=True)   # every local rank's, with --nproc-per-node > 1
        if pids is not None and not all(isinstance(p, int) and not isinstance(p, bool) for p in pids):
            raise MalformedMessageError("worker_ready: field 'pids' must be a list of integers")
        startup = _req(msg, "startup", dict, optional=True)   # the worker's start-up phases (epoch s)
        if startup is not None and not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                            for v in startup.values()):
            raise MalformedMessageError("worker_ready: field 'startup' must map phases to times")
        node.store = store_address(msg.get("store"))
        self._forget_holdings(node.node_id)
        self._event("worker_ready", node=node.node_id, incarnation=inc, pid=node.worker_pid,
                    **({"pids": pids} if pids is not None else {}),
                    **({"startup": startup} if startup else {}))
        if self._finished:
            return
        if not self._members and not self._stalled:
            self._schedule_start()
        elif node.node_id not in self._members and not node.leaving:
            self._add_join(node.node_id)

    def _on_worker_exit(self, node: _Node, msg: dict[str, Any]) -> None:
        rc = _req(msg, "returncode", int, optional=True)
        inc = _req(msg, "incarnation", int, optional=True)
        error = _req(msg, "error", str, optional=True)
        detail = {"error": error[:500]} if error else {}
        if inc is not None and inc != node.incarnation:
            self._event("worker_exit", node=node.node_id, returncode=rc, incarnation=inc, stale=True, **detail)
            return
        was_ready = node.ready
        node.ready = False
        node.worker_pid = None
        self._forget_holdings(node.node_id)
        self._pending_joins.discard(node.node_id)
        self._event("worker_exit", node=node.node_id, returncode=rc, incarnation=node.incarnation, **detail)
        if (was_ready and node.node_id in self._members and node.node_id not in self._done):
            self._declare_failure(node.node_id, "worker_exit", returncode=rc)

    def _on_worker_msg(self, node: _Node, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "progress":
            step = msg.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                node.step = step
                if self._members and node.node_id == self._members[0]:
                    self._on_step(step)
            gen = msg.get("generation")
            if self._plan is not None and gen == self._plan.generation and self._applied_gen < gen:
                self._mark_applied(self._plan)  # training on it: applied, even without a report
        elif kind == "routing":
            self._on_routing(node, msg)
        elif kind == "reconfigured":
            self._on_reconfigured(node, msg)
        elif kind == "collective_error":
            self._on_collective_error(node, msg)
        elif kind == "done":
            self._done.add(node.node_id)
            self._event("worker_done", node=node.node_id, step=msg.get("step"))
            if not self._check_done():
                self._save_state(now=True)
        elif kind == "storage":   # moc checkpoints failing to reach storage, or reaching it again
            ok = msg.get("ok") is True
            self._event("storage_recovered" if ok else "storage_degraded",
                        level=logging.INFO if ok else logging.WARNING, node=node.node_id,
                        **{k: msg.get(k) for k in ("step", "persist_failures", "last_persisted_step", "error")
                           if msg.get(k) is not None})
        else:
            self._event("worker_message", node=node.node_id, msg=msg)

    def _on_routing(self, node: _Node, msg: dict[str, Any]) -> None:
        layers = msg.get("layers")
        if not isinstance(layers, dict):
            raise MalformedMessageError("routing: field 'layers' must be an object")
        known = (self._model or {}).get("layers", {})
        for name, counts in layers.items():
            if name not in known or not isinstance(counts, list) or len(counts) != known[name]:
                continue
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in counts):
                continue
            self._routing.setdefault(name, deque(maxlen=self.config.routing_window)).append(
                [float(x) for x in counts])
        self._save_state()

    def _loads(self) -> dict[str, list[float]]:
        return {name: [sum(col) for col in zip(*hist)] for name, hist in self._routing.items() if hist}

    def _on_reconfigured(self, node: _Node, msg: dict[str, Any]) -> None:
        gen = msg.get("generation")
        plan = self._plan
        fields = {k: msg.get(k) for k in ("generation", "t_resumed", "timings", "moved", "sources",
                                          "plt", "lost_experts")}
        # keep the worker's extra fields, minus names the event record itself uses
        fields.update({k: v for k, v in msg.items() if k not in ("type", "node", "t", "event", "level", "name")})
        if "t" in msg:
            fields["worker_t"] = msg["t"]
        if plan is not None and gen == plan.generation and isinstance(msg.get("t_resumed"), (int, float)):
            if plan.detected_at is not None:
                fields["reconfiguration_s"] = msg["t_resumed"] - plan.detected_at
            fields["since_issue_s"] = msg["t_resumed"] - plan.issued_at
            fields["reason"] = plan.reason
        self._event("reconfigured", node=node.node_id, **fields)
        if plan is None or gen != plan.generation or self._applied_gen >= gen:
            return
        self._mark_applied(plan)

    def _forget_holdings(self, node_id: str) -> None:
        """``node_id``'s worker(s) restarted or left: it holds nothing any more."""
        self._holdings.pop(node_id, None)
        self._gpu_holdings.pop(node_id, None)

    def _mark_applied(self, plan: Plan) -> None:
        gen = plan.generation
        self._applied_gen = gen
        self._holdings, self._gpu_holdings = applied_holdings(plan.members, plan.layers, plan.gpus)
        if self._inflight is not None and self._inflight.generation == gen:
            self._inflight = None
        self._save_state(now=True)
        self._maybe_between_steps()

    def _on_collective_error(self, node: _Node, msg: dict[str, Any]) -> None:
        gen = msg.get("generation")
        self._event("collective_error", node=node.node_id, generation=gen, error=msg.get("error"))
        if gen != self.generation or self._failure_timer is not None or self._collective_timer is not None:
            return
        self._collective_at = time.time()
        self._collective_timer = self._loop.call_later(
            self.config.failure_grace.total_seconds(), self._collective_replan, gen)

    def _collective_replan(self, gen: int) -> None:
        self._collective_timer = None
        if self._resuming:   # handled once the members are back (_end_resume)
            self._resume_collective = gen == self.generation
            if self._resume_collective:
                self._resume_broken()
            return
        detected_at, self._collective_at = self._collective_at, None
        if gen != self.generation or self._failure_timer is not None:
            return
        members = [m for m in self._members if self._eligible(m)]
        lost = [m for m in self._members if m not in members]
        self._issue("collective_error", "immediate", members, lost=lost, detected_at=detected_at)

    def _on_step(self, step: int) -> None:
        self._last_step = step
        self._save_state()
        self._last_rebalance_step = min(self._last_rebalance_step, step)  # resumed from an older step
        every = self.config.rebalance_every
        if every and step - self._last_rebalance_step >= every:
            self._last_rebalance_step = step
            self._rebalance_due = True
            self._maybe_between_steps()

    def _on_leaving(self, node: _Node, msg: dict[str, Any] | None = None) -> None:
        if node.leaving:
            return
        node.leaving = True
        msg = msg or {}
        reason = _req(msg, "reason", str, optional=True) if msg else None
        error = _req(msg, "error", str, optional=True) if msg else None
        detail = {"reason": reason[:64]} if reason else {}
        if error:
            detail["error"] = error[:500]
        self._event("leave", level=logging.WARNING if reason == "crash_loop" else logging.INFO,
                    node=node.node_id, **detail)
        self._pending_joins.discard(node.node_id)
        if node.node_id not in self._members or not node.ready:
            # nothing to hand over (a crash-looping node's worker is gone): go now; a
            # member without a worker is being replaced by a failure plan already
            self._send(node.node_id, {"type": "shutdown", "reason": "leave"})
            return
        self._pending_leaves.add(node.node_id)
        if self._leave_timer is None:
            self._leave_timer = self._loop.call_later(self.config.failure_grace.total_seconds(),
                                                      self._leave_window_closed)

    def _leave_window_closed(self) -> None:
        self._leave_timer = None
        self._maybe_between_steps()

    def _check_done(self) -> bool:
        """Is the job done (every member's worker reported done)? Ends it the first time."""
        if self._finished:
            return True
        if not self._members or not set(self._members) <= self._done:
            return False
        self._finished = True
        self._save_state(now=True)
        self._event("done", generation=self.generation, members=self._members)
        for node_id in list(self._nodes):
            self._send(node_id, {"type": "shutdown", "reason": "done"})
        if self.config.exit_when_done:
            self._end_job()
        return True

    @abstractmethod
    def _end_job(self) -> None:
        """The job is done and the agents were told: stop once they have left."""

    # ------------------------------------------------------------------ membership logic
    def _eligible(self, node_id: str) -> bool:
        n = self._nodes.get(node_id)
        return n is not None and not n.dead and n.ready and not n.conn.closed

    def _declare_failure(self, node_id: str, cause: str, **detail: Any) -> None:
        now = time.time()
        self._event("node_failed", node=node_id, cause=cause, generation=self.generation, **detail)
        if node_id in self._lost:
            return
        self._lost[node_id] = cause
        self._pending_leaves.discard(node_id)
        if self._detected_at is None:
            self._detected_at = now
        if self._failure_timer is None:
            self._failure_timer = self._loop.call_later(self.config.failure_grace.total_seconds(),
                                                        self._failure_replan)

    def _failure_replan(self) -> None:
        self._failure_timer = None
        if self._resuming:   # the failures stay in _lost for _end_resume
            return
        if self._collective_timer is not None:
            self._collective_timer.cancel()
            self._collective_timer = None
        lost = [m for m in self._members if m in self._lost or not self._eligible(m)]
        members = [m for m in self._members if m not in lost]
        self._lost.clear()
        detected_at, self._detected_at = self._detected_at, None
        if not lost:
            self._maybe_between_steps()
            return
        self._issue("failure", "immediate", members, lost=lost, detected_at=detected_at)

    def _schedule_start(self) -> None:
        cfg = self.config
        ready = [n for n in self._nodes if self._eligible(n)]
        need = max(cfg.min_nodes, cfg.expected_nodes or 0) if self.generation == 0 else cfg.min_nodes
        if cfg.expected_nodes is not None and self.generation == 0:  # only the very first plan waits
            if len(ready) >= need:
                self._start_now()
            return
        if self._start_timer is None:
            self._start_timer = self._loop.call_later(cfg.join_window.total_seconds(), self._start_now)

    def _start_now(self) -> None:
        if self._start_timer is not None:
            self._start_timer.cancel()
            self._start_timer = None
        if self._members or self._stalled:
            return
        ready = sorted(n for n in self._nodes if self._eligible(n) and not self._nodes[n].leaving)
        if len(ready) < self.config.min_nodes:
            self._event("waiting_for_nodes", ready=ready, min_nodes=self.config.min_nodes)
            return
        self._pending_joins.clear()
        self._issue("start", "immediate", ready, joined=ready)

    def _warming_up(self) -> list[str]:
        """Registered nodes on their way to join: alive, not members, not leaving, whose
        workers have not said hello yet (a join window waits for these only)."""
        return sorted(n for n, node in self._nodes.items()
                      if n not in self._members and not node.dead and not node.ready and not node.leaving
                      and n not in self._left and n not in self._done)

    def _add_join(self, node_id: str) -> None:
        if node_id in self._pending_joins:
            return
        self._pending_joins.add(node_id)
        warming = self._warming_up()
        self._event("join", node=node_id, generation=self.generation, waiting_for=warming)
        if not warming:
            # Nobody else is on the way: the window would batch nothing, so the plan goes
            # now (a lone joiner trains a window sooner and nobody waits on a timer).
            if self._join_timer is not None:
                self._join_timer.cancel()
            self._join_timer = None
            self._maybe_between_steps()
            return
        if self._join_timer is None:
            self._join_deadline = time.monotonic() + self.config.join_window.total_seconds()
            self._join_timer = self._loop.call_later(self.config.join_window.total_seconds(),
                                                     self._join_window_closed)

    def _join_window_closed(self) -> None:
        self._join_timer = None
        self._maybe_between_steps()

    def _maybe_between_steps(self) -> None:
        """Issue the next queued between-steps plan, if none is in flight."""
        if self._finished or self._resuming:
            return
        if self._inflight is not None or self._failure_timer is not None or self._collective_timer is not None:
            return
        if not self._members and not self._stalled:
            if any(self._eligible(n) for n in self._pending_joins):
                self._pending_joins.clear()
                self._schedule_start()
            return
        survivors = [m for m in self._members if self._eligible(m)]
        if len(survivors) < len(self._members) and not self._stalled:
            return  # a failure is being detected; its plan comes first
        if self._pending_leaves and self._stalled:
            # no plan can be made now: let the leaving nodes go without a hand-over
            for n in sorted(self._pending_leaves):
                self._left.add(n)
                self._send(n, {"type": "shutdown", "reason": "leave"})
            self._members = [m for m in self._members if m not in self._pending_leaves]
            self._pending_leaves.clear()
        if self._pending_leaves and self._leave_timer is None:
            leaving = sorted(n for n in self._pending_leaves if n in self._members)
            self._pending_leaves.clear()
            if leaving:
                members = [m for m in survivors if m not in leaving]
                if not self._issue("leave", "between_steps", members, leaving=leaving):
                    for n in leaving:  # cannot plan without them: let them go anyway
                        self._left.add(n)
                        self._send(n, {"type": "shutdown", "reason": "leave"})
                return
        joins = sorted(n for n in self._pending_joins if self._eligible(n) and n not in self._members)
        if joins and self._join_timer is None:
            self._pending_joins.clear()
            mode = "immediate" if self._stalled else "between_steps"
            self._issue("join", mode, survivors + joins, joined=joins)
            return
        if self._rebalance_due and not self._stalled:
            self._rebalance_due = False
            self._rebalance(survivors)

    def _rebalance(self, members: list[str]) -> None:
        if self._plan is None or self._model is None or not self._routing:
            return
        loads = self._loads()
        layers = self._layer_specs()
        try:
            new = compute_plan(members, self._holdings, layers, loads, self._slots(members),
                               self.config.min_replicas, self.gpus_per_node or 1, self._gpu_holdings)
        except InsufficientSlots:
            return
        cur = 0.0
        for spec in layers:
            t = loads.get(spec.name) or [1.0] * spec.num_experts
            cur += max_replica_load(self._plan.layers[spec.name], t)
        gain = (cur - new.max_load) / cur if cur > 0 else 0.0
        if gain < self.config.rebalance_min_gain:
            self._event("rebalance_skipped", step=self._last_step, gain=round(gain, 4),
                        min_gain=self.config.rebalance_min_gain)
            return
        self._issue("rebalance", "between_steps", members, precomputed=new, gain=round(gain, 4))

    # ------------------------------------------------------------------ plans
    def _layer_specs(self) -> list[LayerSpec]:
        assert self._model is not None
        return [LayerSpec(k, v) for k, v in self._model["layers"].items()]

    def _slots(self, members: list[str]) -> int:
        return min([self._nodes[m].slots for m in members if m in self._nodes] or [self.config.slots_per_node])

    def _issue(self, reason: str, mode: str, members: list[str], *, lost: list[str] = (),
               joined: list[str] = (), leaving: list[str] = (), precomputed: Any = None,
               gain: float | None = None, detected_at: float | None = None) -> bool:
        """Compute and send a plan. Returns False when no plan can be made (then waits)."""
        cfg = self.config
        # leaving nodes of a superseded leave plan are told to go now
        superseded = self._inflight
        leaving = list(leaving)
        if superseded is not None and mode == "immediate":
            leaving += [n for n in superseded.leaving if n in self._nodes and n not in leaving]
            self._inflight = None
        if self._model is None:
            return False
        if len(members) < cfg.min_nodes:
            self._stall(reason, members, f"{len(members)} member(s) < min_nodes = {cfg.min_nodes}")
            return False
        t0 = time.perf_counter()
        per_node = self.gpus_per_node or 1
        try:
            res = precomputed or compute_plan(members, self._holdings, self._layer_specs(), self._loads(),
                                              self._slots(members), cfg.min_replicas, per_node,
                                              self._gpu_holdings)
        except ValueError as exc:  # InsufficientSlots, or a planning input the library refuses
            self._stall(reason, members, str(exc))
            return False
        compute_ms = (time.perf_counter() - t0) * 1000
        self.generation += 1
        g = self.generation
        plan = Plan(
            generation=g, mode=mode, reason=reason, members=list(members), leaving=leaving,
            incarnations={m: self._nodes[m].incarnation for m in members if m in self._nodes},
            store=self._plan_store(members[0]), prefix=f"lazarus/gen{g}", slots=self._slots(members),
            # G ranks per node, contiguous: rank = node index * G + local rank. "layers"
            # rows are per node (c slots); with G > 1 "gpus" splits them over the node's
            # ranks (Placement.gpus), keeping experts on the GPUs that hold them.
            gpus_per_node=per_node, layers=res.layers, lost=list(lost), joined=list(joined),
            detected_at=detected_at, issued_at=time.time(),
            fetches={"greedy": res.fetches_greedy, "identity": res.fetches_identity,
                     "same_node": res.gpu_moves, "same_node_round_robin": res.gpu_moves_round_robin},
            missing=res.missing, transfers=res.transfers, recovery_probability=res.recovery,
            gpus=res.gpus or None,
        )
        self._plan = plan
        self._members = list(members)
        self._stalled = False
        self._left.update(leaving)
        self._inflight = plan  # until a worker reports it applied, or an immediate plan supersedes it
        for n in leaving:
            self._pending_leaves.discard(n)
        self._save_state(now=True)   # before anyone hears of it: a restart resumes from here
        rec = list(res.recovery.values())
        self._event("plan", generation=g, reason=reason, mode=mode, members=members, gpus_per_node=per_node,
                    world_size=plan.world, lost=list(lost),
                    joined=list(joined), leaving=leaving, detected_at=detected_at,
                    fetches=plan.fetches, missing=res.missing, recovery_probability=res.recovery,
                    recovery_mean=sum(rec) / len(rec) if rec else None, recovery_min=min(rec, default=None),
                    compute_ms=round(compute_ms, 3), gain=gain, layers=res.layers,
                    **({"gpus": res.gpus} if res.gpus else {}))
        wire = plan.to_wire()
        for n in list(members) + [n for n in leaving if n not in members]:
            self._send(n, wire)
        self._refresh_joins()
        return True

    def _plan_store(self, first: str) -> dict[str, Any]:
        """Where a plan's group forms: the store the worker of its first member (rank 0)
        hosts, which lives as long as that member does, so that the group forms even if
        this controller dies meanwhile; the controller's own store when that worker hosts
        none (a worker that does not use ElasticTrainer)."""
        node = self._nodes.get(first)
        if node is not None and node.ready and node.store is not None:
            return {**node.store, "node": first, "incarnation": node.incarnation}
        return {"host": self.config.store_host, "port": self.store_port, "epoch": self.epoch}

    def _stall(self, reason: str, members: list[str], why: str) -> None:
        self._event("cannot_plan", level=logging.ERROR, reason=reason, members=members, why=why)
        if self._members or self._stalled:
            self._members = list(members)
            self._stalled = bool(members)
        if not members:
            self._inflight = None
        self._save_state(now=True)
        self._loop.call_soon(self._maybe_between_steps)  # queued joins may make a plan possible

    def _refresh_joins(self) -> None:
        """Ready nodes outside the plan (e.g. from a superseded join plan) queue as joins."""
        for n, node in self._nodes.items():
            if self._eligible(n) and n not in self._members and not node.leaving and n not in self._left:
                self._add_join(n)
