"""Exact mode's bookkeeping: the window being captured, the replay under way, the outcome
of a window round, and the gradient digest that catches a replay that diverged."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import xxhash

from .._cuda import runtime
from .._cuda.copies import to_host_later
from .._snapshot import SnapshotBuffer
from .._units import local_tensor
from .schedule import ExactSchedule
from .store import extra_name

__all__ = ["Window", "Replay", "Round", "GradDigest", "grad_digest", "grad_digest_later", "digest_kind", "digest_key",
           "window_steps"]


def _signed(v: int) -> int:
    """``v`` (0 <= v < 2**64) as the int64 with the same bits."""
    return v - (1 << 64) if v >= 1 << 63 else v


_MIX = _signed(0x9E3779B97F4A7C15)          # odd: h * _MIX + x mixes the order of what is summed in
_CHUNK = 1 << 20                            # int64 words per weighted sum (8 MiB of weights per device)
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    """``_CHUNK`` odd int64 weights (splitmix64 of the position; the same bits on every
    device: int64 arithmetic wraps the same way everywhere), made once per device."""
    w = _WEIGHTS.get(device)
    if w is None:
        z = torch.arange(_CHUNK, dtype=torch.int64, device=device) * _MIX + _signed(0x632BE59BD9B4E019)
        z = (z ^ (z >> 30)) * _signed(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> 27)) * _signed(0x94D049BB133111EB)
        w = _WEIGHTS[device] = (z ^ (z >> 31)) | 1
    return w


def _words(g: torch.Tensor) -> torch.Tensor:
    """The bytes of the contiguous ``g`` as int64 words (viewed when they divide evenly,
    else widened from narrower integers)."""
    b = g.reshape(-1).view(torch.uint8)
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if b.numel() % size == 0:
            try:
                return b.view(dtype).to(torch.int64)
            except RuntimeError:      # storage offset not aligned for the wider dtype
                continue
    return b.to(torch.int64)


class GradDigest:
    """A gradient digest on its way to the host: :meth:`result` gives the dict stored in
    a window's header (waiting for the device copy when it is not there yet)."""

    def __init__(self, value: dict[str, Any] | None = None, *, event: Any = None,
                 host: torch.Tensor | None = None) -> None:
        self._value, self._event, self._host = value, event, host

    def result(self) -> dict[str, Any]:
        if self._value is None:
            assert self._host is not None     # a device digest carries its host copy
            if self._event is not None:
                self._event.synchronize()
            h = int(self._host[0]) & ((1 << 64) - 1)
            sq = float(self._host[1:2].view(torch.float64)[0])
            self._value = {"dev64": f"{h:016x}", "norm": sq ** 0.5}
        return self._value


def digest_kind(model: torch.nn.Module) -> str:
    """``"dev64"`` when the model's parameters live on a CUDA device (the digest is computed
    there, see :func:`grad_digest_later`), else ``"xxh3"`` (on the host)."""
    rt = runtime()
    return "dev64" if any(rt.device_of(p) is not None or p.is_cuda for p in model.parameters()) else "xxh3"


def grad_digest_later(model: torch.nn.Module, kind: str | None = None) -> GradDigest:
    """The gradient digest of ``model`` (``kind``: ``"xxh3"`` or ``"dev64"``, default
    :func:`digest_kind`), without waiting for the device.

    ``xxh3`` (host): xxh3 of every gradient's bytes. ``dev64`` (device): every gradient's
    bytes as int64 words, weighted by fixed odd numbers and summed (int64 sums wrap, so the
    order of the additions does not change the bits: the same on every run and device),
    chained over gradients and chunks with their names and sizes; no gradient leaves the
    device, and the two words (digest, squared norm) reach the host in one non-blocking copy.
    Both: parameter order, names included; a DTensor's local shard; and the norm of the
    bytes (this rank's part; float32 dot products: a hint for the error message, only the
    digest is compared)."""
    kind = digest_kind(model) if kind is None else kind
    if kind == "xxh3":
        return GradDigest(_xxh3_digest(model))
    if kind != "dev64":
        raise ValueError(f"grad digest kind must be 'xxh3' or 'dev64', got {kind!r}")
    h: torch.Tensor | None = None
    sq: torch.Tensor | None = None
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = local_tensor(p.grad).detach().contiguous()
        if h is None:
            h = torch.zeros((), dtype=torch.int64, device=g.device)
            sq = torch.zeros((), dtype=torch.float64, device=g.device)
        assert sq is not None
        mixed = torch.zeros((), dtype=torch.int64, device=g.device) + _signed(
            xxhash.xxh3_64_intdigest(name.encode()) ^ (g.numel() * g.element_size()))
        if g.numel():
            words = _words(g)
            w = _weights(g.device)
            for chunk in words.split(_CHUNK):
                mixed = mixed * _MIX + (chunk * w[: chunk.numel()]).sum()
            flat = g.reshape(-1)
            flat = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
            sq = sq + torch.dot(flat, flat).double().to(sq.device, non_blocking=True)
        h = h * _MIX + mixed.to(h.device, non_blocking=True)
    if h is None or sq is None:
        h = torch.zeros((), dtype=torch.int64)
        sq = torch.zeros((), dtype=torch.float64)
    event, host = to_host_later(torch.stack([h, sq.view(torch.int64)]))
    return GradDigest(event=event, host=host)


def _xxh3_digest(model: torch.nn.Module) -> dict[str, Any]:
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


def grad_digest(model: torch.nn.Module, kind: str | None = None) -> dict[str, Any]:
    """:func:`grad_digest_later`'s result, waited for."""
    return grad_digest_later(model, kind).result()


def digest_key(recorded: Mapping[str, Any]) -> str:
    """The kind of a recorded digest (windows written before device digests hold ``xxh3``)."""
    return "dev64" if "dev64" in recorded else "xxh3"


@dataclass
class Window:
    start: int
    schedule: ExactSchedule
    buf: SnapshotBuffer
    index: int                                  # windows started by this process
    offset: int = 0
    pieces: list[dict[str, Any]] = field(default_factory=list)
    step_bytes: list[int] = field(default_factory=list)
    grad: GradDigest | None = None

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
