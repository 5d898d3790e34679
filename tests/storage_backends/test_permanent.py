"""Storage errors classed permanent (no retry cures them: permission, read-only, credentials,
access denied, no bucket) or not, on real failures: an immutable directory, a read-only
mount, a moto server with IAM checks, a missing bucket, a closed port and a hung socket."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest

from tests.conftest import FAST_RETRY, free_port
from tests.helpers.unwritable import immutable, read_only_mount
from storage_backends import PERMANENT_KINDS, open_store, permanent_fault


def _error_of(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the error is what the test examines
        return exc
    raise AssertionError("expected the storage call to fail")


def test_immutable_directory_is_permanent_permission(tmp_path):
    store = open_store(tmp_path / "root", retry=FAST_RETRY)
    with immutable(store.root):
        exc = _error_of(lambda: store.write("data/1/x.bin", b"abc"))
    assert isinstance(exc, PermissionError)
    fault = permanent_fault(exc)
    assert fault is not None and fault.kind == "permission"
    assert "chattr -i" in fault.fix and "Operation not permitted" in fault.error


def test_read_only_mount_is_permanent_read_only(tmp_path):
    with read_only_mount(str(tmp_path / "ro")) as root:
        store = open_store(root, retry=FAST_RETRY, create=False)
        exc = _error_of(lambda: store.write("manifests/1.json", b"{}"))
    fault = permanent_fault(exc)
    assert fault is not None and fault.kind == "read-only"
    assert "remount" in fault.fix and "Read-only file system" in fault.error


def test_check_writable_removes_its_probe_and_raises_on_unwritable(tmp_path):
    store = open_store(tmp_path / "root")
    store.check_writable()
    assert list((tmp_path / "root").iterdir()) == []
    with immutable(store.root):
        exc = _error_of(store.check_writable)
    assert permanent_fault(exc).kind == "permission"


def test_missing_bucket_on_write_is_permanent(s3):
    store = open_store("s3://nope/run", **s3.options, retry=FAST_RETRY, check=False)
    exc = _error_of(lambda: store.write("x.bin", b"abc"))
    fault = permanent_fault(exc)
    assert fault is not None and fault.kind == "no-bucket" and "create it" in fault.fix


def test_unknown_access_key_and_denied_user_are_permanent(s3):
    from moto.core import enable_iam_authentication

    iam = __import__("boto3").client("iam", endpoint_url=s3.endpoint, aws_access_key_id="testing",
                                     aws_secret_access_key="testing", region_name="us-east-1")
    iam.create_user(UserName="nobody")
    key = iam.create_access_key(UserName="nobody")["AccessKey"]
    opts = dict(s3.options, retry=FAST_RETRY, check=False)
    with enable_iam_authentication():
        bad = open_store("s3://ckpt/run", **{**opts, "key": "AKIANOSUCHKEY0000000", "secret": "x"})
        exc = _error_of(lambda: bad.write("x.bin", b"abc"))
        fault = permanent_fault(exc)
        assert fault is not None and fault.kind == "credentials", exc
        assert "AWS_ACCESS_KEY_ID" in fault.fix
        denied = open_store("s3://ckpt/run", **{**opts, "key": key["AccessKeyId"],
                                                "secret": key["SecretAccessKey"]})
        exc = _error_of(lambda: denied.write("x.bin", b"abc"))
    fault = permanent_fault(exc)
    assert fault is not None and fault.kind == "access-denied", exc
    assert "s3:PutObject" in fault.fix


def test_no_credentials_is_permanent_and_named(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    port = free_port()
    with pytest.raises(PermissionError) as info:
        open_store("s3://bucket/run", endpoint_url=f"http://127.0.0.1:{port}", retry=FAST_RETRY)
    message = str(info.value)
    assert "NoCredentialsError" in message
    for setting in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "endpoint_url="):
        assert setting in message
    assert permanent_fault(info.value).kind == "credentials"


def test_refused_connection_and_timeout_are_not_permanent():
    port = free_port()   # nothing listens there
    store = open_store("s3://b/run", endpoint_url=f"http://127.0.0.1:{port}", key="k", secret="s",
                       retry=FAST_RETRY, check=False, connect_timeout=timedelta(seconds=1))
    refused = _error_of(lambda: store.write("x.bin", b"abc"))
    assert isinstance(refused, ConnectionError) and permanent_fault(refused) is None
    with socket.socket() as hung:   # accepts connections, never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        store = open_store("s3://b/run", endpoint_url=f"http://127.0.0.1:{hung.getsockname()[1]}", key="k",
                           secret="s", retry=FAST_RETRY, check=False, read_timeout=timedelta(seconds=0.5))
        t0 = time.monotonic()
        slow = _error_of(lambda: store.read("x.bin"))
    assert isinstance(slow, TimeoutError) and permanent_fault(slow) is None
    assert time.monotonic() - t0 < 30


def test_every_kind_has_a_fix():
    assert set(PERMANENT_KINDS) == {"read-only", "permission", "credentials", "access-denied", "no-bucket"}
    assert all(len(fix) > 40 for fix in PERMANENT_KINDS.values())
