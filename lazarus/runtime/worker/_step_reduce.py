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
the results come to the host in one copy, so the step waits for the device once, where it
must (the agreed plan is read on the host), not once per scalar.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["all_reduce_step", "clip_total_norm_"]

#: Largest integer every float32 between 0 and it represents exactly.
_F32_EXACT = 1 << 24


def all_reduce_step(
    grads: Sequence[tuple[torch.nn.Parameter, Callable[[torch.Tensor], torch.Tensor]]],
    *,
    sums: Sequence[float | torch.Tensor] = (),
    maxima: Sequence[int] = (),
    rank: int,
    world: int,
    group: Any = None,
) -> tuple[list[float], list[int]]:
    """Sum every parameter's gradient over the ranks, pass it through its function (a mean:
    ``g / world``) and store it as the parameter's ``grad`` (zeros where a rank has none);
    return ``sums`` summed and ``maxima`` maximised over the ranks. One all-reduce when
    they ride on the gradients (see the module), else one more per kind of scalar.

    Args:
        grads: ``(parameter, post)`` pairs, the same parameters in the same order on every
            rank.
        sums: floats (or 0-dim tensors, on the gradients' device) to add up over the ranks.
        maxima: integers ``>= 0`` to take the maximum of over the ranks.
        rank, world: this rank and the group's size (``world == 1``: nothing is sent).
    """
    if any(int(m) < 0 for m in maxima):
        raise ValueError(f"maxima must be integers >= 0, got {list(maxima)}")
    if world <= 1:
        for p, post in grads:
            if p.grad is not None:
                p.grad = post(p.grad)
        return _host(_stack(sums, torch.device("cpu"))) if sums else [], [int(m) for m in maxima]
    parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p, _ in grads]
    flat = torch.cat(parts) if parts else torch.zeros(0)
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
        tail = flat[n:].double().cpu()   # the one wait for the device
        slots = tail[len(sums):].view(len(maxima), world)
        return _host(tail[: len(sums)]), [int(x) for x in slots.max(dim=1).values.round().long()] if maxima else []
    out_sums, out_max = [], []
    if sums:
        t = _stack(sums, flat.device)
        dist.all_reduce(t, group=group)
        out_sums = _host(t)
    if maxima:
        t = torch.tensor([int(m) for m in maxima], dtype=torch.int64, device=flat.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        out_max = [int(x) for x in t.cpu()]
    return out_sums, out_max


def _stack(sums: Sequence[float | torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sums as one float64 vector on ``device``: tensors never read on the host, numbers
    filled in there (a copy from pageable host memory would wait for the device)."""
    return torch.stack([s.to(device=device, dtype=torch.float64).reshape(()) if isinstance(s, torch.Tensor)
                        else torch.full((), float(s), dtype=torch.float64, device=device) for s in sums])


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
