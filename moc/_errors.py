"""Errors moc raises into the training loop."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """Checkpointing stopped protecting the job: snapshots keep failing, or the state
    newer than the last commit could not be persisted. ``__cause__`` is the last error."""
