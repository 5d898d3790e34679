"""``open_store(url, **storage_options)``: pick a backend from the URL scheme."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from ._errors import permanent_fault
from ._retry import RetryPolicy
from ._store import DEFAULT_PART_SIZE, LocalStore, S3Store, Store

__all__ = ["open_store", "SCHEMES"]

SCHEMES = ("file", "s3", "memory")
_COMMON = ("retry", "part_size")


def _pop_common(opts: dict[str, Any]) -> dict[str, Any]:
    common = {k: opts.pop(k) for k in _COMMON if k in opts}
    retry = common.get("retry")
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise ValueError(f"storage option 'retry' must be a RetryPolicy, got {type(retry).__name__}")
    common.setdefault("part_size", DEFAULT_PART_SIZE)
    return common


def _reject_unknown(scheme: str, opts: dict[str, Any], allowed: tuple[str, ...]) -> None:
    if opts:
        raise ValueError(
            f"unknown storage option(s) {sorted(opts)} for {scheme}:// stores; allowed: {sorted(allowed)}"
        )


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"storage option {name!r} must be a positive timedelta, got {value!r}")
    return float(value)


def _open_local(path: str, url: str, opts: dict[str, Any]) -> Store:
    from fsspec.implementations.local import LocalFileSystem

    common = _pop_common(opts)
    fsync = opts.pop("fsync", True)
    create = opts.pop("create", True)
    _reject_unknown("file", opts, _COMMON + ("fsync", "create"))
    root = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(root) and not os.path.isdir(root):
        raise NotADirectoryError(f"storage root {root!r} exists and is not a directory")
    if create:
        os.makedirs(root, exist_ok=True)
    elif not os.path.isdir(root):
        raise FileNotFoundError(f"storage root {root!r} does not exist")
    return LocalStore(LocalFileSystem(), root, url=f"file://{root}", fsync=fsync, **common)


def _open_memory(path: str, url: str, opts: dict[str, Any]) -> Store:
    from fsspec.implementations.memory import MemoryFileSystem

    common = _pop_common(opts)
    _reject_unknown("memory", opts, _COMMON)
    root = "/" + path.strip("/")
    return Store(MemoryFileSystem(), root, url=f"memory://{root.lstrip('/')}", **common)


def _env(*names: str) -> str | None:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return None


def _open_s3(bucket: str, prefix: str, url: str, opts: dict[str, Any]) -> Store:
    import s3fs

    if not bucket:
        raise ValueError(f"s3 URL {url!r} names no bucket; expected s3://BUCKET[/PREFIX]")
    common = _pop_common(opts)
    check = opts.pop("check", True)
    upload_concurrency = opts.pop("upload_concurrency", 8)
    endpoint = opts.pop("endpoint_url", None) or _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    key = opts.pop("key", None) or _env("AWS_ACCESS_KEY_ID")
    secret = opts.pop("secret", None) or _env("AWS_SECRET_ACCESS_KEY")
    token = opts.pop("token", None) or _env("AWS_SESSION_TOKEN")
    region = opts.pop("region", None) or _env("AWS_REGION", "AWS_DEFAULT_REGION")
    connect_timeout = _seconds("connect_timeout", opts.pop("connect_timeout", timedelta(seconds=5)))
    read_timeout = _seconds("read_timeout", opts.pop("read_timeout", timedelta(seconds=60)))
    config_kwargs = {
        "connect_timeout": connect_timeout,
        "read_timeout": read_timeout,
        # Our RetryPolicy owns retries; botocore and s3fs each try once.
        "retries": {"max_attempts": 1, "mode": "standard"},
        **opts.pop("config_kwargs", {}),
    }
    client_kwargs = dict(opts.pop("client_kwargs", {}))
    if region:
        client_kwargs.setdefault("region_name", region)
    fs = s3fs.S3FileSystem(
        key=key, secret=secret, token=token, endpoint_url=endpoint,
        client_kwargs=client_kwargs, config_kwargs=config_kwargs,
        use_listings_cache=False, skip_instance_cache=True, **opts,
    )
    fs.retries = 1
    root = f"{bucket}/{prefix.strip('/')}".rstrip("/")
    store = S3Store(fs, root, url=f"s3://{root}", upload_concurrency=upload_concurrency, **common)
    if check:
        where = f" at {endpoint}" if endpoint else ""

        def head() -> None:
            try:
                fs.call_s3("head_bucket", Bucket=bucket)
            except FileNotFoundError as exc:
                raise FileNotFoundError(f"bucket {bucket!r} does not exist{where}") from exc

        try:
            store.retry.call(head, what=f"open {store.url}{where}")
        except OSError as exc:
            fault = permanent_fault(exc)
            if fault is None:
                raise
            # the same built-in type, with what to change: a bare NoCredentialsError names
            # neither the variables nor the options that would have supplied them
            raise type(exc)(f"{exc}; fix: {fault.fix}") from exc
    return store


def open_store(url: str | os.PathLike[str], **storage_options: Any) -> Store:
    """Open the store at ``url``.

    Schemes: a plain path or ``file://`` (local disk or NFS), ``s3://BUCKET/PREFIX``
    (via s3fs; ``endpoint_url``, ``key``, ``secret``, ``token``, ``region`` come from the
    options or from ``AWS_ENDPOINT_URL[_S3]``, ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``), and ``memory://``
    (in-process, for tests).

    Options for every scheme: ``retry`` (:class:`RetryPolicy`), ``part_size`` (bytes per
    multipart part, >= 5 MiB). Local: ``fsync`` (default True), ``create`` (default True).
    S3: ``check`` (probe the bucket on open, default True), ``upload_concurrency``
    (multipart parts in flight, default 8), ``connect_timeout`` and
    ``read_timeout`` (``timedelta``), plus any ``s3fs.S3FileSystem`` argument.
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise ValueError(f"storage url must be a non-empty string, got {url!r}")
    opts = dict(storage_options)
    if "://" not in url:
        return _open_local(url, url, opts)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        return _open_local(parts.netloc + parts.path, url, opts)
    if scheme == "memory":
        return _open_memory(parts.netloc + parts.path, url, opts)
    if scheme in ("s3", "s3a"):
        return _open_s3(parts.netloc, parts.path, url, opts)
    raise ValueError(
        f"storage url {url!r} has unsupported scheme {parts.scheme!r}; "
        f"allowed: {', '.join(s + '://' for s in SCHEMES)} or a plain path"
    )
