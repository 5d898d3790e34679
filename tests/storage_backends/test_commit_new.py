"""Conditional commits (``Store.commit_new``): an existing key is never overwritten, on
local disk (hard link of the fsynced temporary), memory and a real moto S3 server
(``If-None-Match: *``)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from storage_backends import CommitConflict, StorageError, open_store


def test_commit_new_publishes_a_free_key(store):
    store.commit_new("manifests/a.json", [b"ab", b"cd"])
    assert store.read("manifests/a.json") == b"abcd"
    assert store.list("manifests/") == ["manifests/a.json"]


def test_commit_new_refuses_a_taken_key_and_keeps_the_first_object(store):
    store.commit_new("m.json", b"first writer")
    with pytest.raises(CommitConflict) as info:
        store.commit_new("m.json", b"second writer")
    err = info.value
    assert err.key == "m.json" and err.url == store.url
    assert "m.json" in str(err) and store.url in str(err)
    assert isinstance(err, FileExistsError) and isinstance(err, OSError)
    assert store.read("m.json") == b"first writer"


def test_commit_new_refuses_a_key_taken_by_a_plain_write(store):
    store.write("w.json", b"plain")
    with pytest.raises(CommitConflict):
        store.commit_new("w.json", b"other")
    assert store.read("w.json") == b"plain"


def test_commit_new_same_bytes_again_is_the_same_commit(store):
    """A retried request whose first try landed finds its own bytes: not a conflict."""
    store.commit_new("k.json", b"same")
    store.commit_new("k.json", b"same")
    assert store.read("k.json") == b"same"


def test_commit_new_rejects_large_objects(store):
    with pytest.raises(ValueError, match="small objects"):
        store.commit_new("big", b"\0" * (16 * 2**20 + 1))


def test_local_commit_new_leaves_no_temporaries(tmp_path):
    store = open_store(str(tmp_path / "s"))
    store.commit_new("a/m.json", b"1")
    with pytest.raises(CommitConflict):
        store.commit_new("a/m.json", b"2")
    assert sorted(os.listdir(tmp_path / "s" / "a")) == ["m.json"]


def _race(root: str, who: int, start, out) -> None:
    store = open_store(root)
    start.wait()
    try:
        store.commit_new("manifests/000000000001.json", f"writer {who}".encode())
        out.put((who, "won"))
    except CommitConflict:
        out.put((who, "refused"))
    except StorageError as exc:  # pragma: no cover - reported, fails the test below
        out.put((who, repr(exc)))


def test_local_commit_new_races_between_processes_have_one_winner(tmp_path):
    """Real processes race for one key on real files: exactly one wins, the others are refused."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(tmp_path / "s"), i, start, out)) for i in range(4)]
    for p in procs:
        p.start()
    start.set()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert sorted(results.values()) == ["refused", "refused", "refused", "won"]
    winner = next(w for w, r in results.items() if r == "won")
    assert open_store(str(tmp_path / "s")).read("manifests/000000000001.json") == f"writer {winner}".encode()


def test_s3_commit_new_sends_if_none_match(s3):
    """On S3 the refusal comes from the server (412 PreconditionFailed), not a client-side check."""
    store = open_store("s3://ckpt/run", **s3.options)
    store.commit_new("m.json", b"one")
    client = s3.client()
    with pytest.raises(Exception) as info:
        client.put_object(Bucket="ckpt", Key="run/m.json", Body=b"two", IfNoneMatch="*")
    assert "PreconditionFailed" in str(info.value)
    with pytest.raises(CommitConflict):
        store.commit_new("m.json", b"two")
    assert client.get_object(Bucket="ckpt", Key="run/m.json")["Body"].read() == b"one"
