"""Public dispatcher functions: counts per rank (Algorithm 1) and the send-order permutation.

On CUDA tensors each public call syncs the host at most once (its argument checks, all
read back together); the ``*_trusted`` variants, for inputs the caller produced itself
(the MoE layer), do not sync at all. A compiled op that raises at use (a build that
cannot run here) is disabled with one warning and the torch implementation answers.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _build, _torch_impl
from ._build import load_ops
from ._validate import check_counts, check_permutation_args, check_rank


def _use_compiled(device: torch.device, backend: str | None) -> bool:
    if backend not in (None, "cpp", "torch"):
        raise ValueError(f"backend must be None (auto), 'cpp' or 'torch', got {backend!r}")
    if backend == "torch":
        return False
    state = load_ops()
    ok = state.cuda if device.type == "cuda" else (state.cpp and device.type == "cpu")
    if backend == "cpp" and not ok:
        raise RuntimeError(f"the compiled dispatcher is not available on {device}: {state.reason or 'not built'}")
    return ok


def _compiled(name: str, device: torch.device, backend: str | None, *args: Any) -> Any:
    """``torch.ops.lazarus.<name>(*args, check=False)``, or None after disabling the
    compiled ops of ``device``'s kind when it raised anything but a ValueError (bad input
    is the caller's error; "no kernel image is available", a missing symbol, ... are the
    build's). A forced ``backend="cpp"`` re-raises instead."""
    try:
        return getattr(torch.ops.lazarus, name)(*args, check=False)
    except ValueError:
        raise
    except RuntimeError as exc:
        if backend == "cpp":
            raise
        _build.disable("cuda" if device.type == "cuda" else "cpu", f"{name}: {type(exc).__name__}: {exc}")
        return None


def dispatch_rank_trusted(R: torch.Tensor, T: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dispatch_counts` for one rank without the argument checks (no host sync on a
    GPU): int64 ``R``, ``T`` on one device, that the caller built and checks itself (it
    must refuse tokens routed to experts without replicas before using the result)."""
    if _use_compiled(R.device, None):
        out = _compiled("dispatch_rank", R.device, None, R, T, rank)
        if out is not None:
            return out[0], out[1]
    return _torch_impl.dispatch_rank(R, T, rank)


def dispatch_permutation_trusted(experts: torch.Tensor, send: torch.Tensor) -> torch.Tensor:
    """:func:`dispatch_permutation` without the argument checks (no host sync on a GPU):
    int64 ``experts`` in range and a ``send`` on the same device whose column sums are the
    experts' counts (as :func:`dispatch_rank_trusted` returns them for valid counts)."""
    if _use_compiled(experts.device, None):
        out = _compiled("dispatch_permutation", experts.device, None, experts, send)
        if out is not None:
            return out
    return _torch_impl.dispatch_permutation(experts, send)


def dispatch_counts(
    R: torch.Tensor, T: torch.Tensor, rank: int | None = None, *, backend: str | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Tokens of each expert every rank sends to every rank, balanced over replicas.

    Args:
        R: [E, N] replicas of expert e on rank j (from the placement).
        T: [E, N] tokens routed to expert e on rank j (the all-gathered router counts).
        rank: ``None`` for the full table (small N: tests, analysis); a rank id for that
            rank's own sends and receives in O(N*E), without the N x N x E table.
        backend: ``None`` picks the compiled op when it loaded (CUDA for CUDA tensors) and
            the torch implementation otherwise; ``"cpp"`` / ``"torch"`` force one.

    Returns:
        ``rank=None``: int64 [N_src, N_dst, E]. ``rank=i``: ``(send[N_dst, E], recv[N_src, E])``.

    Every rank j processes ``cap[e][j]`` tokens of e: the largest-remainder rounding of its
    fair share ``t_e * R[e][j] / r_e``, so within one token of it; its own tokens first.
    The rule is deterministic, so all ranks agree without another collective.
    """
    r, t = check_counts(R, T)
    if rank is not None:
        rank = check_rank(rank, r.shape[1])
    if _use_compiled(r.device, backend):
        out = (_compiled("dispatch_table", r.device, backend, r, t) if rank is None
               else _compiled("dispatch_rank", r.device, backend, r, t, rank))
        if out is not None:
            return out if rank is None else (out[0], out[1])
    if rank is None:
        return _torch_impl.dispatch_table(r, t)
    return _torch_impl.dispatch_rank(r, t, rank)


def dispatch_permutation(experts: torch.Tensor, send: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Order of local token slots for the dispatch all-to-all.

    Args:
        experts: [M] expert id of every routed token slot (top-k slots flattened).
        send: [N_dst, E] from :func:`dispatch_counts` for this rank.

    Returns:
        int64 [M] gather indices: ``slots[perm]`` lists the slots for rank 0 first, then
        rank 1, ...; within a destination grouped by expert in ascending id; within an
        expert in original order, the first ``send[0, e]`` going to rank 0.
    """
    ex, sd = check_permutation_args(experts, send)
    if _use_compiled(ex.device, backend):
        out = _compiled("dispatch_permutation", ex.device, backend, ex, sd)
        if out is not None:
            return out
    return _torch_impl.dispatch_permutation(ex, sd)


def compiled_backend() -> str:
    """``"cuda"``, ``"cpp"`` or ``"torch"``: the best implementation this process loaded."""
    state = load_ops()
    return "cuda" if state.cuda else ("cpp" if state.cpp else "torch")


def dispatch_device(device: torch.device | str) -> torch.device:
    """Where to run the dispatcher for tokens on ``device``: the device itself when it is
    a CUDA device and the CUDA kernels loaded, the CPU otherwise (the counts are tiny; the
    torch implementation issues many small ops that are faster on the host)."""
    device = torch.device(device)
    if device.type == "cuda" and load_ops().cuda:
        return device
    return torch.device("cpu")
