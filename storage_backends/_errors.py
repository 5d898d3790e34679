"""One table that maps provider errors onto Python's built-in exceptions.

Every backend funnels its failures through :func:`classify`, so callers only ever see
``FileNotFoundError``, ``PermissionError``, ``ConnectionError``, ``TimeoutError`` or
``OSError``, each carrying the store URL and key, and the retry loop knows which of them
are worth another attempt. :func:`permanent_fault` says which failures no later attempt
cures either (permission, read-only, credentials, access denied, no bucket) and the fix.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["ErrorRule", "ERROR_TABLE", "classify", "PermanentFault", "PermanentStorageError", "PERMANENT_KINDS",
           "S3_SETTINGS", "permanent_fault", "CommitConflict"]


class CommitConflict(FileExistsError):
    """A conditional commit (:meth:`Store.commit_new`) found its key taken by another
    writer's object: nothing was written. ``key`` is the store key, ``url`` the object's URL.
    Never retried (another try finds the same object)."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__(f"commit {url}/{key}: refused, the key already holds another writer's object "
                         f"(conditional commit: an existing object is never overwritten)")
        self.url = url
        self.key = key


@dataclass(frozen=True)
class ErrorRule:
    """Maps errors whose class name or provider code matches onto one built-in type."""

    builtin: type[BaseException]
    transient: bool
    class_names: frozenset[str] = frozenset()
    codes: frozenset[str] = frozenset()
    errnos: frozenset[int] = frozenset()


# Order matters: the first rule that matches wins. Class names are matched against the
# whole MRO of the raised exception, codes against S3/HTTP error codes and statuses.
ERROR_TABLE: tuple[ErrorRule, ...] = (
    ErrorRule(
        FileNotFoundError,
        transient=False,
        class_names=frozenset({"FileNotFoundError", "NoSuchKey", "NoSuchBucket"}),
        codes=frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"}),
        errnos=frozenset({errno.ENOENT}),
    ),
    ErrorRule(
        PermissionError,
        transient=False,
        class_names=frozenset({"PermissionError", "NoCredentialsError", "PartialCredentialsError"}),
        codes=frozenset(
            {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch",
             "ExpiredToken", "InvalidToken", "AllAccessDisabled"}
        ),
        errnos=frozenset({errno.EACCES, errno.EPERM, errno.EROFS}),
    ),
    ErrorRule(
        TimeoutError,
        transient=True,
        class_names=frozenset(
            {"TimeoutError", "ConnectTimeoutError", "ReadTimeoutError", "FSTimeoutError",
             "ServerTimeoutError", "timeout"}
        ),
        codes=frozenset({"RequestTimeout", "RequestTimeoutException", "408"}),
        errnos=frozenset({errno.ETIMEDOUT}),
    ),
    ErrorRule(
        ConnectionError,
        transient=True,
        class_names=frozenset(
            {"ConnectionError", "EndpointConnectionError", "ConnectionClosedError",
             "ClientConnectorError", "ServerDisconnectedError", "ClientOSError",
             "ClientPayloadError", "IncompleteRead", "HTTPClientError",
             "ResponseParserError", "ProxyConnectionError"}
        ),
        codes=frozenset(
            {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
             "InternalError", "ServiceUnavailable", "500", "502", "503", "504"}
        ),
        errnos=frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.EPIPE, errno.EAGAIN,
                          errno.EHOSTUNREACH, errno.ENETUNREACH}),
    ),
)


def _codes_of(exc: BaseException) -> set[str]:
    codes: set[str] = set()
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error") or {}
        if err.get("Code"):
            codes.add(str(err["Code"]))
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if status:
            codes.add(str(status))
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        codes.add(str(status))
    return codes


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def classify(exc: BaseException) -> tuple[type[BaseException], bool]:
    """Return ``(builtin_type, transient)`` for any error raised by a backend.

    The exception and its causes are examined; unknown errors map to ``OSError`` and are
    not retried.
    """
    for link in _chain(exc):
        names = {cls.__name__ for cls in type(link).__mro__}
        codes = _codes_of(link)
        link_errno = getattr(link, "errno", None)
        for rule in ERROR_TABLE:
            if (names & rule.class_names) or (codes & rule.codes) or (
                link_errno is not None and link_errno in rule.errnos
            ):
                return rule.builtin, rule.transient
    return OSError, False


# -- permanent or transient --------------------------------------------------------------
# ``classify`` says whether one call is worth retrying; a caller that keeps trying across
# calls (a checkpoint persister) also needs to know which failures no retry can cure, and
# what the user has to change. Checked on the whole chain of causes, the most specific
# kind first: a retry wrapper's ``PermissionError`` around a ``NoCredentialsError`` is a
# credentials problem, not a file permission.

_CREDENTIAL_NAMES = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"})
_CREDENTIAL_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                               "ExpiredTokenException", "InvalidClientTokenId", "UnrecognizedClientException"})
_DENIED_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "403"})
_NO_BUCKET = frozenset({"NoSuchBucket"})

#: the environment variables and options an S3 store is configured by (named in errors)
S3_SETTINGS = ("AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary credentials), "
               "AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL for a non-AWS endpoint (MinIO, moto, Ceph), AWS_REGION; "
               "or the storage options key=, secret=, token=, endpoint_url=, region=")

PERMANENT_KINDS: dict[str, str] = {
    "read-only": "the filesystem is mounted read-only: remount it read-write, or point the storage URL at a "
                 "writable location",
    "permission": "the storage location is not writable by this process (user {user}): fix its owner or mode "
                  "(`ls -ld`), clear an immutable flag (`lsattr -d`, `chattr -i`), or point the storage URL at a "
                  "writable location",
    "credentials": "the S3 credentials are missing or wrong: set " + S3_SETTINGS,
    "access-denied": "these S3 credentials may not write here: grant s3:PutObject, s3:GetObject, s3:ListBucket and "
                     "s3:DeleteObject on the bucket and prefix, or use other credentials (" + S3_SETTINGS + ")",
    "no-bucket": "the bucket does not exist at this endpoint: create it, or fix the bucket name or the endpoint "
                 "(AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL or endpoint_url=)",
}


@dataclass(frozen=True)
class PermanentFault:
    """A storage failure no retry cures: ``kind`` (a key of :data:`PERMANENT_KINDS`),
    ``fix`` (what the user has to change) and ``error`` (``Type: message`` of the failure)."""

    kind: str
    fix: str
    error: str

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "fix": self.fix, "error": self.error}

    @classmethod
    def from_json(cls, d: dict[str, str]) -> "PermanentFault":
        return cls(kind=str(d["kind"]), fix=str(d["fix"]), error=str(d["error"]))


class PermanentStorageError(OSError):
    """A store cannot be written, and retrying will not change that (see
    :func:`permanent_fault`); the message names the location, the error and the fix."""

    def __init__(self, message: str, fault: PermanentFault) -> None:
        super().__init__(message)
        self.fault = fault


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no name for this uid: the number says it
        import os

        return f"uid {os.getuid()}"


def permanent_fault(exc: BaseException) -> PermanentFault | None:
    """The permanent kind of a storage failure, or None when it may be transient or is
    unknown (timeouts, 5xx, throttling, refused or reset connections, anything else:
    worth another try later).

    Permanent: read-only filesystem (``EROFS``), permission (``EACCES``/``EPERM``,
    ``PermissionError``), missing or invalid S3 credentials (``NoCredentialsError``,
    ``InvalidAccessKeyId``, ``SignatureDoesNotMatch``, expired tokens), access denied
    (``AccessDenied``, HTTP 403) and a missing bucket (``NoSuchBucket``).
    """
    links = list(_chain(exc))
    error = f"{type(exc).__name__}: {exc}"
    for kind, test in (
        ("read-only", lambda e, n, c: getattr(e, "errno", None) == errno.EROFS),
        ("credentials", lambda e, n, c: bool(n & _CREDENTIAL_NAMES or c & _CREDENTIAL_CODES)),
        ("no-bucket", lambda e, n, c: bool(n & _NO_BUCKET or c & _NO_BUCKET)),
        ("access-denied", lambda e, n, c: bool(c & _DENIED_CODES)),
        ("permission", lambda e, n, c: "PermissionError" in n
            or getattr(e, "errno", None) in (errno.EACCES, errno.EPERM)),
    ):
        for link in links:
            names = {cls.__name__ for cls in type(link).__mro__}
            if test(link, names, _codes_of(link)):
                fix = PERMANENT_KINDS[kind]
                return PermanentFault(kind, fix.format(user=_user()) if "{user}" in fix else fix, error)
    return None
