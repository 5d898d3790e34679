"""moc inside other libraries' training loops.

Each adapter lives in its own module and imports its library only when imported itself:

* :mod:`moc.integrations.transformers`: ``MoCCallback`` for ``transformers.Trainer``
  (needs ``transformers`` and ``accelerate``: ``pip install "moc-lazarus[hf]"``);
* :mod:`moc.integrations.lightning`: ``MoCCallback`` for ``lightning.Trainer``
  (``pip install "moc-lazarus[lightning]"``);
* :mod:`moc.integrations.torchtitan`: ``MoCCheckpointManager``, torchtitan's checkpointer
  contract (``Trainer.Config.checkpoint``) served by moc (torchtitan 0.3.0, installed with
  ``--no-deps`` beside ``pip install "moc-lazarus[titan]"``; see docs/trainers.md).

Nothing is imported here, so ``import moc`` never pulls in a trainer library.
"""

__all__: list[str] = []
