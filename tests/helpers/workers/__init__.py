"""Scripts the tests run as separate processes (``python tests/helpers/workers/x.py``), with the
repository root on ``PYTHONPATH`` or put on ``sys.path`` by the script itself; a few are also imported
by the tests (``from tests.helpers.workers import exact_worker``)."""
