"""Tests of ``lazarus.sim`` and the ``lazarus simulate`` command."""
