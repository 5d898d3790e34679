"""``MoCConfig``: every knob of the checkpoint manager, validated at construction."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Union

from ._selection import SELECTIONS
from ._store import CODECS
from ._units import DEFAULT_EXPERT_PATTERN, LAYOUT_NAMES, ExpertLayout

__all__ = ["MoCConfig", "SHARDINGS"]

SHARDINGS = ("adaptive", "equal", "none")
_SCHEMES = ("file", "s3", "s3a", "memory")

Auto = str  # the literal "auto"


def _check_int(name: str, value: Any, lo: int, *, allow_auto: bool = False, allow_none: bool = False) -> None:
    if allow_auto and value == "auto":
        return
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        extra = " or 'auto'" if allow_auto else ""
        extra += " or None" if allow_none else ""
        raise ValueError(f"MoCConfig.{name} must be an integer >= {lo}{extra}, got {value!r}")


@dataclass
class MoCConfig:
    """Configuration of :class:`moc.CheckpointManager`.

    Attributes:
        storage: where checkpoints persist: a path, ``file://``, ``s3://BUCKET/PREFIX`` or
            ``memory://`` (see :func:`storage_backends.open_store`).
        storage_options: passed to ``open_store`` (endpoint, credentials, retry, ...).
        interval: checkpoint every ``interval`` steps, or ``"auto"`` (Young/Daly from the
            measured checkpoint overhead and the observed failure rate).
        k_snapshot: experts per MoE layer copied to CPU memory at each checkpoint; ``None``
            saves all (no partial checkpointing); ``"auto"``: the largest K whose copy fits
            in one forward+backward, measured.
        k_persist: experts per layer (of the snapshotted ones) written to storage at each
            persisted checkpoint; ``None`` = ``k_snapshot``.
        persist_every: every n-th snapshot also goes to storage (1: all of them); the
            others live in memory only (fast, frequent recovery points).
        selection: ``"sequential"`` (round robin, staggered across layers) or
            ``"load_aware"`` (most tokens since the last save first).
        dynamic_k: double K (per level, capped at E) after a recovery when the
            accumulated PLT exceeds ``plt_threshold``.
        plt_threshold: PLT above which dynamic-K raises K (0.0375 in the MoC paper).
        top_k: experts each token is routed to (the PLT denominator counts tokens x top_k).
            ``None`` (default): read from the model (its routers' ``top_k``, a transformers
            config's ``num_experts_per_tok`` and the like; see :mod:`moc._units.top_k`), 1
            when it does not say. A value the model contradicts, or more than a layer's
            experts, is an error naming both.
        sharding: how ranks split the saving work: ``"adaptive"`` (greedy, largest module
            to the least loaded rank), ``"equal"`` (round robin) or ``"none"`` (rank 0
            saves every non-expert module).
        compression: ``None`` / ``"raw"`` or ``"zstd"`` (byte-plane shuffled).
        keep_last: committed steps kept in storage.
        expert_layout: how the model stores its experts: ``"auto"`` (per-expert modules,
            transformers 5.x fused ``experts.gate_up_proj``/``down_proj``, torchtitan
            ``experts.w1/w2/w3``, Megatron ``local_experts.<i>``, TE ``weight<i>``), one of
            those by name (``"per_expert"``, ``"hf_fused"``, ``"torchtitan"``, ``"megatron"``,
            ``"te_grouped"``), or an :class:`moc.ExpertLayout` (regex + expert dim).
        expert_pattern: regex with groups ``layer`` and ``expert`` naming per-expert
            parameters (the ``per_expert`` layout).
        max_consecutive_failures: failed snapshots in a row after which ``step()`` raises
            :class:`moc.CheckpointError` instead of training on unprotected.
        snapshot_dir: where the three snapshot buffers live; default a per-run folder in
            ``/dev/shm`` so a restarted process on the same node recovers from memory.
        snapshot_copies: in-memory copies of every share: the owner's, then copies on
            ranks of other nodes than the unit's holders (``CheckpointManager(node=...)``),
            then co-holders (from their own replicas, no network) when there are too few
            other nodes; 2 means losing one node loses no snapshot share. 1 halves
            snapshot memory.
        mtbf: failure interval assumed by ``interval="auto"`` until failures are observed.
        persist_timeout: how long :meth:`CheckpointManager.wait` waits for storage (transient
            errors are retried that long; a permanent one, such as a read-only location or
            wrong credentials, is raised at once).
        stop_timeout: after SIGTERM, the most the manager spends flushing the newest
            snapshot before the process exits (status 143; the snapshot stays in the
            snapshot directory). Keep it below the orchestrator's grace period (Kubernetes
            ``terminationGracePeriodSeconds``, 30 s by default; ``docker stop -t``, 10 s).
        coordination_timeout: timeout of the manager's own process groups.
        exact: sparse checkpoints that lose no tokens (``docs/exact.md``): every step captures
            the full state of the units scheduled for it and the compute weights of the
            others, over a window of W = ceil(E / k_snapshot) steps; ``restore()`` returns
            the window's first step + 1 and the loop's replay of the window brings every
            unit back exactly (PLT stays 0). Needs ``interval=1``; ``persist_every``
            counts windows; ``k_persist``, ``interval="auto"``, ``k_snapshot="auto"`` and
            ``selection="load_aware"`` are refused. Several ranks and DTensor (FSDP2)
            parameters: each rank captures and replays its own pieces, the ranks agree
            once per window. Not with Lazarus' ElasticTrainer yet.
    """

    storage: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    interval: Union[int, Auto] = 50
    k_snapshot: Union[int, Auto, None] = None
    k_persist: Union[int, None] = None
    persist_every: int = 1
    selection: str = "sequential"
    dynamic_k: bool = True
    plt_threshold: float = 0.0375
    top_k: Union[int, None] = None
    sharding: str = "adaptive"
    compression: Union[str, None] = None
    keep_last: int = 3
    expert_layout: Union[str, ExpertLayout] = "auto"
    expert_pattern: str = DEFAULT_EXPERT_PATTERN
    max_consecutive_failures: int = 3
    snapshot_dir: Union[str, None] = None
    snapshot_copies: int = 2
    mtbf: timedelta = timedelta(hours=6)
    persist_timeout: timedelta = timedelta(minutes=10)
    stop_timeout: timedelta = timedelta(seconds=25)
    coordination_timeout: timedelta = timedelta(minutes=5)
    exact: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.storage, os.PathLike):
            self.storage = os.fspath(self.storage)
        if not isinstance(self.storage, str) or not self.storage:
            raise ValueError(f"MoCConfig.storage must be a non-empty URL or path, got {self.storage!r}")
        if "://" in self.storage:
            scheme = self.storage.split("://", 1)[0].lower()
            if scheme not in _SCHEMES:
                raise ValueError(
                    f"MoCConfig.storage has unsupported scheme {scheme!r}; allowed: file://, s3://, memory:// or a path"
                )
        if not isinstance(self.storage_options, dict):
            raise ValueError("MoCConfig.storage_options must be a dict")
        _check_int("interval", self.interval, 1, allow_auto=True)
        _check_int("k_snapshot", self.k_snapshot, 1, allow_auto=True, allow_none=True)
        _check_int("k_persist", self.k_persist, 1, allow_none=True)
        _check_int("persist_every", self.persist_every, 1)
        if isinstance(self.k_snapshot, int) and self.k_persist is not None and self.k_persist > self.k_snapshot:
            raise ValueError(
                f"MoCConfig.k_persist ({self.k_persist}) must be <= k_snapshot ({self.k_snapshot}): "
                "persisted experts are taken from the snapshot"
            )
        if self.selection not in SELECTIONS:
            raise ValueError(f"MoCConfig.selection must be one of {SELECTIONS}, got {self.selection!r}")
        if not isinstance(self.plt_threshold, (int, float)) or not 0.0 < self.plt_threshold < 1.0:
            raise ValueError(f"MoCConfig.plt_threshold must be in (0, 1), got {self.plt_threshold!r}")
        _check_int("top_k", self.top_k, 1, allow_none=True)
        if self.sharding not in SHARDINGS:
            raise ValueError(f"MoCConfig.sharding must be one of {SHARDINGS}, got {self.sharding!r}")
        if self.compression not in (None, *CODECS):
            raise ValueError(f"MoCConfig.compression must be one of {(None, *CODECS)}, got {self.compression!r}")
        _check_int("keep_last", self.keep_last, 1)
        _check_int("snapshot_copies", self.snapshot_copies, 1)
        try:
            groups = set(re.compile(self.expert_pattern).groupindex)
        except (re.error, TypeError) as exc:
            raise ValueError(f"MoCConfig.expert_pattern is not a valid regex: {exc}") from exc
        if not {"layer", "expert"} <= groups:
            raise ValueError("MoCConfig.expert_pattern must have named groups 'layer' and 'expert'")
        if not isinstance(self.expert_layout, ExpertLayout) and self.expert_layout not in LAYOUT_NAMES:
            raise ValueError(f"MoCConfig.expert_layout must be one of {LAYOUT_NAMES} or an ExpertLayout, "
                             f"got {self.expert_layout!r}")
        _check_int("max_consecutive_failures", self.max_consecutive_failures, 1)
        if not isinstance(self.exact, bool):
            raise ValueError(f"MoCConfig.exact must be True or False, got {self.exact!r}")
        if self.exact:
            self._check_exact()
        for name in ("mtbf", "persist_timeout", "stop_timeout", "coordination_timeout"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value <= timedelta(0):
                raise ValueError(f"MoCConfig.{name} must be a positive timedelta, got {value!r}")

    def _check_exact(self) -> None:
        if self.interval != 1:
            raise ValueError(f"MoCConfig.interval must be 1 when exact=True (every step captures the scheduled "
                             f"units' full state and the others' compute weights), got {self.interval!r}")
        if self.k_snapshot == "auto":
            raise ValueError("MoCConfig.k_snapshot must be an integer >= 1 or None when exact=True (it sets the "
                             "window W = ceil(E / k_snapshot)), got 'auto'")
        if self.k_persist is not None:
            raise ValueError(f"MoCConfig.k_persist must be None when exact=True (a complete window is what is "
                             f"persisted), got {self.k_persist!r}")
        if self.selection != "sequential":
            raise ValueError(f"MoCConfig.selection must be 'sequential' when exact=True (the window schedule; "
                             f"'load_aware' is not supported there yet), got {self.selection!r}")
