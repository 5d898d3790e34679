"""(d) The Lazarus MoE layer in bf16 against a plain reference on the same tokens and routing.

Our layer: an :class:`lazarus.moe.ElasticMoE` with fused SwiGLU experts
(:class:`lazarus.moe.GroupedExperts`, the transformers 5.x ``gate_up_proj`` / ``down_proj``
layout) on one rank: its ``dispatch`` (counts, the dispatcher, the permutation, the
experts through :func:`lazarus.moe.grouped_mm`, the gated combine). The references compute
the same function with nothing of ours:

* ``grouped``: the token slots sorted by expert (a stable ``argsort``), ``torch._grouped_mm``
  for each projection with the offsets on the device, the gated combine through the inverse
  permutation (no host sync, no atomics);
* ``loop``: the same sort, then one matmul per expert (the counts read to the host once).

Both sides get the same tokens ``h``, the same expert ids and the same gates (the router run
once, outside the timing: routing is not what is compared), the same weights, and the same
loss; forward + backward is timed, the ratio is tokens/s of ours over the best reference,
measured in the same run (target >= 80% on a GPU in bf16). ``compare`` checks first that
ours and the references produce the same outputs and gradients (relative error of each); on CPU in float32 at a tiny
size that comparison is the smoke test (tests/test_bench_gpu_moe_bf16.py). The GPU
figures are NOT YET MEASURED: no GPU has run this section.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SIZES", "build", "compare", "measure", "reference_grouped", "reference_loop"]

#: (tokens, d_model, d_ff per expert, experts, top_k) per run size
SIZES = {"full": dict(tokens=16384, dim=2048, ff=1024, experts=16, top_k=2),
         "quick": dict(tokens=4096, dim=512, ff=512, experts=8, top_k=2),
         "tiny": dict(tokens=96, dim=32, ff=48, experts=4, top_k=2)}

_GROUPED = getattr(torch, "_grouped_mm", None)


def build(p: dict[str, int], device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """Our layer: fused SwiGLU experts, every expert on this one rank, weights drawn from ``seed``."""
    from lazarus.moe import ElasticMoE, GroupedExperts, SoftmaxRouter, grouped_mm
    from lazarus.planning import Placement

    e, d, ff = p["experts"], p["dim"], p["ff"]

    class SwiGLU(GroupedExperts):
        def run(self, x: torch.Tensor, counts: Any) -> torch.Tensor:
            gate, up = grouped_mm(x, self.gate_up_proj.transpose(-2, -1), counts).chunk(2, dim=-1)
            return grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), counts)

    class Layer(ElasticMoE):
        def __init__(self) -> None:
            super().__init__(e)
            g = torch.Generator().manual_seed(seed)
            w = {"gate_up_proj": torch.randn(e, 2 * ff, d, generator=g) * d ** -0.5,
                 "down_proj": torch.randn(e, d, ff, generator=g) * ff ** -0.5}
            self.router = SoftmaxRouter(d, e, p["top_k"], seed=seed + 1)
            self.experts = SwiGLU(e, list(range(e)), w)
            self._init_placement(Placement([list(range(e))]))

    return Layer().to(device=device, dtype=dtype)


def _sorted_slots(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order of the token slots sorted by expert, their token, counts per expert), on the device."""
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, order // ids.shape[1], counts


def _combine(y: torch.Tensor, order: torch.Tensor, gates: torch.Tensor, n_tok: int, dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = sum_k gates[t, k] * y[slot (t, k)]`` with ``y`` in sorted slot order (the
    layer's combine: the slots put back in order, gated, summed over k)."""
    k = gates.shape[1]
    slots = torch.empty_like(y)
    slots[order] = y
    return (slots * gates.reshape(-1, 1)).view(n_tok, k, -1).sum(1).to(dtype)


def reference_grouped(h: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, w_gate_up: torch.Tensor,
                      w_down: torch.Tensor) -> torch.Tensor:
    """The layer's function with ``torch._grouped_mm`` over the slots sorted by expert."""
    if _GROUPED is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm")
    order, tok, counts = _sorted_slots(ids, w_gate_up.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    xs = h.index_select(0, tok)
    gate, up = _GROUPED(xs, w_gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    y = _GROUPED(F.silu(gate) * up, w_down.transpose(-2, -1), offs=offs)
    return _combine(y, order, gates, h.shape[0], h.dtype)


def reference_loop(h: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, w_gate_up: torch.Tensor,
                   w_down: torch.Tensor) -> torch.Tensor:
    """The same with one matmul per expert (the counts read once)."""
    order, tok, counts = _sorted_slots(ids, w_gate_up.shape[0])
    xs = h.index_select(0, tok)
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gate, up = (xs[start:start + n] @ w_gate_up[e].t()).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ w_down[e].t())
        start += n
    return _combine(torch.cat(outs), order, gates, h.shape[0], h.dtype)


def _routing(layer: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        ids, gates = layer.router(h)
    return ids, gates


def _sides(layer: nn.Module) -> dict[str, Callable[..., torch.Tensor]]:
    ex = layer.experts
    sides: dict[str, Callable[..., torch.Tensor]] = {
        "lazarus": lambda h, ids, g: layer.dispatch(h, ids, g),
        "loop": lambda h, ids, g: reference_loop(h, ids, g, ex.gate_up_proj, ex.down_proj)}
    if _GROUPED is not None:
        sides["grouped"] = lambda h, ids, g: reference_grouped(h, ids, g, ex.gate_up_proj, ex.down_proj)
    return sides


def _fwd_bwd(layer: nn.Module, fn: Callable[..., torch.Tensor], h: torch.Tensor, ids: torch.Tensor,
             gates: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward; (output, gradients of h, gates and the expert weights)."""
    layer.zero_grad(set_to_none=True)
    h = h.detach().requires_grad_()
    gates = gates.detach().requires_grad_()
    out = fn(h, ids, gates)
    out.float().square().mean().backward()
    ex = layer.experts
    assert h.grad is not None and gates.grad is not None
    return out.detach(), {"h": h.grad, "gates": gates.grad, "gate_up_proj": ex.gate_up_proj.grad,
                          "down_proj": ex.down_proj.grad}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms, in float32)."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare(layer: nn.Module, h: torch.Tensor, *, rel_tol: float) -> dict[str, float]:
    """Ours against each reference on ``h`` (the same routing): the relative error
    (:func:`_rel`) of the outputs and of each gradient; a ValueError naming the first one
    beyond ``rel_tol`` (bf16 rounds differently in each implementation, so element-wise
    tolerances would fail on sums of many terms; the norm of the difference does not)."""
    ids, gates = _routing(layer, h)
    sides = _sides(layer)
    ours_out, ours_grads = _fwd_bwd(layer, sides.pop("lazarus"), h, ids, gates)
    errors: dict[str, float] = {}
    for name, fn in sides.items():
        out, grads = _fwd_bwd(layer, fn, h, ids, gates)
        errors[f"{name}/out"] = _rel(ours_out, out)
        for key, g in grads.items():
            errors[f"{name}/{key}"] = _rel(ours_grads[key], g)
    bad = {k: v for k, v in errors.items() if not v <= rel_tol}
    if bad:
        raise ValueError(f"the MoE layer and the reference differ beyond a relative error of {rel_tol}: {bad}")
    return errors


def measure(p: dict[str, int], device: torch.device, dtype: torch.dtype, iters: int = 10,
            warmup: int = 3) -> dict[str, Any]:
    """Forward + backward of ours and of each reference, interleaved in rounds (the same
    conditions for each), after :func:`compare` passed. Returns seconds per iteration,
    tokens/s and the ratio of ours to the best reference."""
    torch.manual_seed(0)
    layer = build(p, device, dtype)
    h = torch.randn(p["tokens"], p["dim"], device=device, dtype=dtype)
    diffs = compare(layer, h, rel_tol=2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5)
    ids, gates = _routing(layer, h)
    sides = _sides(layer)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for fn in sides.values():
        for _ in range(warmup):
            _fwd_bwd(layer, fn, h, ids, gates)
    sync()
    spent = dict.fromkeys(sides, 0.0)
    for _ in range(iters):
        for name, fn in sides.items():
            sync()
            t0 = time.perf_counter()
            _fwd_bwd(layer, fn, h, ids, gates)
            sync()
            spent[name] += time.perf_counter() - t0
    seconds = {k: v / iters for k, v in spent.items()}
    best = min((k for k in seconds if k != "lazarus"), key=lambda k: seconds[k])
    from lazarus.moe import grouped_mm_available

    w = layer.experts.gate_up_proj.transpose(-2, -1)
    return {"seconds": seconds, "tokens_per_s": {k: p["tokens"] / v for k, v in seconds.items()},
            "best_reference": best, "ratio": seconds[best] / seconds["lazarus"], "rel_error": diffs,
            "kernel": grouped_mm_available(h[:16].contiguous(), w), "dtype": str(dtype).replace("torch.", ""),
            "size": dict(p)}
