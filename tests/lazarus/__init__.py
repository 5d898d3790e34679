"""Tests of ``lazarus``, one folder per subpackage (``tests/lazarus/runtime/test_x.py`` tests
``lazarus/runtime/_x.py``)."""
