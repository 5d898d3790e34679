"""Exact mode's bookkeeping: the window being captured, the replay under way, the outcome
of a window round, and the gradient digest that catches a replay that diverged."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import xxhash

from .._snapshot import SnapshotBuffer
from .._units import local_tensor
from .schedule import ExactSchedule
from .store import extra_name

__all__ = ["Window", "Replay", "Round", "grad_digest", "window_steps"]


def grad_digest(model: torch.nn.Module) -> dict[str, Any]:
    """xxh3 of every gradient's bytes (parameter order, names included; a DTensor's local
    shard) and the norm of those bytes (this rank's part; float32 dot products: a hint for
    the error message, only the hash is compared)."""
    h = xxhash.xxh3_64()
    sq = 0.0
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = local_tensor(p.grad).detach()
        if g.device.type != "cpu":
            g = g.cpu()
        g = g.contiguous()
        h.update(name.encode())
        if g.numel():
            # ignore: numpy's stubs give ndarray __buffer__ only on Python >= 3.12
            h.update(memoryview(g.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type, unused-ignore]
            # not g.double().pow(2).sum(): that copies every gradient twice (~1.7 s per window
            # on benchmarks/exact's 1.3 GB model, all of it in the optimizer step's pre-hook)
            flat = g.reshape(-1)
            flat = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
            sq += float(torch.dot(flat, flat))
    return {"xxh3": h.hexdigest(), "norm": sq ** 0.5}


@dataclass
class Window:
    start: int
    schedule: ExactSchedule
    buf: SnapshotBuffer
    index: int                                  # windows started by this process
    offset: int = 0
    pieces: list[dict[str, Any]] = field(default_factory=list)
    step_bytes: list[int] = field(default_factory=list)
    grad: dict[str, Any] | None = None

    @property
    def end(self) -> int:
        return self.start + self.schedule.window - 1


@dataclass
class Replay:
    start: int
    end: int
    steps: dict[int, dict[str, Any]]            # step -> {"full": [...], "weights": [...], "extra": tree}
    grad: dict[str, Any] | None
    source: str
    lease: SnapshotBuffer | None = None
    next: int = 0
    checked: bool = False


@dataclass
class Round:
    """The outcome of a window round: the same on every rank."""

    no_buffer: bool
    prev_failed: bool
    sigterm: bool
    fatal: bool
    persist: int | None                          # the window (its last step) to persist now


def window_steps(ex: Mapping[str, Any], slots: Mapping[str, int],
                 trees: Mapping[tuple[str, int, str], Any]) -> dict[int, Any]:
    """A window's trees by replayed step: per step, the full states promoted then (units
    of that slot), the compute weights of the units promoted later, and the extra state."""
    start, w = int(ex["start"]), int(ex["window"])
    steps: dict[int, dict[str, Any]] = {}
    for i in range(w):
        t = start + i
        full = [trees[("full", t, u)] for u, s in sorted(slots.items()) if s == i]
        weights = [trees[("weights", t, u)] for u, s in sorted(slots.items()) if s > i]
        steps[t] = {"full": full, "weights": weights, "extra": trees[("extra", t, extra_name(t))]}
    return steps
