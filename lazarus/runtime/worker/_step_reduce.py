"""The step's one all-reduce: dense gradients, the MoE layers' replicated gradients and the
step's scalars in a single collective.

Every step needs, besides the gradients, a global sum (the experts' share of the gradient
norm, for clipping) and a global maximum (the newest plan any rank has heard of, so that
all ranks switch to it at the same step boundary). Each used to be its own all-reduce of
one number; on loaded hosts a collective costs about the same whatever its size (every
rank must be scheduled: ~5 ms on the 2-core test machine, where a step of the demo model
runs 25 of them), so they ride on the gradients' flat instead:

- a sum is one more element of the flat;
- a maximum over ``W`` ranks is ``W`` more elements: rank ``r`` writes its value at
  position ``r`` and zeros elsewhere, the summed slots hold every rank's value, their
  maximum is the answer.

They ride only where the flat's dtype carries them well: ``float32`` / ``float64`` (a
maximum must be an integer in ``[0, 2**24]`` for ``float32``, exact there). Otherwise (a
``bfloat16`` / ``float16`` model, or no flat at all) each goes in its own all-reduce as before
(``float64`` sum, ``int64`` max): the results are the same either way but for the sum's
rounding (``float32`` there).

The sums may be device tensors (0-dim): they are written into the flat on the device, and
the results come to the host in one copy, together with this rank's own values that the
host needs (its loss), so the step waits for the device once, where it must (the agreed
plan is read on the host), not once per scalar: one device-to-host copy per step in every
case (riding or not, one rank or many).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["StepTotals", "all_reduce_step", "clip_total_norm_"]

#: Largest integer every float32 between 0 and it represents exactly.
_F32_EXACT = 1 << 24
#: Largest integer every float64 between 0 and it represents exactly (the host copy's dtype).
_F64_EXACT = 1 << 53


@dataclass(frozen=True)
class StepTotals:
    """What :func:`all_reduce_step` brings to the host: ``sums`` summed and ``maxima``
    maximised over the ranks, ``local`` (this rank's own values, e.g. its loss) as given."""

    sums: list[float]
    maxima: list[int]
    local: list[float]


def all_reduce_step(
    grads: Sequence[tuple[torch.nn.Parameter, Callable[[torch.Tensor], torch.Tensor]]],
    *,
    sums: Sequence[float | torch.Tensor] = (),
    maxima: Sequence[int] = (),
    local: Sequence[float | torch.Tensor] = (),
    rank: int,
    world: int,
    group: Any = None,
) -> StepTotals:
    """Sum every parameter's gradient over the ranks, pass it through its function (a mean:
    ``g / world``) and store it as the parameter's ``grad`` (zeros where a rank has none);
    return ``sums`` summed and ``maxima`` maximised over the ranks, and ``local`` read on
    the host. One all-reduce when they ride on the gradients (see the module), else one
    more per kind of scalar; in every case ONE device-to-host copy (the step's one wait
    for the device: the plan agreement is read on the host, and the loss rides along).

    Args:
        grads: ``(parameter, post)`` pairs, the same parameters in the same order on every
            rank.
        sums: floats (or 0-dim tensors, on the gradients' device) to add up over the ranks.
        maxima: integers in ``[0, 2**53]`` to take the maximum of over the ranks.
        local: floats or tensors on the gradients' device (this rank's loss, its routing
            counts) to read on the host, not reduced; returned flat, in order (a tensor
            gives its elements), as float64 (exact for integers up to 2**53).
        rank, world: this rank and the group's size (``world == 1``: nothing is sent).
    """
    if any(not 0 <= int(m) <= _F64_EXACT for m in maxima):
        raise ValueError(f"maxima must be integers in [0, 2**53], got {list(maxima)}")
    device = _device(grads, sums, local)
    if world <= 1:
        for p, post in grads:
            if p.grad is not None:
                p.grad = post(p.grad)
        values = _host(_stack([*sums, *local], device))
        return StepTotals(values[: len(sums)], [int(m) for m in maxima], values[len(sums):])
    parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p, _ in grads]
    flat = torch.cat(parts) if parts else torch.zeros(0, device=device)
    ride = flat.dtype in (torch.float32, torch.float64) and (
        flat.dtype == torch.float64 or all(int(m) <= _F32_EXACT for m in maxima))
    n = flat.numel()
    if ride and (sums or maxima):
        extra = torch.zeros(len(sums) + world * len(maxima), dtype=flat.dtype, device=flat.device)
        if sums:
            extra[: len(sums)] = _stack(sums, flat.device)
        for i, m in enumerate(maxima):
            extra[len(sums) + i * world + rank] = float(int(m))
        flat = torch.cat([flat, extra])
    if flat.numel():
        dist.all_reduce(flat, group=group)
    pos = 0
    for p, post in grads:
        k = p.numel()
        p.grad = post(flat[pos: pos + k]).view_as(p)
        pos += k
    if ride:
        summed = flat[n: n + len(sums)].double()
        top = flat[n + len(sums):].double().view(len(maxima), world).amax(dim=1)
    else:
        summed = _stack(sums, flat.device)
        if sums:
            dist.all_reduce(summed, group=group)
        top_int = torch.tensor([int(m) for m in maxima], dtype=torch.int64, device=flat.device)
        if maxima:
            dist.all_reduce(top_int, op=dist.ReduceOp.MAX, group=group)
        top = top_int.double()            # exact: maxima are at most 2**53
    # the one wait for the device: every value the host needs, in one copy
    values = _host(torch.cat([summed, top, _stack(local, flat.device)]))
    k, m = len(sums), len(maxima)
    return StepTotals(values[:k], [int(round(x)) for x in values[k: k + m]], values[k + m:])


def _device(grads: Sequence[tuple[torch.nn.Parameter, Any]], *values: Sequence[Any]) -> torch.device:
    """Where the step's tensors live: the gradients', else the first tensor value's, else the host."""
    for p, _ in grads:
        return p.device
    for seq in values:
        for v in seq:
            if isinstance(v, torch.Tensor):
                return v.device
    return torch.device("cpu")


def _stack(values: Sequence[float | torch.Tensor], device: torch.device) -> torch.Tensor:
    """The values as one float64 vector on ``device`` (a tensor gives its elements, in
    order): tensors never read on the host, numbers filled in there (a copy from pageable
    host memory would wait for the device)."""
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.cat([s.detach().to(device=device, dtype=torch.float64).reshape(-1)
                      if isinstance(s, torch.Tensor)
                      else torch.full((1,), float(s), dtype=torch.float64, device=device) for s in values])


def _host(t: torch.Tensor) -> list[float]:
    return [float(x) for x in t.cpu().tolist()]


def clip_total_norm_(counted: Sequence[torch.Tensor], others: Sequence[torch.Tensor], others_sq: float | torch.Tensor,
                     max_norm: float) -> None:
    """Scale ``counted`` and ``others`` (gradients, in place) by ``max_norm / total`` when the
    total norm exceeds ``max_norm`` (``+ 1e-6``, as torch's ``clip_grad_norm_``): ``total`` is
    the norm of ``counted`` together with ``others_sq``, the squared norm of ``others``
    given (the experts': each counted once over the ranks, summed by the step's
    all-reduce). Computed where the gradients are and never read on the host (on a GPU
    each read would wait for the device); a factor of 1.0 leaves them bit for bit."""
    grads = [*counted, *others]
    if not grads:
        return
    device = grads[0].device
    total_sq = torch.as_tensor(others_sq, dtype=torch.float64).to(device)
    for g in counted:
        total_sq = total_sq + g.pow(2).sum().to(device=device, dtype=torch.float64)
    coef = (max_norm / (total_sq.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device))
