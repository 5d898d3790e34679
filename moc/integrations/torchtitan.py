"""moc as the checkpointer of a torchtitan run (torchtitan >= 0.3).

torchtitan 0.3 builds its checkpointer from ``Trainer.Config.checkpoint``, any
``BaseCheckpointManager.Config``. :class:`MoCCheckpointManager` implements that contract, so
a torchtitan job switches to moc in its config and nothing else::

    from moc import MoCConfig
    from moc.integrations.torchtitan import MoCCheckpointManager

    config = deepseek_v3_debugmodel()                 # any torchtitan Trainer.Config
    config.checkpoint = MoCCheckpointManager.Config(
        enable=True, moc=MoCConfig(storage="s3://bucket/run", interval=50, k_snapshot=2))

The trainer then calls ``load()`` before its loop (moc restores its newest consistent step:
model, optimizer, LR schedule, the trainer's ``step`` / ``ntokens_seen`` and the data
loader's position), ``save(step)`` after each step (``manager.step(step)``: a snapshot every
``interval`` steps, partial for the experts) and ``close()`` at the end (persists the newest
snapshot). The model may be sharded by torchtitan's FSDP2 / expert parallelism: moc saves
each rank's local shards of its DTensors and re-shards on restore.

Limits, each an error naming the field: one model part (no pipeline parallelism), one
optimizer (torchtitan's ``OptimizersContainer`` may hold several when parameter groups name
several optimizers), ``load_step=-1`` only, and none of the DCP-only loading options
(``initial_load_path``, ``create_seed_checkpoint``, ``load_only``, ``exclude_from_loading``,
``last_save_in_hf``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

from .._config import MoCConfig
from .._manager import CheckpointManager
from ._common import inner_optimizer, require

try:
    require("torchtitan", None, "moc.integrations.torchtitan")
except ImportError as exc:
    raise ImportError(f"{exc} (torchtitan 0.3.0 beside this project: pip install -e \".[titan]\" then "
                      "pip install --no-deps torchtitan==0.3.0; see docs/trainers.md)") from exc
from torchtitan.components.checkpointer.base import BaseCheckpointManager  # noqa: E402

__all__ = ["MoCCheckpointManager"]

log = logging.getLogger("moc.integrations.torchtitan")

_RESERVED = ("lr_schedulers", "dataloader")


class _DataloaderState:
    """A torchtitan data loader's position, without the pickle.

    torchtitan's ``ParallelAwareDataloader.state_dict()`` pickles the ``StatefulDataLoader``
    state into bytes; moc never unpickles what it reads back, so this saves the state the
    pickle wraps (plain ints, lists, dicts), and the data-parallel world size it was taken at."""

    def __init__(self, dataloader: Any) -> None:
        self.dataloader = dataloader
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader
        except ImportError:   # pragma: no cover - torchtitan depends on torchdata
            StatefulDataLoader = None
        self._stateful = StatefulDataLoader if isinstance(dataloader, StatefulDataLoader or ()) else None

    def _world(self) -> int | None:
        return getattr(self.dataloader, "dp_world_size", None)

    def state_dict(self) -> dict[str, Any]:
        inner = self._stateful.state_dict(self.dataloader) if self._stateful else self.dataloader.state_dict()
        return {"world_size": self._world(), "state": inner}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("world_size") != self._world():
            raise ValueError(f"the data loader was saved at data-parallel degree {state.get('world_size')} and "
                             f"restores at {self._world()}: torchtitan's data loaders cannot be re-sharded")
        if self._stateful:
            self._stateful.load_state_dict(self.dataloader, dict(state["state"]))
        else:
            self.dataloader.load_state_dict(dict(state["state"]))


class MoCCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpointer contract (``load`` / ``save`` / ``close``) served by a
    :class:`moc.CheckpointManager` over the (single) model part and optimizer."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint options plus moc's.

        ``moc``: the :class:`moc.MoCConfig`; left ``None``, moc writes to
        ``<dump_folder>/<folder>`` every ``interval`` steps with its defaults.
        ``save_dataloader``: save the data loader's position (torchtitan's are stateful)."""

        moc: MoCConfig | None = None
        save_dataloader: bool = True

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list, optimizers: Any, lr_schedulers: Any,
                 states: Mapping[str, Any], sd_adapter: Any = None, base_folder: str = "") -> None:
        self.enable = config.enable
        self.save_future = None
        self.manager: CheckpointManager | None = None
        if not self.enable:
            return
        _check_config(config)
        if len(model_parts) != 1:
            raise ValueError(f"MoCCheckpointManager: model_parts has {len(model_parts)} parts; moc checkpoints one "
                             "model part (pipeline parallelism is not supported)")
        inner = list(getattr(optimizers, "optimizers", [optimizers]))
        if len(inner) != 1:
            raise ValueError(f"MoCCheckpointManager: the OptimizersContainer holds {len(inner)} optimizers; moc "
                             "checkpoints one (give every parameter group the same optimizer)")
        taken = sorted(set(states) & set(_RESERVED))
        if taken:
            raise ValueError(f"MoCCheckpointManager: states may not use the names {taken} (used by moc)")
        cfg = config.moc if config.moc is not None else \
            MoCConfig(storage=os.path.join(base_folder, config.folder), interval=config.interval)
        if not isinstance(cfg, MoCConfig):
            raise TypeError(f"MoCCheckpointManager.Config.moc must be a moc.MoCConfig, got {type(cfg).__name__}")
        extra: dict[str, Any] = dict(states)
        extra["lr_schedulers"] = lr_schedulers
        if dataloader is not None and config.save_dataloader:
            extra["dataloader"] = _DataloaderState(dataloader)
        self.manager = CheckpointManager(cfg, model=model_parts[0], optimizer=inner_optimizer(inner[0]),
                                         extra_state=extra)
        self.restored_step: int | None = None

    # -- BaseCheckpointManager hooks ---------------------------------------------------------
    def _load(self, step: int = -1) -> bool:
        if step != -1:
            raise ValueError(f"MoCCheckpointManager.load(step={step}): moc restores its newest consistent step; "
                             "allowed: -1")
        assert self.manager is not None
        start = self.manager.restore()
        self.restored_step = start - 1 if start > 0 else None
        if start > 0:
            log.info("rank %d step %d: restored moc's checkpoint; training resumes at step %d",
                     self.manager.rank, start - 1, start)
        return start > 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        assert self.manager is not None
        self.manager.step(curr_step)
        if last_step:
            self.manager.wait()
        return True

    def _maybe_wait_for_staging(self) -> None:
        # moc's snapshot copy is guarded by an optimizer pre-step hook: nothing to wait for here.
        return None

    def _wait_for_saving(self) -> None:   # save_future is never set
        return None

    def _close(self) -> None:
        if self.manager is not None:
            manager, self.manager = self.manager, None
            manager.close()


def _check_config(config: Any) -> None:
    """Reject the DCP-only options moc does not implement, naming the field."""
    if config.load_step != -1:
        raise ValueError(f"checkpoint.load_step={config.load_step}: moc restores its newest consistent step; "
                         "allowed: -1")
    for name, default in (("initial_load_path", None), ("create_seed_checkpoint", False), ("load_only", False),
                          ("last_save_in_hf", False)):
        if getattr(config, name) != default:
            raise ValueError(f"checkpoint.{name}={getattr(config, name)!r} is a torchtitan DCP option that "
                             f"MoCCheckpointManager does not implement; allowed: {default!r}")
    if config.exclude_from_loading:
        raise ValueError(f"checkpoint.exclude_from_loading={config.exclude_from_loading!r} is not supported by "
                         "MoCCheckpointManager; allowed: []")
