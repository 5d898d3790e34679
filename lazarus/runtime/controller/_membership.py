"""Membership and plan logic of the controller: the view of the cluster and when to plan.

:class:`Membership` holds the nodes (without their connections: the controller keeps
those), the model, what every member holds, the routing history, the newest plan and the
timers. It never touches a socket: it talks to the outside only through the
:class:`Port` given to it (send a message to a node, record an event, save the state,
call back later on the event loop), so a test drives it alone with fake timers and a
list of sent messages. Its reachability probes (after a collective error, and before a
node cut off for a broken link joins again) are :class:`~._probes.Probes`', which it owns.

Everything here runs on the controller's event loop thread and never blocks: message
handlers update the view of the cluster, timers coalesce failures (``failure_grace``) and
batch joins (``join_window``, which closes as soon as no other registered node is still
warming up: a lone joiner is planned at once), and :meth:`Membership.issue` computes and
sends plans.

Plan ordering rules:

* failures and collective errors -> an *immediate* plan (it supersedes whatever plan is
  in flight; the survivors are blocked and wait for it);
* joins, graceful leaves, rebalances -> *between-steps* plans, one at a time: the next
  waits until the newest plan was applied (first ``reconfigured`` report for its
  generation) or superseded. Joins and leaves never share a plan; leaves go first, except
  when every member is leaving while a node is on its way in, which joins first (:mod:`._handover`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from .._config import ControllerConfig
from .._plan import Plan
from .._wire import MalformedMessageError, store_address
from ._flaps import FlapDamper
from ._handover import HandoverWait
from ._silence import hold_for_silent
from ._port import Node, Port, Timer, msg_field
from ._reachability import cut_off
from ._planner import InsufficientSlots, LayerSpec, PlanResult, applied_holdings, compute_plan, max_replica_load
from ._probes import Probes

__all__ = ["Membership"]


class Membership:
    """The cluster view and the plan logic; see the module docstring."""

    def __init__(self, config: ControllerConfig, port: Port) -> None:
        self.config = config
        self.port = port
        self.nodes: dict[str, Node] = {}
        self.generation = 0
        self.plan: Plan | None = None
        self._members: list[str] = []
        self._holdings: dict[str, dict[str, list[int]]] = {}
        # several GPUs per node: node -> layer -> per-GPU expert lists of the applied plan
        self._gpu_holdings: dict[str, dict[str, list[list[int]]]] = {}
        self.applied_gen = 0
        self.stalled = False
        self.model: dict[str, Any] | None = None
        self._routing: dict[str, deque[list[float]]] = {}
        self._last_step: int | None = None
        self._last_rebalance_step = 0
        self._rebalance_due = False
        # pending work
        self._lost: dict[str, str] = {}
        self._detected_at: float | None = None
        self._collective_at: float | None = None
        self._failure_timer: Timer | None = None
        self._collective_timer: Timer | None = None
        # after a collective error: who each member's agent could not reach; nodes cut off (_probes)
        self._probes = Probes(port, view=self, rejoin=self._add_join)
        # hysteresis: drops per node, and the joins held until a flapping node is stable (_flaps)
        self._flaps = FlapDamper(config.flap_limit, config.flap_window, config.flap_hold_down)
        self._held: dict[str, Timer] = {}
        self._start_timer: Timer | None = None
        self._pending_joins: set[str] = set()
        self._join_timer: Timer | None = None
        self._join_deadline: float | None = None
        self._pending_leaves: set[str] = set()
        self._leave_timer: Timer | None = None
        self._handover = HandoverWait(config.handover_wait, port=port, on_expiry=self.maybe_between_steps)
        self.left: set[str] = set()          # nodes a leave plan was issued for
        self._inflight: Plan | None = None  # between-steps plan not yet applied
        self.done: set[str] = set()
        self.finished = False
        self.resuming = False          # a restarted controller waiting for its members (_resume)
        # Workers per node of this job (every node runs the same number): fixed by the
        # first node that registers, kept across controller restarts.
        self.gpus_per_node: int | None = None

    @property
    def members(self) -> list[str]:
        """Members of the newest plan, in rank order."""
        return list(self._members)

    def cancel_timers(self) -> None:
        """The controller stops: no timer may fire any more."""
        for t in (self._failure_timer, self._collective_timer, self._start_timer,
                  self._join_timer, self._leave_timer, *self._held.values()):
            if t is not None:
                t.cancel()
        self._handover.end()

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """What a restarted controller needs of the view (the state file's fields, in
        their order, from ``generation`` to ``gpus_per_node``)."""
        return {
            "generation": self.generation, "plan": None if self.plan is None else self.plan.to_wire(),
            "members": list(self._members),
            "stalled": self.stalled, "applied_gen": self.applied_gen,
            "holdings": self._holdings, "gpu_holdings": self._gpu_holdings, "model": self.model,
            "routing": {name: [list(r) for r in hist] for name, hist in self._routing.items()},
            "last_step": self._last_step, "last_rebalance_step": self._last_rebalance_step,
            "done": sorted(self.done), "left": sorted(self.left), "finished": self.finished,
            "gpus_per_node": self.gpus_per_node,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Take over the view of a saved state (see :meth:`state`)."""
        self.generation = int(state["generation"])
        try:
            self.plan = None if state["plan"] is None else Plan.from_wire(state["plan"])
        except MalformedMessageError as exc:
            raise ValueError(f"state_dir: {self.config.state_dir}: field 'plan': {exc}") from None
        self._members = list(state["members"])
        self.stalled = bool(state["stalled"])
        self.applied_gen = int(state["applied_gen"])
        self._holdings = {str(n): {str(k): [int(x) for x in v] for k, v in layers.items()}
                          for n, layers in state["holdings"].items() if isinstance(layers, dict)}
        # absent in states written before plans carried a per-GPU split
        self._gpu_holdings = {str(n): {str(k): [[int(x) for x in gpu] for gpu in v] for k, v in layers.items()}
                              for n, layers in (state.get("gpu_holdings") or {}).items() if isinstance(layers, dict)}
        self.model = state["model"]
        window = self.config.routing_window
        self._routing = {str(k): deque([[float(x) for x in r] for r in hist][-window:], maxlen=window)
                         for k, hist in state["routing"].items() if isinstance(hist, list)}
        self._last_step = state["last_step"]
        self._last_rebalance_step = int(state["last_rebalance_step"])
        self.done = set(state["done"]) & set(self._members)
        self.left = set(state["left"])
        g = state.get("gpus_per_node")   # absent in states written before several workers per node
        self.gpus_per_node = g if isinstance(g, int) and not isinstance(g, bool) and g >= 1 else None

    # ------------------------------------------------------------------ nodes coming and going
    def refusal(self, nproc: int, slots: int | None) -> str | None:
        """Why a node running ``nproc`` workers cannot join this job (None: it can).

        Every node of a job runs the same number of workers G (the placement spreads each
        node's c slots over G ranks); the first node to register fixes G. Each worker
        needs a slot: c >= G."""
        job = self.gpus_per_node
        if job is not None and nproc != job:
            return (f"--nproc-per-node {nproc} differs from this job's {job} workers per node "
                    f"(every node must run the same number)")
        c = slots or self.config.slots_per_node
        if c < nproc:
            return (f"{c} slots per node < --nproc-per-node {nproc}: every worker needs at least one expert "
                    f"slot; give --slots >= {nproc} (agent or controller)")
        return None

    def register(self, node_id: str, peer: str, *, slots: int | None, incarnation: int, pid: int | None,
                 nproc: int) -> None:
        """A node registered (a new agent, or one that re-registers): a fresh record,
        holding nothing, neither done nor gone. A member re-registering on a live record
        failed."""
        old = self.nodes.get(node_id)
        rejoin = old is not None
        if old is not None and node_id in self._members and not old.dead:  # re-register on a live record
            self.declare_failure(node_id, "reregistered")
        self.nodes[node_id] = Node(node_id, peer, slots or self.config.slots_per_node, incarnation, pid,
                                   time.monotonic(), nproc=nproc)
        self._flaps.registered(node_id, pid)
        self._forget_holdings(node_id)
        self.done.discard(node_id)
        self.left.discard(node_id)
        self.port.event("node_registered", node=node_id, peer=peer, incarnation=incarnation, pid=pid,
                        slots=slots, nproc=nproc, rejoin=rejoin)

    def add(self, node: Node) -> None:
        """Take ``node``'s record as it is (an agent back after a controller restart)."""
        self.nodes[node.node_id] = node

    def node_gone(self, node_id: str, peer: str) -> None:
        """``node_id``'s connection closed: its record goes; a member not done failed."""
        node = self.nodes.pop(node_id)
        if node.dead:
            return
        node.dead = True
        if node_id not in self.done and node_id not in self.left and not node.leaving:
            self._flaps.dropped(node_id, self.port.time())
        if node.node_id in self._members and node.node_id not in self.done:
            self.declare_failure(node.node_id, "disconnect", peer=peer)
        else:
            self.port.event("node_left", node=node.node_id, peer=peer)
            self._pending_joins.discard(node.node_id)
            self._pending_leaves.discard(node.node_id)

    def check_heartbeats(self, now: float, timeout: float) -> None:
        """Nodes silent for more than ``timeout`` seconds (``now``: :func:`time.monotonic`)
        are dead: a member not done failed."""
        for node in list(self.nodes.values()):
            if not node.dead and now - node.last_seen > timeout:
                node.dead = True
                node.ready = False
                self._pending_joins.discard(node.node_id)
                self._pending_leaves.discard(node.node_id)
                if node.node_id not in self.done:
                    self._flaps.dropped(node.node_id, self.port.time())
                if node.node_id in self._members and node.node_id not in self.done:
                    self.declare_failure(node.node_id, "heartbeat_timeout",
                                         silent_s=round(now - node.last_seen, 3))
                else:
                    self.port.event("node_left", node=node.node_id, cause="heartbeat_timeout")

    def evict(self, node_id: str) -> None:
        """``node_id``'s worker is not one the job can use: it is dead to us; its agent
        restarts it as a fresh joiner."""
        node = self.nodes[node_id]
        node.dead = True
        node.ready = False
        self._tell_evicted(node)

    def _tell_evicted(self, node: Node) -> None:
        if not node.evict_sent:
            node.evict_sent = True
            self.port.event("evicted", node=node.node_id, peer=node.peer)
            self.port.send(node.node_id, {"type": "evicted", "node": node.node_id})

    # ------------------------------------------------------------------ messages
    def on_message(self, node_id: str, msg: dict[str, Any]) -> None:
        """A message from registered node ``node_id`` (anything but ``register``)."""
        node = self.nodes[node_id]
        kind = msg["type"]
        node.last_seen = time.monotonic()
        if node.dead:
            self._tell_evicted(node)
            return
        if kind == "heartbeat":
            step = msg_field(msg, "step", int, optional=True)
            if step is not None:
                node.step = step
        elif kind == "ping":
            self.port.send(node_id, {"type": "pong", "nonce": msg.get("nonce")})
        elif kind == "worker_ready":
            self._on_worker_ready(node, msg)
        elif kind == "worker_exit":
            self._on_worker_exit(node, msg)
        elif kind == "leaving":
            self._on_leaving(node, msg)
        elif kind == "probe_result":
            self._probes.on_result(node, msg)
        elif kind == "worker":
            inner = msg.get("msg")
            if not isinstance(inner, dict) or not isinstance(inner.get("type"), str):
                raise MalformedMessageError("worker: field 'msg' must be an object with a string 'type'")
            self._on_worker_msg(node, inner)
        else:
            self.port.event("unknown_message", level=logging.WARNING, node=node.node_id, type=kind)

    def _on_worker_ready(self, node: Node, msg: dict[str, Any]) -> None:
        inc = msg_field(msg, "incarnation", int)
        model = msg_field(msg, "model", dict)
        layers = model.get("layers")
        if not isinstance(layers, dict) or not layers or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 1
            for k, v in layers.items()
        ):
            raise MalformedMessageError("worker_ready: model.layers must map layer names to expert counts >= 1")
        if self.model is None:
            self.model = {"layers": dict(layers), "top_k": model.get("top_k")}
        elif dict(layers) != self.model["layers"]:
            self.port.event("model_mismatch", level=logging.ERROR, node=node.node_id, layers=layers)
            return
        node.incarnation = inc
        node.ready = True
        node.worker_pid = msg_field(msg, "pid", int, optional=True)
        pids = msg_field(msg, "pids", list, optional=True)   # every local rank's, with --nproc-per-node > 1
        if pids is not None and not all(isinstance(p, int) and not isinstance(p, bool) for p in pids):
            raise MalformedMessageError("worker_ready: field 'pids' must be a list of integers")
        startup = msg_field(msg, "startup", dict, optional=True)   # the worker's start-up phases (epoch s)
        if startup is not None and not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                            for v in startup.values()):
            raise MalformedMessageError("worker_ready: field 'startup' must map phases to times")
        node.store = store_address(msg.get("store"))
        self._forget_holdings(node.node_id)
        extra: dict[str, Any] = {"pids": pids} if pids is not None else {}
        if startup:
            extra["startup"] = startup
        if node.store:   # the address this node published
            extra["store"] = node.store
        self.port.event("worker_ready", node=node.node_id, incarnation=inc, pid=node.worker_pid, **extra)
        if self.finished:
            return
        if not self._members and not self.stalled:
            self._schedule_start()
        elif node.node_id not in self._members and not node.leaving:
            self._add_join(node.node_id)

    def _on_worker_exit(self, node: Node, msg: dict[str, Any]) -> None:
        rc = msg_field(msg, "returncode", int, optional=True)
        inc = msg_field(msg, "incarnation", int, optional=True)
        error = msg_field(msg, "error", str, optional=True)
        detail = {"error": error[:500]} if error else {}
        if inc is not None and inc != node.incarnation:
            self.port.event("worker_exit", node=node.node_id, returncode=rc, incarnation=inc, stale=True, **detail)
            return
        was_ready = node.ready
        node.ready = False
        node.worker_pid = None
        self._forget_holdings(node.node_id)
        self._pending_joins.discard(node.node_id)
        self.port.event("worker_exit", node=node.node_id, returncode=rc, incarnation=node.incarnation, **detail)
        if (was_ready and node.node_id in self._members and node.node_id not in self.done):
            self.declare_failure(node.node_id, "worker_exit", returncode=rc)

    def _on_worker_msg(self, node: Node, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "progress":
            step = msg.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                node.step = step
                if self._members and node.node_id == self._members[0]:
                    self._on_step(step)
            gen = msg.get("generation")
            if self.plan is not None and gen == self.plan.generation and self.applied_gen < gen:
                self._mark_applied(self.plan)  # training on it: applied, even without a report
        elif kind == "routing":
            self._on_routing(node, msg)
        elif kind == "reconfigured":
            self._on_reconfigured(node, msg)
        elif kind == "collective_error":
            self._on_collective_error(node, msg)
        elif kind == "done":
            self.done.add(node.node_id)
            self.port.event("worker_done", node=node.node_id, step=msg.get("step"))
            if not self.check_done():
                self.port.save_state(now=True)
        elif kind == "storage":   # moc checkpoints failing to reach storage, or reaching it again
            ok = msg.get("ok") is True
            self.port.event("storage_recovered" if ok else "storage_degraded",
                            level=logging.INFO if ok else logging.WARNING, node=node.node_id,
                            **{k: msg.get(k) for k in ("step", "persist_failures", "last_persisted_step", "error")
                               if msg.get(k) is not None})
        else:
            self.port.event("worker_message", node=node.node_id, msg=msg)

    def _on_routing(self, node: Node, msg: dict[str, Any]) -> None:
        layers = msg.get("layers")
        if not isinstance(layers, dict):
            raise MalformedMessageError("routing: field 'layers' must be an object")
        known = (self.model or {}).get("layers", {})
        for name, counts in layers.items():
            if name not in known or not isinstance(counts, list) or len(counts) != known[name]:
                continue
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in counts):
                continue
            self._routing.setdefault(name, deque(maxlen=self.config.routing_window)).append(
                [float(x) for x in counts])
        self.port.save_state()

    def _loads(self) -> dict[str, list[float]]:
        return {name: [sum(col) for col in zip(*hist)] for name, hist in self._routing.items() if hist}

    def _on_reconfigured(self, node: Node, msg: dict[str, Any]) -> None:
        gen = msg.get("generation")
        plan = self.plan
        fields: dict[str, Any] = {k: msg.get(k) for k in ("generation", "t_resumed", "timings", "moved",
                                                          "sources", "plt", "lost_experts")}
        # keep the worker's extra fields, minus names the event record itself uses
        fields.update({k: v for k, v in msg.items() if k not in ("type", "node", "t", "event", "level", "name")})
        if "t" in msg:
            fields["worker_t"] = msg["t"]
        if plan is not None and gen == plan.generation and isinstance(msg.get("t_resumed"), (int, float)):
            if plan.detected_at is not None:
                fields["reconfiguration_s"] = msg["t_resumed"] - plan.detected_at
            fields["since_issue_s"] = msg["t_resumed"] - plan.issued_at
            fields["reason"] = plan.reason
        self.port.event("reconfigured", node=node.node_id, **fields)
        if plan is None or gen != plan.generation or self.applied_gen >= gen:
            return
        self._mark_applied(plan)

    def _forget_holdings(self, node_id: str) -> None:
        """``node_id``'s worker(s) restarted or left: it holds nothing any more."""
        self._holdings.pop(node_id, None)
        self._gpu_holdings.pop(node_id, None)

    def _mark_applied(self, plan: Plan) -> None:
        gen = plan.generation
        self.applied_gen = gen
        self._holdings, self._gpu_holdings = applied_holdings(plan.members, plan.layers, plan.gpus)
        if self._inflight is not None and self._inflight.generation == gen:
            self._inflight = None
        self.port.save_state(now=True)
        self.maybe_between_steps()

    def _on_collective_error(self, node: Node, msg: dict[str, Any]) -> None:
        gen = msg.get("generation")
        self.port.event("collective_error", node=node.node_id, generation=gen, error=msg.get("error"))
        if gen != self.generation or self._failure_timer is not None or self._collective_timer is not None:
            return
        self._collective_at = time.time()
        self._collective_timer = self.port.call_later(
            self.config.failure_grace.total_seconds(), self._collective_replan, gen)
        self._probes.send(gen)

    def _collective_replan(self, gen: int) -> None:
        self._collective_timer = None
        if self.resuming:   # handled once the members are back (Resume.end)
            self.port.collective_while_resuming(gen == self.generation)
            return
        if gen == self.generation and self._failure_timer is None and self._probes.pending(gen):
            self._collective_timer = self.port.call_later(0.05, self._collective_replan, gen)
            return
        detected_at, self._collective_at = self._collective_at, None
        if gen != self.generation or self._failure_timer is not None:
            return
        members = [m for m in self._members if self.eligible(m)]
        reports = self._probes.reports(gen)
        cut = cut_off(members, reports)
        if cut:   # a broken link: the fewest nodes whose loss leaves everyone reaching everyone
            self.port.event("peers_unreachable", level=logging.WARNING, generation=gen, dropped=cut,
                            reports={k: v for k, v in reports.items() if v})
            for n in cut:
                self.evict(n)   # its worker restarts and joins again once it reaches the others
                self._probes.cut_nodes[n] = 0.0
            members = [m for m in members if m not in cut]
        lost = [m for m in self._members if m not in members]
        self.issue("collective_error", "immediate", members, lost=lost, detected_at=detected_at)

    def _on_step(self, step: int) -> None:
        self._last_step = step
        self.port.save_state()
        self._last_rebalance_step = min(self._last_rebalance_step, step)  # resumed from an older step
        every = self.config.rebalance_every
        if every and step - self._last_rebalance_step >= every:
            self._last_rebalance_step = step
            self._rebalance_due = True
            self.maybe_between_steps()

    def _on_leaving(self, node: Node, msg: dict[str, Any] | None = None) -> None:
        if node.leaving:
            return
        node.leaving = True
        msg = msg or {}
        reason = msg_field(msg, "reason", str, optional=True) if msg else None
        error = msg_field(msg, "error", str, optional=True) if msg else None
        detail = {"reason": reason[:64]} if reason else {}
        if error:
            detail["error"] = error[:500]
        self.port.event("leave", level=logging.WARNING if reason == "crash_loop" else logging.INFO,
                        node=node.node_id, **detail)
        self._pending_joins.discard(node.node_id)
        if node.node_id not in self._members or not node.ready:
            # nothing to hand over (a crash-looping node's worker is gone): go now; a
            # member without a worker is being replaced by a failure plan already
            self.port.send(node.node_id, {"type": "shutdown", "reason": "leave"})
            return
        self._pending_leaves.add(node.node_id)
        if self._leave_timer is None:
            self._leave_timer = self.port.call_later(self.config.failure_grace.total_seconds(),
                                                     self._leave_window_closed)

    def _leave_window_closed(self) -> None:
        self._leave_timer = None
        self.maybe_between_steps()

    def check_done(self) -> bool:
        """Is the job done (every member's worker reported done)? Ends it the first time."""
        if self.finished:
            return True
        if not self._members or not set(self._members) <= self.done:
            return False
        self.finished = True
        self.port.save_state(now=True)
        self.port.event("done", generation=self.generation, members=self._members)
        for node_id in list(self.nodes):
            self.port.send(node_id, {"type": "shutdown", "reason": "done"})
        if self.config.exit_when_done:
            self.port.end_job()
        return True

    # ------------------------------------------------------------------ membership logic
    def eligible(self, node_id: str) -> bool:
        """Can ``node_id`` be a member of a plan now (alive, connected, its worker ready)?"""
        n = self.nodes.get(node_id)
        return n is not None and not n.dead and n.ready and self.port.connected(node_id)

    def declare_failure(self, node_id: str, cause: str, **detail: Any) -> None:
        """``node_id`` failed: a failure plan follows after ``failure_grace`` (which
        collects the other failures of the same event into it)."""
        now = time.time()
        self.port.event("node_failed", node=node_id, cause=cause, generation=self.generation, **detail)
        if node_id in self._lost:
            return
        self._lost[node_id] = cause
        self._pending_leaves.discard(node_id)
        if self._detected_at is None:
            self._detected_at = now
        if self._failure_timer is None:
            self._failure_timer = self.port.call_later(self.config.failure_grace.total_seconds(),
                                                       self._failure_replan)

    def take_failures(self) -> set[str]:
        """The nodes declared failed and not planned for yet; forgets them, and the
        pending failure and collective-error plans (a restarted controller plans for
        them itself once its members are back)."""
        for t in (self._failure_timer, self._collective_timer):
            if t is not None:
                t.cancel()
        self._failure_timer = self._collective_timer = None
        lost = set(self._lost)
        self._lost.clear()
        self._detected_at = None
        return lost

    def _failure_replan(self) -> None:
        self._failure_timer = None
        if self.resuming:   # the failures stay in _lost for Resume.end
            return
        held = 0.0 if self._detected_at is None else time.time() - self._detected_at
        others = [self.nodes[m] for m in self._members if m not in self._lost and m in self.nodes]
        wait = hold_for_silent(others, self.config.heartbeat_timeout.total_seconds(), time.monotonic(), held)
        if wait > 0:   # another member is going silent: one plan for both (._silence)
            self._failure_timer = self.port.call_later(wait, self._failure_replan)
            return
        if self._collective_timer is not None:
            self._collective_timer.cancel()
            self._collective_timer = None
        lost = [m for m in self._members if m in self._lost or not self.eligible(m)]
        members = [m for m in self._members if m not in lost]
        self._lost.clear()
        detected_at, self._detected_at = self._detected_at, None
        if not lost:
            self.maybe_between_steps()
            return
        self.issue("failure", "immediate", members, lost=lost, detected_at=detected_at)

    def offer(self, node_id: str) -> None:
        """A node whose worker is ready and which is no member: the first plan, or a join."""
        if not self._members and not self.stalled:
            self._schedule_start()
        else:
            self._add_join(node_id)

    def _schedule_start(self) -> None:
        cfg = self.config
        ready = [n for n in self.nodes if self.eligible(n)]
        need = max(cfg.min_nodes, cfg.expected_nodes or 0) if self.generation == 0 else cfg.min_nodes
        if cfg.expected_nodes is not None and self.generation == 0:  # only the very first plan waits
            if len(ready) >= need:
                self._start_now()
            return
        if self._start_timer is None:
            self._start_timer = self.port.call_later(cfg.join_window.total_seconds(), self._start_now)

    def _start_now(self) -> None:
        if self._start_timer is not None:
            self._start_timer.cancel()
            self._start_timer = None
        if self._members or self.stalled:
            return
        ready = sorted(n for n in self.nodes if self.eligible(n) and not self.nodes[n].leaving)
        if len(ready) < self.config.min_nodes:
            self.port.event("waiting_for_nodes", ready=ready, min_nodes=self.config.min_nodes)
            return
        self._pending_joins.clear()
        self.issue("start", "immediate", ready, joined=ready)

    def _warming_up(self) -> list[str]:
        """Registered nodes on their way to join: alive, not members, not leaving, whose
        workers have not said hello yet (a join window waits for these only)."""
        return sorted(n for n, node in self.nodes.items()
                      if n not in self._members and not node.dead and not node.ready and not node.leaving
                      and n not in self.left and n not in self.done)

    def _add_join(self, node_id: str) -> None:
        if node_id in self._pending_joins:
            return
        if node_id in self._probes.cut_nodes:   # dropped for a broken link: it joins once it reaches everyone
            self._probes.admit(node_id)
            return
        if self._hold_flapping(node_id):
            return
        self._pending_joins.add(node_id)
        warming = self._warming_up()
        self.port.event("join", node=node_id, generation=self.generation, waiting_for=warming)
        if not warming:
            # Nobody else is on the way: the window would batch nothing, so the plan goes
            # now (a lone joiner trains a window sooner and nobody waits on a timer).
            if self._join_timer is not None:
                self._join_timer.cancel()
            self._join_timer = None
            self.maybe_between_steps()
            return
        if self._join_timer is None:
            self._join_deadline = time.monotonic() + self.config.join_window.total_seconds()
            self._join_timer = self.port.call_later(self.config.join_window.total_seconds(),
                                                    self._join_window_closed)

    def _hold_flapping(self, node_id: str) -> bool:
        """Hold ``node_id``'s join while it is flapping (:mod:`._flaps`): True when held; it
        is offered again once it has been stable for the hold-down."""
        now = self.port.time()
        wait = self._flaps.held(node_id, now)
        if wait <= 0:
            return False
        if node_id not in self._held:
            self.port.event("join_held", level=logging.WARNING, node=node_id, generation=self.generation,
                            flaps=self._flaps.flaps(node_id, now), retry_s=round(wait, 3),
                            hold_down_s=self.config.flap_hold_down.total_seconds())
            self._held[node_id] = self.port.call_later(wait, self._held_over, node_id)
        return True

    def _held_over(self, node_id: str) -> None:
        self._held.pop(node_id, None)
        if node_id not in self._members and self.eligible(node_id) and not self.nodes[node_id].leaving:
            self._add_join(node_id)

    def _join_window_closed(self) -> None:
        self._join_timer = None
        self.maybe_between_steps()

    def maybe_between_steps(self) -> None:
        """Issue the next queued between-steps plan, if none is in flight."""
        if self.finished or self.resuming:
            return
        if self._inflight is not None or self._failure_timer is not None or self._collective_timer is not None:
            return
        if not self._members and not self.stalled:
            if any(self.eligible(n) for n in self._pending_joins):
                self._pending_joins.clear()
                self._schedule_start()
            return
        survivors = [m for m in self._members if self.eligible(m)]
        if len(survivors) < len(self._members) and not self.stalled:
            return  # a failure is being detected; its plan comes first
        if self._pending_leaves and self.stalled:
            # no plan can be made now: let the leaving nodes go without a hand-over
            for n in sorted(self._pending_leaves):
                self.left.add(n)
                self.port.send(n, {"type": "shutdown", "reason": "leave"})
            self._members = [m for m in self._members if m not in self._pending_leaves]
            self._pending_leaves.clear()
        if self._pending_leaves and self._leave_timer is None:
            leaving = sorted(n for n in self._pending_leaves if n in self._members)
            members = [m for m in survivors if m not in leaving]
            incoming = sorted(set(self._warming_up()) | {n for n in self._pending_joins
                                                          if self.eligible(n) and n not in self._members})
            if leaving and not members and self._handover.waiting(leaving, incoming, self.generation):
                # nobody would be left to take their experts: the node on its way in joins
                # first (once its worker is ready), then they leave, handing over to it
                joins = sorted(n for n in self._pending_joins if self.eligible(n) and n not in self._members)
                if joins:
                    self._pending_joins.clear()
                    self.issue("join", "between_steps", survivors + joins, joined=joins)
                return
            self._handover.end()
            self._pending_leaves.clear()
            if leaving:
                if not self.issue("leave", "between_steps", members, leaving=leaving):
                    for n in leaving:  # cannot plan without them: let them go anyway
                        self.left.add(n)
                        self.port.send(n, {"type": "shutdown", "reason": "leave"})
                return
        joins = sorted(n for n in self._pending_joins if self.eligible(n) and n not in self._members)
        if joins and self._join_timer is None:
            self._pending_joins.clear()
            mode = "immediate" if self.stalled else "between_steps"
            self.issue("join", mode, survivors + joins, joined=joins)
            return
        if self._rebalance_due and not self.stalled:
            self._rebalance_due = False
            self._rebalance(survivors)

    def _rebalance(self, members: list[str]) -> None:
        if self.plan is None or self.model is None or not self._routing:
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
            cur += max_replica_load(self.plan.layers[spec.name], t)
        gain = (cur - new.max_load) / cur if cur > 0 else 0.0
        if gain < self.config.rebalance_min_gain:
            self.port.event("rebalance_skipped", step=self._last_step, gain=round(gain, 4),
                            min_gain=self.config.rebalance_min_gain)
            return
        self.issue("rebalance", "between_steps", members, precomputed=new, gain=round(gain, 4))

    # ------------------------------------------------------------------ plans
    def _layer_specs(self) -> list[LayerSpec]:
        assert self.model is not None
        return [LayerSpec(k, v) for k, v in self.model["layers"].items()]

    def _slots(self, members: list[str]) -> int:
        return min([self.nodes[m].slots for m in members if m in self.nodes] or [self.config.slots_per_node])

    def issue(self, reason: str, mode: str, members: list[str], *, lost: Sequence[str] = (),
              joined: Sequence[str] = (), leaving: Sequence[str] = (), precomputed: PlanResult | None = None,
              gain: float | None = None, detected_at: float | None = None) -> bool:
        """Compute and send a plan. Returns False when no plan can be made (then waits)."""
        cfg = self.config
        # leaving nodes of a superseded leave plan are told to go now
        superseded = self._inflight
        leaving = list(leaving)
        if superseded is not None and mode == "immediate":
            leaving += [n for n in superseded.leaving if n in self.nodes and n not in leaving]
            self._inflight = None
        if self.model is None:
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
            incarnations={m: self.nodes[m].incarnation for m in members if m in self.nodes},
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
        self.plan = plan
        self._members = list(members)
        self.stalled = False
        self.left.update(leaving)
        self._inflight = plan  # until a worker reports it applied, or an immediate plan supersedes it
        for n in leaving:
            self._pending_leaves.discard(n)
        self.port.save_state(now=True)   # before anyone hears of it: a restart resumes from here
        rec = list(res.recovery.values())
        gpus: dict[str, Any] = {"gpus": res.gpus} if res.gpus else {}
        self.port.event("plan", generation=g, reason=reason, mode=mode, members=members, gpus_per_node=per_node,
                        world_size=plan.world, lost=list(lost),
                        joined=list(joined), leaving=leaving, detected_at=detected_at,
                        fetches=plan.fetches, missing=res.missing, recovery_probability=res.recovery,
                        recovery_mean=sum(rec) / len(rec) if rec else None, recovery_min=min(rec, default=None),
                        compute_ms=round(compute_ms, 3), gain=gain, layers=res.layers,
                        **gpus)
        wire = plan.to_wire()
        for n in list(members) + [n for n in leaving if n not in members]:
            self.port.send(n, wire)
        self._refresh_joins()
        return True

    def _plan_store(self, first: str) -> dict[str, Any]:
        """Where a plan's group forms: the store the worker of its first member (rank 0)
        hosts, which lives as long as that member does, so that the group forms even if
        the controller dies meanwhile; the controller's own store when that worker hosts
        none (a worker that does not use ElasticTrainer)."""
        node = self.nodes.get(first)
        if node is not None and node.ready and node.store is not None:
            return {**node.store, "node": first, "incarnation": node.incarnation}
        return self.port.own_store()

    def _stall(self, reason: str, members: list[str], why: str) -> None:
        self.port.event("cannot_plan", level=logging.ERROR, reason=reason, members=members, why=why)
        if self._members or self.stalled:
            self._members = list(members)
            self.stalled = bool(members)
        if not members:
            self._inflight = None
        self.port.save_state(now=True)
        self.port.call_soon(self.maybe_between_steps)  # queued joins may make a plan possible

    def _refresh_joins(self) -> None:
        """Ready nodes outside the plan (e.g. from a superseded join plan) queue as joins."""
        for n, node in self.nodes.items():
            if self.eligible(n) and n not in self._members and not node.leaving and n not in self.left:
                self._add_join(n)
