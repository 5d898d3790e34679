"""Errors moc raises into the training loop."""

from __future__ import annotations

__all__ = ["CheckpointError", "FencedError", "ForeignRunError"]


class CheckpointError(RuntimeError):
    """Checkpointing stopped protecting the job: snapshots keep failing, or the state
    newer than the last commit could not be persisted. ``__cause__`` is the last error."""


class FencedError(RuntimeError):
    """A write of a stale generation was refused: a newer generation's fence marker is in
    the store (an elastic runtime re-formed the job without this process). Nothing of it
    was committed. ``step``, ``generation`` (this writer's) and ``fence`` (the newest
    fence's generation) say which."""

    def __init__(self, message: str, *, step: int, generation: int, fence: int) -> None:
        super().__init__(message)
        self.step = step
        self.generation = generation
        self.fence = fence


class ForeignRunError(CheckpointError):
    """Another job writes checkpoints to the same storage location: its manifest holds the
    key this job was committing. Fatal: two jobs must not share one storage path."""

    def __init__(self, message: str, *, url: str, key: str, other_run: str, run: str) -> None:
        super().__init__(message)
        self.url = url
        self.key = key
        self.other_run = other_run
        self.run = run
