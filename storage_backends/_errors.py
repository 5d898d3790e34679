"""One table that maps provider errors onto Python's built-in exceptions.

Every backend funnels its failures through :func:`classify`, so callers only ever see
``FileNotFoundError``, ``PermissionError``, ``ConnectionError``, ``TimeoutError`` or
``OSError``, each carrying the store URL and key, and the retry loop knows which of them
are worth another attempt.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["ErrorRule", "ERROR_TABLE", "classify"]


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
