"""A controller that survives its own restart: its state saved, and the job resumed.

The state that decides plans (generation, members, the newest plan, what every member
holds, routing history, who is done or has left) is saved atomically to the state
directory (:mod:`._state`) by a :class:`StateSaver`. A controller started again with the
same command line finds it and *resumes* (:class:`Resume`, which the controller owns and
which acts on its :class:`~._membership.Membership` through public methods):

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

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .._config import ControllerConfig
from .._wire import MalformedMessageError, store_address
from ._membership import Membership
from ._port import Node, Port, Scheduler, Timer, msg_field
from ._state import encode_state, write_state

__all__ = ["Resume", "ResumeRecord", "StateSaver"]


class StateSaver:
    """Writes the controller's state to its state directory: at once (plans, done), or
    coalesced within a second (routing history, steps). A failed write is recorded once
    (until one succeeds again) and does not stop the job: only a restart would lose ground.

    A coalesced write is encoded on the event loop (a consistent snapshot) and written,
    fsync included, by a thread: the fsync of a large cluster's state (30-60 ms for 1,024
    nodes here, more on a busy disk) would hold every agent's messages meanwhile. Writes
    are ordered: one never replaces the file with an older state than the last written."""

    def __init__(self, directory: str | os.PathLike[str] | None, snapshot: Callable[[], dict[str, Any]], *,
                 call_later: Scheduler, on_error: Callable[[OSError], None]) -> None:
        self.directory = directory
        self._snapshot = snapshot
        self._call_later = call_later
        self._on_error = on_error
        self._timer: Timer | None = None
        self._error_logged = False
        self._lock = threading.Lock()
        self._seq = 0          # snapshots taken
        self._written = 0      # the newest snapshot written

    @property
    def pending(self) -> bool:
        """A coalesced write is due."""
        return self._timer is not None

    def save(self, now: bool = False) -> None:
        if self.directory is None:
            return
        if not now:
            if self._timer is None:
                self._timer = self._call_later(1.0, self._save_in_background)
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._write(self._encode())

    def _encode(self) -> tuple[int, bytes]:
        self._seq += 1
        return self._seq, encode_state(self._snapshot())

    def _save_in_background(self) -> None:
        self._timer = None
        threading.Thread(target=self._write, args=(self._encode(),), name="lazarus-state", daemon=True).start()

    def _write(self, snap: tuple[int, bytes]) -> None:
        seq, data = snap
        assert self.directory is not None
        with self._lock:
            if seq < self._written:   # a newer state was written meanwhile
                return
            try:
                write_state(self.directory, data)
                self._written = seq
                self._error_logged = False
            except OSError as exc:  # keep running: the job is fine, only a restart would lose ground
                if not self._error_logged:
                    self._error_logged = True
                    self._on_error(exc)


@dataclass(frozen=True)
class ResumeRecord:
    """The ``resume`` record of an agent registering again after losing its controller
    connection (it kept its worker)."""

    incarnation: int
    worker_alive: bool
    worker_ready: bool
    worker_pid: int | None
    worker_pids: list[int]
    plan_generation: int
    done: bool
    leaving: bool
    step: int | None
    model: dict[str, Any]
    raw: dict[str, Any]

    @classmethod
    def from_msg(cls, r: dict[str, Any]) -> ResumeRecord:
        """Raises :class:`MalformedMessageError` on a missing or wrong field."""
        inc = msg_field(r, "incarnation", int)
        alive = msg_field(r, "worker_alive", bool)
        ready = msg_field(r, "worker_ready", bool)
        worker_pid = msg_field(r, "worker_pid", int, optional=True)
        worker_pids = msg_field(r, "worker_pids", list, optional=True) or []
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in worker_pids):
            raise MalformedMessageError("register: resume.worker_pids must be a list of integers")
        plan_gen = msg_field(r, "plan_generation", int)
        done = msg_field(r, "done", bool)
        leaving = bool(msg_field(r, "leaving", bool, optional=True))
        step = msg_field(r, "step", int, optional=True)
        model = r.get("model") or {}
        if not isinstance(model, dict):
            raise MalformedMessageError("register: resume.model must be an object")
        return cls(inc, alive, ready, worker_pid, worker_pids, plan_gen, done, leaving, step, model, r)


class Resume:
    """A restarted controller waiting for its members to come back; see the module
    docstring. Inactive (``membership.resuming`` False) on a fresh start."""

    def __init__(self, config: ControllerConfig, membership: Membership, port: Port) -> None:
        self.config = config
        self.membership = membership
        self.port = port
        self._waiting: set[str] = set()
        self._back: list[str] = []
        self._started: float | None = None
        self._serving: float | None = None   # when the restarted controller served again
        self._collective = False
        self._timer: Timer | None = None

    def restore(self, state: dict[str, Any]) -> None:
        """Take over a saved state (called before serving): the view, and, with members,
        wait for them."""
        m = self.membership
        m.restore(state)
        if m.members:
            m.resuming = True
            self._waiting = set(m.members) - m.done
            self._started = time.time()

    def start(self, epoch: int) -> None:
        """Once serving: give the members ``resume_grace`` to come back."""
        m = self.membership
        if not m.resuming:
            return
        self._serving = time.time()
        self.port.event("resuming", generation=m.generation, members=m.members,
                        waiting=sorted(self._waiting), epoch=epoch,
                        grace_s=self.config.resume_grace.total_seconds())
        self._timer = self.port.call_later(self.config.resume_grace.total_seconds(), self.end)
        if not self._waiting:
            self.end()

    def cancel(self) -> None:
        """The controller stops."""
        if self._timer is not None:
            self._timer.cancel()

    # ------------------------------------------------------------------ agents coming back
    def admit(self, node_id: str, peer: str, slots: int | None, pid: int | None, r: ResumeRecord,
              nproc: int = 1) -> tuple[Node, ResumeRecord]:
        """The record of a node coming back (not in the view yet: :meth:`on_back`), and
        ``r`` as the job takes it (a worker whose model is not the job's is not ready)."""
        ready = r.worker_ready
        model = self.membership.model
        if ready and model is not None and r.model.get("layers") != model.get("layers"):
            self.port.event("model_mismatch", level=logging.ERROR, node=node_id, layers=r.model.get("layers"))
            ready = False
            r = replace(r, worker_ready=False)
        alive = r.worker_alive
        node = Node(node_id, peer, slots or self.config.slots_per_node, r.incarnation, pid, time.monotonic(),
                    nproc=nproc)
        node.ready = alive and ready
        node.worker_pid = r.worker_pid if alive else None
        node.store = store_address(r.raw.get("store")) if alive else None
        node.step = r.step
        node.leaving = r.leaving
        return node, r

    def on_back(self, node: Node, r: ResumeRecord) -> None:
        """A node registered again with a ``resume`` record (what :meth:`admit` gave,
        the node now connected): take it back, fail it, evict it, or let it join."""
        m = self.membership
        node_id, inc, alive, plan_gen, done = node.node_id, r.incarnation, r.worker_alive, r.plan_generation, r.done
        m.add(node)
        member = node_id in m.members
        planned = m.plan.incarnations.get(node_id) if m.plan is not None else None
        same = member and alive and inc == planned
        self.port.event("node_resumed", node=node_id, peer=node.peer, incarnation=inc, planned_incarnation=planned,
                        worker_alive=alive, worker_ready=r.worker_ready, plan_generation=plan_gen, step=r.step,
                        done=done, member=member, same_worker=same, generation=m.generation, nproc=node.nproc,
                        worker_pids=r.worker_pids if alive else [])
        self.port.send(node_id, {"type": "registered", "node": node_id, "slots": self.config.slots_per_node,
                                 "heartbeat_timeout_s": self.config.heartbeat_timeout.total_seconds(),
                                 "resumed": True})
        if m.finished:
            self.port.send(node_id, {"type": "shutdown", "reason": "done"})
            return
        if member:
            self._waiting.discard(node_id)
            self._back.append(node_id)
            if done:
                m.done.add(node_id)
                self.port.save_state(now=True)
            elif same:
                if plan_gen < m.generation and m.plan is not None:
                    self.port.send(node_id, m.plan.to_wire())   # it may never have got the newest plan
            else:
                # the worker this plan counts on is gone (crashed, or replaced) while we were away
                m.declare_failure(node_id, "worker_lost_while_away", incarnation=inc,
                                  planned_incarnation=planned)
                if alive and plan_gen > 0:
                    m.evict(node_id)
            if m.resuming and not self._waiting:
                # let the reports it queued (collective errors, progress) arrive first
                self._reset_timer(max(self.config.failure_grace.total_seconds(), 0.2))
            m.check_done()
            return
        if r.leaving or node_id in m.left:
            self.port.send(node_id, {"type": "shutdown", "reason": "leave"})
        elif done:
            self.port.send(node_id, {"type": "shutdown", "reason": "done"})
        elif alive and plan_gen > 0:
            m.evict(node_id)     # a worker of an older generation: restart it as a fresh joiner
        elif node.ready:
            m.offer(node_id)

    def on_collective(self, current: bool) -> None:
        """A collective error's grace passed while resuming (``current``: of the current
        generation): planned for once the members are back."""
        self._collective = current
        if current:
            self._broken()

    def _broken(self) -> None:
        """A member that is back reported a broken collective of the current generation:
        training has stopped, so a member still missing is most likely dead; it has
        ``resume_broken_grace`` from the moment the controller served again, not the
        whole ``resume_grace`` (never later than the timer already set)."""
        if not self.membership.resuming or not self._waiting or self._serving is None:
            return
        grace = min(self.config.resume_broken_grace, self.config.resume_grace).total_seconds()
        delay = max(0.0, self._serving + grace - time.time())
        timer = self._timer
        if timer is None or self.port.time() + delay < timer.when():
            self.port.event("resume_shortened", waiting=sorted(self._waiting), in_s=round(delay, 3),
                            generation=self.membership.generation)
            self._reset_timer(delay)

    def _reset_timer(self, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.port.call_later(delay, self.end)

    def end(self) -> None:
        """Every member is back (or ``resume_grace`` passed): one plan for what happened."""
        m = self.membership
        if not m.resuming:
            return
        m.resuming = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        failed = m.take_failures()
        missing = sorted(self._waiting)
        self._waiting.clear()
        for n in missing:
            self.port.event("node_failed", node=n, cause="not_back_after_restart", generation=m.generation)
        members = m.members
        lost = [n for n in members if n not in m.done
                and (n in missing or n in failed or not m.eligible(n))]
        survivors = [n for n in members if n not in lost]
        unapplied = m.applied_gen < m.generation
        collective, self._collective = self._collective, False
        started = self._started or time.time()
        self.port.event("resumed", generation=m.generation, back=sorted(self._back), missing=missing,
                        lost=lost, collective_error=collective, unapplied_plan=unapplied,
                        waited_s=round(time.time() - started, 3))
        if m.check_done():
            return
        if lost:
            m.issue("failure", "immediate", survivors, lost=lost, detected_at=started)
        elif collective:
            m.issue("collective_error", "immediate", survivors, detected_at=started)
        elif unapplied:
            # the newest plan was in flight when the controller died and is still not applied
            # (a member never got it, or its store was the controller's): some members may be
            # stuck in its rendezvous; re-form everyone on a new plan
            m.issue("resume", "immediate", survivors, detected_at=started)
        else:
            m.maybe_between_steps()
