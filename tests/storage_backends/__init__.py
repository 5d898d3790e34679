"""Tests of ``storage_backends``: the contract every backend honours, and its errors."""
