"""Shared fixtures: a real moto S3 server on loopback, and one store per backend."""

from __future__ import annotations

import os
import socket
import uuid
from datetime import timedelta
from typing import Iterator

import pytest
import torch

from storage_backends import RetryPolicy, open_store

# Tiny models on a 2-core machine with several processes: one intra-op thread each avoids
# OpenMP oversubscription (a step goes from ~1 s to ~5 ms under load).
torch.set_num_threads(1)

FAST_RETRY = RetryPolicy(attempts=3, initial=timedelta(milliseconds=20), maximum=timedelta(milliseconds=100))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoS3:
    """A real S3 endpoint (moto's server) on 127.0.0.1 for one test module."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.options = {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing",
                        "region": "us-east-1"}

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        """Stop serving and close the listening socket, so the endpoint refuses
        connections like a server that is down (moto's stop() leaves it bound)."""
        self.server.stop()
        inner = getattr(self.server, "_server", None)
        if inner is not None:
            inner.server_close()

    def reset(self) -> None:
        import urllib.request

        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=10).read()

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def make_bucket(self, name: str = "ckpt") -> str:
        self.client().create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="module")
def moto_s3() -> Iterator[MotoS3]:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    server = MotoS3()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3(moto_s3: MotoS3) -> Iterator[MotoS3]:
    """The module's moto server, reset before and after the test, with bucket 'ckpt'."""
    moto_s3.reset()
    moto_s3.make_bucket("ckpt")
    yield moto_s3
    moto_s3.reset()


BACKENDS = ("local", "memory", "s3")


@pytest.fixture(params=BACKENDS)
def backend_url(request, tmp_path):
    """(url, options) for a fresh, empty store on each backend."""
    if request.param == "local":
        return str(tmp_path / "store"), {"retry": FAST_RETRY}
    if request.param == "memory":
        return f"memory://test-{uuid.uuid4().hex}", {"retry": FAST_RETRY}
    server = request.getfixturevalue("s3")
    return "s3://ckpt/run", dict(server.options, retry=FAST_RETRY)


@pytest.fixture
def store(backend_url):
    url, opts = backend_url
    return open_store(url, **opts)
