"""``ElasticTrainer``: the training-process side of Lazarus.

One trainer runs in every worker process an agent spawns. It owns the model, the
optimizer and the moc checkpoint manager, and drives the step loop::

    zero_grad -> loss_fn(model, step, rank, world) -> backward -> replica gradient sync ->
    one all-reduce (data-parallel gradients, the gradient norm's expert share, the plan
    agreement) -> clip -> optimizer.step() -> moc step -> a new plan, if agreed on

On the first broken collective a survivor reports it, retires its process group and moc
manager (NCCL communicators aborted, gloo sockets shut down: :mod:`._abort`), waits for the
controller's next plan, re-forms the group on that generation's store prefix, and
migrates state (:mod:`._reconfigure`). The backend follows ``ElasticConfig.device``
(:mod:`._backend`). The failed step is discarded
(or kept, where every survivor applied it). Planned changes (joins, graceful leaves,
rebalancing) are agreed on at a step boundary through the step's all-reduce.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import threading
import time
from collections import deque
from typing import IO, Any, Callable, Mapping, cast

import torch
import torch.distributed as dist
from torch import nn

from lazarus.moe import moe_layers
from lazarus.planning import Placement

from .._plan import Plan, Superseded
from ._backend import TrainerBackend, nccl_environment, resolve_backend
from ._elastic_config import ElasticConfig
from ._lazy_dynamo import defer_dynamo_import
from ._plan_feed import latest_plan, wait_plan
from ._progress import ProgressBeat
from ._reconfigure import Reconfigurer
from ._step_reduce import all_reduce_step, clip_total_norm_
from ._worker_state import WorkerContext, WorkerState, state_after

__all__ = ["ElasticTrainer", "is_collective_error"]

log = logging.getLogger("lazarus.trainer")

LossFn = Callable[[nn.Module, int, int, int], torch.Tensor]
BuildModel = Callable[[Mapping[str, Placement]], nn.Module]
MakeOptimizer = Callable[[nn.Module], torch.optim.Optimizer]

_COLLECTIVE = re.compile(r"gloo|nccl|connection|timed? ?out|closed|reset|peer|broken pipe|socket|store|"
                         r"process group|destroy|abort", re.IGNORECASE)

EXIT_NO_PLAN = 75


def is_collective_error(exc: BaseException) -> bool:
    """Does ``exc`` come from a broken collective (a dead or frozen peer) rather than a
    bug in the training code?"""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    return isinstance(exc, RuntimeError) and bool(_COLLECTIVE.search(str(exc)))


class ElasticTrainer:
    """Expert-parallel training that survives node failures without restarting.

    Args:
        config: timeouts, reporting, moc configuration.
        layout: ``{"layers": {moe_layer_name: num_experts}, "top_k": k}`` of the model
            (the controller plans from it before any model exists).
        build_model: ``fn(placements) -> model`` building the model on the current process
            group with one :class:`lazarus.planning.Placement` per MoE layer name.
            Non-expert weights must be initialised identically on every rank (seeded). A
            node joining between steps calls it before its process group exists, while
            the members train: :mod:`lazarus.moe` layers then hold the experts of the rank
            the plan gives it (``building_for``); a ``build_model`` that needs the group
            itself (it raises without one) is called again once the group has formed.
        make_optimizer: ``fn(model) -> optimizer``; called again after every
            reconfiguration (the expert parameters change), so build parameter groups from
            parameter names. Optimizer state is carried over by parameter.
        channel: the link to this node's agent (default: ``AgentChannel.from_env()``).
    """

    def __init__(self, config: ElasticConfig, *, layout: Mapping[str, Any], build_model: BuildModel,
                 make_optimizer: MakeOptimizer, channel: Any = None) -> None:
        if not isinstance(config, ElasticConfig):
            raise ValueError(f"config must be an ElasticConfig, got {type(config).__name__}")
        self._t_init = time.time()       # the worker's imports are done (start-up phases in its hello)
        layers = layout.get("layers") if isinstance(layout, Mapping) else None
        if not isinstance(layers, Mapping) or not layers:
            raise ValueError("layout must be {'layers': {moe_layer_name: num_experts}, 'top_k': k}")
        if channel is None:
            from ._channel import AgentChannel

            channel = AgentChannel.from_env()
            if channel is None:
                raise RuntimeError("ElasticTrainer must run in a worker started by `lazarus agent` "
                                   "(LAZARUS_AGENT_FD is not set)")
        self.config = config
        self.layout = {"layers": dict(layers), "top_k": int(layout.get("top_k", 1))}
        self.channel = channel
        self.node = str(channel.node_id)
        # Several workers per node (``lazarus agent --nproc-per-node G``): this one's place
        # on the node, as torchrun sets it (LOCAL_RANK, LOCAL_WORLD_SIZE).
        self.local_rank = int(getattr(channel, "local_rank", 0))
        self.local_world = int(getattr(channel, "local_world_size", 1))
        self.where = self.node if self.local_world == 1 else f"{self.node}/{self.local_rank}"
        key = config.memory_key
        #: this worker's snapshot folder in the node's memory (one per local rank)
        self.memory_key = (f"worker{self.local_rank}" if key is None
                           else key if self.local_world == 1 else f"{key}-{self.local_rank}")
        self.backend: TrainerBackend = resolve_backend(config.device, config.backend, local_rank=self.local_rank)
        if self.backend.device.type == "cuda":
            torch.cuda.set_device(self.backend.device)
        if self.backend.backend == "nccl":
            applied = nccl_environment(f"node {self.where}", init_timeout=config.rendezvous_timeout)
            log.info("node %s step -: NCCL settings %s", self.where,
                     " ".join(f"{k}={v}" for k, v in applied.items()) or "all from the environment")
        log.info("node %s step -: device %s, backend %s", self.where, self.backend.device, self.backend.backend)
        context = WorkerContext(node=self.node, local_rank=self.local_rank, local_world=self.local_world,
                                where=self.where, backend=self.backend, layout=self.layout, channel=channel,
                                memory_key=self.memory_key, metric=self._metric)
        self.reconf = Reconfigurer(config, context=context, build_model=build_model, make_optimizer=make_optimizer)
        # model, optimizer, moc manager, step, place in the group: replaced whole by every
        # reconfiguration (Reconfigurer.apply), read through the properties below
        self._state = WorkerState()
        self.losses: list[tuple[int, float]] = []
        self._routing: dict[str, torch.Tensor] = {}
        # a routing report on its way to the host: (step, {layer: experts}, the counts on the
        # device) rides on the next step's one copy; then (step, {layer: counts}) to send
        self._routing_out: tuple[int, dict[str, int], torch.Tensor] | None = None
        self._routing_ready: tuple[int, dict[str, list[int]]] | None = None
        self._agreed: int | None = None   # the plan agreement of the step just applied (its all-reduce)
        self._metrics: IO[str] | None = None
        self._step_s: deque[float] = deque(maxlen=21)   # this rank's recent steps, end to end
        self._last_end: float | None = None              # when its last step ended (None: after a failure)
        self._paused: dict[str, Any] | None = None       # a between-steps plan applied after a step
        self._storage_failures = 0       # moc persist failures already reported
        self._storage_bad_since: int | None = None  # last persisted step when storage went bad
        self._training = threading.Event()   # set while the step loop runs on a healthy group
        # the training thread's progress, read by the agent's hang watchdog (written by this
        # thread only: it stops when the step stops)
        self._beat = ProgressBeat.from_env()
        self._watch_lock = threading.Lock()
        self._stop_watch = threading.Event()

    # -- public ----------------------------------------------------------------------------
    @property
    def state(self) -> WorkerState:
        """The model, optimizer, moc manager, step and place in the group, as one
        :class:`._worker_state.WorkerState` (each also an attribute of its own)."""
        return self._state

    @property
    def model(self) -> nn.Module | None:
        return self._state.model

    @model.setter
    def model(self, value: nn.Module | None) -> None:
        self._state = self._state.replace(model=value)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._state.optimizer

    @optimizer.setter
    def optimizer(self, value: torch.optim.Optimizer | None) -> None:
        self._state = self._state.replace(optimizer=value)

    @property
    def ckpt(self) -> Any:
        """The moc CheckpointManager of this generation (None between generations)."""
        return self._state.ckpt

    @ckpt.setter
    def ckpt(self, value: Any) -> None:
        self._state = self._state.replace(ckpt=value)

    @property
    def step(self) -> int:
        """The next step to run (== optimizer steps applied)."""
        return self._state.step

    @step.setter
    def step(self, value: int) -> None:
        self._state = self._state.replace(step=value)

    @property
    def rank(self) -> int:
        return self._state.rank

    @rank.setter
    def rank(self, value: int) -> None:
        self._state = self._state.replace(rank=value)

    @property
    def world(self) -> int:
        return self._state.world

    @world.setter
    def world(self, value: int) -> None:
        self._state = self._state.replace(world=value)

    @property
    def members(self) -> list[str]:
        return self._state.members

    @members.setter
    def members(self, value: list[str]) -> None:
        self._state = self._state.replace(members=value)

    @property
    def generation(self) -> int:
        return self._state.generation

    @generation.setter
    def generation(self, value: int) -> None:
        self._state = self._state.replace(generation=value)

    @property
    def device(self) -> torch.device:
        """Where the model lives (``ElasticConfig.device`` resolved): ``build_model``'s
        result is moved here, and ``loss_fn`` should put its batches here."""
        return self.backend.device

    def run(self, loss_fn: LossFn, total_steps: int) -> None:
        """Train until ``total_steps`` optimizer steps are applied (counted over the job's
        life, across reconfigurations), then flush the last checkpoint and report done."""
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be an integer >= 1, got {total_steps!r}")
        t_warm = _warm_up()
        self.reconf.probe_storage()
        startup = {"imported": self._t_init, "warm": t_warm, "probed": time.time()}
        t_process = _process_start_time()
        if t_process is not None:
            startup = {"process": t_process, **startup}
        self.channel.hello(self.layout, startup=startup, store=self.reconf.host_store())
        # a hot spare (``lazarus agent --standby``) waits, warm, for as long as it is not called in
        plan = self._wait_plan(-1, unbounded=os.environ.get("LAZARUS_STANDBY") == "1")
        self._reconfigure_loop(plan, error=None)
        watcher = threading.Thread(target=self._watch_plans, name=f"lazarus-watch-{self.where}", daemon=True)
        watcher.start()
        try:
            self._loop(loss_fn, total_steps)
        finally:
            self._stop_watch.set()

    def _watch_plans(self) -> None:
        """A failure plan arriving while this rank trains means the group is dead, even if
        no collective here has failed yet (a frozen peer keeps its sockets open, so a
        collective with it would only fail after ``collective_timeout``): abort the group's
        NCCL communicators and shut its gloo sockets, so the blocked collective fails now
        and recovery starts."""
        while not self._stop_watch.wait(0.05):
            self._abort_on_watchdog_error()
            plan = latest_plan(self.channel)
            if plan is None or plan.mode != "immediate" or plan.generation <= self.generation:
                continue
            with self._watch_lock:
                if self._training.is_set() and plan.generation > self.generation:
                    r = self.reconf.aborter.interrupt()
                    log.warning("node %s step %d: plan %d (%s) arrived while training on generation %d; aborted %d "
                                "NCCL communicators, interrupted %d connections", self.where, self.step,
                                plan.generation, plan.reason, self.generation, r.nccl_aborted,
                                r.sockets_shut)
                    self._training.clear()

    def _abort_on_watchdog_error(self) -> None:
        """NCCL's watchdog recorded an error or a timeout (a dead or frozen peer) on the
        group this rank trains on: with torch's async error handling off nothing aborts the
        communicators but us. Abort them, so the kernel blocking the training thread's sync
        returns and the step fails (its health check) now."""
        if not self._training.is_set():
            return
        error = self.reconf.aborter.watchdog_error()
        if error is None:
            return
        with self._watch_lock:
            if self._training.is_set():
                r = self.reconf.aborter.interrupt()
                log.warning("node %s step %d: NCCL watchdog reported %s on generation %d; aborted %d NCCL "
                            "communicators", self.where, self.step, error, self.generation, r.nccl_aborted)
                self._training.clear()

    def _loop(self, loss_fn: LossFn, total_steps: int) -> None:
        while self.step < total_steps and not self.left:
            failure = None
            try:
                self._beat.step(self.step, self.generation)
                loss = self._train_step(loss_fn)
                t1 = time.time()
                if self._paused is not None:
                    self._report_pause(t1)
                elif self._last_end is not None:
                    # a step as the members live it: from one step's end to the next's (the
                    # plan agreement, reports and moc's per-step work included)
                    self._step_s.append(t1 - self._last_end)
                self._last_end = t1
                self._after_step(loss, t_end=t1)
            except Exception as exc:  # noqa: BLE001 - classified below
                if not is_collective_error(exc):
                    raise
                failure = f"{type(exc).__name__}: {exc}"
            # Handled outside the except block: the traceback's frames hold the broken
            # process group, and its sockets must close when we destroy it so that the
            # other survivors fail fast instead of waiting out their timeout.
            if failure is not None:
                self._last_end = None   # the recovery is no step
                self._on_broken_collective(failure)
        if self.left:
            self._report_left()
        else:
            self._finish()

    def _report_left(self) -> None:
        """Tell the agent that this worker handed its state over and is out of the job:
        from here on nothing the job needs runs here, so a process held up at exit by
        background work that cannot end (a checkpoint write to hung storage, abandoned by
        the hand-over) is stopped by the agent after ``--stop-timeout``, not waited for."""
        log.info("node %s step %d: left the job", self.where, self.step)
        self._beat.done(self.step, self.generation)
        try:
            self.channel.send({"type": "left", "step": self.step, "generation": self.generation})
        except Exception:  # noqa: BLE001 - the agent link has its own watchdog
            pass

    @property
    def left(self) -> bool:
        """This node left the job gracefully (a between-steps plan without it)."""
        return self._state.left

    def expert_digests(self) -> dict[str, str]:
        """``unit -> hex digest`` of the weights and optimizer state of every expert this
        rank holds (tests compare replicas across ranks)."""
        return self.reconf.digests(cast(nn.Module, self.model), self.optimizer, experts=True)

    def dense_digest(self) -> str:
        """One digest over all non-expert weights and their optimizer state."""
        return self.reconf.dense_digest(cast(nn.Module, self.model), self.optimizer)

    # -- the step --------------------------------------------------------------------------
    def _train_step(self, loss_fn: LossFn) -> float:
        model, opt = self.model, self.optimizer
        assert model is not None and opt is not None
        step = self.step
        self._agreed = None
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, step, self.rank, self.world)
        loss.backward()
        expert_sq, target, loss_value = self._sync_gradients(loss)
        if self.config.grad_clip is not None:
            self._clip_gradients(self.config.grad_clip, expert_sq)
        if self.backend.backend == "nccl":
            # NCCL collectives do not block the host: wait until this step's have run, and
            # never apply a step whose communicators were aborted meanwhile (garbage).
            torch.cuda.current_stream(self.device).synchronize()
            self.reconf.aborter.check_healthy()
        opt.step()
        self.step = step + 1             # applied: from here on the step counts
        self._agreed = target            # (used only now: on NCCL the step's collectives proved healthy above)
        for name, layer in moe_layers(model):
            if layer.routing_counts is not None:
                self._routing[name] = self._routing.get(name, torch.zeros_like(layer.routing_counts)) \
                    + layer.routing_counts
        if self.ckpt is not None:
            self.ckpt.step(step)
        return loss_value

    def _pending_generation(self) -> int:
        """The newest between-steps plan this rank may switch to after the step (0: none).
        A between-steps plan waits for an exact replay to end (every rank replays the same
        steps, so all wait alike): applied mid-replay it would force another rollback. A
        join counts once its joiners have built their models (they do while we train): the
        members never wait for a joiner's build, only for the switch itself."""
        latest = latest_plan(self.channel)
        pending = latest.generation if latest is not None and latest.generation > self.generation else 0
        if pending and self.ckpt is not None and self.ckpt.replaying:
            pending = 0
        if pending and latest is not None and not self.reconf.joiners_prepared(latest, self.step):
            pending = 0
        return pending

    def _sync_gradients(self, loss: torch.Tensor) -> tuple[float, int, float]:
        """Replica gradients of every expert summed over its holders (all layers in one
        reduce-scatter / all-gather pair, :func:`lazarus.moe.sync_moe_gradients`), then the
        dense gradients averaged over ranks together with the MoE layers' replicated ones
        (routers, shared experts; scaled by each layer's ``grad_reduction``) in one flat
        all-reduce, which also carries the experts' share of the squared gradient norm (a
        sum) and the plan agreement (a maximum; :func:`._step_reduce.all_reduce_step`):
        three collectives per step whatever the number of layers.

        The step's one device-to-host copy brings those two and this rank's ``loss`` to
        the host (no other read of the device in the step's own machinery).

        Returns:
            (the squared norm of the expert gradients, each expert counted once; the
            newest plan generation any rank will switch to after this step, 0: none;
            this rank's loss).
        """
        from lazarus.moe import sync_moe_gradients

        model = self.model
        assert model is not None
        sync_moe_gradients(model, include_router=False)
        layers = [layer for _, layer in moe_layers(model)]
        sums = [sum(layer.expert_grad_sq() for layer in layers)] if self.config.grad_clip is not None else []
        # (dense: divided by the world as DDP does; replicated: times the layer's scale, as
        # the layer's own sync does, so the values are those of the separate reductions)
        # (one rank: nothing to average, its replicated gradients are its own)
        params: list[tuple[nn.Parameter, Callable[[torch.Tensor], torch.Tensor]]] = []
        if self.world > 1:
            def mean(g: torch.Tensor) -> torch.Tensor:
                return g / self.world

            params += [(p, mean) for p in self.reconf.dense_params(model)]
            for layer in layers:
                scale = 1.0 / layer.world_size if layer.grad_reduction == "mean" else 1.0
                params += [(p, _times(scale)) for p in layer.replicated_parameters()]
        out, self._routing_out = self._routing_out, None
        local = [loss.detach()] + ([out[2]] if out is not None else [])
        totals = all_reduce_step(params, sums=sums, maxima=[self._pending_generation()], local=local,
                                 rank=self.rank, world=self.world)
        if out is not None:
            counts, pos = {}, 1
            for name, n in out[1].items():
                counts[name] = [int(round(x)) for x in totals.local[pos: pos + n]]
                pos += n
            self._routing_ready = (out[0], counts)
        return (totals.sums[0] if totals.sums else 0.0), totals.maxima[0], totals.local[0]

    def _clip_gradients(self, max_norm: float, expert_sq: float) -> None:
        """Clip by the norm of the whole model's gradient, each expert counted once (not
        once per replica; ``expert_sq``: their squared norm, summed over the ranks with the
        step's all-reduce): the same coefficient on every rank, so replicas and dense
        weights stay identical. Computed where the gradients are, never read on the host (on
        a GPU a read per parameter would wait for the device each time)."""
        model = self.model
        assert model is not None
        squared = [p.grad for p in self.reconf.dense_params(model) if p.grad is not None]
        for _, layer in moe_layers(model):
            squared += [p.grad for p in layer.replicated_parameters() if p.grad is not None]   # router, shared
        experts = [p.grad for _, layer in moe_layers(model) for p in layer.experts.parameters() if p.grad is not None]
        clip_total_norm_(squared, experts, expert_sq, max_norm)

    def _report_pause(self, t_end: float) -> None:
        """How long a between-steps plan kept this member from training: from the end of
        its last step before the plan to the end of its first step after it, less its
        typical (median) step, measured the same way (from one step's end to the next's):
        ``stall_s``, which also counts a first step slower than before (a world that grew
        on shared cores); ``wait_s``: from the end of its last step to training again (the
        agreement and the reconfiguration). Every rank appends one ``member_pause``
        metrics record."""
        p, self._paused = self._paused, None
        assert p is not None
        steps = sorted(self._step_s)
        typical = steps[len(steps) // 2] if steps else 0.0
        gap = t_end - p["t_last"]
        self._metric({"kind": "member_pause", "t": t_end, "node": self.where, "rank": self.rank,
                      "generation": self.generation, "reason": p["reason"], "gap_s": round(gap, 4),
                      "typical_step_s": round(typical, 4), "stall_s": round(max(0.0, gap - typical), 4),
                      "wait_s": round(p["t_resumed"] - p["t_last"], 4),
                      "agree_s": round(p["t_agreed"] - p["t_last"], 4),
                      "reconfigure_s": round(p["t_resumed"] - p["t_agreed"], 4)})

    def _after_step(self, loss: float, t_end: float | None = None) -> None:
        step = self.step - 1
        self.losses.append((step, loss))
        if self.rank == 0:
            self._metric({"kind": "step", "t": time.time(), "step": step, "loss": loss, "world": self.world,
                          "generation": self.generation})
        ready, self._routing_ready = self._routing_ready, None
        if ready is not None:   # the counts of the report before, come with this step's one copy
            self.channel.send({"type": "routing", "step": ready[0], "layers": ready[1]})
        if self.step % self.config.report_every == 0:
            self.channel.send({"type": "progress", "step": self.step, "generation": self.generation,
                               "loss": loss, "world_size": self.world, "t": time.time()})
            if self.rank == 0 and self._routing:
                # not read here (a second wait for the device this step): they ride on the
                # next step's copy to the host (_sync_gradients) and are sent after it
                self._routing_out = (self.step, {k: v.numel() for k, v in self._routing.items()},
                                     torch.cat([v.reshape(-1) for v in self._routing.values()]))
            self._routing = {}
            self._report_storage()
        # Plan agreement: the newest generation any rank has heard of (between-steps plans),
        # agreed on by the step's all-reduce (_sync_gradients).
        target, self._agreed = self._agreed, None
        if target is None:
            raise RuntimeError("no plan agreement for this step (the step did not run its gradient all-reduce)")
        if target > self.generation:
            t_agreed = time.time() if t_end is None else t_end
            plan = self._wait_plan(self.generation, at_least=target)
            self._reconfigure_loop(plan, error=None)
            if t_end is not None and not self.left:
                self._paused = {"t_last": t_end, "t_agreed": t_agreed, "t_resumed": time.time(),
                                "reason": plan.reason}

    def _report_storage(self) -> None:
        """Tell the controller (its event log) when checkpoints stop reaching storage and
        when they reach it again; training itself never waits for storage."""
        if self.ckpt is None:
            return
        st = self.ckpt.status()
        counts = st.get("exact") or st    # exact mode: its windows' persists
        fails = int(counts.get("persist_failures") or 0)
        persisted = counts.get("last_persisted_step")
        persisted = -1 if persisted is None else int(persisted)
        if fails > self._storage_failures:
            self._storage_failures = fails
            if self._storage_bad_since is None:
                self._storage_bad_since = persisted
                self.channel.send({"type": "storage", "ok": False, "step": self.step, "persist_failures": fails,
                                   "last_persisted_step": persisted, "error": str(st.get("last_error") or "")[:300]})
        elif self._storage_bad_since is not None and persisted > self._storage_bad_since:
            self._storage_bad_since = None
            self.channel.send({"type": "storage", "ok": True, "step": self.step, "persist_failures": fails,
                               "last_persisted_step": persisted})

    # -- failures and reconfiguration --------------------------------------------------------
    def _on_broken_collective(self, error: str) -> None:
        self._beat.idle(self.step, self.generation)
        with self._watch_lock:
            self._training.clear()
        t_error = time.time()
        log.warning("node %s rank %d step %d gen %d: collective failed: %s", self.where, self.rank, self.step,
                    self.generation, error.splitlines()[0][:200])
        try:
            self.channel.send({"type": "collective_error", "generation": self.generation,
                               "step": self.step, "error": error[:300]})
        except Exception:  # noqa: BLE001 - the agent link has its own watchdog
            pass
        self._retire_group()
        plan = self._wait_plan(self.generation)
        self._reconfigure_loop(plan, error=t_error)

    def _reconfigure_loop(self, plan: Plan, error: float | None) -> None:
        """Apply ``plan``; if it breaks (another failure meanwhile), wait for the next."""
        self._beat.idle(self.step, self.generation)
        with self._watch_lock:
            self._training.clear()
        try:
            self._reconfigure_loop_inner(plan, error)
        finally:
            with self._watch_lock:
                self._training.set()

    def _reconfigure_loop_inner(self, plan: Plan, error: float | None) -> None:
        while True:
            broken = None
            try:
                self._state = self.reconf.apply(plan, self._lend_state(), t_error=error)
                return
            except Superseded as exc:
                self._state = state_after(exc, self._state)   # what the plan wrote before it was superseded
                log.info("node %s: plan %d superseded", self.where, plan.generation)
            except Exception as exc:  # noqa: BLE001
                self._state = state_after(exc, self._state)   # what it wrote before it failed
                if not is_collective_error(exc):
                    raise
                broken = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                log.warning("node %s: reconfiguration to generation %d failed: %s", self.where,
                            plan.generation, broken)
            except BaseException as exc:
                self._state = state_after(exc, self._state)
                raise
            if broken is not None:  # outside the except block, see run()
                self._retire_group()
                # Every member may still be alive (one was late, or froze and woke up): without
                # this report nothing would make the controller issue another plan.
                try:
                    self.channel.send({"type": "collective_error", "generation": plan.generation,
                                       "step": self.step, "error": f"reconfiguration failed: {broken}"})
                except Exception:  # noqa: BLE001 - the agent link has its own watchdog
                    pass
            if error is None:
                error = time.time()
            plan = self._wait_plan(plan.generation)

    def _lend_state(self) -> WorkerState:
        """The state, handed to the reconfigurer, which returns the next one (or, failing,
        the one it reached with its exception: :func:`._worker_state.state_after`).
        Meanwhile this trainer keeps it without its moc manager and optimizer, so that
        the reconfigurer's is the only reference to them: a manager it retires is released
        off the training thread, an optimizer it replaces is freed at once (as when it
        wrote this trainer's fields). Only the step, generation and place in the group are
        read meanwhile (the plan watcher, log lines)."""
        state = self._state
        self._state = state.replace(ckpt=None, optimizer=None)
        return state

    def _retire_group(self) -> None:
        """Retire the group and the moc manager (:meth:`._reconfigure.Reconfigurer.retire_group`)."""
        try:
            self._state = self.reconf.retire_group(self._lend_state())
        except BaseException as exc:
            self._state = state_after(exc, self._state)
            raise

    def _wait_plan(self, newer_than: int, at_least: int | None = None, unbounded: bool = False) -> Plan:
        self._beat.idle(self.step, self.generation)
        deadline = time.monotonic() + self.config.plan_timeout.total_seconds()
        while True:
            if unbounded:
                deadline = time.monotonic() + self.config.plan_timeout.total_seconds()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.error("node %s: no plan newer than generation %d within %s; exiting", self.where, newer_than,
                          self.config.plan_timeout)
                os._exit(EXIT_NO_PLAN)
            try:
                plan = wait_plan(self.channel, newer_than, timeout=remaining)
            except TimeoutError:
                continue
            if at_least is not None and plan.generation < at_least:
                newer_than = plan.generation
                continue
            if self.node not in plan.members and self.node not in plan.leaving:
                # Not (or no longer) part of the job: wait to be included.
                newer_than = plan.generation
                deadline = time.monotonic() + self.config.plan_timeout.total_seconds()
                continue
            return plan

    def _finish(self) -> None:
        self._beat.done(self.step, self.generation)   # every step applied; the last flush is no step
        if self.ckpt is not None:
            try:
                self.ckpt.close()
            except Exception as exc:  # noqa: BLE001 - training is done; report and go on
                log.error("node %s: final checkpoint failed: %s", self.where, exc)
        self.channel.send({"type": "done", "step": self.step})
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- metrics -----------------------------------------------------------------------------
    def _metric(self, record: dict[str, Any]) -> None:
        """Append ``record`` to ``metrics_path`` (one line, written at once)."""
        path = self.config.metrics_path
        if not path:
            return
        if self._metrics is None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._metrics = open(path, "a", buffering=1)
        self._metrics.write(json.dumps(record) + "\n")


def _times(scale: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient's post-reduction: times ``scale``."""
    return lambda g: g * scale


def _process_start_time() -> float | None:
    """When this process started (epoch seconds, to a clock tick), from /proc; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _warm_up() -> float:
    """One-time costs paid before this worker says it is ready, not during a
    reconfiguration where the other members wait for it: ``torch._dynamo``, which every
    ``torch.optim`` optimizer imports on first use (1.3 s on a quiet core, 3-9 s on a
    loaded 2-core machine), is deferred until something compiles
    (:func:`._lazy_dynamo.defer_dynamo_import`; imported here when that is off), the
    dispatch extension is loaded, and the import heap is frozen out of the collector."""
    from lazarus.dispatch import load_ops

    defer_dynamo_import()
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.0)
    load_ops()
    # Everything imported so far lives as long as the process: keep it out of every later
    # collection (a full gc.collect() retiring a broken group otherwise walks torch's whole
    # import heap: ~1 s of the survivors' recovery on 2 loaded cores).
    gc.collect()
    gc.freeze()
    return time.time()
