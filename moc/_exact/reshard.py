"""Exact mode's restore onto other ranks or another placement (``restore(reshard=True)``).

A window committed to storage holds, per rank of the job that wrote it, that rank's units
(its slots, the full state at each unit's slot step, compute weights before it). Restoring
onto another job (another number of ranks, another assignment of units to ranks: an
elastic runtime after a failure) reads every unit this rank holds *now* by its name:

* every unit comes from one *canonical* record: the lowest rank of the window that held it
  (a replicated unit was stored once per holder as ``<unit>@rank<r>``; any holder's copy is
  equal, but their slots may differ, and every holder must promote the unit at the same
  step with the same state or the replicas would drift apart after the replay);
* a unit whose canonical record this rank also holds in its own shared memory (the same
  window, the unit at the same slot: the same bytes) is read from there, the rest from
  storage;
* the extra state (RNG, optimizer hyper-parameters) of each step is this rank's own where
  the window had that rank, else rank 0's.

The replay-divergence check compares each rank's gradients with those recorded by the same
rank when the step was first trained: it holds only when the world and every rank's units
are the window's (then replay is bit-identical). The caller turns it off otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import xxhash

from .._errors import CheckpointError
from .._snapshot import PERSIST, READY, BufferPool, SnapshotBuffer
from .._store import CheckpointStore, Manifest, TensorMeta, decode_tree
from .store import extra_name, load_window, weights_name

__all__ = ["Resharded", "canonical_sources", "read_resharded"]

Key = tuple[str, int, str]


@dataclass
class Resharded:
    """This rank's part of a window, read by unit name."""

    slots: dict[str, int]                        # unit -> slot (the canonical record's)
    trees: dict[Key, Any]                        # (what, step, unit) -> tree, as a memory window
    grad: dict[str, Any] | None                  # this rank's recorded gradient digest (same rank index)
    same_layout: bool                            # world and this rank's units are the window's
    from_memory: int = 0                         # units read from this rank's shared memory
    from_storage: int = 0
    lease: SnapshotBuffer | None = None          # the memory buffer read (held until the replay ends)
    notes: list[str] = field(default_factory=list)


def _parts(manifest: Manifest) -> list[dict[str, Any]]:
    ex = manifest.meta["exact"]
    return ex.get("ranks") or [ex]              # format 1: one process, its meta at the top


def canonical_sources(manifest: Manifest, units: Iterable[str]) -> dict[str, tuple[int, int]]:
    """``unit -> (rank of the window whose record is read, its slot)`` for every unit of
    ``units``; raises :class:`CheckpointError` naming the units no rank of the window held."""
    parts = _parts(manifest)
    out: dict[str, tuple[int, int]] = {}
    for u in units:
        for r, p in enumerate(parts):
            s = p["slots"].get(u)
            if s is not None:
                out[u] = (r, int(s))
                break
    missing = sorted(set(units) - set(out))
    if missing:
        raise CheckpointError(
            f"the exact window at step {manifest.step} has no record of units {missing[:4]} (written by "
            f"{len(parts)} rank(s)); a unit is read back by its name, so the model must have the same units "
            "(a DTensor piece the same global offsets)")
    return out


def _memory_buffer(pool: BufferPool, manifest: Manifest) -> SnapshotBuffer | None:
    """This rank's buffer holding the manifest's window (same run, same steps), if any."""
    start = int(manifest.meta["exact"]["start"])
    for b in pool.buffers:
        h = b.header or {}
        if b.step == manifest.step and b.state in (READY, PERSIST) and h.get("run") == manifest.meta.get("run_id") \
                and isinstance(h.get("exact"), dict) and int(h["exact"].get("start", -1)) == start:
            return b
    return None


def _from_memory(buf: SnapshotBuffer, picks: dict[str, tuple[int, int]], start: int) -> dict[Key, Any]:
    """The trees of every unit of ``picks`` that ``buf``'s window has at the same slot."""
    header = buf.header
    slots = header["exact"]["slots"]
    pieces = {(p["what"], int(p["step"]), p["unit"]): p for p in header["pieces"]}
    out: dict[Key, Any] = {}
    for u, (_, s) in picks.items():
        if slots.get(u) != s:
            continue
        keys = [("full", start + s, u)] + [("weights", t, u) for t in range(start, start + s)]
        if not all(k in pieces for k in keys):
            continue
        for k in keys:
            p = pieces[k]
            if "xxh3:" + xxhash.xxh3_64_hexdigest(buf.view(p["offset"], p["nbytes"])) != p["checksum"]:
                raise ValueError(f"piece {p['unit']} of step {p['step']} failed its checksum")
            out[k] = decode_tree(p["skeleton"], [TensorMeta.from_json(m) for m in p["tensors"]],
                                 buf.data[p["offset"]: p["offset"] + p["nbytes"]])
    return out


def read_resharded(store: CheckpointStore, manifest: Manifest, *, rank: int, world: int, units: Iterable[str],
                   pool: BufferPool | None) -> Resharded:
    """Read this rank's units of the window committed in ``manifest`` by name (see the
    module docstring). ``pool``: this rank's shared-memory buffers (None: storage only)."""
    units = sorted(units)
    parts = _parts(manifest)
    ex = manifest.meta["exact"]
    start, w = int(ex["start"]), int(ex["window"])
    picks = canonical_sources(manifest, units)
    own = parts[rank] if rank < len(parts) else None
    same = len(parts) == world and own is not None and set(own["slots"]) == set(units)
    trees: dict[Key, Any] = {}
    lease = None
    notes: list[str] = []
    buf = _memory_buffer(pool, manifest) if pool is not None else None
    if buf is not None:
        assert pool is not None     # buf is one of its buffers
        with pool.lock:
            buf.users += 1
        try:
            trees = _from_memory(buf, picks, start)
        except (OSError, ValueError, KeyError) as exc:
            notes.append(f"memory copy unusable ({exc}); storage instead")
            trees = {}
        if trees:
            lease = buf
        else:
            pool.release(buf)
    in_memory = {k[2] for k in trees if k[0] == "full"}
    want: dict[str, Key] = {}
    for u, (r, s) in picks.items():
        if u in in_memory:
            continue
        name = f"{u}@rank{r}" if f"{u}@rank{r}" in manifest.units else u
        want[name] = ("full", start + s, u)
        for t in range(start, start + s):
            want[weights_name(t, name)] = ("weights", t, u)
    extra_rank = rank if rank < len(parts) else 0
    for t in range(start, start + w):
        want[extra_name(t, extra_rank)] = ("extra", t, extra_name(t))
    absent = [n for n in want if n not in manifest.units]
    if absent:
        if lease is not None and pool is not None:     # a lease is one of pool's buffers
            pool.release(lease)
        raise CheckpointError(f"the exact window at step {manifest.step} has no {absent[:3]} (rank {rank})")
    try:
        loaded_units = load_window(store, manifest, list(want), rank)
    except BaseException:
        if lease is not None and pool is not None:     # a lease is one of pool's buffers
            pool.release(lease)
        raise
    trees.update({want[name]: tree for name, tree in loaded_units.items()})
    return Resharded(slots={u: s for u, (_, s) in picks.items()}, trees=trees,
                     grad=own.get("grad") if own is not None else None, same_layout=same,
                     from_memory=len(in_memory), from_storage=len(units) - len(in_memory), lease=lease, notes=notes)
