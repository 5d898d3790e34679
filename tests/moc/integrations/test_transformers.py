"""moc.integrations.transformers.MoCCallback with a real transformers.Trainer.

A tiny random qwen3_moe (fused experts, routers tapped for PLT) is trained for 3 epochs of
6 optimizer steps (12 batches of 2, gradient accumulation 2) by tests/helpers/workers/hf_trainer_worker.py,
which only adds ``callbacks=[MoCCallback(...)]``. One run goes uninterrupted; another is
SIGKILLed at the end of step 10 (moc's newest checkpoint: step 8, mid-epoch), run again
and SIGKILLed at step 13 (newest: step 12, an epoch boundary), and run a third time. Each
resumed run must continue exactly as the uninterrupted one: model and optimizer as saved,
``global_step`` from the restored step, the same samples in every later step, the same
learning rates, epochs and losses, the same final weights.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from moc import MoCConfig  # noqa: E402

from tests.helpers.trainer_runs import finish, same_after, start  # noqa: E402


def _start(tmp, name, storage, *extra):
    return start("hf_trainer_worker.py", tmp, name, storage, *extra)


@pytest.mark.timeout(600)
def test_trainer_resumes_exactly_after_sigkill(tmp_path):
    storage = tmp_path / "ckpt"
    ref_proc, ref_dir = _start(tmp_path, "ref", tmp_path / "ref-ckpt")
    crash_proc, crash_dir = _start(tmp_path, "crash", storage, "--kill-at", "10")
    ref, _ = finish(ref_proc, ref_dir)
    first, _ = finish(crash_proc, crash_dir, -signal.SIGKILL)
    assert ref["final"]["global_step"] == 18 and ref["final"]["resumed_step"] is None
    assert ref["final"]["report"].startswith("moc: nothing to resume in ")
    assert max(map(int, first["steps"])) == 10

    # Second run: resumes from step 8 (mid-epoch 1), then is killed at step 13.
    again, again_dir = _start(tmp_path, "again", storage, "--kill-at", "13")
    second, log = finish(again, again_dir, -signal.SIGKILL)
    assert _resume_lines(log) == ["moc: resumed step 8 from * (experts 8 from step 8; dense "], log
    assert second["resumed"]["global_step"] == 8
    assert second["resumed"]["model"] == ref["steps"]["8"]["model"]          # weights as saved at step 8
    assert second["resumed"]["optimizer"] == ref["steps"]["8"]["optimizer"]  # Adam state too
    same_after(ref, second, 8, 13)

    # Third run: resumes from step 12 (an epoch boundary) with the Trainer saving too.
    last, last_dir = _start(tmp_path, "last", storage, "--save-strategy", "steps")
    third, log = finish(last, last_dir)
    assert third["resumed"]["global_step"] == 12
    assert third["resumed"]["model"] == ref["steps"]["12"]["model"]
    same_after(ref, third, 12, 18)
    assert third["final"]["global_step"] == 18 and third["final"]["resumed_step"] == 12
    assert "the Trainer also saves (save_strategy='steps')" in log
    # What the restore did, once, at the default log level; the two epochs trained before
    # the restore are skipped without the Trainer's "stopping training" warning.
    assert _resume_lines(log) == ["moc: resumed step 12 from * (experts 8 from step 12; dense "], log
    assert third["final"]["report"].startswith("moc: resumed step 12 from ")
    assert "There seems not to be a single sample in your epoch_iterator" not in log
    assert third["final"]["trainer_log_filters"] == 0                       # the filter went with the run
    assert os.path.isdir(last_dir / "trainer-out" / "checkpoint-15")        # the Trainer's own saves still run


def _resume_lines(log: str) -> list[str]:
    """moc's resume lines in a run's output, up to the units, the source as ``*`` (memory or
    storage: whether the newest snapshot was persisted before the kill depends on timing)."""
    return [re.sub(r" from (memory|storage) \(", " from * (", ln[:ln.index("dense ") + 6])
            for ln in log.splitlines() if ln.startswith("moc: resumed")]


def test_callback_rejects_bad_arguments():
    from moc.integrations.transformers import MoCCallback

    with pytest.raises(TypeError, match="moc.MoCConfig"):
        MoCCallback({"storage": "x"})
    with pytest.raises(ValueError, match="lr_scheduler"):
        MoCCallback(MoCConfig(storage="memory://x"), extra_state={"lr_scheduler": object()})
    with pytest.raises(ValueError, match="process_group, node"):
        MoCCallback(MoCConfig(storage="memory://x"), manager_kwargs={"model": None})
