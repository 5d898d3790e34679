"""Choosing what to restore: the newest version of every unit among in-memory snapshots
(on any surviving rank) and storage, consistent with one restore step.

Pure planning over JSON inventories, so every rank computes the same answer from the
gathered inventories without further talk.

* The restore step ``S`` is the newest step at which every non-expert module is complete:
  either a storage manifest, or a snapshot step whose module bytes are fully covered by
  the snapshot shards that survive in memory.
* Every unit then takes its newest version at or before ``S``: from memory when some step
  ``<= S`` covers all its bytes, from storage otherwise (the manifest's record).
* Versions newer than ``S`` are never used: the model would otherwise mix states that
  never coexisted.

What a restore did is summed up for the user in a :class:`RestoreReport` (one log line,
``CheckpointManager.last_restore_report``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

__all__ = ["Source", "RestorePlan", "RestoreReport", "report_restore", "plan_restore", "plan_units", "MemoryPiece",
           "manifest_inventory", "restore_snapshots", "module_units_of"]


@dataclass(frozen=True)
class MemoryPiece:
    """Bytes ``[start, end)`` of a unit's version ``step``, held in rank ``rank``'s buffer."""

    rank: int
    step: int
    start: int
    end: int
    buffer: int
    offset: int
    checksum: str


@dataclass
class Source:
    """Where one unit comes from."""

    unit: str
    version: int
    level: str                                   # "snapshot" (memory) or "persist" (storage)
    pieces: list[MemoryPiece] = field(default_factory=list)   # memory only
    meta: dict[str, Any] = field(default_factory=dict)        # skeleton, tensors, nbytes, ...
    cum: int | None = None       # experts: routing counter when this version was taken


@dataclass
class RestorePlan:
    step: int
    from_memory: bool                            # S is a snapshot step (newer than storage)
    sources: dict[str, Source]
    plt: dict[str, Any]                          # tracker state at S
    meta: dict[str, Any]                         # manager metadata at S (K values, counters)


@dataclass(frozen=True)
class RestoreReport:
    """What one :meth:`moc.CheckpointManager.restore` did, for the whole job (every rank
    computes the same plan); ``str(report)`` is the line moc logs.

    Attributes:
        step: the step restored; None when nothing was stored (training starts at 0).
        next_step: what ``restore()`` returned (the step to run next).
        source: where the restore step came from: ``"memory"`` (a shared-memory snapshot
            newer than storage) or ``"storage"``; None when nothing was restored.
        storage: the store's URL.
        units_from_memory: units (experts, non-expert modules, extra state; a unit split
            over ranks counts once per piece) read from the ranks' in-memory snapshots.
        units_from_storage: units read from storage.
        experts_by_version: experts restored per saved version, ``{step: count}``; an
            expert older than ``step`` lost the updates since its version (what PLT counts).
        dense: non-expert module units (all at ``step``).
        plt: the run's proportion of lost tokens after this restore (0.012 = 1.2%).
        seconds: how long ``restore()`` took.
        exact_window: exact mode: the window ``(first, last)`` restored, whose steps the
            loop replays (no token lost; the unit counts are not reported there).
    """

    step: int | None
    next_step: int
    source: str | None
    storage: str
    units_from_memory: int = 0
    units_from_storage: int = 0
    experts_by_version: Mapping[int, int] = field(default_factory=dict)
    dense: int = 0
    plt: float = 0.0
    seconds: float = 0.0
    exact_window: tuple[int, int] | None = None

    @property
    def experts(self) -> int:
        """Experts restored, all versions together."""
        return sum(self.experts_by_version.values())

    def __str__(self) -> str:
        if self.step is None:
            return f"moc: nothing to resume in {self.storage}; training starts at step 0 ({self.seconds:.2f} s)"
        if self.exact_window is not None:
            first, last = self.exact_window
            what = (f"exact window {first}-{last}; the loop replays steps {first + 1}-{last}" if last > first
                    else f"exact window {first}-{last}")
        else:
            versions = ", ".join(f"{n} from step {v}" for v, n in sorted(self.experts_by_version.items(),
                                                                           reverse=True))
            what = (f"experts {versions or 'none'}; dense {self.dense}; units {self.units_from_memory} from memory, "
                    f"{self.units_from_storage} from storage")
        return (f"moc: resumed step {self.step} from {self.source} ({what}), PLT {100 * self.plt:.2f}%, "
                f"{self.seconds:.2f} s; training continues at step {self.next_step}")


def report_restore(plan: RestorePlan | None, *, next_step: int, storage: str, plt: float, seconds: float,
                   exact_window: tuple[int, int, str] | None = None) -> RestoreReport:
    """The :class:`RestoreReport` of a restore that returned ``next_step``: from its plan
    (plain mode) or the exact window ``(first, last, source)`` it restored."""
    if not next_step:
        return RestoreReport(None, 0, None, storage, seconds=seconds)
    if exact_window is not None:
        first, last, source = exact_window
        return RestoreReport(first, next_step, source, storage, plt=plt, seconds=seconds,
                             exact_window=(first, last))
    assert plan is not None          # a plain restore that returned a step planned it
    levels = [src.level for src in plan.sources.values()]
    versions: dict[int, int] = {}
    for name in sorted({n.split("#", 1)[0] for n in plan.sources if n.startswith("expert/")}):
        version = min(src.version for n, src in plan.sources.items() if n.split("#", 1)[0] == name)
        versions[version] = versions.get(version, 0) + 1
    dense = len({n.split("#", 1)[0] for n in plan.sources if not n.startswith(("expert/", "extra/"))})
    return RestoreReport(plan.step, next_step, "memory" if plan.from_memory else "storage", storage,
                         units_from_memory=levels.count("snapshot"), units_from_storage=levels.count("persist"),
                         experts_by_version=versions, dense=dense, plt=plt, seconds=seconds)


def manifest_inventory(manifest: Any) -> dict[str, Any] | None:
    """What the planner needs of a :class:`moc._store.format.Manifest` (None stays None)."""
    if manifest is None:
        return None
    return {"step": manifest.step, "plt": manifest.plt, "meta": manifest.meta,
            "units": {n: {"step": r.step} for n, r in manifest.units.items()}}


def restore_snapshots(headers: Sequence[Mapping[str, Any]], manifest: Any) -> list[Mapping[str, Any]]:
    """The snapshot headers a full ``restore()`` considers: those of the job that wrote
    the newest manifest (none at all when storage has no manifest)."""
    if manifest is None:
        return []
    run = manifest.meta.get("run_id")
    return [h for h in headers if h.get("run") == run]


def module_units_of(names: Sequence[str], manifest: Any = None) -> list[str]:
    """The non-expert module units among unit names (the restore step must hold them all).

    With a manifest saved under another sharding (world size, FSDP / EP degree), module
    pieces carry other names (``#p...`` suffixes): the saved ones are then what a complete
    step must hold, when they cover the same modules."""
    modules = sorted(n for n in names if not n.startswith(("expert/", "extra/")))
    if manifest is not None:
        bases = {n.split("#", 1)[0] for n in modules}
        saved = sorted(n for n, r in manifest.units.items() if r.kind == "module" and n.split("#", 1)[0] in bases)
        if {n.split("#", 1)[0] for n in saved} == bases:
            return saved
    return modules


def _cover(pieces: list[MemoryPiece], nbytes: int) -> list[MemoryPiece] | None:
    """A minimal left-to-right cover of ``[0, nbytes)`` from the pieces, or None."""
    chosen: list[MemoryPiece] = []
    pos = 0
    for p in sorted(pieces, key=lambda p: (p.start, -p.end)):
        if p.start > pos:
            break
        if p.end > pos:
            if chosen and chosen[-1].start == p.start:
                chosen[-1] = p
            else:
                chosen.append(p)
            pos = p.end
    if pos < nbytes:
        return None
    # Trim overlaps so each byte is read once.
    out, pos = [], 0
    for p in chosen:
        a = max(p.start, pos)
        if a < p.end:
            # A trimmed piece no longer matches its recorded checksum.
            checksum = p.checksum if a == p.start else ""
            out.append(MemoryPiece(p.rank, p.step, a, p.end, p.buffer, p.offset + (a - p.start), checksum))
            pos = p.end
    return out


def plan_restore(
    snapshots: Sequence[Mapping[str, Any]],
    manifest: Mapping[str, Any] | None,
    module_units: Sequence[str],
) -> RestorePlan | None:
    """Plan a restore.

    ``snapshots``: published snapshot headers from every rank (each carries ``rank``,
    ``step``, ``buffer``, ``units`` (metadata), ``pieces`` (byte ranges held), ``plt`` and
    ``meta``); ``manifest``: the newest
    valid storage manifest as a dict with ``step``, ``units`` (name -> {"step": version,
    ...}), ``plt`` and ``meta``; ``module_units``: non-expert units the model needs.
    Returns None when there is nothing to restore.
    """
    covers, unit_meta, headers = _memory_covers(snapshots)
    storage_step = int(manifest["step"]) if manifest is not None else None
    mem_steps = sorted({s for (_, s) in covers}, reverse=True)
    restore_step, from_memory = storage_step, False
    for s in mem_steps:
        if storage_step is not None and s <= storage_step:
            break
        if all((m, s) in covers for m in module_units):
            restore_step, from_memory = s, True
            break
    if restore_step is None:
        return None

    stored_units = (manifest["units"] if manifest is not None and storage_step is not None
                    and storage_step <= restore_step else {})
    names = set(stored_units) | {n for (n, s) in covers if s <= restore_step}
    sources = _newest_sources(sorted(names), covers, unit_meta, stored_units, restore_step)
    missing = [m for m in module_units if m not in sources or sources[m].version != restore_step]
    if missing:
        raise RuntimeError(f"restore step {restore_step}: non-expert units {missing[:5]} have no version at that step")
    _attach_counters(sources, headers, manifest)
    if from_memory:
        h = headers[restore_step]
        plt, meta = dict(h.get("plt") or {}), dict(h.get("meta") or {})
    else:
        assert manifest is not None     # not from memory: the restore step is the stored one
        plt, meta = dict(manifest.get("plt") or {}), dict(manifest.get("meta") or {})
    return RestorePlan(restore_step, from_memory, sources, plt, meta)


def plan_units(
    snapshots: Sequence[Mapping[str, Any]],
    manifest: Mapping[str, Any] | None,
    names: Sequence[str],
) -> RestorePlan:
    """The newest saved version of each named unit, from memory (any surviving rank) or
    storage, with no common restore step: for an elastic job that keeps its live state
    and only replaces units it lost (experts whose every replica died). Units with no
    saved version anywhere are absent from ``sources``."""
    covers, unit_meta, headers = _memory_covers(snapshots)
    stored_units = manifest["units"] if manifest is not None else {}
    sources = _newest_sources(sorted(set(names)), covers, unit_meta, stored_units, None)
    _attach_counters(sources, headers, manifest)
    step = max((src.version for src in sources.values()), default=-1)
    return RestorePlan(step, any(s.level == "snapshot" for s in sources.values()), sources, {}, {})


def _memory_covers(snapshots: Sequence[Mapping[str, Any]]):
    """Complete in-memory copies: (unit, step) -> pieces covering it, unit metadata per
    (unit, step), and one header per step."""
    # Pieces per (unit, step) across ranks, and unit metadata per step.
    pieces: dict[tuple[str, int], list[MemoryPiece]] = {}
    unit_meta: dict[tuple[str, int], dict[str, Any]] = {}
    headers: dict[int, Mapping[str, Any]] = {}
    for h in snapshots:
        step = int(h["step"])
        headers.setdefault(step, h)
        for piece in h["pieces"]:
            name = piece["unit"]
            pieces.setdefault((name, step), []).append(MemoryPiece(
                int(h["rank"]), step, int(piece["start"]), int(piece["end"]), int(h["buffer"]),
                int(piece["offset"]), piece["checksum"]))
            unit_meta.setdefault((name, step), h["units"][name])
    covers: dict[tuple[str, int], list[MemoryPiece]] = {}
    for key, ps in pieces.items():
        c = _cover(ps, int(unit_meta[key]["unit_nbytes"]))
        if c is not None:
            covers[key] = c
    return covers, unit_meta, headers


def _newest_sources(names, covers, unit_meta, stored_units, limit: int | None) -> dict[str, Source]:
    """Per unit: the newest complete in-memory version (at or before ``limit``) unless
    storage holds a newer one."""
    sources: dict[str, Source] = {}
    for name in names:
        best_mem = max((s for (n, s) in covers if n == name and (limit is None or s <= limit)), default=None)
        stored = stored_units.get(name)
        stored_version = int(stored["step"]) if stored is not None else None
        if best_mem is not None and (stored_version is None or best_mem >= stored_version):
            sources[name] = Source(name, best_mem, "snapshot", covers[(name, best_mem)],
                                   dict(unit_meta[(name, best_mem)]))
        elif stored is not None and stored_version is not None:     # (set together)
            sources[name] = Source(name, stored_version, "persist", [], dict(stored))
    return sources


def _attach_counters(sources: dict[str, Source], headers, manifest) -> None:
    """Routing counter of each expert version (what PLT charges a recovery with)."""
    for src in sources.values():
        if src.unit.startswith("expert/"):
            layer, e = src.unit.split("#", 1)[0][len("expert/"):].rsplit("/", 1)
            if src.level == "snapshot":
                counters = headers[src.version].get("plt") or {}
                src.cum = int(counters["cum"][layer][int(e)]) if counters.get("cum") else None
            else:
                counters = (manifest.get("plt") or {}).get("saved", {}).get("persist", {})
                src.cum = int(counters[layer][int(e)]) if layer in counters else None
