"""A controller that survives its own restart (a mixin between :class:`Membership` and
:class:`Controller`).

The state that decides plans (generation, members, the newest plan, what every member
holds, routing history, who is done or has left) is saved atomically to the state
directory (:mod:`._state`). A controller started again with the same command line finds
it and *resumes*:

1. it hosts a fresh store of its own (the old one died with it; plans use it only for
   workers that host none). The groups form on a store the first member's worker hosts
   (:meth:`Membership._plan_store`), so the workers kept training meanwhile, and a plan
   that reached every member before the controller died (a join, say) was applied
   without it;
2. agents reconnect and register with a ``resume`` record (worker incarnation, alive,
   ready, newest plan given to it, done). A member whose worker of the current plan is
   still running is taken back as it is; one whose worker was replaced or died while the
   controller was away is a failure; a non-member worker left over from an older
   generation is evicted (restarted as a fresh joiner);
3. reports the agents queued while it was away (collective errors, done, progress) are
   replayed after the registration;
4. no plan is made while the members come back: once all have, or after
   ``resume_grace``, one immediate plan handles whatever happened meanwhile (members that
   did not come back, broken collectives, a plan that was in flight when the controller
   died and may not have been applied); with nothing to handle, training just goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from .._plan import Plan
from .._wire import MalformedMessageError, store_address
from ._membership import Membership, _Node, _req

if TYPE_CHECKING:
    from ._controller import _Conn

__all__ = ["Resumable"]


class Resumable(Membership):
    """State saving and resuming; see the module docstring."""

    epoch: int
    port: int | None
    store_port: int | None

    def _init_resume(self) -> None:
        self.epoch = 1
        self._resuming = False
        self._resume_waiting: set[str] = set()
        self._resume_back: list[str] = []
        self._resume_started: float | None = None
        self._resume_serving: float | None = None   # when the restarted controller served again
        self._resume_collective = False
        self._resume_timer: asyncio.TimerHandle | None = None
        self._save_timer: asyncio.TimerHandle | None = None
        self._state_error_logged = False

    # ------------------------------------------------------------------ saving
    def _state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "port": int(self.port or 0), "store_port": int(self.store_port or 0),
            "generation": self.generation, "plan": None if self._plan is None else self._plan.to_wire(),
            "members": list(self._members),
            "stalled": self._stalled, "applied_gen": self._applied_gen,
            "holdings": self._holdings, "gpu_holdings": self._gpu_holdings, "model": self._model,
            "routing": {name: [list(r) for r in hist] for name, hist in self._routing.items()},
            "last_step": self._last_step, "last_rebalance_step": self._last_rebalance_step,
            "done": sorted(self._done), "left": sorted(self._left), "finished": self._finished,
            "gpus_per_node": self.gpus_per_node, "saved_at": time.time(),
        }

    def _save_state(self, now: bool = False) -> None:
        """Persist the state: at once (plans, done), or coalesced within a second."""
        if self.config.state_dir is None or self._loop is None:
            return
        if not now:
            if self._save_timer is None:
                self._save_timer = self._loop.call_later(1.0, self._save_state, True)
            return
        if self._save_timer is not None:
            self._save_timer.cancel()
            self._save_timer = None
        from ._state import write_state

        try:
            write_state(self.config.state_dir, self._state_dict())
            self._state_error_logged = False
        except OSError as exc:  # keep running: the job is fine, only a restart would lose ground
            if not self._state_error_logged:
                self._state_error_logged = True
                self._event("state_write_failed", level=logging.ERROR, state_dir=str(self.config.state_dir),
                            error=str(exc))

    def _restore_state(self, state: dict[str, Any]) -> None:
        """Take over a saved state (called before serving)."""
        self.epoch = int(state["epoch"]) + 1
        self.generation = int(state["generation"])
        try:
            self._plan = None if state["plan"] is None else Plan.from_wire(state["plan"])
        except MalformedMessageError as exc:
            raise ValueError(f"state_dir: {self.config.state_dir}: field 'plan': {exc}") from None
        self._members = list(state["members"])
        self._stalled = bool(state["stalled"])
        self._applied_gen = int(state["applied_gen"])
        self._holdings = {str(n): {str(k): [int(x) for x in v] for k, v in layers.items()}
                          for n, layers in state["holdings"].items() if isinstance(layers, dict)}
        # absent in states written before plans carried a per-GPU split
        self._gpu_holdings = {str(n): {str(k): [[int(x) for x in gpu] for gpu in v] for k, v in layers.items()}
                              for n, layers in (state.get("gpu_holdings") or {}).items() if isinstance(layers, dict)}
        self._model = state["model"]
        window = self.config.routing_window
        self._routing = {str(k): deque([[float(x) for x in r] for r in hist][-window:], maxlen=window)
                         for k, hist in state["routing"].items() if isinstance(hist, list)}
        self._last_step = state["last_step"]
        self._last_rebalance_step = int(state["last_rebalance_step"])
        self._done = set(state["done"]) & set(self._members)
        self._left = set(state["left"])
        g = state.get("gpus_per_node")   # absent in states written before several workers per node
        self.gpus_per_node = g if isinstance(g, int) and not isinstance(g, bool) and g >= 1 else None
        if self._members:
            self._resuming = True
            self._resume_waiting = set(self._members) - self._done
            self._resume_started = time.time()

    def _start_resume(self) -> None:
        """Once serving: give the members ``resume_grace`` to come back."""
        if not self._resuming:
            return
        assert self._loop is not None
        self._resume_serving = time.time()
        self._event("resuming", generation=self.generation, members=self._members,
                    waiting=sorted(self._resume_waiting), epoch=self.epoch,
                    grace_s=self.config.resume_grace.total_seconds())
        self._resume_timer = self._loop.call_later(self.config.resume_grace.total_seconds(), self._end_resume)
        if not self._resume_waiting:
            self._end_resume()

    # ------------------------------------------------------------------ agents coming back
    def _on_resume(self, conn: _Conn, node_id: str, slots: int | None, pid: int | None,
                   r: dict[str, Any], nproc: int = 1) -> bool:
        """Registration of an agent that lost its controller connection and kept its worker."""
        inc = _req(r, "incarnation", int)
        alive = _req(r, "worker_alive", bool)
        ready = _req(r, "worker_ready", bool)
        worker_pid = _req(r, "worker_pid", int, optional=True)
        worker_pids = _req(r, "worker_pids", list, optional=True) or []
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in worker_pids):
            raise MalformedMessageError("register: resume.worker_pids must be a list of integers")
        plan_gen = _req(r, "plan_generation", int)
        done = _req(r, "done", bool)
        leaving = bool(_req(r, "leaving", bool, optional=True))
        step = _req(r, "step", int, optional=True)
        model = r.get("model") or {}
        if not isinstance(model, dict):
            raise MalformedMessageError("register: resume.model must be an object")
        if ready and self._model is not None and model.get("layers") != self._model.get("layers"):
            self._event("model_mismatch", level=logging.ERROR, node=node_id, layers=model.get("layers"))
            ready = False
        conn.node_id = node_id
        node = _Node(node_id, conn, slots or self.config.slots_per_node, inc, pid, time.monotonic(), nproc=nproc)
        node.ready = alive and ready
        node.worker_pid = worker_pid if alive else None
        node.store = store_address(r.get("store")) if alive else None
        node.step = step
        node.leaving = leaving
        self._nodes[node_id] = node
        member = node_id in self._members
        planned = self._plan.incarnations.get(node_id) if self._plan is not None else None
        same = member and alive and inc == planned
        self._event("node_resumed", node=node_id, peer=conn.peer, incarnation=inc, planned_incarnation=planned,
                    worker_alive=alive, worker_ready=ready, plan_generation=plan_gen, step=step, done=done,
                    member=member, same_worker=same, generation=self.generation, nproc=nproc,
                    worker_pids=worker_pids if alive else [])
        self._send_conn(conn, {"type": "registered", "node": node_id, "slots": self.config.slots_per_node,
                               "heartbeat_timeout_s": self.config.heartbeat_timeout.total_seconds(),
                               "resumed": True})
        if self._finished:
            self._send_conn(conn, {"type": "shutdown", "reason": "done"})
            return True
        if member:
            self._resume_waiting.discard(node_id)
            self._resume_back.append(node_id)
            if done:
                self._done.add(node_id)
                self._save_state(now=True)
            elif same:
                if plan_gen < self.generation and self._plan is not None:
                    self._send(node_id, self._plan.to_wire())   # it may never have got the newest plan
            else:
                # the worker this plan counts on is gone (crashed, or replaced) while we were away
                self._declare_failure(node_id, "worker_lost_while_away", incarnation=inc,
                                      planned_incarnation=planned)
                if alive and plan_gen > 0:
                    self._evict(node)
            if self._resuming and not self._resume_waiting:
                # let the reports it queued (collective errors, progress) arrive first
                self._resume_timer_reset(max(self.config.failure_grace.total_seconds(), 0.2))
            self._check_done()
            return True
        if leaving or node_id in self._left:
            self._send_conn(conn, {"type": "shutdown", "reason": "leave"})
        elif done:
            self._send_conn(conn, {"type": "shutdown", "reason": "done"})
        elif alive and plan_gen > 0:
            self._evict(node)     # a worker of an older generation: restart it as a fresh joiner
        elif node.ready:
            if not self._members and not self._stalled:
                self._schedule_start()
            else:
                self._add_join(node_id)
        return True

    def _evict(self, node: _Node) -> None:
        node.dead = True
        node.ready = False
        if not node.evict_sent:
            node.evict_sent = True
            self._event("evicted", node=node.node_id, peer=node.conn.peer)
            self._send_conn(node.conn, {"type": "evicted", "node": node.node_id})

    def _resume_broken(self) -> None:
        """A member that is back reported a broken collective of the current generation:
        training has stopped, so a member still missing is most likely dead; it has
        ``resume_broken_grace`` from the moment the controller served again, not the
        whole ``resume_grace`` (never later than the timer already set)."""
        if not self._resuming or not self._resume_waiting or self._resume_serving is None:
            return
        assert self._loop is not None
        grace = min(self.config.resume_broken_grace, self.config.resume_grace).total_seconds()
        delay = max(0.0, self._resume_serving + grace - time.time())
        timer = self._resume_timer
        if timer is None or self._loop.time() + delay < timer.when():
            self._event("resume_shortened", waiting=sorted(self._resume_waiting), in_s=round(delay, 3),
                        generation=self.generation)
            self._resume_timer_reset(delay)

    def _resume_timer_reset(self, delay: float) -> None:
        assert self._loop is not None
        if self._resume_timer is not None:
            self._resume_timer.cancel()
        self._resume_timer = self._loop.call_later(delay, self._end_resume)

    def _end_resume(self) -> None:
        """Every member is back (or ``resume_grace`` passed): one plan for what happened."""
        if not self._resuming:
            return
        self._resuming = False
        if self._resume_timer is not None:
            self._resume_timer.cancel()
            self._resume_timer = None
        for t in (self._failure_timer, self._collective_timer):
            if t is not None:
                t.cancel()
        self._failure_timer = self._collective_timer = None
        missing = sorted(self._resume_waiting)
        self._resume_waiting.clear()
        for m in missing:
            self._event("node_failed", node=m, cause="not_back_after_restart", generation=self.generation)
        lost = [m for m in self._members if m not in self._done
                and (m in missing or m in self._lost or not self._eligible(m))]
        self._lost.clear()
        self._detected_at = None
        survivors = [m for m in self._members if m not in lost]
        unapplied = self._applied_gen < self.generation
        collective, self._resume_collective = self._resume_collective, False
        started = self._resume_started or time.time()
        self._event("resumed", generation=self.generation, back=sorted(self._resume_back), missing=missing,
                    lost=lost, collective_error=collective, unapplied_plan=unapplied,
                    waited_s=round(time.time() - started, 3))
        if self._check_done():
            return
        if lost:
            self._issue("failure", "immediate", survivors, lost=lost, detected_at=started)
        elif collective:
            self._issue("collective_error", "immediate", survivors, detected_at=started)
        elif unapplied:
            # the newest plan was in flight when the controller died and is still not applied
            # (a member never got it, or its store was the controller's): some members may be
            # stuck in its rendezvous; re-form everyone on a new plan
            self._issue("resume", "immediate", survivors, detected_at=started)
        else:
            self._maybe_between_steps()
