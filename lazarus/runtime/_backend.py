"""Which device a trainer computes on and which ``torch.distributed`` backend it uses.

The backend follows the device: ``cpu`` -> gloo, ``cuda`` -> NCCL (``ElasticConfig.backend``
overrides). An NCCL job's process group is ``"cpu:gloo,cuda:nccl"``: CUDA tensors (dense
gradients, the MoE all-to-alls, expert transfers) move over NCCL, the small CPU-side
agreements (the per-step plan flag, JSON inventories) over gloo, without a device round
trip.

NCCL runs with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (abort the communicator on an error
or a timeout, keep the process: survivors re-form the next generation in-process) unless
the environment sets it; its collective timeout is the group's, ``collective_timeout``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

__all__ = ["BACKENDS", "DEVICES", "TrainerBackend", "resolve_backend", "nccl_environment"]

log = logging.getLogger("lazarus.trainer")

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda", "cuda:<index>")
NCCL_ERROR_HANDLING = "2"     # CleanUpOnly: abort the communicator, never tear the process down


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

    ``device="auto"``: ``cuda:<LOCAL_RANK mod device count>`` when CUDA is available, else
    ``cpu``; ``backend="auto"``: NCCL on CUDA, gloo on CPU. NCCL on a CPU device, or a CUDA
    device without CUDA, is a ValueError naming the field.
    """
    check_device_spec(device)
    check_backend_spec(backend)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if device == "auto":
        if torch.cuda.is_available():
            dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        else:
            dev = torch.device("cpu")
    elif device == "cpu":
        dev = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise ValueError(f"ElasticConfig.device={device!r} needs CUDA, which this process does not have "
                             f"({_cuda_summary()}); use device='cpu' or 'auto'")
        index = int(device[5:]) if ":" in device else local_rank % torch.cuda.device_count()
        if index >= torch.cuda.device_count():
            raise ValueError(f"ElasticConfig.device={device!r}: only {torch.cuda.device_count()} CUDA device(s)")
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


def nccl_environment(where: str) -> None:
    """Turn NCCL's asynchronous error handling on in abort-only mode before the first NCCL
    group is created (the variable is read when a group is constructed); a value the user
    set is kept, with a warning when it would tear the process down."""
    current = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    if current is None:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_ERROR_HANDLING
    elif current != NCCL_ERROR_HANDLING:
        log.warning("%s: TORCH_NCCL_ASYNC_ERROR_HANDLING=%s is kept; %s (abort only) lets survivors recover "
                    "in-process", where, current, NCCL_ERROR_HANDLING)
