"""moc as the checkpointer of a Lightning run: one ``Callback``, nothing else changed.

::

    trainer = lightning.Trainer(max_epochs=3, callbacks=[MoCCallback(MoCConfig(storage="runs/ckpt", interval=50))],
                                enable_checkpointing=False)
    trainer.fit(module, dataloader)      # run the same script again after a crash: it resumes by itself

At ``on_fit_start`` (optimizers exist, the loops have not started) the callback builds a
:class:`moc.CheckpointManager` over the ``LightningModule`` and its optimizer, with the LR
schedulers and the fit loop's progress (what Lightning's own checkpoints call ``loops``) as
extra state, and restores moc's newest step. ``on_train_batch_end`` after each optimizer
step calls ``manager.step(trainer.global_step)``, where Lightning's ``ModelCheckpoint``
saves; ``on_fit_end`` persists the newest snapshot.

After a restore Lightning restarts its loops as it does from its own checkpoint (global
step, epoch, batch index), and the callback makes the data exact, which Lightning does
not do for a plain ``DataLoader`` resumed mid-epoch: the epoch's iterator is re-made from
the RNG state the saving run had when that epoch began (so a shuffling ``DataLoader``
draws the same order), the batches the restored step had consumed are skipped, and the RNG
is put back where the saving run had it after that step.

One optimizer (automatic or manual optimization); ``ckpt_path=`` given to ``fit`` takes
precedence (the callback then loads nothing).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from .._config import MoCConfig
from .._units import capture_rng, restore_rng
from ._common import CallbackRun, QuietWarning, delegated, require

require("lightning.pytorch", "lightning", "moc.integrations.lightning")
from lightning.pytorch import Callback  # noqa: E402
from lightning.fabric.utilities.data import _set_sampler_epoch  # noqa: E402
from lightning.fabric.utilities.warnings import PossibleUserWarning  # noqa: E402

__all__ = ["MoCCallback"]

log = logging.getLogger("moc.integrations.lightning")


class _FitProgress:
    """The fit loop's progress and the RNG state at the start of the current epoch, as a
    moc extra-state object."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.epoch_rng: dict[str, Any] | None = None
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"fit_loop": self.trainer.fit_loop.state_dict(), "global_step": self.trainer.global_step,
                "epoch": self.trainer.current_epoch, "epoch_rng": self.epoch_rng,
                "batches_per_epoch": _finite(self.trainer.num_training_batches),
                "accumulate_grad_batches": self.trainer.accumulate_grad_batches}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.loaded = dict(sd)


class MoCCallback(Callback):
    """Checkpoint a ``lightning.Trainer`` fit with moc and resume it automatically.

    Args:
        config: the :class:`moc.MoCConfig`; ``interval`` counts optimizer steps
            (``trainer.global_step``).
        resume: restore moc's newest step when ``fit`` starts (default).
        extra_state: more objects with ``state_dict()``/``load_state_dict()``.
        manager_kwargs: passed on to :class:`moc.CheckpointManager` (``process_group``,
            ``node``, ``expert_pattern``, ``memory_key``).

    Attributes:
        manager: the :class:`moc.CheckpointManager` while ``fit`` runs, else ``None``.
        resumed_step: the global step the newest ``fit`` restored (``None``: nothing).
        last_restore_report: what the newest ``fit``'s restore did, a :class:`moc.RestoreReport`
            (the line moc logged; ``step`` None when nothing was stored; None: no restore).
    """

    config = delegated("config", "the :class:`moc.MoCConfig`")
    resume = delegated("resume", "restore moc's newest step when ``fit`` starts")
    extra_state = delegated("extra_state", "the user's extra state objects")
    manager_kwargs = delegated("manager_kwargs", "passed on to :class:`moc.CheckpointManager`")
    manager = delegated("manager", "the :class:`moc.CheckpointManager` while ``fit`` runs, else None")
    resumed_step = delegated("resumed_step", "the global step the newest ``fit`` restored (None: nothing)")
    last_restore_report = delegated("last_restore_report", "what the newest ``fit``'s restore did (a "
                                    ":class:`moc.RestoreReport`; None: no restore was made)")

    def __init__(self, config: MoCConfig, *, resume: bool = True, extra_state: Mapping[str, Any] | None = None,
                 manager_kwargs: Mapping[str, Any] | None = None) -> None:
        self._run = CallbackRun(config, resume=resume, extra_state=extra_state, manager_kwargs=manager_kwargs,
                                reserved=lambda n: n == "fit" or n.startswith("lr_scheduler"))
        self._progress: _FitProgress | None = None
        self._rng = self._run.rng
        # Restarted mid-epoch, Lightning warns that a plain DataLoader cannot resume exactly;
        # after a moc restore the callback positions it exactly: that warning, then only.
        self._quiet = QuietWarning("You're resuming from a checkpoint that ended before the epoch ended and your "
                                   "dataloader is not resumable", PossibleUserWarning,
                                   "lightning.pytorch.loops.training_epoch_loop")
        self._skip = 0
        self._epoch_rng: dict[str, Any] | None = None
        self._keep_epoch_rng = False
        self._last_step = -1

    def on_fit_start(self, trainer, pl_module) -> None:
        if len(trainer.optimizers) > 1:
            raise ValueError(f"MoCCallback supports one optimizer, the module configured {len(trainer.optimizers)}")
        self._progress = _FitProgress(trainer)
        extra: dict[str, Any] = {"fit": self._progress}
        for i, cfg in enumerate(trainer.lr_scheduler_configs):
            extra[f"lr_scheduler{i}"] = cfg.scheduler
        self._run.open(pl_module, trainer.optimizers[0] if trainer.optimizers else None, extra)
        self._skip = 0
        self._epoch_rng = None
        self._keep_epoch_rng = False
        self._last_step = trainer.global_step
        if trainer.ckpt_path is not None:
            log.warning("rank %d step %d: fit(ckpt_path=%s) given; moc loads nothing and checkpoints on from there",
                        trainer.global_rank, trainer.global_step, trainer.ckpt_path)
            return
        if self.resume:
            step = self._run.restore()
            if step is not None:
                self._quiet.install()        # Lightning warns when its loop restarts, before the first batch
                self._apply_restore(trainer, step)

    def _apply_restore(self, trainer, step: int) -> None:
        assert self._progress is not None   # made by on_fit_start before the restore
        saved = self._progress.loaded or {}
        if "fit_loop" not in saved:
            raise RuntimeError(f"moc restored step {step} but its store holds no Lightning loop state "
                               "(written by another trainer?)")
        per_epoch, accumulate = saved.get("batches_per_epoch"), saved.get("accumulate_grad_batches")
        trainer.fit_loop.load_state_dict(_epoch_closed(saved["fit_loop"], per_epoch))
        self.resumed_step = step
        self._last_step = step
        batch = trainer.fit_loop.epoch_loop.batch_progress.current
        # at on_train_batch_end the batch was processed, not completed: the loop counts it
        # completed on restart, and the batches consumed are the processed ones
        self._skip = batch.processed if trainer.fit_loop.epoch_loop.restarting else 0
        now = _finite(trainer.num_training_batches)
        if (per_epoch, accumulate) != (now, trainer.accumulate_grad_batches) and now is not None:
            log.warning("rank %d step %d: batches per epoch / accumulation changed (%s, %s) -> (%s, %s); the data "
                        "after the resume differ from the saving run's", trainer.global_rank, step, per_epoch,
                        accumulate, now, trainer.accumulate_grad_batches)
        self._epoch_rng = saved.get("epoch_rng")
        self._progress.epoch_rng = self._epoch_rng
        self._rng.hold()
        log.info("rank %d step %d: resumed from moc (epoch %d, %d batches of it already trained)",
                 trainer.global_rank, step, trainer.current_epoch, self._skip)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.resumed_step is None:
            return
        assert self._progress is not None   # a resumed fit: on_fit_start made it
        if not self._skip:
            # Restored at the end of an epoch: the next one begins as in the saving run, its
            # iterator made from the RNG state the step left (Lightning would not re-make
            # the iterator it made before this hook while resuming).
            self._rng.release()
            self._epoch_rng = capture_rng()
            self._progress.epoch_rng = self._epoch_rng
            self._keep_epoch_rng = True
            if trainer.current_epoch > 0 and trainer.fit_loop._data_fetcher is not None:
                iter(trainer.fit_loop._data_fetcher)
            return
        fetcher = trainer.fit_loop._data_fetcher
        if fetcher is None or self._epoch_rng is None:
            raise RuntimeError("MoCCallback: cannot position the training data (no data fetcher or epoch RNG state)")
        # Re-make the epoch's iterator as the saving run made it, from the epoch's RNG
        # state, and drop the batches it had consumed.
        restore_rng(self._epoch_rng)
        if trainer.current_epoch > 0:
            iter(fetcher)
        for loader in trainer.fit_loop._combined_loader.flattened:   # before the sampler draws
            _set_sampler_epoch(loader, trainer.fit_loop.epoch_progress.current.processed)
        iterator = fetcher.iterator
        for _ in range(self._skip):
            next(iterator)
        self._rng.release()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        # The RNG state the epoch's data order is drawn from (an epoch > 0 makes its
        # iterator right after this hook; epoch 0's sampler draws at its first batch).
        if self._keep_epoch_rng:
            self._keep_epoch_rng = False
            return
        self._epoch_rng = capture_rng()
        if self._progress is not None:
            self._progress.epoch_rng = self._epoch_rng

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._quiet.remove()                 # the loop has restarted: Lightning's own warnings pass again

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.manager is None or trainer.global_step == self._last_step:
            return                              # accumulating: no optimizer step yet
        self._last_step = trainer.global_step
        self.manager.step(trainer.global_step)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._quiet.remove()
        self._run.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._quiet.remove()
        self._run.close(keep_snapshots=True, raise_errors=False, flush=False)


def _epoch_closed(fit_loop: Mapping[str, Any], per_epoch: int | None) -> dict[str, Any]:
    """The loop state saved after the last batch of an epoch, as at the end of that epoch.

    Saved at ``on_train_batch_end`` of an epoch's last batch, the state says "epoch running,
    last batch processed"; Lightning restarted from it runs no batch of the next epoch. An
    epoch whose batches were all processed is an epoch that ended: say so, so the next one
    starts afresh (with its ``on_train_epoch_start``)."""
    state = {k: (dict(v) if isinstance(v, dict) else v) for k, v in fit_loop.items()}
    batches = state.get("epoch_loop.batch_progress")
    epochs = state.get("epoch_progress")
    if not (per_epoch and batches and epochs and batches["current"]["processed"] >= per_epoch):
        return state
    done = {"ready": 0, "started": 0, "processed": 0, "completed": 0}
    total = dict(batches["total"], completed=batches["total"]["processed"])
    state["epoch_loop.batch_progress"] = dict(batches, total=total, current=done, is_last_batch=False)
    state["epoch_progress"] = {part: dict(epochs[part], processed=epochs[part]["ready"],
                                          completed=epochs[part]["ready"]) for part in ("total", "current")}
    return state


def _finite(n: Any) -> int | None:
    return int(n) if isinstance(n, (int, float)) and n != float("inf") else None
