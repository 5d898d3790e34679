"""The checkpoint manifest: versioned JSON, readable without torch.

Layout of a checkpoint store (keys relative to the store root)::

    manifests/000000000120.json        # one per committed step of generation 0; written last
    manifests/000000000120.g3.json     # the same for fencing generation 3 (> 0)
    data/000000000120/g3.<writer>.<nonce>.<group>.bin   # chunks of unit bytes, many units per object
    data/000000000120/<writer>.<group>.bin              # the same, as stores before fencing named it
    fence/g000000000003.json           # generation 3 took over, resuming at a step (see below)

A manifest lists every unit of the logical checkpoint at its step. A unit's record says at
which step its saved version was taken and where its bytes live, possibly in an older
step's objects (partial checkpoints compose). Each chunk carries its own checksum.

Fencing: every writer carries a generation (0 unless an elastic runtime sets one; stores
written before fencing existed are generation 0 throughout). Data keys hold the generation
and a per-process nonce, so no writer ever overwrites another's objects; manifests are
committed conditionally (never over an existing key) under a key unique per step and
generation. A fence marker ``fence/g<gen>.json`` (``{"generation", "resume_step", ...}``)
says that generation ``gen`` took over and trains from ``resume_step`` on: a writer of an
older generation refuses to commit once it sees it, and readers ignore any manifest of an
older generation whose step is at or above the resume step of a newer fence (a stale
writer's, or a replaced timeline's). Of the visible manifests of one step the newest
generation's is the step's checkpoint.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import xxhash

__all__ = [
    "FORMAT_VERSION",
    "ChunkRecord",
    "UnitRecord",
    "Manifest",
    "ManifestError",
    "UnsupportedFormatError",
    "manifest_key",
    "parse_manifest_key",
    "step_of_manifest_key",
    "Fence",
    "fence_key",
    "visible_manifests",
    "step_of_data_key",
    "UNIT_KINDS",
]

FORMAT_VERSION = 1
UNIT_KINDS = ("expert", "module", "extra")
MANIFEST_PREFIX = "manifests/"
DATA_PREFIX = "data/"
FENCE_PREFIX = "fence/"
_MANIFEST_RE = re.compile(r"^manifests/(\d{12})(?:\.g(\d+))?\.json$")
_FENCE_RE = re.compile(r"^fence/g(\d{12})\.json$")
_DATA_RE = re.compile(r"^data/(\d{12})/")


class ManifestError(ValueError):
    """A manifest that cannot be parsed or fails validation."""


class UnsupportedFormatError(ManifestError):
    """A manifest written by a newer, incompatible version of moc."""


def manifest_key(step: int, generation: int = 0) -> str:
    """The manifest key of ``step`` committed by generation ``generation``."""
    return f"{MANIFEST_PREFIX}{step:012d}" + (f".g{generation}" if generation else "") + ".json"


def parse_manifest_key(key: str) -> tuple[int, int] | None:
    """``(step, generation)`` of a manifest key (None: not a manifest key)."""
    m = _MANIFEST_RE.match(key)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def fence_key(generation: int) -> str:
    return f"{FENCE_PREFIX}g{generation:012d}.json"


def generation_of_fence_key(key: str) -> int | None:
    m = _FENCE_RE.match(key)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Fence:
    """Generation ``generation`` took over at ``resume_step``: manifests of older generations
    at steps >= ``resume_step`` are a stale writer's and are never read."""

    generation: int
    resume_step: int
    run_id: str = ""
    created_at: float = 0.0

    def hides(self, step: int, generation: int) -> bool:
        return generation < self.generation and step >= self.resume_step

    def to_bytes(self) -> bytes:
        return json.dumps({"generation": self.generation, "resume_step": self.resume_step,
                           "run_id": self.run_id, "created_at": self.created_at},
                          separators=(",", ":")).encode()

    @staticmethod
    def from_bytes(data: bytes, *, source: str) -> "Fence":
        try:
            body = json.loads(data)
            fence = Fence(generation=int(body["generation"]), resume_step=int(body["resume_step"]),
                          run_id=str(body.get("run_id", "")), created_at=float(body.get("created_at", 0.0)))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"fence marker {source} is malformed: {type(exc).__name__}: {exc}") from exc
        if fence.generation < 1 or fence.resume_step < 0:
            raise ManifestError(f"fence marker {source}: generation must be >= 1 and resume_step >= 0, got "
                                f"{fence.generation} and {fence.resume_step}")
        return fence


def visible_manifests(keys: list[str], fences: list[Fence]) -> tuple[dict[int, tuple[int, str]], list[str]]:
    """Which manifest keys readers use: ``({step: (generation, key)}, hidden keys)``. A
    manifest is hidden when a fence of a newer generation resumes at or below its step; of
    the rest, each step's newest generation wins."""
    visible: dict[int, tuple[int, str]] = {}
    hidden: list[str] = []
    for key in keys:
        parsed = parse_manifest_key(key)
        if parsed is None:
            continue
        step, gen = parsed
        if any(f.hides(step, gen) for f in fences):
            hidden.append(key)
            continue
        if step not in visible or visible[step][0] < gen:
            if step in visible:
                hidden.append(visible[step][1])
            visible[step] = (gen, key)
        else:
            hidden.append(key)
    return visible, sorted(hidden)


def data_prefix(step: int) -> str:
    return f"{DATA_PREFIX}{step:012d}/"


def step_of_manifest_key(key: str) -> int | None:
    m = _MANIFEST_RE.match(key)
    return int(m.group(1)) if m else None


def step_of_data_key(key: str) -> int | None:
    m = _DATA_RE.match(key)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ChunkRecord:
    """Bytes ``[offset, offset + nbytes)`` of a unit's stream, stored in one object."""

    key: str             # object holding the chunk
    start: int           # where the stored chunk begins inside the object
    stored_nbytes: int   # bytes on storage (after compression)
    offset: int          # position of the chunk in the unit's raw stream
    nbytes: int          # raw bytes
    codec: str           # "raw" | "zstd"
    itemsize: int        # byte-plane shuffle width used with zstd (1 = none)
    checksum: str        # "xxh3:<hex>" of the stored bytes

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @staticmethod
    def from_json(d: dict[str, Any]) -> "ChunkRecord":
        return ChunkRecord(
            key=str(d["key"]), start=int(d["start"]), stored_nbytes=int(d["stored_nbytes"]),
            offset=int(d["offset"]), nbytes=int(d["nbytes"]), codec=str(d["codec"]),
            itemsize=int(d["itemsize"]), checksum=str(d["checksum"]),
        )


@dataclass(frozen=True)
class UnitRecord:
    """Where the saved version of one unit lives, and how to decode it."""

    name: str
    kind: str                   # "expert" | "module" | "extra"
    step: int                   # step at which this version was taken
    nbytes: int                 # raw size of the unit's stream
    skeleton: Any               # JSON tree with {"@t": i} tensor references
    tensors: list[dict[str, Any]]
    chunks: list[ChunkRecord]
    layer: str | None = None
    expert: int | None = None

    @property
    def stored_nbytes(self) -> int:
        return sum(c.stored_nbytes for c in self.chunks)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "kind": self.kind, "step": self.step, "nbytes": self.nbytes,
            "skeleton": self.skeleton, "tensors": self.tensors,
            "chunks": [c.to_json() for c in self.chunks],
        }
        if self.layer is not None:
            d["layer"] = self.layer
            d["expert"] = self.expert
        return d

    @staticmethod
    def from_json(name: str, d: dict[str, Any]) -> "UnitRecord":
        kind = str(d["kind"])
        if kind not in UNIT_KINDS:
            raise ManifestError(f"unit {name!r}: kind must be one of {UNIT_KINDS}, got {kind!r}")
        chunks = [ChunkRecord.from_json(c) for c in d["chunks"]]
        nbytes = int(d["nbytes"])
        covered = sorted((c.offset, c.offset + c.nbytes) for c in chunks)
        pos = 0
        for lo, hi in covered:
            if lo != pos:
                raise ManifestError(f"unit {name!r}: chunks do not tile its {nbytes} bytes")
            pos = hi
        if pos != nbytes:
            raise ManifestError(f"unit {name!r}: chunks cover {pos} of its {nbytes} bytes")
        return UnitRecord(
            name=name, kind=kind, step=int(d["step"]), nbytes=nbytes, skeleton=d["skeleton"],
            tensors=list(d["tensors"]), chunks=chunks, layer=d.get("layer"),
            expert=None if d.get("expert") is None else int(d["expert"]),
        )

    def keys(self) -> set[str]:
        return {c.key for c in self.chunks}


def _body_checksum(body: dict[str, Any]) -> str:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return "xxh3:" + xxhash.xxh3_64_hexdigest(canon.encode())


@dataclass
class Manifest:
    """One committed step: every unit's newest version, plus PLT data and user metadata.

    ``plt`` holds what the proportion-of-lost-tokens accounting needs:
    ``{"top_k": int, "total_tokens": int, "routed": {layer: expert slots routed},
    "lost_tokens": {layer: int},
    "unsaved": {layer: [tokens routed to expert e since the version this manifest points to]},
    "per_layer": {layer: float}, "value": float}``.
    """

    step: int
    units: dict[str, UnitRecord]
    plt: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    format_version: int = FORMAT_VERSION

    def layers(self) -> dict[str, dict[int, UnitRecord]]:
        out: dict[str, dict[int, UnitRecord]] = {}
        for rec in self.units.values():
            if rec.kind == "expert":
                assert rec.expert is not None       # expert records carry their expert index
                out.setdefault(str(rec.layer), {})[int(rec.expert)] = rec
        return {k: dict(sorted(v.items())) for k, v in out.items()}

    def keys(self) -> set[str]:
        out: set[str] = set()
        for rec in self.units.values():
            out |= rec.keys()
        return out

    def to_bytes(self) -> bytes:
        body = {
            "format_version": self.format_version,
            "step": self.step,
            "created_at": self.created_at,
            "units": {name: rec.to_json() for name, rec in sorted(self.units.items())},
            "plt": self.plt,
            "meta": self.meta,
        }
        body["checksum"] = _body_checksum(body)
        return json.dumps(body, separators=(",", ":")).encode()

    @staticmethod
    def from_bytes(data: bytes, *, source: str = "manifest") -> "Manifest":
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{source} is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ManifestError(f"{source} must be a JSON object, got {type(body).__name__}")
        version = body.get("format_version")
        if not isinstance(version, int):
            raise ManifestError(f"{source} has no integer format_version")
        if version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{source} has format_version {version}; this moc reads format_version <= "
                f"{FORMAT_VERSION}: upgrade moc to read it"
            )
        stored = body.pop("checksum", None)
        if stored is None or stored != _body_checksum(body):
            raise ManifestError(f"{source} failed its checksum (corrupted)")
        try:
            units = {name: UnitRecord.from_json(name, rec) for name, rec in body["units"].items()}
            return Manifest(
                step=int(body["step"]), units=units, plt=dict(body.get("plt") or {}),
                meta=dict(body.get("meta") or {}), created_at=float(body.get("created_at", 0.0)),
                format_version=version,
            )
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"{source} is malformed: {type(exc).__name__}: {exc}") from exc
