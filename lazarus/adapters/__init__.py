"""Adapters that make other libraries' MoE models elastic under Lazarus.

* :mod:`lazarus.adapters.hf` -- Hugging Face transformers 5.x MoE models (Mixtral,
  Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, Llama 4, DBRX, JetMoE, LongCat-Flash,
  Switch Transformers, NLLB-MoE, ...): :func:`lazarus.adapters.hf.make_elastic`.

Each adapter is imported on its own (``from lazarus.adapters.hf import make_elastic``), so
``lazarus`` never imports transformers unless asked to.
"""

__all__: list[str] = []
