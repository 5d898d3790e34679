"""The test suite, importable as the package ``tests`` (so that tests in different folders may share a
basename). The tests of ``pkg/_x.py`` are in ``tests/pkg/test_x.py``; shared helpers are in ``tests/helpers``;
the repository-level checks (layering, docs, examples, benchmarks) are at this top level; ``tests/gpu`` holds
the CUDA tests (``make test-gpu``)."""
