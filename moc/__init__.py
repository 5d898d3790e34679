"""moc: checkpointing built for Mixture-of-Experts training.

:class:`CheckpointManager` (configured by :class:`MoCConfig`) wraps a training loop:
partial-expert, two-level (shared-memory snapshot, then storage), triple-buffered,
asynchronous checkpoints, sharded over ranks, with PLT tracking and dynamic K. The
persistent level lives in :class:`CheckpointStore` (store format, atomic commit, partial
checkpoints that compose over steps, checksums, retention); the ``moc`` CLI inspects,
verifies and exports what it wrote.
"""

from ._config import MoCConfig
from ._errors import CheckpointError, FencedError, ForeignRunError
from ._manager import CheckpointManager
from ._plt import PLTTracker
from ._restore import RestoreReport
from ._selection import load_aware_selection, sequential_selection
from ._store import decode_tree, encode_tree
from ._store.format import FORMAT_VERSION, ChunkRecord, Manifest, ManifestError, UnitRecord, UnsupportedFormatError
from ._store.store import CheckpointStore, CorruptObjectError, LoadResult, ShardWriter, VerifyProblem
from ._units import DEFAULT_EXPERT_PATTERN, ExpertLayout, UnitLayout, UnitSpec, discover_units

__all__ = [
    "CheckpointManager",
    "MoCConfig",
    "RestoreReport",
    "CheckpointError",
    "FencedError",
    "ForeignRunError",
    "ExpertLayout",
    "CheckpointStore",
    "ShardWriter",
    "LoadResult",
    "VerifyProblem",
    "CorruptObjectError",
    "Manifest",
    "UnitRecord",
    "ChunkRecord",
    "ManifestError",
    "UnsupportedFormatError",
    "FORMAT_VERSION",
    "encode_tree",
    "decode_tree",
    "PLTTracker",
    "sequential_selection",
    "load_aware_selection",
    "DEFAULT_EXPERT_PATTERN",
    "UnitLayout",
    "UnitSpec",
    "discover_units",
]
