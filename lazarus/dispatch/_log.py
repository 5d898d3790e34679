"""Logging helpers: every line names the rank it comes from."""

from __future__ import annotations

import logging
import os

import torch.distributed as dist


def rank_tag() -> str:
    """``rank N`` from the initialised process group, else ``$RANK``, else ``rank -``."""
    if dist.is_available() and dist.is_initialized():
        return f"rank {dist.get_rank()}"
    return f"rank {os.environ.get('RANK', '-')}"


def get_logger(name: str) -> logging.LoggerAdapter:
    """A logger whose messages are prefixed with ``[rank N]`` at emit time."""

    class _RankAdapter(logging.LoggerAdapter):
        def process(self, msg, kwargs):
            return f"[{rank_tag()}] {msg}", kwargs

    return _RankAdapter(logging.getLogger(name), {})
