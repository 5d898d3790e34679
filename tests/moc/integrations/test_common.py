"""moc/integrations/_common.py: what the trainer callbacks keep back from the user after a
moc restore is one message on one logger (``QuietRecord``) or one warning of one category
from one module (``QuietWarning``), nothing else, and nothing once removed."""

from __future__ import annotations

import logging
import warnings

import pytest

from moc.integrations._common import QuietRecord, QuietWarning

EMPTY = "There seems not to be a single sample in your epoch_iterator, stopping training at step 100!"
NOT_RESUMABLE = ("You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not "
                 "resumable. This can cause unreliable results if further training is done.")


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_quiet_record_keeps_back_that_message_on_that_logger_only():
    trainer_log, other_log = logging.getLogger("transformers.trainer"), logging.getLogger("transformers.other")
    kept = _Kept()
    for lg in (trainer_log, other_log):
        lg.addHandler(kept)
    quiet = QuietRecord("transformers.trainer", "There seems not to be a single sample in your epoch_iterator")
    try:
        quiet.install()
        quiet.install()                      # once
        trainer_log.warning(EMPTY)
        trainer_log.warning("Some other warning")
        other_log.warning(EMPTY)
        quiet.remove()
        trainer_log.warning(EMPTY)
    finally:
        quiet.remove()
        for lg in (trainer_log, other_log):
            lg.removeHandler(kept)
    assert kept.messages == ["Some other warning", EMPTY, EMPTY]
    assert quiet not in trainer_log.filters


def test_quiet_warning_keeps_back_that_warning_of_that_module_only():
    lightning = pytest.importorskip("lightning.fabric.utilities.warnings")
    category, module = lightning.PossibleUserWarning, "lightning.pytorch.loops.training_epoch_loop"
    quiet = QuietWarning("You're resuming from a checkpoint that ended before the epoch ended and your dataloader "
                         "is not resumable", category, module)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        before = list(warnings.filters)
        quiet.install()
        warnings.filterwarnings("error", message="unrelated")     # a filter added meanwhile stays

        def warn(message, cat=category, mod=module):
            warnings.warn_explicit(message, cat, "loop.py", 1, module=mod, registry={})

        warn(NOT_RESUMABLE)                                       # kept back
        warn(NOT_RESUMABLE, mod="my_project.loop")                # another module's: shown
        warn(NOT_RESUMABLE, cat=UserWarning)                      # another category: shown
        warn("Another warning of that loop")                      # another message: shown
        quiet.remove()
        quiet.remove()
        warn(NOT_RESUMABLE)                                       # removed: shown again
        assert warnings.filters[1:] == before and "unrelated" in warnings.filters[0][1].pattern
    assert [str(w.message) for w in seen] == [NOT_RESUMABLE, NOT_RESUMABLE, "Another warning of that loop",
                                              NOT_RESUMABLE]
