"""``ElasticConfig``: the training-process side of the elastic runtime."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Union

from moc import MoCConfig

from ._backend import check_backend_spec, check_device_spec
from ._reform import check_reform_spec

__all__ = ["ElasticConfig", "LOST_EXPERTS"]

#: the values of ``ElasticConfig.lost_experts``
LOST_EXPERTS = ("restore", "replay")


@dataclass
class ElasticConfig:
    """Settings of :class:`~lazarus.runtime.ElasticTrainer`.

    Attributes:
        collective_timeout: timeout of every gloo/NCCL collective. A frozen host (SIGSTOP of
            the agent too, a hung machine) surfaces as an error after this long; a killed
            peer at once, a frozen or hung worker whose agent lives as soon as that agent's
            watchdog kills it (``AgentConfig.stopped_timeout`` / ``hang_timeout``).
        rendezvous_timeout: how long joining a new generation may take (all members
            arriving + ``init_process_group``). Must exceed ``collective_timeout``.
        connect_timeout: how long forming a generation's gloo group waits for any one
            peer (its address on the store, its connection), once every member arrived.
            gloo retries a connection up to 5 times this, and nothing interrupts it: a
            node that dies while the group forms holds the others that long. A member
            slower than this fails the attempt; the next attempt waits 4x longer (up to
            ``collective_timeout``), back to this once a group formed. NCCL groups form
            with ``collective_timeout`` (a communicator is aborted instead).
        plan_timeout: how long a survivor waits for the controller's next plan after a
            broken collective before giving up (exit status 75).
        report_every: steps between routing-count / progress reports to the controller.
        moc: checkpointing underneath (``None``: no checkpoints, so an expert whose every
            replica dies cannot be recovered and the job stops with an error). An exact
            ``MoCConfig`` (``exact=True``) goes with ``lost_experts="replay"``.
        lost_experts: what happens when a plan leaves some expert with no surviving replica
            (while a replica survives, peers hand it over either way):

            * ``"restore"``: the fast path. The lost experts are loaded from moc (a peer's
              memory copy, else storage) and training goes on from the current step; the
              tokens routed to them since their version are lost (PLT booked). Needs a
              non-exact ``moc``.
            * ``"replay"``: no token is lost. Every rank rolls back to the first step of the
              newest exact window committed to storage, restores every unit it now holds
              by name (its own memory copy where it has the same record, else storage) and
              replays the window; PLT stays 0, the steps since the window's start are
              trained again. Needs ``moc=MoCConfig(exact=True, ...)``.
            * ``None`` (default): ``"replay"`` with an exact ``moc``, else ``"restore"``.
        memory_key: name of this worker's snapshot folder in the node's memory directory
            (stable across ranks and incarnations, so snapshots are found after a crash).
            ``None``: ``worker<LOCAL_RANK>`` (``worker0`` with one worker per node); a name
            given here gets ``-<LOCAL_RANK>`` appended when the node runs several workers.
        metrics_path: JSON-lines file where rank 0 appends one record per step and one per
            reconfiguration, and every rank one ``member_pause`` record per between-steps
            plan it applied (how long it did not train for it; ``None``: off).
        grad_clip: max global gradient norm (``None``: no clipping).
        device: where the trainer computes: ``"auto"`` (``cuda:<LOCAL_RANK>`` when CUDA is
            available, else ``cpu``), ``"cpu"``, ``"cuda"`` or ``"cuda:<index>"``. The model
            ``build_model`` returns is moved there; ``ElasticTrainer.device`` says which.
        backend: ``"auto"`` (follows the device: NCCL on CUDA, gloo on CPU), ``"gloo"`` or
            ``"nccl"`` (CUDA only). A broken NCCL communicator is aborted, gloo's sockets
            are shut down; both re-form the next generation in-process.
        reform: how an NCCL trainer re-forms its group when members leave it: ``"auto"``
            (default) shrinks the current communicator (``ncclCommShrink``, torch's
            ``shrink_group``: NCCL >= 2.27) when the plan only removes ranks, keeps the
            others' order and the communicator is intact, and aborts it and forms a new one
            otherwise (a join, a reorder, gloo, an older NCCL); ``"shrink"`` the same, but a
            torch or NCCL that cannot shrink at all is an error at start; ``"reinit"``
            always aborts and forms a new one. A shrink that fails falls back to a new
            communicator (logged with the rank and step). The GPU timings of both ways are
            not yet measured (``make gpu-check`` records them).
    """

    collective_timeout: timedelta = timedelta(seconds=10)
    rendezvous_timeout: timedelta = timedelta(seconds=30)
    connect_timeout: timedelta = timedelta(milliseconds=300)
    plan_timeout: timedelta = timedelta(seconds=60)
    report_every: int = 10
    moc: Union[MoCConfig, None] = None
    memory_key: Union[str, None] = None
    metrics_path: Union[str, None] = None
    grad_clip: Union[float, None] = 1.0
    device: str = "auto"
    backend: str = "auto"
    lost_experts: Union[str, None] = None
    reform: str = "auto"

    def __post_init__(self) -> None:
        for name in ("collective_timeout", "rendezvous_timeout", "plan_timeout", "connect_timeout"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value <= timedelta(0):
                raise ValueError(f"ElasticConfig.{name} must be a positive timedelta, got {value!r}")
        if self.rendezvous_timeout <= self.collective_timeout:
            raise ValueError(
                f"ElasticConfig.rendezvous_timeout ({self.rendezvous_timeout}) must be longer than "
                f"collective_timeout ({self.collective_timeout})"
            )
        if self.connect_timeout > self.collective_timeout:
            raise ValueError(
                f"ElasticConfig.connect_timeout ({self.connect_timeout}) must not exceed "
                f"collective_timeout ({self.collective_timeout})"
            )
        if isinstance(self.report_every, bool) or not isinstance(self.report_every, int) or self.report_every < 1:
            raise ValueError(f"ElasticConfig.report_every must be an integer >= 1, got {self.report_every!r}")
        if self.moc is not None and not isinstance(self.moc, MoCConfig):
            raise ValueError(f"ElasticConfig.moc must be a moc.MoCConfig or None, got {type(self.moc).__name__}")
        exact = self.moc is not None and self.moc.exact
        if self.lost_experts is None:
            self.lost_experts = "replay" if exact else "restore"
        if self.lost_experts not in LOST_EXPERTS:
            raise ValueError(f"ElasticConfig.lost_experts must be one of {', '.join(map(repr, LOST_EXPERTS))} or "
                             f"None, got {self.lost_experts!r}")
        if self.lost_experts == "replay" and not exact:
            raise ValueError("ElasticConfig.lost_experts='replay' needs moc=MoCConfig(exact=True, ...): the rollback "
                             f"replays an exact window (moc is {'None' if self.moc is None else 'not exact'}); use "
                             "lost_experts='restore' for the PLT-booking fast path")
        if self.lost_experts == "restore" and exact:
            raise ValueError("ElasticConfig.lost_experts='restore' cannot go with an exact moc (MoCConfig(exact=True) "
                             "has no partial restore: it rolls back and replays); use lost_experts='replay' (or None), "
                             "or exact=False for the PLT-booking fast path")
        if self.memory_key is not None and (not isinstance(self.memory_key, str) or not self.memory_key
                                            or "/" in self.memory_key or self.memory_key.startswith(".")):
            raise ValueError(f"ElasticConfig.memory_key must be a plain folder name, got {self.memory_key!r}")
        if self.grad_clip is not None and not (isinstance(self.grad_clip, (int, float)) and self.grad_clip > 0):
            raise ValueError(f"ElasticConfig.grad_clip must be a positive number or None, got {self.grad_clip!r}")
        check_device_spec(self.device, "ElasticConfig.device")
        check_backend_spec(self.backend, "ElasticConfig.backend")
        check_reform_spec(self.reform, "ElasticConfig.reform")
        if self.backend == "nccl" and self.device == "cpu":
            raise ValueError("ElasticConfig.backend='nccl' needs a CUDA device, got device='cpu'; "
                             "use device='cuda' (or 'auto') or backend='gloo'")
