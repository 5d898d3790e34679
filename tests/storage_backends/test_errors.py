"""Bad input and provider failures surface as clear built-in exceptions."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from tests.conftest import FAST_RETRY, MotoS3, free_port
from storage_backends import RetryPolicy, classify, open_store


@pytest.mark.parametrize("url", ["gs://bucket/x", "hdfs://nn/path", "ftp://host/p"])
def test_unknown_scheme_is_value_error_listing_allowed(url):
    with pytest.raises(ValueError, match=r"unsupported scheme .*allowed: file://, s3://, memory://"):
        open_store(url)


def test_empty_url_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        open_store("")


def test_unknown_option_names_option(tmp_path):
    with pytest.raises(ValueError, match=r"unknown storage option\(s\) \['colour'\]"):
        open_store(tmp_path, colour="blue")


def test_local_root_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        open_store(f)


def test_unreachable_endpoint_is_connection_error_naming_it():
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"127\.0\.0\.1:{port}"):
        open_store("s3://bucket/run", endpoint_url=f"http://127.0.0.1:{port}", key="k", secret="s",
                   retry=FAST_RETRY, connect_timeout=timedelta(seconds=1))
    assert time.monotonic() - t0 < 10


def test_missing_bucket_is_file_not_found_naming_bucket(s3):
    with pytest.raises(FileNotFoundError, match="bucket 'nope' does not exist"):
        open_store("s3://nope/run", **s3.options, retry=FAST_RETRY)


def test_s3_url_without_bucket():
    with pytest.raises(ValueError, match="names no bucket"):
        open_store("s3:///run")


def test_bad_credentials_map_to_permission_error():
    from botocore.exceptions import ClientError

    err = ClientError({"Error": {"Code": "InvalidAccessKeyId", "Message": "bad key"},
                       "ResponseMetadata": {"HTTPStatusCode": 403}}, "PutObject")
    assert classify(err) == (PermissionError, False)


@pytest.mark.parametrize(
    "code,expected",
    [("NoSuchKey", (FileNotFoundError, False)), ("AccessDenied", (PermissionError, False)),
     ("SlowDown", (ConnectionError, True)), ("InternalError", (ConnectionError, True)),
     ("RequestTimeout", (TimeoutError, True)), ("WeirdError", (OSError, False))],
)
def test_error_table(code, expected):
    from botocore.exceptions import ClientError

    err = ClientError({"Error": {"Code": code, "Message": code}}, "GetObject")
    assert classify(err) == expected


def test_retry_policy_validation():
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="initial"):
        RetryPolicy(initial=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="jitter"):
        RetryPolicy(jitter=2.0)


def test_retry_backoff_grows_and_caps():
    p = RetryPolicy(initial=timedelta(milliseconds=100), maximum=timedelta(seconds=1), jitter=0.0)
    assert [p.delay(i) for i in (1, 2, 3, 4, 5)] == [0.1, 0.2, 0.4, 0.8, 1.0]


def test_write_survives_s3_outage(tmp_path):
    """The endpoint goes away mid-run and comes back: retries carry the write through."""
    server = MotoS3()
    server.start()
    try:
        server.make_bucket("ckpt")
        patient = RetryPolicy(attempts=12, initial=timedelta(milliseconds=100), maximum=timedelta(milliseconds=400))
        store = open_store("s3://ckpt/run", **server.options, retry=patient,
                           connect_timeout=timedelta(seconds=1))
        store.write("before", b"1")
        server.stop()
        restarted = threading.Event()

        def come_back():
            time.sleep(1.0)
            server.start()
            restarted.set()

        threading.Thread(target=come_back, daemon=True).start()
        store.write("during", b"2")  # blocks in retries until the endpoint is back
        assert restarted.is_set()
        assert store.read("before") == b"1" and store.read("during") == b"2"
    finally:
        server.stop()


def test_outage_longer_than_policy_raises_connection_error():
    server = MotoS3()
    server.start()
    server.make_bucket("ckpt")
    store = open_store("s3://ckpt/run", **server.options, retry=FAST_RETRY, connect_timeout=timedelta(seconds=1))
    server.stop()
    with pytest.raises(ConnectionError, match=r"write s3://ckpt/run/k: .*after 3 attempts"):
        store.write("k", b"x")


def test_local_permission_error(tmp_path):
    import os

    if os.geteuid() == 0:
        # root ignores file modes; a read-only bind is not available here, so check the
        # mapping of the errno instead.
        import errno

        assert classify(OSError(errno.EACCES, "denied")) == (PermissionError, False)
        return
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    store = open_store(root)
    with pytest.raises(PermissionError):
        store.write("x", b"1")
