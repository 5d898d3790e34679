"""Storage backends for checkpoints: local disk / NFS, S3 (s3fs) and memory, over fsspec.

>>> from storage_backends import open_store
>>> store = open_store("memory://doc-example")
>>> store.write("a/b.bin", b"hello")
5
>>> store.read("a/b.bin", start=1, end=3)
b'el'
"""

from ._commit import is_temporary
from ._errors import (ERROR_TABLE, PERMANENT_KINDS, CommitConflict, PermanentFault, PermanentStorageError, classify,
                      permanent_fault)
from ._open import SCHEMES, open_store
from ._retry import RetryPolicy, StorageError
from ._store import LocalStore, S3Store, Store

__all__ = [
    "open_store",
    "Store",
    "LocalStore",
    "S3Store",
    "RetryPolicy",
    "StorageError",
    "ERROR_TABLE",
    "classify",
    "permanent_fault",
    "PermanentFault",
    "PermanentStorageError",
    "PERMANENT_KINDS",
    "SCHEMES",
    "is_temporary",
    "CommitConflict",
]
