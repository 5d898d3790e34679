"""moc.integrations.lightning.MoCCallback with a real lightning.Trainer.

tests/helpers/workers/lightning_worker.py: a LightningModule around a tiny random qwen3_moe, a shuffling
DataLoader (its order drawn from the global RNG each epoch), gradient accumulation 2, 3
epochs of 6 optimizer steps, and ``callbacks=[MoCCallback(...)]``. As for the transformers
Trainer: one run uninterrupted; one SIGKILLed at step 10 (newest moc checkpoint: step 8,
mid-epoch, which Lightning alone does not resume exactly with a plain DataLoader), run again
and SIGKILLed at step 13 (newest: step 12, the last batch of an epoch), and run to the end.
Every resumed step must train the same samples to the same weights, optimizer state,
learning rate and loss as the uninterrupted run.
"""

from __future__ import annotations

import re
import signal

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

from moc import MoCConfig  # noqa: E402

from tests.helpers.trainer_runs import finish, same_after, start  # noqa: E402


def _start(tmp, name, storage, *extra):
    return start("lightning_worker.py", tmp, name, storage, *extra)


@pytest.mark.timeout(600)
def test_lightning_resumes_exactly_after_sigkill(tmp_path):
    storage = tmp_path / "ckpt"
    ref_proc, ref_dir = _start(tmp_path, "ref", tmp_path / "ref-ckpt")
    crash_proc, crash_dir = _start(tmp_path, "crash", storage, "--kill-at", "10")
    ref, _ = finish(ref_proc, ref_dir)
    first, _ = finish(crash_proc, crash_dir, -signal.SIGKILL)
    assert ref["final"]["report"].startswith("moc: nothing to resume in ")
    assert ref["final"] == {"global_step": 18, "resumed_step": None, "report": ref["final"]["report"],
                            "filters_left": 0}
    assert max(map(int, first["steps"])) == 10

    again, again_dir = _start(tmp_path, "again", storage, "--kill-at", "13")
    second, log = finish(again, again_dir, -signal.SIGKILL)
    assert second["resumed"]["global_step"] == 8 and second["resumed"]["epoch"] == 1
    # Resumed mid-epoch: moc says what it restored, once, at the default log level, and
    # Lightning's "dataloader is not resumable" warning (moc positions the data exactly) is not shown.
    lines = [ln for ln in log.splitlines() if ln.startswith("moc: resumed")]
    assert len(lines) == 1 and re.match(r"moc: resumed step 8 from (memory|storage) \(experts 8 from step 8; ",
                                        lines[0]), log
    assert "not resumable" not in log, log
    assert second["resumed"]["model"] == ref["steps"]["8"]["model"]
    assert second["resumed"]["optimizer"] == ref["steps"]["8"]["optimizer"]
    same_after(ref, second, 8, 13)

    last, last_dir = _start(tmp_path, "last", storage)
    third, _ = finish(last, last_dir)
    assert third["resumed"]["global_step"] == 12 and third["resumed"]["epoch"] == 2
    assert third["resumed"]["model"] == ref["steps"]["12"]["model"]
    same_after(ref, third, 12, 18)
    assert third["final"]["report"].startswith("moc: resumed step 12 from ")
    assert third["final"] == {"global_step": 18, "resumed_step": 12, "report": third["final"]["report"],
                              "filters_left": 0}                 # the warning filter went with the restart


def test_callback_rejects_bad_arguments():
    from moc.integrations.lightning import MoCCallback

    with pytest.raises(TypeError, match="moc.MoCConfig"):
        MoCCallback("runs/x")
    with pytest.raises(ValueError, match="lr_scheduler0"):
        MoCCallback(MoCConfig(storage="memory://x"), extra_state={"lr_scheduler0": object()})
