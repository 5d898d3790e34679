"""CheckpointStore on every backend: partial checkpoints compose, retention, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from moc import CheckpointStore, CorruptObjectError, ManifestError, UnsupportedFormatError
from moc._store.format import FORMAT_VERSION, manifest_key
from storage_backends import open_store


def expert_tree(layer: int, e: int, value: float) -> dict:
    return {"model": {f"layers.{layer}.moe.experts.{e}.w": torch.full((4, 8), value)},
            "optimizer": {"state": {f"layers.{layer}.moe.experts.{e}.w": {"step": torch.tensor(value),
                                                                           "exp_avg": torch.full((4, 8), -value)}}}}


def save_step(cs, step, experts, base, *, value=None, layers=2):
    units = {"module/emb": ({"model": {"emb.weight": torch.full((16, 8), float(step))}}, {"kind": "module"}),
             "extra": ({"extra": {"step": step}}, {"kind": "extra"})}
    for layer in range(layers):
        for e in experts:
            v = float(step * 100 + layer * 10 + e) if value is None else value
            units[f"expert/l{layer}/{e}"] = (expert_tree(layer, e, v),
                                             {"kind": "expert", "layer": f"l{layer}", "expert": e})
    return cs.save(step, units, base=base, plt={"top_k": 1, "unsaved": {"l0": [step] * 4}})


@pytest.fixture
def cs(store):
    return CheckpointStore(store)


def test_partial_checkpoints_compose(cs):
    m = save_step(cs, 0, range(4), None)
    m = save_step(cs, 10, [0, 1], m)
    m = save_step(cs, 20, [2], m)
    assert cs.steps() == [0, 10, 20]
    r = cs.load()
    assert r.step == 20
    assert r.versions["expert/l0/0"] == 10 and r.versions["expert/l1/2"] == 20 and r.versions["expert/l0/3"] == 0
    assert r.versions["module/emb"] == 20
    w = r.units["expert/l1/1"]["model"]["layers.1.moe.experts.1.w"]
    assert torch.equal(w, torch.full((4, 8), 10 * 100 + 10 + 1.0))
    assert r.units["expert/l0/3"]["optimizer"]["state"]["layers.0.moe.experts.3.w"]["step"].item() == 3.0
    # Older steps still load their own view.
    assert cs.load(10).versions["expert/l0/2"] == 0
    assert m.layers()["l0"][2].step == 20
    assert cs.read_manifest(20).plt["unsaved"]["l0"] == [20] * 4


def test_sharded_unit_chunks_from_several_writers(cs):
    """One unit's bytes split over two writers (as ranks holding replicas do)."""
    from moc._store.store import make_record
    from moc._store.codec import encode_tree

    tree = expert_tree(0, 0, 7.0)
    enc = encode_tree(tree)
    half = enc.nbytes // 2
    w0, w1 = cs.writer(5, "r0"), cs.writer(5, "r1")
    c0 = w0.add_chunk(enc, start=0, end=half, group="experts")
    c1 = w1.add_chunk(enc, start=half, group="experts")
    w0.finish(), w1.finish()
    rec = make_record("expert/l0/0", enc, [c0, c1], kind="expert", step=5, layer="l0", expert=0)
    cs.commit(5, [rec])
    out = cs.load().units["expert/l0/0"]
    assert torch.equal(out["model"]["layers.0.moe.experts.0.w"], torch.full((4, 8), 7.0))
    n = cs.nonce
    assert sorted(cs.store.list("data/")) == [f"data/000000000005/g0.r0.{n}.experts.bin",
                                              f"data/000000000005/g0.r1.{n}.experts.bin"]


def test_compression_round_trip_and_saves_bytes(store):
    cs = CheckpointStore(store, compression="zstd")
    t = torch.linspace(-1, 1, 50_000).to(torch.bfloat16)
    m = cs.save(1, {"module/a": ({"model": {"a": t}}, {"kind": "module"})})
    rec = m.units["module/a"]
    assert rec.stored_nbytes < rec.nbytes
    assert torch.equal(cs.load().units["module/a"]["model"]["a"], t)


def test_retention_keeps_last_and_collects_unreferenced(store):
    cs = CheckpointStore(store, keep_last=2)
    m = save_step(cs, 0, range(4), None)
    for step in (10, 20, 30, 40):
        m = save_step(cs, step, [step // 10 % 4], m)
    assert cs.steps() == [30, 40]
    live = cs.read_manifest(30).keys() | cs.read_manifest(40).keys()
    assert set(cs.store.list("data/")) == live
    # Expert 0 was last saved at step 40, expert 1 at 10: its step-10 object must survive.
    assert cs.load().versions["expert/l0/1"] == 10
    assert any(k.startswith("data/000000000010/") for k in live)
    assert not any(k.startswith("data/000000000020/w0.state") for k in cs.store.list("data/"))


def test_gc_never_touches_objects_of_later_uncommitted_steps(store):
    cs = CheckpointStore(store, keep_last=1)
    m = save_step(cs, 0, range(2), None, layers=1)
    w = cs.writer(20)
    w.add_unit("module/emb", {"model": {"emb.weight": torch.zeros(2)}}, kind="module")
    w.finish()  # in flight: written, not committed
    save_step(cs, 10, [0], m, layers=1)
    assert f"data/000000000020/g0.w0.{cs.nonce}.state.bin" in cs.store.list("data/")


def test_concurrent_load_equals_sequential(store):
    """Units read by several threads at once come back exactly as one reader gets them."""
    cs = CheckpointStore(store)
    m = save_step(cs, 0, range(8), None, layers=3)
    save_step(cs, 10, [1, 5], m, layers=3)
    seq = CheckpointStore(store, read_concurrency=1).load()
    par = CheckpointStore(store, read_concurrency=8).load()
    assert seq.versions == par.versions and list(seq.units) == list(par.units)
    for name, tree in seq.units.items():
        for key, value in tree.get("model", {}).items():
            assert torch.equal(value, par.units[name]["model"][key]), (name, key)


@pytest.mark.parametrize("read_concurrency", [1, 8])
def test_corrupt_unit_falls_back_to_previous_version(store, read_concurrency):
    cs = CheckpointStore(store, read_concurrency=read_concurrency)
    m = save_step(cs, 0, range(2), None, layers=1)
    m = save_step(cs, 10, [0], m, layers=1)
    key = m.units["expert/l0/0"].chunks[0].key
    blob = bytearray(cs.store.read(key))
    blob[len(blob) // 2] ^= 0xFF
    cs.store.write(key, bytes(blob))
    r = cs.load()
    assert r.versions["expert/l0/0"] == 0
    assert r.fallbacks == [("expert/l0/0", 10, 0)]
    with pytest.raises(CorruptObjectError, match=key):
        cs.load(fallback=False)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damage_is_caught_naming_the_object(store, damage):
    cs = CheckpointStore(store)
    m = save_step(cs, 0, range(2), None, layers=1)
    key = m.units["expert/l0/1"].chunks[0].key
    blob = bytearray(cs.store.read(key))
    if damage == "flip":
        blob[-3] ^= 0x01
        cs.store.write(key, bytes(blob))
    elif damage == "truncate":
        cs.store.write(key, bytes(blob[:-7]))
    else:
        cs.store.delete(key)
    with pytest.raises(CorruptObjectError) as info:
        cs.load(fallback=False)
    assert key in str(info.value) and info.value.key == key
    problems = cs.verify()
    assert problems and all(p.key == key for p in problems)
    assert "expert/l0/1" in problems[0].units


def test_invalid_manifest_json(store):
    cs = CheckpointStore(store)
    save_step(cs, 0, range(1), None, layers=1)
    store.commit(manifest_key(5), b"{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        cs.read_manifest(5)
    # The newest *valid* step is used for recovery.
    assert cs.latest_manifest().step == 0
    assert cs.load().step == 0


def test_manifest_with_newer_format_version(store):
    cs = CheckpointStore(store)
    m = save_step(cs, 0, range(1), None, layers=1)
    body = json.loads(m.to_bytes())
    body["format_version"] = FORMAT_VERSION + 1
    store.commit(manifest_key(0), json.dumps(body).encode())
    with pytest.raises(UnsupportedFormatError, match=rf"format_version {FORMAT_VERSION + 1}.*upgrade moc"):
        cs.read_manifest(0)


def test_manifest_bit_flip_fails_checksum(store):
    cs = CheckpointStore(store)
    m = save_step(cs, 0, range(1), None, layers=1)
    text = m.to_bytes().replace(b'"step":0', b'"step":1', 1)
    store.commit(manifest_key(0), text)
    with pytest.raises(ManifestError, match="checksum"):
        cs.read_manifest(0)


def test_manifest_readable_without_torch(store):
    cs = CheckpointStore(store)
    save_step(cs, 0, range(2), None, layers=1)
    body = json.loads(store.read(manifest_key(0)))
    assert body["format_version"] == FORMAT_VERSION
    rec = body["units"]["expert/l0/1"]
    assert rec["tensors"][0]["dtype"] == "float32" and rec["chunks"][0]["checksum"].startswith("xxh3:")


def test_missing_step_lists_committed_ones(cs):
    save_step(cs, 3, range(1), None, layers=1)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 9 .*\[3\]"):
        cs.read_manifest(9)


@pytest.mark.parametrize("kwargs,match", [({"compression": "lz4"}, "compression"),
                                          ({"keep_last": 0}, "keep_last"),
                                          ({"zstd_level": 30}, "zstd_level"),
                                          ({"read_concurrency": 0}, "read_concurrency")])
def test_bad_configuration(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        CheckpointStore(str(tmp_path), **kwargs)


def test_export_loads_with_weights_only(tmp_path):
    cs = CheckpointStore(str(tmp_path / "s"))
    m = save_step(cs, 0, range(2), None, layers=1)
    save_step(cs, 4, [1], m, layers=1)
    state = cs.export()
    path = tmp_path / "out.pt"
    torch.save(state, path)
    back = torch.load(path, weights_only=True)
    assert back["moc"]["step"] == 4
    assert torch.equal(back["model"]["layers.0.moe.experts.1.w"], torch.full((4, 8), 401.0))
    assert torch.equal(back["model"]["layers.0.moe.experts.0.w"], torch.full((4, 8), 0.0))
    assert set(back["optimizer"]["state"]) == {"layers.0.moe.experts.0.w", "layers.0.moe.experts.1.w"}


def test_same_checkpoint_visible_from_second_handle(backend_url):
    url, opts = backend_url
    a = CheckpointStore(open_store(url, **opts))
    save_step(a, 0, range(2), None, layers=1)
    b = CheckpointStore(open_store(url, **opts))
    assert b.steps() == [0] and set(b.load().units) == set(a.load().units)
