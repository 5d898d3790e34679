"""Tests of ``moc``: ``tests/moc/test_x.py`` tests ``moc/_x.py`` (or the feature of that name)."""
