"""Exact mode (``MoCConfig(exact=True)``): sparse checkpoints that lose no tokens.

:class:`ExactCheckpointer` (:mod:`.checkpointer`) captures and persists windows; the window
schedule and its size formula (:mod:`.schedule`); the window, replay and round bookkeeping
(:mod:`.state`); windows in storage (:mod:`.store`); where a restore finds a window
(:mod:`.loading`); the hand-over in an elastic job
(:mod:`.elastic`) and the restore onto other ranks or placements (:mod:`.reshard`)."""

from .checkpointer import ExactCheckpointer

__all__ = ["ExactCheckpointer"]
