"""Tests of ``lazarus.dispatch``: ``test_dispatch.py`` the dispatcher as a whole, the others one part each."""
