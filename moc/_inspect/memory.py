"""``moc inspect --memory DIR``: the snapshot buffers in a memory directory and what a
``restore()`` would take from them, without reading a tensor.

The plan comes from the same functions ``CheckpointManager.restore()`` calls
(:func:`moc._snapshot.buffers.read_headers` for the published headers, then
:func:`moc._restore.restore_snapshots`, :func:`~moc._restore.manifest_inventory`,
:func:`~moc._restore.module_units_of` and :func:`~moc._restore.plan_restore`), so the
report is by construction what a restore does, assuming every folder found is served by a
rank of the restoring job and the model has the stored units. Two things a restore learns
only by reading bytes are not predicted: a snapshot piece failing its checksum, and a
stored object that is corrupt (restore then uses an older version of that unit).

A directory is read as one rank's folder (``buf<i>.bin`` / ``buf<i>.json`` inside), or as
a parent of such folders up to two levels down (``/dev/shm/moc-<key>/rank<r>``, an agent's
``--snapshot-dir/<worker>``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .._restore import RestorePlan, manifest_inventory, module_units_of, plan_restore, restore_snapshots
from .._snapshot.buffers import HEADER_VERSION, _checksum_header, read_headers
from .._store import Manifest
from .summary import group_rows, human, layer_labels, natural_key

__all__ = ["BufferInfo", "find_folders", "scan_folder", "memory_report", "format_memory"]

COMPLETE, FILLING, TORN = "complete", "being filled", "torn"
_BUF_RE = re.compile(r"^buf(\d+)\.(bin|json)$")
_TMP_RE = re.compile(r"^buf(\d+)\.json\.tmp-")
LEVEL_NAMES = {"snapshot": "memory", "persist": "storage"}


@dataclass
class BufferInfo:
    folder: str            # relative to the directory given
    buffer: int
    state: str             # complete | being filled | torn
    step: int | None = None
    run: str | None = None
    rank: int | None = None            # rank that wrote it
    nbytes: int = 0                    # size of buf<i>.bin
    used: bool = False                 # a restore would consider it (this job's, valid)
    note: str = ""
    header: dict[str, Any] | None = field(default=None, repr=False)


def find_folders(directory: str) -> list[str]:
    """Folders holding snapshot buffers: ``directory`` itself, else its sub-folders, else
    theirs. Raises ``ValueError`` naming ``--memory`` when ``directory`` is no folder."""
    if not os.path.exists(directory):
        raise ValueError(f"--memory {directory}: no such directory")
    if not os.path.isdir(directory):
        raise ValueError(f"--memory {directory}: not a directory")

    def has_buffers(d: str) -> bool:
        try:
            return any(_BUF_RE.match(n) or _TMP_RE.match(n) for n in os.listdir(d))
        except OSError:
            return False

    def subdirs(d: str) -> list[str]:
        try:
            return sorted((os.path.join(d, n) for n in os.listdir(d) if os.path.isdir(os.path.join(d, n))),
                          key=natural_key)
        except OSError:
            return []

    level = [directory]
    for _ in range(3):
        found = [d for d in level if has_buffers(d)]
        if found:
            return found
        level = [s for d in level for s in subdirs(d)]
    return []


def _mappers(paths: list[str]) -> dict[str, list[int]] | None:
    """pid list per path of the live processes mapping each file (None: cannot tell)."""
    if not os.path.isdir("/proc/self") or not paths:
        return None if paths else {}
    want = {os.path.realpath(p): p for p in paths}
    out: dict[str, list[int]] = {p: [] for p in paths}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                text = f.read()
        except OSError:
            continue
        for real, p in want.items():
            if real in text:
                out[p].append(int(pid))
    return out


def scan_folder(folder: str, label: str) -> list[BufferInfo]:
    """Every buffer of one folder with its state. Complete = a header that
    :func:`read_headers` accepts (what a restore reads)."""
    names = os.listdir(folder)
    valid = {int(h["buffer"]): h for h in read_headers(folder)}
    indices: set[int] = set(valid)
    filling: set[int] = set()
    for n in names:
        m = _BUF_RE.match(n)
        if m:
            indices.add(int(m.group(1)))
        m = _TMP_RE.match(n)
        if m:
            indices.add(int(m.group(1)))
            filling.add(int(m.group(1)))
    bins = {i: os.path.join(folder, f"buf{i}.bin") for i in indices}
    no_header = [bins[i] for i in indices if i not in valid and not os.path.exists(_header(folder, i))
                 and os.path.exists(bins[i])]
    mapped = _mappers(no_header)
    out = []
    for i in sorted(indices):
        size = os.path.getsize(bins[i]) if os.path.exists(bins[i]) else 0
        info = BufferInfo(label, i, TORN, nbytes=size)
        if i in valid:
            h = valid[i]
            info.state, info.header = COMPLETE, h
            info.step, info.run, info.rank = int(h["step"]), h.get("run"), h.get("rank")
            need = max((int(p["offset"]) + int(p["end"]) - int(p["start"]) for p in h.get("pieces", [])), default=0)
            if size < need:
                info.note = (f"buf{i}.bin is missing" if not os.path.exists(bins[i])
                             else f"buf{i}.bin holds {size} of {need} bytes") + ": a restore using it fails"
        elif os.path.exists(_header(folder, i)):
            info.note = _why_invalid(_header(folder, i))
        elif i in filling:
            info.state, info.note = FILLING, "header being published"
        elif mapped is None:
            info.note = "no header (cannot tell whether a live process is filling it)"
        elif mapped.get(bins[i]):
            info.state, info.note = FILLING, f"no header yet; mapped by pid {', '.join(map(str, mapped[bins[i]]))}"
        else:
            info.note = "no header and no process maps it: the fill never finished"
        out.append(info)
    return out


def _header(folder: str, i: int) -> str:
    return os.path.join(folder, f"buf{i}.json")


def _why_invalid(path: str) -> str:
    try:
        with open(path) as f:
            body = json.load(f)
    except (OSError, ValueError) as exc:
        return f"header is not valid JSON ({type(exc).__name__})"
    if not isinstance(body, dict):
        return "header is not a JSON object"
    stored = body.pop("checksum", None)
    if stored != _checksum_header(body):
        return "header fails its checksum"
    if body.get("version") != HEADER_VERSION:
        return f"header version {body.get('version')!r}, this moc reads {HEADER_VERSION}"
    return "header rejected"


def memory_report(directory: str, manifest: Manifest | None) -> dict[str, Any]:
    """Buffers found under ``directory`` and the restore plan against ``manifest`` (the
    store's newest readable one, as ``restore()`` uses)."""
    folders = find_folders(directory)
    buffers: list[BufferInfo] = []
    headers: list[dict[str, Any]] = []
    for rank, folder in enumerate(folders):
        label = os.path.relpath(folder, directory)
        found = scan_folder(folder, label)
        # A restore serves each folder from one rank: number the folders like ranks.
        complete = [dict(b.header, rank=rank) for b in found if b.state == COMPLETE and b.header is not None]
        used = {int(h["buffer"]) for h in restore_snapshots(complete, manifest)}
        for b in found:
            b.used = b.state == COMPLETE and b.buffer in used
            if b.state == COMPLETE and not b.used:
                b.note = b.note or ("no manifest in storage: restore ignores memory" if manifest is None
                                    else f"another job's (run {b.run}): ignored")
        buffers += found
        headers += [h for h in complete if int(h["buffer"]) in used]
    modules = module_units_of(list(manifest.units)) if manifest is not None else []
    plan = plan_restore(headers, manifest_inventory(manifest), modules)
    return {
        "directory": directory, "folders": [os.path.relpath(f, directory) for f in folders],
        "buffers": [{k: v for k, v in asdict(b).items() if k != "header"} for b in buffers],
        "storage_step": manifest.step if manifest is not None else None,
        "plan": _plan_json(plan, [os.path.relpath(f, directory) for f in folders]),
    }


def _plan_json(plan: RestorePlan | None, folders: list[str]) -> dict[str, Any] | None:
    if plan is None:
        return None
    units = {}
    layers: dict[str, dict[str, Any]] = {}
    cum = (plan.plt or {}).get("cum") or {}
    for name, src in sorted(plan.sources.items()):
        where = LEVEL_NAMES[src.level]
        units[name] = {"source": where, "level": src.level, "version": src.version,
                       "folders": sorted({folders[p.rank] for p in src.pieces}, key=natural_key)}
        if name.startswith("expert/"):
            layer, e = name[len("expert/"):].rsplit("/", 1)
            row = layers.setdefault(layer, {"memory": [], "storage": [], "lost_tokens": 0})
            row[where].append(src.version)
            if src.cum is not None and layer in cum and int(e) < len(cum[layer]):
                row["lost_tokens"] += max(0, int(cum[layer][int(e)]) - src.cum)
    return {"step": plan.step, "from_memory": plan.from_memory, "resume_step": plan.step + 1,
            "units": units, "layers": {k: layers[k] for k in sorted(layers, key=natural_key)}}


def format_memory(rep: dict[str, Any], max_rows: int = 60) -> list[str]:
    out = [f"memory   {rep['directory']} ({len(rep['folders'])} folder{'s' if len(rep['folders']) != 1 else ''} "
           f"with snapshot buffers)"]
    if rep["buffers"]:
        width = max(8, max(len(b["folder"]) for b in rep["buffers"]))
        out.append(f"{'folder':<{width}} {'buffer':<7} {'state':<13} {'step':>7} {'bytes':>10}  note")
        for b in rep["buffers"]:
            step = "-" if b["step"] is None else str(b["step"])
            note = b["note"] or ("used by restore" if b["used"] else "")
            out.append(f"{b['folder']:<{width}} buf{b['buffer']:<4} {b['state']:<13} {step:>7} "
                       f"{human(b['nbytes']):>10}  {note}")
    else:
        out.append("no snapshot buffers found")
    plan = rep["plan"]
    storage = rep["storage_step"]
    out.append("")
    if plan is None:
        out.append("restore() finds nothing: it starts at step 0")
        return out
    where = "memory" if plan["from_memory"] else "storage"
    out.append(f"restore() takes step {plan['step']} from {where} (storage's newest step: {storage}) and "
               f"resumes at step {plan['resume_step']}")
    rows = [{"layer": k, **v} for k, v in plan["layers"].items()]
    if rows:
        pattern, labels = layer_labels([r["layer"] for r in rows])
        size, groups = group_rows([dict(r, label=lab) for r, lab in zip(rows, labels)], max_rows)
        width = max(10, min(28, max(len(g[0]["label"] if len(g) == 1 else f"{g[0]['label']}-{g[-1]['label']}")
                                    for g in groups)))
        note = f" ({size} layers per row)" if size > 1 else ""
        out.append(f"experts per MoE layer{': ' + pattern if pattern else ''}{note}: count @ version step(s)")
        out.append(f"{'layer':<{width}} {'from memory':<18} {'from storage':<18} {'lost tokens':>11}")
        for g in groups:
            label = g[0]["label"] if len(g) == 1 else f"{g[0]['label']}-{g[-1]['label']}"
            mem = [v for r in g for v in r["memory"]]
            sto = [v for r in g for v in r["storage"]]
            out.append(f"{label[:width]:<{width}} {_count_at(mem):<18} {_count_at(sto):<18} "
                       f"{sum(r['lost_tokens'] for r in g):>11}")
    others: dict[tuple[str, str], list[int]] = {}
    for name, u in plan["units"].items():
        if not name.startswith("expert/"):
            kind = "extra state" if name.startswith("extra/") else "non-expert modules"
            others.setdefault((kind, u["source"]), []).append(u["version"])
    for (kind, src), versions in sorted(others.items()):
        out.append(f"{kind}: {len(versions)} from {src} @ {_steps(versions)}")
    return out


def _steps(versions: list[int]) -> str:
    v = sorted(set(versions))
    return str(v[0]) if len(v) == 1 else f"{v[0]}..{v[-1]}"


def _count_at(versions: list[int]) -> str:
    return f"{len(versions)} @ {_steps(versions)}" if versions else "-"
