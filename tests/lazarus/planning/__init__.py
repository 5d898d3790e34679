"""Tests of ``lazarus.planning`` (``test_cli.py``: the ``lazarus plan`` command)."""
