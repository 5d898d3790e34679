"""Which device a trainer computes on and which ``torch.distributed`` backend it uses.

The backend follows the device: ``cpu`` -> gloo, ``cuda`` -> NCCL (``ElasticConfig.backend``
overrides). An NCCL job's process group is ``"cpu:gloo,cuda:nccl"``: CUDA tensors (dense
gradients, the MoE all-to-alls, expert transfers) move over NCCL, the small CPU-side
agreements (the per-step plan flag, JSON inventories) over gloo, without a device round
trip.

NCCL is set up for in-process recovery (:data:`NCCL_SETTINGS`, applied by
:func:`nccl_environment` unless the environment already sets a variable): no debug dump and
no dump wait on a timeout, no heartbeat monitor that calls ``std::abort()`` on the process, CUDA
errors not rethrown as process aborts, and torch's async error handling off, as its
``_abort_process_group`` expects: Lazarus aborts the communicators itself (on a plan, or
when the watchdog reports an error or a timeout, see ``GroupAborter``). The collective
timeout is the group's, ``collective_timeout``.

A CUDA device belongs to one worker: ``device="auto"`` gives ``LOCAL_RANK`` i the GPU i,
and a ``LOCAL_RANK`` without a GPU of its own is a ValueError naming ``--nproc-per-node``
and the device count (never a modulo that puts two ranks on one GPU, which NCCL refuses
with "Duplicate GPU").
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

import torch

__all__ = ["BACKENDS", "DEVICES", "NCCL_SETTINGS", "TrainerBackend", "resolve_backend", "nccl_environment",
           "nccl_init_kwargs", "local_cuda_index"]

log = logging.getLogger("lazarus.trainer")

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda", "cuda:<index>")

#: What an NCCL worker runs with unless its environment says otherwise (see the README's
#: failure table). Each value is the in-process-recovery choice; the comment says why.
NCCL_SETTINGS: dict[str, str] = {
    # No flight-recorder dump when a collective times out or fails: the dump (and the wait
    # for it, 4 x the dump wait, ~60 s by default) would hold the watchdog's work lock.
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    # ...and should one be requested anyway, wait at most 4 x 250 ms for it.
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "250",
    # No heartbeat monitor: it std::abort()s the process when the watchdog is stuck for
    # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (a blocking NCCL call on a dead peer). Lazarus has its
    # own: the agent's heartbeats, the controller's plans and the trainer's watcher.
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    # A CUDA error seen by the watchdog is recorded, not rethrown in its thread (which would
    # terminate the process); the trainer's health check raises it in the training thread.
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    # Torch's async error handling off, as _abort_process_group expects: the watchdog only
    # records an error or a timeout (get_error()); the trainer's watcher aborts the
    # communicators itself and re-forms the next generation in-process.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    # Non-blocking communicator init: ncclCommInitRank with a dead peer returns instead of
    # blocking, and a newer plan can abort the half-formed communicator.
    "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
}
#: set from ``ElasticConfig.rendezvous_timeout`` (whole seconds): how long a non-blocking
#: NCCL call (the communicator's init) may take before it fails (torch's default: 30 min)
NCCL_NONBLOCKING_TIMEOUT = "TORCH_NCCL_NONBLOCKING_TIMEOUT"


@dataclass(frozen=True)
class TrainerBackend:
    """The resolved choice.

    Attributes:
        device: where the model, gradients and collectives' tensors live.
        backend: ``"gloo"`` or ``"nccl"``.
        init_backend: what ``init_process_group`` gets (``"gloo"`` or ``"cpu:gloo,cuda:nccl"``).
    """

    device: torch.device
    backend: str

    @property
    def init_backend(self) -> str:
        return "cpu:gloo,cuda:nccl" if self.backend == "nccl" else "gloo"

    @property
    def transfer_device(self) -> torch.device:
        """Where unit transfers put their bytes: the device for NCCL, else the host."""
        return self.device if self.backend == "nccl" else torch.device("cpu")


def check_device_spec(value: object, field: str = "ElasticConfig.device") -> None:
    """ValueError unless ``value`` is ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:<index>"``."""
    ok = isinstance(value, str) and (value in ("auto", "cpu", "cuda")
                                     or (value.startswith("cuda:") and value[5:].isdigit()))
    if not ok:
        raise ValueError(f"{field} must be one of {DEVICES}, got {value!r}")


def check_backend_spec(value: object, field: str = "ElasticConfig.backend") -> None:
    if value not in BACKENDS:
        raise ValueError(f"{field} must be one of {BACKENDS}, got {value!r}")


def _cuda_summary() -> str:
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda or 'not built'}), "
            f"torch.cuda.is_available() = {torch.cuda.is_available()}")


def resolve_backend(device: str = "auto", backend: str = "auto", *, local_rank: int | None = None
                    ) -> TrainerBackend:
    """Resolve ``ElasticConfig.device`` / ``.backend``.

    ``device="auto"`` / ``"cuda"``: ``cuda:<LOCAL_RANK>`` when CUDA is available (see
    :func:`local_cuda_index`), ``"auto"`` falls back to ``cpu`` without CUDA;
    ``backend="auto"``: NCCL on CUDA, gloo on CPU. NCCL on a CPU device, a CUDA device
    without CUDA, or a ``LOCAL_RANK`` without a GPU of its own is a ValueError naming the
    field.
    """
    check_device_spec(device)
    check_backend_spec(backend)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if device == "auto":
        if torch.cuda.is_available():
            dev = torch.device("cuda", local_cuda_index(local_rank, torch.cuda.device_count(), device))
        else:
            dev = torch.device("cpu")
    elif device == "cpu":
        dev = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise ValueError(f"ElasticConfig.device={device!r} needs CUDA, which this process does not have "
                             f"({_cuda_summary()}); use device='cpu' or 'auto'")
        count = torch.cuda.device_count()
        index = int(device[5:]) if ":" in device else local_cuda_index(local_rank, count, device)
        if index >= count:
            raise ValueError(f"ElasticConfig.device={device!r}: only {count} CUDA device(s) visible "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r})")
        dev = torch.device("cuda", index)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError(f"ElasticConfig.backend='nccl' needs CUDA, which this process does not have "
                             f"({_cuda_summary()}); use backend='gloo' or 'auto'")
        if dev.type != "cuda":
            raise ValueError(f"ElasticConfig.backend='nccl' needs a CUDA device, but ElasticConfig.device "
                             f"resolved to {dev}; use device='cuda' (or 'auto') or backend='gloo'")
        if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
            raise ValueError(f"ElasticConfig.backend='nccl': this torch build has no NCCL ({_cuda_summary()})")
    return TrainerBackend(device=dev, backend=backend)


def local_cuda_index(local_rank: int, device_count: int, device: str = "auto") -> int:
    """The GPU of worker ``local_rank`` on its node: GPU ``local_rank`` itself.

    Raises:
        ValueError: ``local_rank`` is negative, or there is no GPU ``local_rank`` (more
            workers than GPUs: ``lazarus agent --nproc-per-node`` exceeds the node's
            ``device_count``). Two ranks never share a GPU (NCCL refuses it).
    """
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
        raise ValueError(f"LOCAL_RANK must be an integer >= 0, got {local_rank!r}")
    if local_rank >= device_count:
        raise ValueError(
            f"ElasticConfig.device={device!r}: LOCAL_RANK={local_rank} has no GPU of its own: this node "
            f"has {device_count} CUDA device(s) (torch.cuda.device_count() = {device_count}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); start at most "
            f"{device_count} worker(s) per node (lazarus agent --nproc-per-node {max(device_count, 1)}), or give "
            f"each worker an explicit device='cuda:<i>'")
    return local_rank


def nccl_environment(where: str, *, init_timeout: timedelta | None = None,
                     environ: Any = None) -> dict[str, str]:
    """Apply :data:`NCCL_SETTINGS` (and ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` from
    ``init_timeout``) to ``environ`` (default ``os.environ``) before the first NCCL group is
    created (the variables are read when a group, or NCCL, starts). A variable the user set
    is kept, with a warning when it works against in-process recovery. Returns what was
    set here (name -> value)."""
    env = os.environ if environ is None else environ
    wanted = dict(NCCL_SETTINGS)
    if init_timeout is not None:
        wanted[NCCL_NONBLOCKING_TIMEOUT] = str(max(1, int(init_timeout.total_seconds())))
    applied: dict[str, str] = {}
    kept: list[str] = []
    for name, value in wanted.items():
        current = env.get(name)
        if current is None:
            env[name] = value
            applied[name] = value
        elif current != value:
            kept.append(f"{name}={current} (Lazarus would set {value})")
    if kept:
        log.warning("%s step -: NCCL settings from the environment kept: %s; the other values are what lets "
                    "survivors abort and recover in-process", where, ", ".join(kept))
    return applied


def nccl_init_kwargs(backend: TrainerBackend) -> dict[str, Any]:
    """Extra ``init_process_group`` arguments of a generation's group: for NCCL the
    device, so that the communicator is formed eagerly inside the (interruptible)
    rendezvous and subgroups split from it; nothing for gloo."""
    if backend.backend != "nccl":
        return {}
    dev = backend.device
    if dev.type != "cuda" or dev.index is None:
        raise ValueError(f"an NCCL group needs a CUDA device with an index, got {dev}")
    return {"device_id": dev}


def settings_table(settings: Mapping[str, str] = NCCL_SETTINGS) -> str:
    """``NAME=value`` pairs, for log lines."""
    return " ".join(f"{k}={v}" for k, v in settings.items())
