"""Public dispatcher functions: counts per rank (Algorithm 1) and the send-order permutation."""

from __future__ import annotations

import torch

from . import _torch_impl
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
        if rank is None:
            return torch.ops.lazarus.dispatch_table(r, t)
        send, recv = torch.ops.lazarus.dispatch_rank(r, t, rank)
        return send, recv
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
        return torch.ops.lazarus.dispatch_permutation(ex, sd)
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
