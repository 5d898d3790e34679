"""Applying a controller plan inside a running training process.

1. Retire the broken (or superseded) process group and moc manager, keeping the moc
   buffers (node memory) and bookkeeping for the next manager.
2. Rendezvous on the plan's store prefix: every member adds itself to a counter, then
   ``init_process_group`` on a ``PrefixStore`` of that generation. A newer plan arriving
   meanwhile aborts the wait (:class:`Superseded`).
3. Inventory: each rank's step and the experts it holds, written to the store with the
   rendezvous's arrival and read back with it (worlds up to :data:`STORE_INVENTORY_WORLD`;
   one JSON all-gather otherwise, and on the current group for leaves); what each rank
   then sends is described through the same store (a receiver waits for its senders
   only). The state
   of the newest step wins: ranks behind it (joiners, or ranks that did not apply the
   step that broke) receive the dense modules from a rank at that step; every expert a
   rank must hold under the new plan and lacks comes from a surviving holder, the fetches
   of one expert rotating over its holders; one all-to-all moves them all.
4. Install: re-drive every MoE layer with its new placement, rebuild the optimizer (state
   carried over by parameter), load the received units. A joiner of a between-steps join
   built its model before step 2 (:meth:`Reconfigurer._prepare_join`: for the rank the
   plan gives it, while the members kept training; they switch to the plan only once
   every joiner counted itself prepared, :meth:`Reconfigurer.joiners_prepared`); any other
   joiner builds it here, which takes seconds on a loaded machine. When the plan has
   joiners, every member then meets at a barrier on the controller's store, bounded by
   ``rendezvous_timeout``, so that no survivor waits for a joiner in a collective bounded
   by the much shorter ``collective_timeout``.
5. A new moc manager on the new group (it adopts the old one's buffers and counters);
   experts with no surviving replica come from moc. ``ElasticConfig.lost_experts``:
   ``"restore"``: peer memory first, storage last, PLT booked; ``"replay"`` (an exact
   moc): every rank rolls back to the newest committed exact window's first step + 1,
   restoring every unit it now holds by name (``restore(reshard=True)``), and the loop
   replays the window (PLT 0); also when the previous generation was cut mid-replay.

Graceful changes (join, leave, rebalance) arrive as between-steps plans. When the new
members are a subset of the current ones (a leave or a rebalance) the state moves on the
current group first, so a leaving node can hand its experts over before it goes.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, cast
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch import nn

from lazarus.moe import moe_layers
from lazarus.moe._placement import rank_slots
from lazarus.planning import Placement
from moc import CheckpointManager, UnitSpec
from storage_backends import open_store
from moc.elastic import apply_partial, capture_unit, discover_units

from .._plan import Plan, Superseded
from ._abort import GroupAborter, SocketTracker, nccl_errors, release_in_background, reset_group_names
from ._backend import nccl_init_kwargs
from ._join_gate import JoinGate
from ._moc_groups import MocGroups
from ._plan_feed import latest_plan
from ._reform import (ReformChoice, abort_quietly, agree_on_shrink, attach_nccl, reform_for_plan, shrink_for_plan,
                      trainer_shrink_available)
from ._rendezvous_store import StoreClients
from ._transfer import StoreBoard, choose_moves, exchange_units, read_all, unit_needs, world_comm
from ._worker_state import StateDraft, WorkerContext, WorkerState, carry_state

__all__ = ["Reconfigurer", "Superseded"]

log = logging.getLogger("lazarus.reconfigure")


#: Largest world whose inventory travels through the rendezvous store (each rank writes
#: its entry as it arrives and reads every entry once all have arrived: no collective
#: round after the group forms, 10-25 ms of every member's wait on 2 loaded cores). Past
#: it the store would serve world x world entries from one server: an all-gather's ring
#: spreads that load instead.
STORE_INVENTORY_WORLD = 64


class Reconfigurer:
    """Applies plans to a worker's :class:`WorkerState` (:meth:`apply`): it never holds
    the trainer, only what it needs of it. ``config``: the worker's :class:`.ElasticConfig`;
    ``context``: its node, backend, layout, agent channel and metrics callback;
    ``build_model`` / ``make_optimizer``: the user's (see :class:`.ElasticTrainer`).
    Owns its parts: :attr:`stores` (the plans' store clients), :attr:`gate` (joins
    prepared while the members train), :attr:`moc_groups` (moc's groups formed in a
    thread) and :attr:`aborter` (the current group's teardown)."""

    def __init__(self, config: Any, *, context: WorkerContext, build_model: Callable,
                 make_optimizer: Callable) -> None:
        self.config = config
        self.ctx = context
        self.build_model = build_model
        self.make_optimizer = make_optimizer
        self.handover = None
        self.unrestored: set[str] = set()   # lost experts not yet restored from moc
        self._pending_lost_mine: set[str] = set()
        self._joiners = 0   # members of the plan being applied that arrive without a model (they build it)
        self._dense: list[nn.Parameter] | None = None
        self.stores = StoreClients(config, where=context.where, channel=context.channel)
        self.group_store: tuple[Any, ...] | None = None   # the store the current group formed on
        self._hosted: dist.TCPStore | None = None   # the rendezvous store this worker hosts (host_store)
        self.aborter = GroupAborter(context.backend.backend)
        self.sockets = self.aborter.sockets    # gloo connections opened by our groups
        self._superseded = threading.Event()  # set while applying a plan once a newer one arrived
        self._form_failures = 0   # group formations in a row that failed with no newer plan meanwhile (_form_timeout)
        self.moc_groups = MocGroups(config, where=context.where, sockets=self.sockets,
                                    superseded=self._superseded, stores=self.stores)
        self.gate = JoinGate(config, where=context.where, stores=self.stores)
        # A joiner's model built before its group formed (see _prepare_join): it holds no
        # trained state until the plan's transfer is installed.
        self.stateless = False
        self.rollback: dict[str, Any] | None = None   # what the newest plan's rollback did (lost_experts="replay")
        # ElasticConfig.reform: can this process shrink an NCCL communicator at all?
        self.shrink_available = trainer_shrink_available(getattr(config, "reform", "auto"), context.backend.backend)
        self.last_reform: ReformChoice | None = None   # how the newest plan's group was formed (tests, logs)

    def _prepare_join(self, s: StateDraft, plan: Plan) -> None:
        """A joiner, before the plan's rendezvous: build the model for its rank of the plan
        while the members still train (:meth:`._join_gate.JoinGate.build`), then count
        itself prepared on the store the plan's group forms on (either way)."""
        rank, world = self._plan_position(plan)
        t0 = time.time()
        if s.model is None:
            s.model = self.gate.build(rank, world, lambda: self.build_model(self._placements(plan)), self.ctx.device)
            if s.model is not None:
                self.stateless = True
        self.gate.announce(plan, rank, world, t0, built=s.model is not None)

    def joiners_prepared(self, plan: Plan, step: int) -> bool:
        """A member, at a step boundary (``step``: its next): may it switch to ``plan`` now
        (:meth:`._join_gate.JoinGate.joiners_prepared`)?"""
        return self.gate.joiners_prepared(plan, step)

    def _plan_position(self, plan: Plan) -> tuple[int, int]:
        """(this worker's rank, the world size) in ``plan``."""
        return plan.rank(self.ctx.node, self.ctx.local_rank, self.ctx.local_world), plan.world

    # -- groups ----------------------------------------------------------------------------
    def retire_group(self, state: WorkerState, planned: bool = False) -> WorkerState:
        """Retire the moc manager (keep its buffers) and tear the process group down;
        returns ``state`` without its manager. ``planned``: every member retires this
        healthy group together at a step boundary (a between-steps plan), so nothing waits
        on its sockets closing and the full garbage collection that forces them closed
        after a failure is skipped (it costs 0.7-1.3 s on 2 loaded cores, all of it
        members' waiting time). On an error the state reached goes with it
        (:func:`._worker_state.state_after`)."""
        s = StateDraft(state)
        del state   # the draft holds it alone (see apply)
        try:
            self._retire(s, planned)
        except BaseException as exc:
            carry_state(exc, s.freeze())
            raise
        return s.freeze()

    def _retire(self, s: StateDraft, planned: bool = False) -> None:
        if not dist.is_initialized() and s.ckpt is None:
            return   # retired already (a failure retires before waiting for the plan)
        # Abort the NCCL communicators and shut the gloo sockets down first: every peer's
        # pending operation (training thread, or moc's snapshot/persist threads) fails at
        # once instead of waiting out its timeout, and so do this process's own background
        # threads. NCCL groups are then aborted, never destroyed (that can hang).
        t0 = time.time()
        retired: list[Any] = []   # freed off this thread (see release_in_background)
        settle: list[Callable[[], Any]] = []
        report = None
        if dist.is_initialized():
            report = self.aborter.retire()
            retired.extend(self.aborter.take_retired())   # their destructors: ~10 ms a group
        else:
            self.aborter.interrupt()
        t1 = time.time()
        if not planned:
            gc.collect()  # drop the last references so the broken group's sockets close now
        t2 = time.time()
        if s.ckpt is not None:
            try:
                self.handover = s.ckpt.detach()
            except Exception as exc:  # noqa: BLE001
                log.warning("node %s: moc detach failed: %s", self.ctx.where, exc)
            retired.append(s.ckpt)
            settle.append(s.ckpt.join_threads)   # its daemon threads let go of it first
            s.ckpt = None
        if self.moc_groups.live is not None:   # moc's private groups (their sockets are shut already)
            self.moc_groups.live.destroy()
            retired.append(self.moc_groups.live)
            self.moc_groups.live = None
        if retired:
            release_in_background(retired, name=f"lazarus-release-{s.generation}", settle=settle)
        group = ("none" if report is None else
                 f"{report.backend} {report.teardown or 'none'}, {report.nccl_aborted} NCCL communicators aborted, "
                 f"{report.sockets_shut} connections shut")
        log.info("node %s step %d gen %d: retired in %.3f s (group %.3f: %s; gc %.3f, moc detach %.3f)", self.ctx.where,
                 s.step, s.generation, time.time() - t0, t1 - t0, group, t2 - t1, time.time() - t2)

    def host_store(self) -> dict[str, Any] | None:
        """Host this node's rendezvous store (local rank 0, when the agent says at which
        address others reach it): every generation whose first member is this node forms
        its group on it, so a join, a leave or a failure's group forms even while the
        controller is away (restarting). Returns ``{"host", "port"}`` for the hello; None
        when this worker hosts none (plans then name the controller's store)."""
        host = getattr(self.ctx.channel, "store_host", None)
        if not host or self.ctx.local_rank != 0:
            return None
        hosted = self._hosted
        if hosted is None:
            hosted = self._hosted = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                                  timeout=self.config.rendezvous_timeout)
            SocketTracker.protect_port(hosted.port)   # its connections are the other members'
            log.info("node %s step -: hosting a rendezvous store on %s:%d", self.ctx.where, host, hosted.port)
        return {"host": host, "port": int(hosted.port)}

    def _rendezvous(self, s: StateDraft, plan: Plan, inventory: dict[str, Any] | None = None, *,
                    shrink: ReformChoice | None = None, shrunk: Any = None) -> list[Any] | None:
        """Form the plan's group; with ``inventory`` (this rank's entry) and a world of at
        most :data:`STORE_INVENTORY_WORLD`, return every rank's entry in rank order, read
        from the store as the rendezvous completes (None: gather it on the group). ``shrunk``:
        this rank's shrunk communicator, used if every member's ``shrink`` worked (:mod:`._reform`)."""
        try:
            return self._rendezvous_inner(s, plan, inventory, shrink, shrunk)
        except BaseException:
            self.stores.drop()   # it may be the store of a controller that died: reconnect next time
            if shrunk is not None:
                abort_quietly(shrunk)
            raise

    def _rendezvous_inner(self, s: StateDraft, plan: Plan, inventory: dict[str, Any] | None,
                          shrink: ReformChoice | None, shrunk: Any) -> list[Any] | None:
        members = plan.members
        rank, world = self._plan_position(plan)
        store = self.stores.client_for(plan.store, plan.generation)
        prefix = plan.prefix
        by_store = inventory is not None and world <= STORE_INVENTORY_WORLD
        if by_store:   # written before the arrival is counted: all are there once all arrived
            store.set(f"{prefix}/inventory/{rank}", json.dumps(inventory))
            self.stores.board_for(plan)   # now: see StoreClients.board_for
        if shrink is not None:   # this rank's shrink outcome, read by all once all arrived
            store.set(f"{prefix}/shrunk/{rank}", "1" if shrunk is not None else "0")
        store.add(f"{prefix}/arrived", 1)
        deadline = time.monotonic() + self.config.rendezvous_timeout.total_seconds()
        while store.add(f"{prefix}/arrived", 0) < world:
            latest = latest_plan(self.ctx.channel)
            if latest is not None and latest.generation > plan.generation:
                raise Superseded()
            if time.monotonic() > deadline:
                raise TimeoutError(f"rendezvous of generation {plan.generation} timed out")
            time.sleep(0.005)
        gathered = None
        if by_store:
            gathered = [json.loads(v) for v in read_all(store, [f"{prefix}/inventory/{r}" for r in range(world)])]
        if shrink is not None:   # every member's shrink succeeded, or none is used
            shrunk = agree_on_shrink(read_all(store, [f"{prefix}/shrunk/{r}" for r in range(world)]), shrunk,
                                     where=f"node {self.ctx.where} rank {rank} step {s.step} gen {plan.generation}")
        reset_group_names()   # a failed earlier attempt may have advanced the names here only
        form = self._form_timeout()
        with self.sockets.track():
            # NCCL: cuda:nccl for device tensors, cpu:gloo for the small host agreements;
            # the watchdog's timeout is the group's (collective_timeout). With the device
            # (nccl_init_kwargs) the NCCL communicator is formed here, eagerly, inside this
            # interruptible rendezvous: init errors surface here, and a newer plan aborts a
            # half-formed (non-blocking) one instead of a first training collective doing it.
            # gloo: formed with the short connect timeout (see _form_timeout), the group's
            # collectives then get collective_timeout.
            try:
                if shrunk is not None:   # the host half only; the CUDA half is the shrunk communicator
                    dist.init_process_group("cpu:gloo", store=dist.PrefixStore(prefix + "/pg", store),
                                            rank=rank, world_size=world, timeout=form)
                    attach_nccl(shrunk, self.ctx.backend.device, self.ctx.backend.init_backend)
                else:
                    dist.init_process_group(self.ctx.backend.init_backend,
                                            store=dist.PrefixStore(prefix + "/pg", store), rank=rank,
                                            world_size=world, timeout=form, **nccl_init_kwargs(self.ctx.backend))
            except Exception:
                # no newer plan meanwhile: a slow member (or a death not yet planned): wait longer next time
                if not self._superseded.is_set():
                    self._form_failures += 1
                    log.warning("node %s step %d: the group of generation %s did not form within %.2f s per member; "
                                "the next attempt waits %.2f s", self.ctx.where, s.step, plan.generation,
                                form.total_seconds(), self._form_timeout().total_seconds())
                raise
        self._form_failures = 0
        if form != self.config.collective_timeout:
            dist.distributed_c10d._set_pg_timeout(self.config.collective_timeout)
        self.aborter.formed()
        if self.ctx.backend.backend == "nccl":
            self._nccl_ready(plan)
        s.rank, s.world, s.members, s.generation = rank, world, list(members), plan.generation
        self.group_store = tuple(sorted(plan.store.items()))
        # what torchrun would say, for user code that reads it (the rank changes with the plan)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), GROUP_RANK=str(members.index(self.ctx.node)),
                          LOCAL_RANK=str(self.ctx.local_rank), LOCAL_WORLD_SIZE=str(self.ctx.local_world))
        return gathered

    def _try_shrink(self, s: StateDraft, plan: Plan) -> tuple[ReformChoice | None, Any]:
        """Shrink the current NCCL communicator for ``plan`` (:mod:`._reform`, the leavers do
        not call this)? ``(choice, this rank's shrunk backend or None)``; ``(None, None)``
        when the plan forms a new one."""
        where = f"node {self.ctx.where} rank {s.rank} step {s.step} gen {s.generation} -> {plan.generation}"
        self.last_reform = choice = reform_for_plan(
            getattr(self.config, "reform", "auto"), backend=self.ctx.backend.backend, available=self.shrink_available,
            members=s.members, world=s.world, plan_members=plan.members, plan_gpus_per_node=plan.gpus_per_node,
            intact=dist.is_initialized() and not self.aborter.interrupted and not nccl_errors(), where=where)
        if not choice.shrink:
            return None, None
        return choice, shrink_for_plan(choice, *self._plan_position(plan), device=self.ctx.device, where=where)

    def _form_timeout(self) -> timedelta:
        """How long ``init_process_group`` waits for any one peer. gloo retries a connection
        to a peer up to 5x its timeout and no socket shutdown stops it: a member that dies
        while the group forms (after arriving at the counter) held the others 5x
        ``collective_timeout`` (25 s in the soak, seed 4) while the next plan waited. Every
        member has arrived before this, so its address and connection are due within
        milliseconds: ``connect_timeout``, 4x longer after each attempt that failed with
        no newer plan meanwhile (a member slowed by load, a slow name lookup), ``collective_timeout`` at
        most. NCCL: ``collective_timeout`` (its communicator is aborted instead)."""
        cfg = self.config
        if self.ctx.backend.backend == "nccl":
            return cfg.collective_timeout
        return min(cfg.connect_timeout * (4 ** min(self._form_failures, 8)), cfg.collective_timeout)

    def _nccl_ready(self, plan: Plan) -> None:
        """Wait until this generation's NCCL communicator works: one all-reduce of one
        element on the device, synchronised. A non-blocking init finishes here (not in the
        first training collective); a peer that died meanwhile makes the watchdog record a
        timeout after ``collective_timeout``, and a newer plan aborts it at once."""
        probe = torch.ones(1, device=self.ctx.device)
        dist.all_reduce(probe)
        torch.cuda.current_stream(self.ctx.device).synchronize()
        errors = nccl_errors()
        if self.aborter.interrupted or errors:
            raise RuntimeError(f"NCCL communicator of generation {plan.generation} failed to form: "
                               f"{errors[0] if errors else 'aborted'}")
        if int(probe.item()) != plan.world:
            raise RuntimeError(f"NCCL communicator of generation {plan.generation} summed {probe.item()} "
                               f"over {plan.world} ranks")

    def _store_barrier(self, plan: Plan, name: str) -> None:
        """Every member of ``plan`` past point ``name``, met on the controller's store (the
        client of this plan's rendezvous), waiting up to ``rendezvous_timeout``. A newer
        plan interrupts the wait (:meth:`_interruptible` shuts the store's sockets)."""
        store = self.stores.client
        if store is None:
            raise RuntimeError(f"barrier {name!r} of generation {plan.generation} without a store client")
        key = f"{plan.prefix}/{name}"
        if store.add(key, 1) == plan.world:
            store.set(key + "/all", "1")
        store.wait([key + "/all"], self.config.rendezvous_timeout)

    @contextmanager
    def _interruptible(self, plan: Plan) -> Iterator[list[int]]:
        """While applying ``plan``: when a newer immediate plan arrives (a member died or
        froze meanwhile), abort the NCCL communicators (formed or forming) and shut down the
        connections opened for this plan (the new group, moc's groups, connects being
        retried) and the store client, so that whatever blocks (``init_process_group``,
        ``new_group``, a store wait, an NCCL kernel) fails now instead of after its
        timeout. An error or timeout NCCL's watchdog records meanwhile aborts the
        communicators too (torch's own async error handling is off). Yields a list that holds
        the newer generation once that happened."""
        interrupted: list[int] = []
        self._superseded.clear()
        before = SocketTracker.open_sockets()
        stop = threading.Event()
        gen = plan.generation

        def watch() -> None:
            while not stop.wait(0.05):
                error = self.aborter.watchdog_error()   # NCCL only: a peer died mid-apply
                if error is not None:
                    n = self.aborter.interrupt_nccl()
                    log.warning("node %s: NCCL watchdog reported %s while applying generation %d; aborted %d "
                                "NCCL communicators", self.ctx.where, error, gen, n)
                if not interrupted:
                    latest = latest_plan(self.ctx.channel)
                    if latest is None or latest.mode != "immediate" or latest.generation <= gen:
                        continue
                    interrupted.append(latest.generation)
                    self._superseded.set()
                    # NCCL: abort the communicator being formed or just formed (a blocked
                    # all-reduce of _nccl_ready, a non-blocking init waiting on a dead peer).
                    self.aborter.interrupt_nccl()
                    n = SocketTracker.shutdown_opened_since(before) + self.stores.sockets.shutdown_all()
                    log.warning("node %s: plan %d arrived while applying generation %d; interrupted %d connections",
                                self.ctx.where, latest.generation, gen, n)
                else:   # connects retried meanwhile
                    SocketTracker.shutdown_opened_since(before)

        th = threading.Thread(target=watch, name=f"lazarus-apply-{gen}", daemon=True)
        th.start()
        try:
            yield interrupted
        finally:
            stop.set()
            self._superseded.clear()
            th.join()
            if interrupted:
                self.stores.drop()   # its connections were shut by the watch: a new client next time

    # -- the plan ----------------------------------------------------------------------------
    def apply(self, plan: Plan, state: WorkerState, t_error: float | None) -> WorkerState:
        """Apply ``plan`` (see the module docstring) to ``state``; returns the new state
        (``state`` itself is left as it was). Raises :class:`Superseded` when a newer
        immediate plan arrived meanwhile (what was blocked is interrupted). Whatever it
        raises carries the state the apply reached (:func:`._worker_state.state_after`):
        the fields written before the failure (a retired manager, the new group's rank,
        an installed model), which the trainer keeps as it did when they were its own."""
        s = StateDraft(state)
        # From here the draft alone holds the state's objects (the caller lent its state,
        # :meth:`._trainer.ElasticTrainer._lend_state`, and CPython hands an argument's
        # reference over to the callee): a manager retired below is released off this
        # thread (release_in_background) and a replaced optimizer freed when replaced, as
        # when they were the trainer's own fields.
        del state
        try:
            with self._interruptible(plan) as interrupted:
                try:
                    self._apply(s, plan, t_error)
                except Exception:
                    self.moc_groups.drop(step=s.step, generation=s.generation)
                    if interrupted:
                        raise Superseded() from None
                    raise
            if interrupted:   # done anyway, but a newer immediate plan replaces it
                raise Superseded()
        except BaseException as exc:
            carry_state(exc, s.freeze())
            raise
        return s.freeze()

    def _apply(self, s: StateDraft, plan: Plan, t_error: float | None) -> None:
        t0 = time.time()
        timings: dict[str, float] = {}
        self.moc_groups.waited = None
        if self.gate.is_prepared_join(plan) and self.ctx.node in plan.joined and (s.model is None or self.stateless):
            self._prepare_join(s, plan)
            timings["prepare"] = time.time() - t0
            t0 = time.time()
        members = list(plan.members)
        leaving = list(plan.leaving)
        in_old = (plan.mode == "between_steps" and dist.is_initialized()
                  and set(members) | set(leaving) <= set(s.members))
        if in_old:
            # Hand-over on the current group (leaves, rebalancing): every holder is here.
            received, lost, newest, stats = self._migrate(s, plan, s.members)
            dist.barrier()
            timings["migrate"] = time.time() - t0
            if self.ctx.node in leaving:
                log.info("node %s: handed over %d units, leaving the job", self.ctx.where, stats["moved"])
                self._retire(s)
                s.left = True
                return
            # A group formed on another store (the one of an earlier controller incarnation)
            # is re-formed on the plan's: moc's groups (and any later new_group) need a live store.
            same_group = members == s.members and tuple(sorted(plan.store.items())) == self.group_store
            if not same_group:
                t1 = time.time()   # members only left: the survivors may shrink the NCCL communicator
                shrink, shrunk = self._try_shrink(s, plan)
                timings["shrink"] = time.time() - t1
                t1 = time.time()
                self._retire(s, planned=True)
                timings["retire"] = time.time() - t1
                t1 = time.time()
                self._rendezvous(s, plan, shrink=shrink, shrunk=shrunk)
                timings["rendezvous"] = time.time() - t1
            elif s.ckpt is not None:
                self.handover = s.ckpt.detach()
                s.ckpt = None
            s.generation = plan.generation
            self.moc_groups.start(plan, rank=s.rank, world=s.world, generation=s.generation)
        else:
            t1 = time.time()
            self._retire(s, planned=plan.mode == "between_steps")
            timings["retire"] = time.time() - t1
            t1 = time.time()
            mine = self._inventory_entry(s)
            inventory = self._rendezvous(s, plan, mine[0])
            timings["rendezvous"] = time.time() - t1
            self.moc_groups.start(plan, rank=s.rank, world=s.world, generation=s.generation)
            t1 = time.time()
            received, lost, newest, stats = self._migrate(s, plan, members, mine=mine, inventory=inventory)
            timings["migrate"] = time.time() - t1
        t1 = time.time()
        self._install(s, plan, received, newest)
        timings["install"] = time.time() - t1
        if self._joiners:
            # moc's groups first: they connect through this process's store client, which the
            # barrier's wait would hold until every rank arrived (a rank whose groups wait on
            # ours, and ours on its barrier: a cycle until the groups' timeout)
            self.moc_groups.wait(step=s.step, generation=s.generation)
            t1 = time.time()
            self._store_barrier(plan, "installed")
            timings["joiners"] = time.time() - t1
        t1 = time.time()
        self.rollback = None
        sources = self._moc(s, lost, fresh_start=newest < 0)
        timings["moc"] = time.time() - t1
        if self.moc_groups.waited is not None:   # part of "moc": waiting for its groups
            timings["moc_groups_wait"] = self.moc_groups.waited
        stats["sources"] = dict(stats["sources"], **sources)
        t_resumed = time.time()
        record = {"kind": "reconfigured", "type": "reconfigured", "generation": s.generation,
                  "reason": plan.reason, "world_size": s.world, "members": members, "step": s.step,
                  "t_error": t_error, "t_plan": plan.issued_at, "detected_at": plan.detected_at,
                  "t_resumed": t_resumed, "timings": timings, "moved": stats["moved"],
                  "same_node_moved": stats.get("same_node_moved", 0),
                  "dense_moves": stats["dense_moves"], "sources": stats["sources"],
                  "lost_experts": sorted(lost), "plt": s.ckpt.plt() if s.ckpt is not None else 0.0,
                  "recovery": None if not lost and self.rollback is None else self.config.lost_experts,
                  "rollback": self.rollback,
                  "fetches": plan.fetches, "recovery_probability": plan.recovery_probability}
        if s.rank == 0:
            self.ctx.channel.send({k: v for k, v in record.items() if k != "kind"})
            self.ctx.metric(record)
        log.info("node %s rank %d/%d gen %d (%s): resumed at step %d in %.3f s; %d experts moved, sources %s; %s",
                 self.ctx.where, s.rank, s.world, s.generation, plan.reason, s.step, t_resumed - t0,
                 stats["moved"], stats["sources"], " ".join(f"{k} {v:.3f}" for k, v in timings.items()))

    # -- inventory and migration -------------------------------------------------------------
    def _held(self, s: StateDraft) -> dict[str, list[int]]:
        if s.model is None or self.stateless:
            return {}
        return {name: [e for e in layer.local_experts if f"expert/{name}/{e}" not in self.unrestored]
                for name, layer in moe_layers(s.model)}

    def _inventory_entry(self, s: StateDraft) -> tuple[dict[str, Any], Any]:
        """This rank's inventory entry (node, step, the units it holds) and its model's unit
        layout (None without state)."""
        model = s.model
        has_state = model is not None and not self.stateless
        layout = discover_units(model) if model is not None and not self.stateless else None
        modules = sorted(u.name for u in layout.modules()) if layout is not None else []
        return ({"node": self.ctx.node, "local": self.ctx.local_rank, "step": s.step if has_state else -1,
                 "experts": self._held(s), "modules": modules, "built": s.model is not None}, layout)

    def _migrate(self, s: StateDraft, plan: Plan, group_members: list[str], *,
                 mine: tuple[dict[str, Any], Any] | None = None, inventory: list[Any] | None = None):
        """Move units so every member of ``plan`` holds what it needs at the newest step.
        Runs on the current group, whose ranks are ``group_members``. ``mine``: this rank's
        inventory entry and layout (:meth:`_inventory_entry`), ``inventory``: every rank's,
        read at the rendezvous (else gathered here)."""
        comm = world_comm()
        entry, layout = mine if mine is not None else self._inventory_entry(s)
        inv = inventory if inventory is not None else comm.gather_json(entry)
        if len(inv) != comm.world or inv[comm.rank] != entry:
            raise RuntimeError(f"inventory of generation {plan.generation} does not match the group: "
                               f"{len(inv)} entries for {comm.world} ranks")
        newest = max(r["step"] for r in inv)
        # A joiner that built its model before the rendezvous (_prepare_join) installs the
        # state at once: only one still to build is waited for at the store barrier.
        self._joiners = sum(1 for r in inv if r["step"] < 0 and not r.get("built"))
        stats: dict[str, Any] = {"moved": 0, "same_node_moved": 0, "dense_moves": 0, "sources": {"peer": 0}}
        self._pending_lost_mine = set()
        if newest < 0:
            return {}, [], newest, stats
        rank_of = {(r["node"], int(r.get("local", 0))): i for i, r in enumerate(inv)}
        per_rank = {layer: rank_slots(p) for layer, p in self._placements(plan).items()}
        g = plan.gpus_per_node
        slots = {rank_of[(plan.members[p // g], p % g)]: {layer: sl[p] for layer, sl in per_rank.items()}
                 for p in range(plan.world)}
        needs, holders = unit_needs(inv, newest, slots)
        moves, missing = choose_moves(needs, holders, [r["node"] for r in inv])
        lost = sorted({u for u, _ in missing if u.startswith("expert/")})
        dense_missing = [u for u, _ in missing if not u.startswith("expert/")]
        if dense_missing:
            raise RuntimeError(f"no rank holds dense units {dense_missing[:3]} at step {newest}")
        trees = {}
        if layout is not None:
            model = s.model
            assert model is not None   # it has a layout
            state = model.state_dict(keep_vars=True)
            params = dict(model.named_parameters())   # once: capture_unit would list them per unit
            for m in moves:
                if m.src == comm.rank and m.unit not in trees:
                    trees[m.unit] = capture_unit(layout.units[m.unit], model, s.optimizer, state=state,
                                                 params=params)
        # read at the rendezvous: the descriptions of what moves go through its store too
        board = (StoreBoard(self.stores.board, f"{plan.prefix}/units", self.config.collective_timeout)
                 if inventory is not None and self.stores.board is not None else None)
        received = exchange_units(moves, trees, comm, device=self.ctx.backend.transfer_device, board=board)
        stats["moved"] = sum(1 for m in moves if m.unit.startswith("expert/"))
        # expert copies that moved between two GPUs of one node (never over the network)
        stats["same_node_moved"] = sum(1 for m in moves if m.unit.startswith("expert/")
                                       and inv[m.src]["node"] == inv[m.dst]["node"])
        stats["dense_moves"] = sum(1 for m in moves if not m.unit.startswith("expert/"))
        stats["sources"]["peer"] = stats["moved"]
        # Units this rank must get from moc (no surviving replica anywhere).
        self._pending_lost_mine = {u for u, dst in missing if dst == comm.rank}
        return received, lost, newest, stats

    def _placements(self, plan: Plan) -> dict[str, Placement]:
        """The plan's per-layer placements: rows per node, spread over its G ranks as the
        plan's ``gpus`` split says (round-robin in plans without one)."""
        g = plan.gpus_per_node
        split = plan.gpus or {}
        return {layer: Placement([list(s) for s in slots], num_experts=int(self.ctx.layout["layers"][layer]),
                                 gpus_per_node=g, gpus=split.get(layer) if g > 1 else None)
                for layer, slots in plan.layers.items()}

    def _install(self, s: StateDraft, plan: Plan, received: dict[str, Any], newest: int) -> None:
        me = s.rank
        placements = self._placements(plan)
        carried: list[Any] = []
        if s.model is None:
            s.model = self.build_model(placements).to(self.ctx.device)
        else:
            layout = None
            for name, layer in moe_layers(s.model):
                new = placements[name]
                held = layer.local_experts
                mine = rank_slots(new)[me]
                added = sorted(set(mine) - set(held))
                keep = sorted(set(mine) & set(held))
                if layer.experts.fused and (added or len(keep) < len(held)):
                    # Fused expert tensors are rebuilt with the new rows: carry the kept
                    # experts' weights and optimizer state over as units (views of the old
                    # tensors, applied to the new ones below).
                    if layout is None:
                        layout = discover_units(s.model)
                        state = s.model.state_dict(keep_vars=True)
                        params = dict(s.model.named_parameters())
                    carried += [capture_unit(cast(UnitSpec, layout.expert_unit(name, e)), s.model, s.optimizer,
                                             state=state, params=params) for e in keep]
                # Placeholders: the received units (below) and moc (for lost experts) overwrite them.
                layer.set_placement(new, expert_states=layer.initial_expert_states(added))
        old = s.optimizer
        s.optimizer = self.make_optimizer(s.model)
        if old is not None:
            for p in s.model.parameters():
                if p in old.state:
                    s.optimizer.state[p] = old.state[p]
        apply_partial(s.model, s.optimizer, [*carried, *received.values()])
        self.unrestored |= {u for u in self._pending_lost_mine}
        if newest >= 0:
            s.step = newest
            self.stateless = False   # a prepared joiner's model now holds the newest step
        self._dense = None

    def probe_storage(self) -> None:
        """Reach the checkpoint storage once, before this worker joins a group (outside every
        collective): a wrong bucket or credentials fail here with storage's own error; an S3
        endpoint that is down or hung right now is only logged. The managers built in
        reconfigurations then open it without probing it (``check=False``): opening storage
        inside a reconfiguration held the other ranks' collective past its timeout while S3
        hung, and every new plan failed the same way (issue 28's soak: a join while a
        persist hung stalled the job until the joiner gave up)."""
        cfg = self.config.moc
        if cfg is None or urlsplit(str(cfg.storage)).scheme.lower() not in ("s3", "s3a"):
            return
        if cfg.storage_options.get("check") is False:
            return
        result: list[BaseException | None] = []

        def probe() -> None:
            try:
                open_store(cfg.storage, **cfg.storage_options)
                result.append(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                result.append(exc)

        # A hung endpoint answers nothing for minutes (each attempt waits out the read
        # timeout): wait at most the rendezvous timeout, in a thread that cannot hold the
        # process up at exit.
        limit = self.config.rendezvous_timeout.total_seconds()
        th = threading.Thread(target=probe, name="lazarus-storage-probe", daemon=True)
        th.start()
        th.join(limit)
        exc = result[0] if result else TimeoutError(f"no answer within {limit:.0f} s")
        if exc is not None and not isinstance(exc, (ConnectionError, TimeoutError)):
            raise exc
        if exc is not None:
            log.warning("node %s step -: storage %s unreachable at start (%s); joining anyway, persists will retry",
                        self.ctx.where, cfg.storage, str(exc).splitlines()[0][:200])
        cfg.storage_options = {**cfg.storage_options, "check": False}

    def _moc(self, s: StateDraft, lost: list[str], fresh_start: bool) -> dict[str, int]:
        cfg = self.config.moc
        out = {"memory": 0, "storage": 0}
        if cfg is None:
            if lost:
                raise RuntimeError(f"experts {lost[:4]} lost every replica and no moc checkpoint is configured")
            return out
        cfg_dir = os.environ.get("LAZARUS_SNAPSHOT_DIR") or getattr(self.ctx.channel, "snapshot_dir", None)
        if cfg_dir and cfg.snapshot_dir is None:
            cfg.snapshot_dir = cfg_dir
        self.moc_groups.timeout()
        comm = self.moc_groups.take(step=s.step, generation=s.generation)
        with self.sockets.track():   # moc's own gloo groups (made here if not beforehand)
            s.ckpt = CheckpointManager(cfg, model=cast(nn.Module, s.model), optimizer=s.optimizer,
                                       memory_key=self.ctx.memory_key, handover=self.handover, node=self.ctx.node,
                                       comm=comm, generation=max(0, s.generation))
        self.handover = None
        out = self._moc_state(s, cfg, lost, fresh_start, out)
        # Fence the older generations (a frozen or partitioned member's writes) from the step
        # this one resumes at: rank 0 writes the marker off this thread (storage must not
        # hold up the reconfiguration's collectives), before its first commit at the latest.
        if s.generation >= 1:
            s.ckpt.fence(s.generation, resume_step=s.step, wait=False)
        return out

    def _moc_state(self, s: StateDraft, cfg: Any, lost: list[str], fresh_start: bool,
                   out: dict[str, int]) -> dict[str, int]:
        """Restore what this generation needs from moc (the step, lost experts)."""
        assert s.ckpt is not None
        if fresh_start:
            s.step = s.ckpt.restore(reshard=True) if cfg.exact else s.ckpt.restore()
            self.unrestored.clear()
            self.stateless = False
            return out
        if cfg.exact and (lost or s.ckpt.interrupted_replay):
            self.rollback = self._rollback(s, lost)
            out["storage"] = len(lost)     # a lost expert's state died with its holders: from storage
            return out
        if lost:
            result = s.ckpt.restore_units(lost)
            for unit, r in result.items():
                if r["level"] == "snapshot":
                    out["memory"] += 1
                elif r["level"] == "persist":
                    out["storage"] += 1
            self.unrestored.clear()
        return out

    def _rollback(self, s: StateDraft, lost: list[str]) -> dict[str, Any]:
        """``lost_experts="replay"``: every rank of the new generation restores the units it
        holds now from the newest exact window in storage (its own memory copy where it has
        the same record) and the step goes back to the window's first step + 1; the loop
        then replays the window (moc promotes the units as in any exact restore). Also run
        when the previous generation was itself replaying (its model is half replayed)."""
        assert s.ckpt is not None
        before, t0 = s.step, time.time()
        step = s.ckpt.restore(reshard=True)
        if step == 0:
            raise RuntimeError(f"node {self.ctx.where} step {before}: experts {lost[:4]} lost every replica and "
                               "no exact window is committed to storage yet: nothing to roll back to "
                               "(lost_experts='replay' needs one; persist_every sets how often windows are written)")
        s.step = step
        self.unrestored.clear()
        rep = s.ckpt.status()["exact"]["last_replay"]
        info = {"from_step": before, "to_step": step, "steps": before - step, "window": [rep["start"], rep["end"]],
                "source": rep["source"], "units": rep.get("units"), "checked": rep.get("checked"),
                "cause": "lost_experts" if lost else "interrupted_replay", "seconds": round(time.time() - t0, 4)}
        log.info("node %s rank %d step %d gen %d: rolled back %d steps to the exact window %d-%d (%s; units %s; "
                 "replay check %s) in %.3f s", self.ctx.where, s.rank, step, s.generation, info["steps"], rep["start"],
                 rep["end"], info["cause"], info["units"], "on" if info["checked"] else "off", info["seconds"])
        return info

    # -- helpers -----------------------------------------------------------------------------
    def dense_params(self, model: nn.Module) -> list[nn.Parameter]:
        """Parameters of ``model`` (the current state's) outside the MoE layers
        (data-parallel over all ranks), in name order; cached until the next install."""
        if self._dense is None:
            moe = {id(p) for _, layer in moe_layers(model) for p in layer.parameters()}
            self._dense = [p for _, p in sorted(model.named_parameters()) if id(p) not in moe]
        return self._dense

    @staticmethod
    def digests(model: nn.Module, optimizer: Any, experts: bool = True) -> dict[str, str]:
        """``unit -> digest`` of each expert's (``experts``) or else each dense unit's weights
        and optimizer state."""
        layout = discover_units(model)
        state = model.state_dict(keep_vars=True)
        out = {}
        for name, spec in layout.units.items():
            if (spec.kind == "expert") == experts:
                out[name] = _digest(capture_unit(spec, model, optimizer, state=state))
        return out

    @classmethod
    def dense_digest(cls, model: nn.Module, optimizer: Any) -> str:
        h = hashlib.sha256()
        for name, d in sorted(cls.digests(model, optimizer, experts=False).items()):
            h.update(name.encode())
            h.update(d.encode())
        return h.hexdigest()[:16]


def _digest(tree: Any) -> str:
    h = hashlib.sha256()

    def walk(x: Any, path: str) -> None:
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k], f"{path}/{k}")
        elif isinstance(x, torch.Tensor):
            h.update(path.encode())
            h.update(x.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                     if x.dim() > 0 else x.detach().cpu().reshape(1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{path}={x!r}".encode())

    walk(tree, "")
    return h.hexdigest()[:16]
