"""The persistent level's bytes and books: how a unit's state is encoded (:mod:`.codec`),
the versioned manifest and store layout (:mod:`.format`), and :class:`CheckpointStore`, which
writes, commits, reads, verifies and retires checkpoints (:mod:`.store`)."""

from .codec import CODECS, TensorMeta, TreePlan, decode_tree, encode_tree, meta_tree, plan_tree, unit_buffer
from .format import ChunkRecord, Manifest, UnitRecord, manifest_key
from .store import CheckpointStore, CorruptObjectError

__all__ = ["CODECS", "TensorMeta", "TreePlan", "decode_tree", "encode_tree", "meta_tree", "plan_tree", "unit_buffer",
           "ChunkRecord", "Manifest", "UnitRecord", "manifest_key", "CheckpointStore",
           "CorruptObjectError"]
