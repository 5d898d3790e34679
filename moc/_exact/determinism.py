"""The settings exact replay needs on CUDA, checked (never set) by exact mode.

Replay recomputes a window's steps and must produce the same bits as the first time. On a
CPU torch's kernels are deterministic; on CUDA several are not unless asked:

* ``torch.use_deterministic_algorithms(True)`` (not ``warn_only``): ``index_add_``,
  ``scatter_add_``, ``index_put_(accumulate=True)`` and the backward of indexing and
  ``gather`` (what MoE layers combine expert outputs with, e.g. ``examples/toy_moe.py``,
  ``lazarus/adapters/hf``) accumulate floats with atomics in an order that changes from
  run to run; the flag switches them to deterministic kernels and makes an op that has
  none raise instead of diverging quietly;
* ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (or ``:16:8``) in the environment before the
  process first uses cuBLAS: without it cuBLAS may split a matmul's reduction differently
  (torch raises at the first matmul when the flag above is on and this is not set);
* ``torch.backends.cudnn.benchmark = False``: benchmarking may pick another convolution
  algorithm in the restarted process.

moc does not set them itself: the first two change every kernel of the process (the
user's too) and the cuBLAS variable is read when cuBLAS starts, before moc is constructed
in most programs. Exact mode on CUDA refuses to start without them, naming each one.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

from .._cuda import runtime
from .._errors import CheckpointError

__all__ = ["CUBLAS_CONFIGS", "replay_setting_problems", "check_replay_settings", "on_cuda"]

CUBLAS_CONFIGS = (":4096:8", ":16:8")


def on_cuda(tensors: Iterable[torch.Tensor]) -> bool:
    """Does any of ``tensors`` live on a CUDA device?"""
    rt = runtime()
    return any(t.is_cuda or rt.device_of(t) is not None for t in tensors)


def replay_setting_problems() -> list[str]:
    """What is missing for bit-exact replay on CUDA, one line each ([]: nothing)."""
    problems = []
    if not torch.are_deterministic_algorithms_enabled():
        problems.append("torch.use_deterministic_algorithms(True) is not set (index_add_ / scatter_add_ and the "
                        "backward of indexing use float atomics whose order, and so whose bits, change from run "
                        "to run)")
    elif torch.is_deterministic_algorithms_warn_only_enabled():
        problems.append("torch.use_deterministic_algorithms(True, warn_only=True) lets an op without a "
                        "deterministic kernel run anyway: use warn_only=False")
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if cublas not in CUBLAS_CONFIGS:
        problems.append(f"the environment variable CUBLAS_WORKSPACE_CONFIG is {cublas!r}; set it to ':4096:8' "
                        "(or ':16:8') before the process first uses cuBLAS (e.g. in the launcher's environment)")
    if torch.backends.cudnn.benchmark:
        problems.append("torch.backends.cudnn.benchmark is True (a restarted process may pick another "
                        "convolution algorithm): set it to False")
    return problems


def check_replay_settings(where: str) -> None:
    """Raise :class:`CheckpointError` naming every setting bit-exact replay on CUDA lacks."""
    problems = replay_setting_problems()
    if problems:
        raise CheckpointError(
            f"{where}: exact mode on CUDA needs deterministic kernels to replay a window bit for bit "
            f"(docs/exact.md, 'On CUDA'); missing: " + "; ".join(problems))
