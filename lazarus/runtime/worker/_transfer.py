"""Moving unit states (an expert's weights + optimizer state, a dense module) between
ranks after a reconfiguration: a JSON description of what each rank sends (one all-gather,
or a :class:`Board` the receivers read from), one uneven ``all_to_all_single`` of raw
bytes. Pickle-free, like everything that crosses the wire.

Units are moc's (``expert/<layer>/<e>``, ``module/<name>``), captured with
:func:`moc._units.capture_unit`, so the same trees moc checkpoints are what peers send.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from moc.elastic import TensorMeta, decode_tree, plan_tree, unit_buffer
from moc.elastic import Comm

__all__ = ["Board", "Move", "StoreBoard", "choose_moves", "exchange_units", "read_all", "unit_needs", "world_comm"]


class Board(Protocol):
    """Where senders post what they send and receivers read it, instead of an all-gather
    (every rank waiting for every other): a receiver waits only for its senders' posts."""

    def post(self, rank: int, text: str) -> None:
        """Publish rank ``rank``'s description (once per exchange)."""

    def read(self, ranks: Sequence[int]) -> list[str]:
        """The descriptions of ``ranks``, in that order, waiting until each is posted."""


def read_all(store: Any, keys: Sequence[str]) -> list[str]:
    """The values of ``keys`` (all set) in a torch.distributed ``Store``, as text: one
    round trip where the store has ``multi_get`` (torch >= 2.4)."""
    multi_get = getattr(store, "multi_get", None)
    raw = multi_get(list(keys)) if multi_get is not None else [store.get(k) for k in keys]
    return [bytes(v).decode() for v in raw]


class StoreBoard:
    """A :class:`Board` on a torch.distributed ``Store`` (the rendezvous's), one key per
    rank under ``prefix`` (unique to the exchange); a read waits up to ``timeout``, what
    the all-gather it replaces would have waited."""

    def __init__(self, store: Any, prefix: str, timeout: timedelta) -> None:
        self.store, self.prefix, self.timeout = store, prefix, timeout

    def post(self, rank: int, text: str) -> None:
        self.store.set(f"{self.prefix}/{rank}", text)

    def read(self, ranks: Sequence[int]) -> list[str]:
        keys = [f"{self.prefix}/{r}" for r in ranks]
        self.store.wait(keys, self.timeout)
        return read_all(self.store, keys)


@dataclass(frozen=True)
class Move:
    """Send unit ``unit`` from rank ``src`` to rank ``dst``."""

    unit: str
    src: int
    dst: int


def world_comm() -> Comm:
    """JSON collectives on the default process group (the current generation's)."""
    if not (dist.is_available() and dist.is_initialized()):
        return Comm()
    return Comm(rank=dist.get_rank(), world=dist.get_world_size(), group=dist.group.WORLD)


def unit_needs(inv: Sequence[Mapping[str, Any]], newest: int, slots: Mapping[int, Mapping[str, Sequence[int]]]
               ) -> tuple[dict[int, list[str]], dict[str, list[int]]]:
    """What each rank of the next world must receive and who can send each unit.

    ``inv[i]``: rank i's ``{"step", "experts": {layer: [ids held]}, "modules": [dense unit
    names]}`` (step -1: no state yet); ``slots[i]``: the experts of rank i's slots in the
    plan, per layer. A rank at ``newest`` needs the experts it does not hold; a stale one
    (a failure cut its last step short, or a joiner) needs every dense unit and every expert
    of its slots, except one it holds that nobody holds at ``newest``: it keeps that copy,
    one step behind, rather than have it restored from a checkpoint (asking for it, it would
    have found no other holder and booked the expert lost). Holders at ``newest`` are
    preferred; a unit without one is served by its stale holders. Returns ``(needs,
    holders)`` for :func:`choose_moves`."""
    current = [i for i, r in enumerate(inv) if r["step"] == newest]
    module_names = next(r["modules"] for r in inv if r["step"] == newest)
    holders: dict[str, list[int]] = {m: list(current) for m in module_names}
    for i, r in enumerate(inv):
        if r["step"] < 0:
            continue          # a joiner's experts are placeholders until it is installed
        for layer, experts in r["experts"].items():
            for e in experts:
                holders.setdefault(f"expert/{layer}/{e}", []).append(i)
    for unit, ranks in holders.items():
        fresh = [i for i in ranks if inv[i]["step"] == newest]
        holders[unit] = fresh or ranks
    needs: dict[int, list[str]] = {}
    for i, per_layer in slots.items():
        stale = inv[i]["step"] != newest
        want = list(module_names) if stale else []
        for layer, experts in per_layer.items():
            held = inv[i]["experts"].get(layer, [])
            if not stale:
                have = set(held)
            elif inv[i]["step"] >= 0:
                have = {e for e in held
                        if all(inv[j]["step"] != newest for j in holders.get(f"expert/{layer}/{e}", ()))}
            else:
                have = set()
            want += [f"expert/{layer}/{e}" for e in sorted(set(experts)) if e not in have]
        if want:
            needs[i] = want
    return needs, holders


def choose_moves(needs: Mapping[int, Sequence[str]], holders: Mapping[str, Sequence[int]],
                 nodes: Sequence[str] | None = None) -> tuple[list[Move], list[tuple[str, int]]]:
    """Sources for every (unit, destination) need: the holders of a unit take turns
    (fewest sends of this unit first, then fewest sends overall, then lowest rank), so one
    expert's fetches are spread over all its owners. With ``nodes`` (``nodes[r]``: rank
    r's node), a holder on the destination's own node goes first (several GPUs per node:
    an expert moving between a node's GPUs never crosses the network). Returns
    ``(moves, missing)`` where ``missing`` lists needs no rank can serve. Deterministic:
    every rank derives the same answer from the same inputs."""
    moves: list[Move] = []
    missing: list[tuple[str, int]] = []
    per_unit: dict[tuple[str, int], int] = {}
    total: dict[int, int] = {}
    for dst in sorted(needs):
        for unit in sorted(set(needs[dst])):
            owners = [r for r in holders.get(unit, ()) if r != dst]
            if not owners:
                missing.append((unit, dst))
                continue
            src = min(owners, key=lambda r: (nodes is not None and nodes[r] != nodes[dst],
                                             per_unit.get((unit, r), 0), total.get(r, 0), r))
            per_unit[(unit, src)] = per_unit.get((unit, src), 0) + 1
            total[src] = total.get(src, 0) + 1
            moves.append(Move(unit, src, dst))
    return moves, missing


def exchange_units(moves: Sequence[Move], trees: Mapping[str, Any], comm: Comm | None = None, *,
                   device: torch.device | str = "cpu", board: Board | None = None) -> dict[str, Any]:
    """Run ``moves`` (identical list on every rank; collective). ``trees`` holds the state
    trees of the units this rank sends; returns the trees this rank receives.

    ``device`` (the same on every rank) holds the bytes in flight: ``"cpu"`` for gloo, the
    rank's CUDA device for NCCL, where the received trees' tensors then live too.
    ``board``: the descriptions go through it (each rank reads only its senders'),
    otherwise through one all-gather of every rank's."""
    comm = comm or world_comm()
    device = torch.device(device)
    rank, world = comm.rank, comm.world
    if not moves:
        return {}
    plans = {m.unit: plan_tree(trees[m.unit]) for m in moves if m.src == rank}
    mine = {u: {"skeleton": p.skeleton, "tensors": [t.to_json() for t in p.tensors], "nbytes": p.nbytes}
            for u, p in sorted(plans.items())}
    # what each sender sends, by rank: a unit two holders send (to two receivers) is
    # described by each
    described: dict[int, dict[str, Any]]
    if board is None:
        described = dict(enumerate(comm.gather_json(mine)))
    else:
        if mine:
            board.post(rank, json.dumps(mine))
        senders = sorted({m.src for m in moves if m.dst == rank and m.src != rank})
        described = {rank: mine}
        described.update(zip(senders, (json.loads(text) for text in board.read(senders)) if senders else ()))
    send_parts: list[torch.Tensor] = []
    send_splits, recv_splits = [0] * world, [0] * world
    if any(a.dst > b.dst for a, b in zip(moves, moves[1:])):
        raise ValueError("moves must be sorted by destination rank (all_to_all_single layout)")
    for m in moves:
        if rank not in (m.src, m.dst):
            continue
        n = int(described[m.src][m.unit]["nbytes"])
        if m.src == rank:
            buf = torch.empty(n, dtype=torch.uint8, device=device)
            plans[m.unit].copy_range(0, n, buf)
            send_parts.append(buf)
            send_splits[m.dst] += n
        if m.dst == rank:
            recv_splits[m.src] += n
    send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=torch.uint8, device=device)
    if sum(send_splits) != send.numel():
        raise RuntimeError("transfer bookkeeping error: send buffer does not match its splits")
    received = comm.exchange(send, send_splits, recv_splits)
    starts, pos = {}, 0
    for q in range(world):
        starts[q] = pos
        pos += recv_splits[q]
    out: dict[str, Any] = {}
    for m in moves:
        if m.dst != rank:
            continue
        meta = described[m.src][m.unit]
        n = int(meta["nbytes"])
        if device.type == "cpu":
            data, view = unit_buffer(n)
            # ignore: numpy's stubs give ndarray __buffer__ only on Python >= 3.12
            view[:] = memoryview(received[starts[m.src]: starts[m.src] + n].numpy())  # type: ignore[arg-type, unused-ignore]
        else:   # stays on the device; its own storage, 16-byte aligned like the stream
            data = received[starts[m.src]: starts[m.src] + n].clone()
        starts[m.src] += n
        out[m.unit] = decode_tree(meta["skeleton"], [TensorMeta.from_json(t) for t in meta["tensors"]], data)
    return out
