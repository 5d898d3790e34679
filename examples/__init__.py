"""Example models, workers and demos, kept out of the installed packages (``moc``,
``lazarus``): run them from the repository root (``python -m examples.<name>``), or put it on
``PYTHONPATH``. The elastic runtime's example is a byte-level MoE GPT on the stdlib source corpus:

* :mod:`examples.corpus` -- :class:`ByteCorpus`, the offline corpus and its
  deterministic, rank-sliced data stream;
* :mod:`examples.moe_gpt` -- :class:`MoEGPT` on :class:`lazarus.moe.MoELayer`,
  its optimizer, gradient sync and routing-skew helpers
  (``python -m examples.moe_gpt --steps 100`` trains it single-process);
* :mod:`examples.train_elastic` / :mod:`examples.train_hf` -- workers for
  ``lazarus agent``: the MoE GPT, and a transformers Qwen3-MoE made elastic with
  :func:`lazarus.adapters.hf.make_elastic`;
* :mod:`examples.local_cluster` -- :class:`LocalCluster`, a controller and N agents as real
  processes on one machine (the demo, the fault tests, the soak and the benchmarks);
* :mod:`examples.lazarus_demo` (``make demo``) and :mod:`examples.moc_demo` (``make demo-moc``),
  the latter on :mod:`examples.toy_moe` (``ToyMoE``, the tests' and benchmarks' MoE model).

Names are imported lazily, so running a submodule with ``-m`` does not import it twice.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ByteCorpus": "corpus",
    "GPTConfig": "moe_gpt",
    "MoEGPT": "moe_gpt",
    "evaluate": "moe_gpt",
    "make_optimizer": "moe_gpt",
    "moe_layer_names": "moe_gpt",
    "param_group_of": "moe_gpt",
    "routing_skew": "moe_gpt",
    "single_process_placement": "moe_gpt",
    "sync_gradients": "moe_gpt",
    "train_step": "moe_gpt",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
