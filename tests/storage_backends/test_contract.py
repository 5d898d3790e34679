"""One contract every backend (local disk, memory, moto S3) must honour."""

from __future__ import annotations

import os

import pytest

from storage_backends import S3Store, is_temporary, open_store


def test_write_read_roundtrip(store):
    assert store.write("a/b/c.bin", b"hello world") == 11
    assert store.read("a/b/c.bin") == b"hello world"
    assert store.size("a/b/c.bin") == 11


def test_write_many_buffers_is_concatenated(store):
    parts = [b"abc", bytearray(b"def"), memoryview(b"ghi")]
    assert store.write("k", parts) == 9
    assert store.read("k") == b"abcdefghi"


def test_ranged_reads(store):
    data = bytes(range(256)) * 4
    store.write("r", data)
    assert store.read("r", start=10, end=20) == data[10:20]
    assert store.read("r", start=1000) == data[1000:]
    assert store.read("r", end=5) == data[:5]
    assert store.read("r", start=7, end=7) == b""


def test_overwrite_replaces(store):
    store.write("x", b"old-old-old")
    store.write("x", b"new")
    assert store.read("x") == b"new"


def test_exists_and_delete(store):
    assert not store.exists("gone")
    store.write("gone", b"1")
    assert store.exists("gone")
    store.delete("gone")
    assert not store.exists("gone")
    with pytest.raises(FileNotFoundError):
        store.delete("gone")
    store.delete("gone", missing_ok=True)


def test_read_missing_raises_file_not_found_naming_key(store):
    with pytest.raises(FileNotFoundError, match="no/such/key"):
        store.read("no/such/key")


def test_list_prefix_semantics(store):
    for key in ["m/1.json", "m/2.json", "d/1/a.bin", "d/1/b.bin", "d/10/a.bin", "top"]:
        store.write(key, key.encode())
    assert store.list("") == sorted(["m/1.json", "m/2.json", "d/1/a.bin", "d/1/b.bin", "d/10/a.bin", "top"])
    assert store.list("m/") == ["m/1.json", "m/2.json"]
    assert store.list("d/1/") == ["d/1/a.bin", "d/1/b.bin"]
    assert store.list("d/1") == ["d/1/a.bin", "d/1/b.bin", "d/10/a.bin"]
    assert store.list("nothing/") == []


def test_commit_is_visible_and_replaces(store):
    store.commit("manifest.json", b'{"v": 1}')
    assert store.read("manifest.json") == b'{"v": 1}'
    store.commit("manifest.json", b'{"v": 2}')
    assert store.read("manifest.json") == b'{"v": 2}'
    assert store.list("") == ["manifest.json"]


def test_commit_rejects_large_objects(store):
    with pytest.raises(ValueError, match="small objects"):
        store.commit("big", b"\0" * (17 * 2**20))


def test_large_object_streams_in_parts(store):
    # 11 MiB with a 5 MiB part size: three parts on S3 (multipart), streamed elsewhere.
    store.part_size = 5 * 2**20
    chunks = [os.urandom(2**20) for _ in range(11)]
    assert store.write("big.bin", chunks) == 11 * 2**20
    blob = store.read("big.bin")
    assert blob == b"".join(chunks)
    assert store.read("big.bin", start=5 * 2**20 - 3, end=5 * 2**20 + 3) == blob[5 * 2**20 - 3: 5 * 2**20 + 3]


class _FailsMidStream(list):
    """Buffers whose writing pass fails after 6 MiB (object stores size the data first)."""

    def __init__(self, exc: type[Exception], fail_on_pass: int):
        super().__init__(memoryview(b"\1" * 2**20) for _ in range(12))
        self.exc = exc
        self.fail_on_pass = fail_on_pass
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        for i, part in enumerate(list.__iter__(self)):
            if self.passes == self.fail_on_pass and i == 6:
                raise self.exc("connection dropped mid-upload")
            yield part


def test_failed_stream_publishes_nothing(store):
    store.part_size = 5 * 2**20

    class Boom(Exception):
        pass

    store.write("partial.bin", b"previous")
    with pytest.raises(Boom):
        parts = _FailsMidStream(Boom, fail_on_pass=2 if isinstance(store, S3Store) else 1)
        store._put(store._path("partial.bin"), parts, durable=False)
    # The old object is intact and no partial upload or temporary became visible.
    assert store.read("partial.bin") == b"previous"
    assert store.list("") == ["partial.bin"]
    if isinstance(store, S3Store):  # the multipart upload was aborted, not left dangling
        bucket = store.root.split("/", 1)[0]
        assert not store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")


@pytest.mark.parametrize("bad", ["", "/abs", "a//b", "../up", "a/./b", "a/..", "dir/"])
def test_invalid_keys_raise_value_error(store, bad):
    with pytest.raises(ValueError, match="invalid key"):
        store.write(bad, b"x")


def test_bad_range_arguments(store):
    store.write("x", b"abc")
    with pytest.raises(ValueError, match="start"):
        store.read("x", start=-1)
    with pytest.raises(ValueError, match="end"):
        store.read("x", start=3, end=1)


def test_reopen_sees_same_objects(backend_url):
    url, opts = backend_url
    a = open_store(url, **opts)
    a.write("p/q", b"persisted")
    b = open_store(url, **opts)
    assert b.read("p/q") == b"persisted"
    assert b.list("p/") == ["p/q"]


def test_local_writes_leave_no_temporaries(tmp_path):
    store = open_store(tmp_path / "s")
    for i in range(5):
        store.write(f"k{i}", b"x" * 100)
        store.commit("m.json", str(i).encode())
    names = [n for _, _, files in os.walk(tmp_path / "s") for n in files]
    assert not [n for n in names if is_temporary(n)]
    assert sorted(names) == ["k0", "k1", "k2", "k3", "k4", "m.json"]


def test_local_delete_prunes_empty_directories(tmp_path):
    store = open_store(tmp_path / "s")
    store.write("data/000001/a.bin", b"1")
    store.delete("data/000001/a.bin")
    assert os.listdir(tmp_path / "s") == []


def test_read_into_fills_caller_buffer(store):
    data = bytes(range(100))
    store.write("into", data)
    buf = bytearray(10)
    assert store.read_into("into", memoryview(buf), 5) == 10 and bytes(buf) == data[5:15]
    tail = bytearray(20)
    assert store.read_into("into", memoryview(tail), 90) == 10 and bytes(tail[:10]) == data[90:]
    with pytest.raises(FileNotFoundError):
        store.read_into("missing", memoryview(bytearray(4)), 0)
