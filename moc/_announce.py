"""The few lines moc says to every user, whatever their logging set-up: what a restore did.

moc logs through the ``moc`` logger and leaves configuring logging to the application, so
its INFO lines (a checkpoint committed, a layout found) stay quiet under Python's default
set-up, which shows WARNING and above. A line a user must read after a restart (from where
the run resumed, what it cost) is not a warning, yet must be seen: :func:`announce` logs it
at INFO and, unless the application set a level on moc's loggers, lets it through where
the root logger's default level would drop it (to the application's handlers, or to
stderr as Python's last-resort handler writes warnings when there are none).
``logging.getLogger("moc").setLevel(logging.WARNING)`` silences it.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["announce"]


def _level_chosen(logger: logging.Logger) -> bool:
    """Did the application set a level on this logger or one of its parents below the root?"""
    current: logging.Logger | None = logger
    while current is not None and current is not logging.root:
        if current.level != logging.NOTSET:
            return True
        current = current.parent
    return False


def announce(logger: logging.Logger, msg: str, *args: object) -> None:
    """Log ``msg % args`` at INFO on ``logger`` so that a user with no logging configured sees it."""
    if logger.manager.disable >= logging.INFO or logger.disabled:
        return
    if _level_chosen(logger):
        logger.info(msg, *args, stacklevel=2)
        return
    frame = sys._getframe(1)
    record = logger.makeRecord(logger.name, logging.INFO, frame.f_code.co_filename, frame.f_lineno, msg, args, None,
                               func=frame.f_code.co_name)
    if logger.hasHandlers():
        logger.handle(record)                 # the application's handlers, past the root's default level
    elif logging.lastResort is not None:
        logging.lastResort.handle(record)     # no handler anywhere: stderr, as Python does for warnings
