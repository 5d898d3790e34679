"""Scripts the tests run as separate processes (``python tests/helpers/workers/x.py``); each puts the
repository root on ``sys.path`` itself."""
