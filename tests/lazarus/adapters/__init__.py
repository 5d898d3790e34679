"""Tests of ``lazarus.adapters`` (``test_hf.py``: ``lazarus.adapters.hf``)."""
