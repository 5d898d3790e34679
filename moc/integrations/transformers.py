"""moc as the checkpointer of a ``transformers.Trainer``: one callback, nothing else changed.

::

    trainer = Trainer(model=model, args=TrainingArguments(..., save_strategy="no"),
                      train_dataset=ds, callbacks=[MoCCallback(MoCConfig(storage="runs/ckpt", interval=50))])
    trainer.train()          # run the same script again after a crash: it resumes by itself

At ``on_train_begin`` the callback builds a :class:`moc.CheckpointManager` over the
Trainer's model and (unwrapped) optimizer, with the Trainer's LR scheduler and its progress
(global step, epoch, token and FLOP counts, log history, the data position) as extra state,
and restores moc's newest step when there is one. Every optimizer step ends with
``manager.step(state.global_step)``; ``on_train_end`` persists the newest snapshot.

After a restore the Trainer continues as if it had never stopped: ``state.global_step``
from the restored step, the LR schedule from there, the data loader skipping the batches
that step had consumed (whole epochs, then ``(step % steps_per_epoch) x
gradient_accumulation_steps`` batches of the resumed epoch, as ``Trainer`` does for its own
checkpoints) and the RNG put back where the saving run had it when it reached that point.
The batch order matches an uninterrupted run with the Trainer's default seedable sampler
(``accelerator_config.use_seedable_sampler``, on by default).

When the Trainer also saves (``save_strategy`` other than ``"no"``) both run: the Trainer
writes its full ``checkpoint-N`` folders, moc its partial checkpoints; the callback logs this
once and resumes from moc's store. ``trainer.train(resume_from_checkpoint=...)`` takes
precedence: the callback then loads nothing and checkpoints on from the Trainer's step.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any, Mapping

from .._config import MoCConfig
from ._common import CallbackRun, QuietRecord, delegated, require

transformers = require("transformers", "hf", "moc.integrations.transformers")
require("accelerate", "hf", "transformers.Trainer")

from transformers import TrainerCallback  # noqa: E402

__all__ = ["MoCCallback"]

log = logging.getLogger("moc.integrations.transformers")

_STATE_FIELDS = ("global_step", "epoch", "total_flos", "num_input_tokens_seen", "log_history", "best_metric",
                 "best_global_step", "best_model_checkpoint")


class _TrainerProgress:
    """The Trainer's own state as a moc extra-state object (``state_dict`` /
    ``load_state_dict``): read live from ``TrainerState`` when a checkpoint is planned,
    kept aside on restore for the callback to apply."""

    def __init__(self, state: Any, data: Mapping[str, Any]) -> None:
        self.state = state
        self.data = dict(data)
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        out = {name: getattr(self.state, name) for name in _STATE_FIELDS}
        out["log_history"] = [dict(e) for e in (self.state.log_history or [])]
        out["data"] = dict(self.data)
        return out

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.loaded = dict(sd)


class MoCCallback(TrainerCallback):
    """Checkpoint a ``transformers.Trainer`` run with moc and resume it automatically.

    Args:
        config: the :class:`moc.MoCConfig` (storage, interval, K, ...). ``interval`` counts
            optimizer steps (``state.global_step``), as the Trainer's ``save_steps`` does.
        resume: restore moc's newest step at the start of ``train()`` (default). ``False``
            starts from the model as given, and keeps checkpointing into the same store.
        extra_state: more objects with ``state_dict()``/``load_state_dict()`` to save
            and restore with the run.
        manager_kwargs: passed on to :class:`moc.CheckpointManager` (``process_group``,
            ``node``, ``expert_pattern``, ``memory_key``).

    Attributes:
        manager: the :class:`moc.CheckpointManager` while ``train()`` runs, else ``None``.
        resumed_step: the global step restored by the newest ``train()`` (``None``: nothing
            was restored).
        last_restore_report: what the newest ``train()``'s restore did, a :class:`moc.RestoreReport`
            (the line moc logged; ``step`` None when nothing was stored; None: no restore).
    """

    config = delegated("config", "the :class:`moc.MoCConfig`")
    resume = delegated("resume", "restore moc's newest step when ``train()`` starts")
    extra_state = delegated("extra_state", "the user's extra state objects")
    manager_kwargs = delegated("manager_kwargs", "passed on to :class:`moc.CheckpointManager`")
    manager = delegated("manager", "the :class:`moc.CheckpointManager` while ``train()`` runs, else None")
    resumed_step = delegated("resumed_step", "the global step the newest ``train()`` restored (None: nothing)")
    last_restore_report = delegated("last_restore_report", "what the newest ``train()``'s restore did (a "
                                    ":class:`moc.RestoreReport`; None: no restore was made)")

    def __init__(self, config: MoCConfig, *, resume: bool = True, extra_state: Mapping[str, Any] | None = None,
                 manager_kwargs: Mapping[str, Any] | None = None) -> None:
        self._run = CallbackRun(config, resume=resume, extra_state=extra_state, manager_kwargs=manager_kwargs,
                                reserved=lambda n: n in ("trainer", "lr_scheduler"))
        self._progress: _TrainerProgress | None = None
        self._rng = self._run.rng
        # The Trainer finds no batch in an epoch the callback skips on purpose and warns that
        # it stops training (it does not): that warning, in those epochs only.
        self._quiet = QuietRecord("transformers.trainer", "There seems not to be a single sample in your "
                                  "epoch_iterator")
        self._skip_epochs = 0        # whole epochs the restored step had consumed
        self._skip_batches = 0       # batches of the resumed epoch it had consumed
        self._steps_in_epoch: int | None = None
        self._epoch = 0              # epochs this train() has entered
        self._loader: Any = None
        self._done = False           # the restored step is already max_steps

    # -- set-up --------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                       train_dataloader=None, **kwargs):
        if model is None or optimizer is None:
            raise RuntimeError("MoCCallback: the Trainer passed no model or optimizer to on_train_begin")
        where = f"rank {args.process_index} step {state.global_step}"
        save_strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
        if save_strategy != "no" and state.is_world_process_zero:
            log.warning("%s: the Trainer also saves (save_strategy=%r) full checkpoints to %s; moc checkpoints "
                        "every %s steps to %s and resumes from there by itself; set save_strategy='no' to let moc "
                        "own checkpointing", where, save_strategy, args.output_dir, self.config.interval,
                        self.config.storage)
        self._loader = train_dataloader
        self._epoch = 0
        self._skip_epochs = self._skip_batches = 0
        self._done = False
        self._steps_in_epoch = _length(train_dataloader)
        ga = args.gradient_accumulation_steps
        per_epoch = (max(self._steps_in_epoch // ga + int(self._steps_in_epoch % ga > 0), 1)
                     if self._steps_in_epoch else None)
        data = {"steps_in_epoch": self._steps_in_epoch, "update_steps_per_epoch": per_epoch,
                "gradient_accumulation_steps": ga, "train_batch_size": state.train_batch_size,
                "world_size": args.world_size}
        self._progress = _TrainerProgress(state, data)
        extra: dict[str, Any] = {"trainer": self._progress}
        if lr_scheduler is not None:
            extra["lr_scheduler"] = lr_scheduler
        self._run.open(model, optimizer, extra)
        if state.global_step > 0:
            log.warning("%s: the Trainer resumed from its own checkpoint (resume_from_checkpoint); moc loads "
                        "nothing and checkpoints on from step %d", where, state.global_step)
        elif self.resume:
            step = self._run.restore()
            if step is not None:
                self._apply_restore(args, state, control, step, per_epoch)
        return control

    def _apply_restore(self, args, state, control, step: int, per_epoch: int | None) -> None:
        assert self._progress is not None   # made by on_train_begin before the restore
        saved = self._progress.loaded or {}
        for name in _STATE_FIELDS:
            if name in saved:
                setattr(state, name, list(saved[name]) if name == "log_history" else saved[name])
        state.global_step = step
        self.resumed_step = step
        was = saved.get("data", {})
        now = self._progress.data
        changed = {k: (was.get(k), now[k]) for k in ("steps_in_epoch", "gradient_accumulation_steps",
                                                     "train_batch_size", "world_size") if was.get(k) != now[k]}
        if changed:
            log.warning("rank %d step %d: the data set-up differs from the run that saved (%s): batches are "
                        "skipped by global step as the Trainer does, and differ from the saving run's",
                        args.process_index, step, ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()))
        if per_epoch:
            self._skip_epochs, in_epoch = divmod(step, per_epoch)
        else:
            self._skip_epochs, in_epoch = 0, step
        self._skip_batches = 0 if args.ignore_data_skip else in_epoch * args.gradient_accumulation_steps
        if (self._skip_batches and self._steps_in_epoch
                and self._steps_in_epoch % args.gradient_accumulation_steps):
            log.warning("rank %d step %d: %d batches per epoch are not a multiple of gradient_accumulation_steps=%d;"
                        " the last optimizer step of the resumed epoch accumulates differently from an "
                        "uninterrupted run", args.process_index, step, self._steps_in_epoch,
                        args.gradient_accumulation_steps)
        self._done = step >= state.max_steps > 0
        if self._done:
            control.should_training_stop = True
        if self._skip_epochs or self._skip_batches or self._done:
            _skippable(self._loader)
        self._rng.hold()
        _continue_logging_from(step)
        log.info("rank %d step %d: resumed from moc (epoch %d, %d batches of it already trained)",
                 args.process_index, step, self._skip_epochs, self._skip_batches)

    # -- the loop ----------------------------------------------------------------------------
    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.resumed_step is None:
            return control
        if self._done or self._epoch < self._skip_epochs:
            self._loader.skip_batches = sys.maxsize     # this epoch was trained before the restore
            self._quiet.install()
            if state.is_world_process_zero:
                log.info("rank %d step %d: epoch %d was trained before the restore; its batches are skipped",
                         args.process_index, state.global_step, self._epoch)
        elif self._epoch == self._skip_epochs:
            self._loader.skip_batches = self._skip_batches
            if not self._skip_batches:
                self._rng.release()      # epoch boundary: before the epoch's iterator draws
        else:
            self._loader.skip_batches = 0
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        self._rng.release()              # mid-epoch: the first step after the skipped batches
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if (self.resumed_step is not None and self._epoch == self._skip_epochs and self._skip_batches
                and self._steps_in_epoch):
            # The Trainer counts the epoch's batches from the skip: count the skipped ones too,
            # with its formula (epoch + batches / steps_in_epoch), so the floats match.
            seen = round((state.epoch - self._epoch) * self._steps_in_epoch)
            state.epoch = self._epoch + (seen + self._skip_batches) / self._steps_in_epoch
        if self.manager is not None:
            self.manager.step(state.global_step)
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.resumed_step is not None:
            skipped = self._epoch < self._skip_epochs or self._done
            if skipped:
                # An epoch trained before the restore: the Trainer saw no batch in it and
                # would stop; nothing to log, evaluate or save either.
                control.should_training_stop = self._done
                control.should_log = control.should_evaluate = control.should_save = False
            self._quiet.remove()
            if self._epoch >= self._skip_epochs:
                self._loader.skip_batches = 0
        self._epoch += 1
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self._quiet.remove()
        self._run.close()
        return control


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _skippable(loader: Any) -> None:
    if loader is None or not hasattr(loader, "skip_batches"):
        raise TypeError("MoCCallback: resuming needs the Trainer's accelerate data loader (DataLoaderShard or "
                        f"DataLoaderDispatcher, which skip batches), got {type(loader).__name__}")


def _continue_logging_from(step: int) -> None:
    """The Trainer averages the logged loss over the steps since ``_globalstep_last_logged``
    and the run's over those since ``_initial_global_step``, both read before callbacks
    run; a restore moves them to the restored step, as its own resume does."""
    frame = inspect.currentframe()
    try:
        for _ in range(8):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return
            owner = frame.f_locals.get("self")
            if isinstance(owner, transformers.Trainer):
                owner._globalstep_last_logged = step
                owner._initial_global_step = step
                return
    finally:
        del frame
