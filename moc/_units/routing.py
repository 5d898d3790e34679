"""Routing counts without user calls: forward hooks on the models' own routers.

Per MoE layer ``L`` (the text before ``.experts`` in the parameter names), the router is
the submodule ``L.gate`` (transformers' Mixtral, Qwen-MoE, OLMoE, DeepSeek-V3) or
``L.router`` (GPT-OSS, torchtitan, Megatron-core). Its output holds the chosen experts:

* an integer tensor ``[tokens, top_k]`` of expert ids (transformers, torchtitan),
* a boolean routing map ``[tokens, E]`` (Megatron-core) or an integer 0/1 one (Switch
  Transformers), or
* dense weights ``[tokens, E]``, 0 where an expert is not selected (Llama 4),
* tokens per expert, a list of E ints (JetMoE).

Where the router's output holds none of these exactly (DBRX returns float logits; Doge
has no router module), the module the experts are called through is read too: its
integer arguments are the ids (``<layer>.experts(hidden, top_k_index, top_k_weights)``,
Doge's ``down_embed(indices)``). Router ids ``>= E`` are zero-compute experts where the
layer declares them (LongCat-Flash), and an error otherwise.

Every call of a router counts (a layer run twice per forward routes twice the slots). A
router whose output holds none of these is an error at the next checkpoint, naming it,
unless its layer is fed with ``record_routing``: PLT is never silently 0.

Counts accumulate on the router's device (no host sync per step) and are drained into the
manager when it checkpoints. Only training-mode forwards count, and only the first time:
activation checkpointing (``gradient_checkpointing_enable()``, torchtitan's AC,
``torch.utils.checkpoint`` reentrant or not) runs the router's forward again inside the
backward pass, and that recomputation routes no new tokens.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import torch

from .._cuda import LateCopies

__all__ = ["RouterTaps", "find_router", "GLOBAL_ROUTING_ATTR", "routing_reporters"]

log = logging.getLogger("moc")

_ROUTER_NAMES = ("gate", "router")


def find_router(model: torch.nn.Module, layer: str) -> torch.nn.Module | None:
    try:
        block = model.get_submodule(layer)
    except AttributeError:
        return None
    for name in _ROUTER_NAMES:
        mod = getattr(block, name, None)
        if isinstance(mod, torch.nn.Module):
            return mod
    return None


def _recomputing() -> bool:
    """Is this forward running inside a backward pass (activation recomputation)?"""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class _Reading:
    """Expert slots read from one call: ``counts`` [E]; ``rows`` the tokens of a dense
    float reading (0 for an exact one), checked at drain; ``overflow`` ids beyond the
    layer's range (a tensor, not read until drain: no host sync per step)."""

    __slots__ = ("counts", "rows", "overflow")

    def __init__(self, counts: torch.Tensor, rows: int = 0, overflow: torch.Tensor | None = None) -> None:
        self.counts, self.rows, self.overflow = counts, rows, overflow

    def add(self, other: "_Reading") -> "_Reading":
        over = self.overflow if other.overflow is None else (
            other.overflow if self.overflow is None else self.overflow + other.overflow)
        return _Reading(self.counts + other.counts, self.rows + other.rows, over)


def _counts(out: Any, num_experts: int, top_k: int, width: int | None = None, *,
            exact_only: bool = False) -> _Reading | None:
    """Expert slots in a router's output (or in the arguments an experts module is called
    with), read for what they are:

    * a list of E integers: tokens per expert (JetMoE's ``expert_size``; its integer
      tensors are a slot permutation and token indices, not expert ids);
    * a boolean routing map ``[..., E]`` (Megatron-core);
    * an integer tensor ``[..., E]`` of 0/1 (a one-hot dispatch mask: Switch Transformers),
      when E differs from ``top_k`` (then ids and a mask cannot be told apart by shape,
      and both count the same: every expert once per token);
    * an integer tensor ``[..., k]`` of expert ids (transformers, torchtitan): ids in
      ``[E, width)`` select zero-compute experts (LongCat-Flash) and count for none; ids
      ``>= width`` mean the tensor was not ids after all (the drain refuses it); negative
      ids are dropped slots;
    * failing those (unless ``exact_only``), a float tensor ``[..., E]`` whose unselected
      entries are exactly 0 (Llama 4's dense scores): ``rows`` lets :meth:`RouterTaps.drain`
      check that it holds at most ``top_k`` slots per token (logits do not).

    None: nothing readable."""
    width = max(num_experts, width or num_experts)
    items = out if isinstance(out, (tuple, list)) else (out,)
    for t in items:
        if (isinstance(t, (list, tuple)) and len(t) == num_experts and t
                and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in t)):
            return _Reading(torch.tensor(t, dtype=torch.int64))
    tensors = [t for t in items if isinstance(t, torch.Tensor) and t.dim() >= 1]
    for t in tensors:
        if t.dtype == torch.bool and t.shape[-1] == num_experts:
            return _Reading(t.reshape(-1, num_experts).sum(0, dtype=torch.int64))
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            continue
        if t.dim() >= 2 and t.shape[-1] == num_experts and num_experts != top_k:
            return _Reading(t.reshape(-1, num_experts).sum(0, dtype=torch.int64))
        ids = t.reshape(-1).long()      # bins: ids, then width = beyond the range, width + 1 = dropped (< 0)
        binned = torch.bincount(torch.where(ids < 0, width + 1, torch.clamp(ids, max=width)), minlength=width + 2)
        return _Reading(binned[:num_experts], 0, binned[width])
    if exact_only:
        return None
    for t in tensors:
        if t.is_floating_point() and t.dim() >= 2 and t.shape[-1] == num_experts:
            flat = t.detach().reshape(-1, num_experts)
            return _Reading((flat != 0).sum(0, dtype=torch.int64), flat.shape[0])
    return None


def _kinds(out: Any) -> str:
    items = out if isinstance(out, (tuple, list)) else (out,)
    kinds = [f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__ for t in items]
    return f"{kinds}"


def _experts_module(model: torch.nn.Module, layer: str, owner: str | None) -> tuple[str, torch.nn.Module] | None:
    """The module called with the layer's routing: ``<layer>.experts`` (transformers calls it
    with ``(hidden, top_k_index, top_k_weights)``), else the module owning its expert tensors
    (Doge's ``down_embed``, called with the ids; JetMoE's ``input_linear``, with the counts)."""
    for path in (f"{layer}.experts", owner):
        if not path:
            continue
        try:
            return path, model.get_submodule(path)
        except AttributeError:
            continue
    return None


class RouterTaps:
    """Forward hooks on every recognised router, and on the module its layer's experts are
    called through; :meth:`drain` hands over the counts.

    Per layer, the router's output is read first. Where it holds no exact reading (float
    logits, DBRX; no router module at all, Doge), the experts module's inputs are read
    too, in the same forward, and used when the router's reading does not hold up."""

    def __init__(self, model: torch.nn.Module, layers: dict[str, int], *, skip: set[str] | None = None,
                 top_k: int = 1, widths: dict[str, int] | None = None,
                 owners: dict[str, str] | None = None) -> None:
        self.layers = dict(layers)
        self.top_k = int(top_k)
        self.widths = dict(widths or {})
        self._pending: dict[tuple[str, str], _Reading] = {}
        self._handles = []
        self._names: dict[tuple[str, str], str] = {}
        self._armed: dict[str, bool] = {}
        self.unreadable: dict[str, str] = {}    # layer -> why no output of it was read
        self._why: dict[tuple[str, str], str] = {}
        # Readings on a GPU are checked there, the flags copied to the host without waiting,
        # each labelled (layer, why); a flag False means no reading of that layer held up.
        self._checks: LateCopies[tuple[str, str]] = LateCopies(torch.stack)
        self.check_on_device = False   # tests: CPU readings through the device path
        paths = {id(m): n for n, m in model.named_modules()}
        for layer, num in layers.items():
            if skip and layer in skip:
                continue
            router = find_router(model, layer)
            if router is not None:
                self._names[(layer, "router")] = f"{paths.get(id(router), layer)} ({type(router).__name__})"
                self._handles.append(router.register_forward_hook(self._hook(layer, num)))
            found = _experts_module(model, layer, (owners or {}).get(layer))
            if found is not None and found[1] is not router:
                path, mod = found
                self._names[(layer, "experts")] = f"{path} ({type(mod).__name__})"
                self._handles.append(mod.register_forward_pre_hook(self._input_hook(layer, num)))
            self._armed[layer] = router is None
        self.tapped = len({l for l, _ in self._names})

    def _add(self, layer: str, source: str, reading: _Reading) -> None:
        key = (layer, source)
        prev = self._pending.get(key)
        self._pending[key] = reading if prev is None else prev.add(reading)

    def _hook(self, layer: str, num: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            if not module.training or _recomputing():
                return
            with torch.no_grad():
                found = _counts(out, num, self.top_k, self.widths.get(layer))
            # the experts' inputs are read in this forward too unless this reading is exact
            self._armed[layer] = found is None or found.rows > 0
            if found is None:
                self._why.setdefault((layer, "router"), f"it returned {_kinds(out)}")
                return
            self._add(layer, "router", found)
        return hook

    def _input_hook(self, layer: str, num: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not module.training or _recomputing() or not self._armed.get(layer):
                return
            with torch.no_grad():
                found = _counts(tuple(args[1:]) if len(args) > 1 else tuple(args), num, self.top_k,
                                self.widths.get(layer), exact_only=True)
            if found is None:
                self._why.setdefault((layer, "experts"), f"it was called with {_kinds(args)}")
                return
            self._add(layer, "experts", found)
        return hook

    def _failure(self, layer: str, source: str, r: _Reading) -> tuple[str, str] | None:
        """The check reading ``r`` of ``source`` must pass: ``("overflow", why)`` (integer ids
        beyond the layer's range), ``("dense", why)`` (more than top_k slots per token), or
        None for an exact reading."""
        name = self._names.get((layer, source), layer)
        if r.overflow is not None:
            return "overflow", (f"{name}: its integer output holds values >= "
                                f"{self.widths.get(layer, self.layers[layer])} (not expert ids)")
        if r.rows:
            return "dense", (f"{name}: its float output [tokens, E] selects more than top_k = {self.top_k} "
                             "experts per token (logits, not routing)")
        return None

    def _readings(self, layer: str, why: list[str]) -> Iterator[tuple[str, _Reading]]:
        """The layer's readings, router first; a source that gave nothing readable adds its
        reason to ``why`` instead."""
        for source in ("router", "experts"):
            r = self._pending.get((layer, source))
            if r is not None:
                yield source, r
            elif (layer, source) in self._why:
                why.append(f"{self._names.get((layer, source), layer)}: {self._why[(layer, source)]}")

    def _pick(self, layer: str) -> torch.Tensor | None:
        """The layer's counts from the first reading that holds up; None (and a reason in
        ``unreadable``) when none does. Reads the readings' values on the host."""
        why: list[str] = []
        for source, r in self._readings(layer, why):
            failure = self._failure(layer, source, r)
            if failure is not None:
                kind, text = failure
                if kind == "overflow" and r.overflow is not None and int(r.overflow) > 0:
                    why.append(text)
                    continue
                if kind == "dense" and int(r.counts.sum()) > r.rows * self.top_k:
                    why.append(text)
                    continue
            return r.counts
        if why:
            self.unreadable.setdefault(layer, "; ".join(why))
        return None

    def _on_device(self, layer: str) -> torch.device | None:
        """The GPU the layer's readings are on (None: all on the host)."""
        for source in ("router", "experts"):
            r = self._pending.get((layer, source))
            if r is not None and r.counts.device.type != "cpu":
                return r.counts.device
        return torch.device("cpu") if self.check_on_device else None

    def _pick_on(self, layer: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, str]:
        """:meth:`_pick` without reading a value on the host: the first reading that holds
        up is chosen on ``device``; returns (counts, held, why) with ``held`` a 0-dim bool
        tensor, False when no reading held up (``why`` then says why, checked once the flag
        reaches the host: :meth:`_settle_checks`)."""
        why: list[str] = []
        chosen: torch.Tensor | None = None
        held: torch.Tensor | None = None
        for source, r in self._readings(layer, why):
            counts = r.counts.to(device, non_blocking=True)
            ok = torch.ones((), dtype=torch.bool, device=device)
            failure = self._failure(layer, source, r)
            if failure is not None:
                kind, text = failure
                why.append(text)
                if kind == "overflow":
                    assert r.overflow is not None       # said only of a reading with overflow ids
                    ok = r.overflow.to(device, non_blocking=True).reshape(()) == 0
                else:
                    ok = counts.sum() <= r.rows * self.top_k
            if chosen is None or held is None:     # set together: both None before the first reading
                chosen, held = torch.where(ok, counts, torch.zeros_like(counts)), ok
            else:
                use = ok & ~held
                chosen, held = torch.where(use, counts, chosen), held | ok
        assert chosen is not None and held is not None      # asked only of a layer with a pending reading
        return chosen, held, "; ".join(why)

    def _settle_checks(self, *, wait: bool) -> None:
        """Book the device checks whose flags reached the host: a layer none of whose
        readings held up is ``unreadable`` (the drain then raises for it)."""
        for flags, entries in self._checks.arrived(wait=wait):
            for held, (layer, why) in zip(flags.tolist(), entries):
                if not held:
                    self.unreadable.setdefault(layer, why or "no reading held up")

    def _check_later(self, held: list[tuple[str, torch.Tensor, str]]) -> None:
        """Copy the layers' flags to the host without waiting (one copy per device)."""
        self._checks.send((flag, (layer, why)) for layer, flag, why in held)

    def drain(self, record: Callable[[str, torch.Tensor], None],
              fed: Callable[[str], bool] = lambda layer: False) -> None:
        """Hand the counts to ``record``. Raises ``ValueError`` naming the router of every
        layer whose outputs held no readable expert slots (``fed(layer)``: the user feeds
        that layer with ``record_routing``, so its router needs no reading). Readings on a
        GPU are handed over as device tensors and checked without waiting: a layer whose
        readings did not hold up raises at the first drain after its check reached the host
        (one decision late at most), its counts until then are zero."""
        # A layer the user feeds is not read at all: its counts would be booked twice, and
        # reading a reading checks values on the host (a wait for the device on a GPU).
        layers = [l for l in dict.fromkeys([l for l, _ in self._pending] + [l for l, _ in self._why]) if not fed(l)]
        picked: dict[str, torch.Tensor | None] = {}
        held = []
        for l in layers:
            device = self._on_device(l)
            if device is None or not any((l, src) in self._pending for src in ("router", "experts")):
                picked[l] = self._pick(l)
            else:
                # On a GPU: chosen there, checked once the flag is on the host (reading it now
                # would make this step wait for every kernel queued before it).
                picked[l], flag, why = self._pick_on(l, device)
                held.append((l, flag, why))
        self._pending, self._why = {}, {}
        if held:
            self._check_later(held)
        self._settle_checks(wait=False)
        bad = {l: why for l, why in self.unreadable.items() if not fed(l)}
        if bad:
            layer, why = next(iter(bad.items()))
            raise ValueError(f"MoE layer {layer!r}: moc cannot read the expert slots its router selects ({why}); "
                             "expected expert ids [tokens, k], a boolean or 0/1 mask [tokens, E], tokens per "
                             "expert (a list of E ints), or dense weights [tokens, E] that are 0 where an expert "
                             f"is not selected. Call ckpt.record_routing({layer!r}, tokens_per_expert) "
                             "each step instead" + (f" (also {sorted(bad)[1:4]})" if len(bad) > 1 else ""))
        for layer, counts in picked.items():
            if counts is not None:
                record(layer, counts)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


#: The protocol by which an MoE layer reports its own routing to moc, without moc knowing
#: its class: a module with ``reports_global_routing = True`` and a settable ``routing_hook``
#: attribute calls ``routing_hook(counts)`` after each forward with the global (all-rank)
#: tokens per expert. Lazarus's MoE layers declare it; moc never imports them.
GLOBAL_ROUTING_ATTR = "reports_global_routing"


def routing_reporters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every module of ``model`` that reports its own routing."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, GLOBAL_ROUTING_ATTR, False) is True]
