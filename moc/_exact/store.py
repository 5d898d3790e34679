"""Exact mode's windows in storage: names, one rank's part of a window written, the ranks'
parts committed as one manifest, and one rank's part read back.

A window's manifest holds, for every rank r:

* the full state of each of r's units, under the unit's name (a DTensor piece carries its
  piece suffix, :mod:`moc._units.layouts`), version step = the unit's slot step;
* the compute weights of each unit at the steps before its slot, ``exact/weights/<t>/<unit>``;
* the extra state of every step, ``exact/extra/<t>`` (rank 0) or ``exact/extra/<t>/rank<r>``.

A unit held by several ranks (a replicated module under DDP, a replicated expert) is
stored once per holder, as ``<unit>@rank<r>``: each holder replays its own schedule. The
manifest's ``meta["exact"]`` has the window (``start``, ``window``, ``world``) and, per
rank, its slots, the gradient digest of the window's second step and the bytes per step.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from .._errors import CheckpointError
from .._snapshot import SnapshotBuffer
from .._store import CheckpointStore, CorruptObjectError, Manifest, UnitRecord, manifest_key

__all__ = ["weights_name", "extra_name", "stored_name", "write_part", "rank_meta", "read_part"]

FORMAT = 2


def weights_name(step: int, unit: str) -> str:
    """Storage name of a unit's compute weights captured at ``step``."""
    return f"exact/weights/{step}/{unit}"


def extra_name(step: int, rank: int = 0) -> str:
    """Storage name of rank ``rank``'s extra state captured at ``step``."""
    return f"exact/extra/{step}" + (f"/rank{rank}" if rank else "")


def stored_name(unit: str, rank: int, shared: bool) -> str:
    """A unit's name in storage: its own, or ``<unit>@rank<r>`` when several ranks hold it."""
    return f"{unit}@rank{rank}" if shared else unit


def write_part(store: CheckpointStore, buf: SnapshotBuffer, header: Mapping[str, Any], rank: int,
               shared: set[str]) -> list[UnitRecord]:
    """Write this rank's pieces of the window in ``buf`` (objects only); return their records."""
    writer = store.writer(int(header["step"]), f"r{rank}")
    records = []
    for piece in header["pieces"]:
        what, unit, t = piece["what"], piece["unit"], int(piece["step"])
        chunk = writer.add_bytes([buf.view(piece["offset"], piece["nbytes"])], offset=0,
                                 itemsize=piece["itemsize"], group="experts" if piece["kind"] == "expert" else "state")
        if what == "extra":
            name = extra_name(t, rank)
        else:
            name = stored_name(unit, rank, unit in shared)
            if what == "weights":
                name = weights_name(t, name)
        kind = piece["kind"] if what == "full" else "extra"
        records.append(UnitRecord(name=name, kind=kind, step=t, nbytes=piece["nbytes"], skeleton=piece["skeleton"],
                                  tensors=piece["tensors"], chunks=[chunk],
                                  layer=piece["layer"] if kind == "expert" else None,
                                  expert=piece["expert"] if kind == "expert" else None))
    writer.finish()
    return records


def rank_meta(header: Mapping[str, Any]) -> dict[str, Any]:
    """What the manifest keeps of one rank's window header."""
    ex = header["exact"]
    return {"slots": ex["slots"], "grad": ex.get("grad"), "step_bytes": ex.get("step_bytes")}


def window_meta(header: Mapping[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    ex = header["exact"]
    return {"format": FORMAT, "start": ex["start"], "window": ex["window"], "world": len(ranks), "ranks": ranks}


def read_part(store: CheckpointStore, manifest: Manifest, rank: int, world: int, units: Iterable[str],
              shared: set[str]) -> tuple[dict[str, Any], dict[tuple[str, int, str], Any]]:
    """This rank's part of the window committed in ``manifest``: (its meta: slots, grad;
    the trees keyed ``(what, step, unit)`` as in a memory window)."""
    ex = manifest.meta["exact"]
    parts = ex.get("ranks") or [ex]              # format 1: one process, its meta at the top
    if len(parts) != world:
        raise CheckpointError(
            f"{store.store.url}: the exact window at step {manifest.step} was written by {len(parts)} rank(s); "
            f"this job has {world}. Exact replay needs the same ranks holding the same shards (restore with "
            f"{len(parts)} ranks, or use exact=False to reshard)")
    mine = parts[rank]
    slots: dict[str, int] = mine["slots"]
    units = list(units)
    missing = sorted(set(units) - set(slots))
    if missing:
        raise CheckpointError(f"the exact window at step {manifest.step} lacks units {missing[:4]} of this model "
                              f"(rank {rank})")
    start, w = int(ex["start"]), int(ex["window"])
    want: dict[str, tuple[str, int, str]] = {}
    for u in units:
        name = stored_name(u, rank, u in shared)
        want[name] = ("full", start + int(slots[u]), u)
        for t in range(start, start + int(slots[u])):
            want[weights_name(t, name)] = ("weights", t, u)
    for t in range(start, start + w):
        want[extra_name(t, rank)] = ("extra", t, extra_name(t))
    absent = [n for n in want if n not in manifest.units]
    if absent:
        raise CheckpointError(f"the exact window at step {manifest.step} has no {absent[:3]} (rank {rank})")
    units_read = load_window(store, manifest, list(want), rank)
    return mine, {want[name]: tree for name, tree in units_read.items()}


def load_window(store: CheckpointStore, manifest: Manifest, names: list[str], rank: int) -> dict[str, Any]:
    """The named units of an exact window, each at the version the window recorded: never
    an older one in place of an unreadable object (restore falls back so elsewhere), as a
    window replayed from another version would not reproduce the run, and the PLT of an
    exact restore is 0 by promise."""
    try:
        return store.load(manifest.step, names=names, fallback=False).units
    except CorruptObjectError as exc:
        raise CheckpointError(
            f"rank {rank}: the exact window at step {manifest.step} cannot be restored: {exc}. An exact restore "
            f"takes no older version in place of an unreadable object (its replay would not reproduce the run). "
            f"`moc verify {store.store.url}` lists the bad objects; to restore the previous window, remove "
            f"{manifest_key(manifest.step)} from the store") from exc
