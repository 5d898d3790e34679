"""moc inside other libraries' training loops.

Each adapter lives in its own module and imports its library only when imported itself:

* :mod:`moc.integrations.transformers`: ``MoCCallback`` for ``transformers.Trainer``
  (needs ``transformers`` and ``accelerate``: ``pip install "moc-lazarus[hf]"``);
* :mod:`moc.integrations.lightning`: ``MoCCallback`` for ``lightning.Trainer``
  (``pip install "moc-lazarus[lightning]"``);
* :mod:`moc.integrations.torchtitan`: moc as the checkpointer of a torchtitan MoE model
  (a ``GroupedExperts`` model, FSDP2 and expert parallelism; see the torchtitan guide).

Nothing is imported here, so ``import moc`` never pulls in a trainer library.
"""

__all__: list[str] = []
