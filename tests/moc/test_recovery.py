"""Tests of :mod:`moc._recovery` (``restore()``: the newest version of every unit among the
surviving in-memory snapshots and storage, a fallback to an older stored version when the
newest object is corrupt, and PLT booked for the experts restored stale), driven through
a single-process ``CheckpointManager`` on a tiny model with a local store. A fallback to an
older stored version charges the tokens seen since *that* version (DESIGN.md: "lost tokens
= unsaved[l][e] at the version used"), on ``restore()`` and on ``restore_units()``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from moc import CheckpointManager, CheckpointStore, MoCConfig
from moc._snapshot.buffers import read_headers
from tests.helpers.moc_helpers import clone_state, make, train_step

INTERVAL = 3
STEPS = 13          # checkpoints at 0, 3, 6, 9, 12


def cfg_for(tmp_path, **kw) -> MoCConfig:
    kw.setdefault("interval", INTERVAL)
    kw.setdefault("dynamic_k", False)
    return MoCConfig(storage=str(tmp_path / "ckpt"), snapshot_dir=str(tmp_path / "shm"), **kw)


def train(tmp_path, *, keep_snapshots: bool, **kw):
    """Train STEPS steps; return the clones at every checkpoint step and the snapshot dir."""
    model, opt, task = make(0)
    clones = {}
    ckpt = CheckpointManager(cfg_for(tmp_path, **kw), model=model, optimizer=opt)
    assert ckpt.restore() == 0
    for step in range(STEPS):
        train_step(model, opt, task, step, ckpt, batch=16)
        ckpt.wait(flush=False)      # no persist skipped for being busy: the saved versions are deterministic
        if step % INTERVAL == 0:
            clones[step] = clone_state(model, opt)
    assert ckpt.status()["persists_skipped"] == 0
    snapshot_dir = ckpt.snapshot_dir
    ckpt.close(keep_snapshots=keep_snapshots)
    return clones, snapshot_dir


def expert_key(unit: str, key: str) -> bool:
    """Does model key ``key`` belong to expert unit ``unit`` (``expert/<layer>/<e>``)?"""
    layer, e = unit[len("expert/"):].rsplit("/", 1)
    return key.startswith(f"{layer}.experts.{e}.")


def assert_model_matches(model, plan, clones) -> None:
    sd = model.state_dict()
    checked = set()
    for name, src in plan.sources.items():
        if not name.startswith("expert/"):
            continue
        for key in sd:
            if expert_key(name, key):
                assert torch.equal(sd[key], clones[src.version]["model"][key]), (name, key, src.version)
                checked.add(key)
    for key in sd:
        if key not in checked:                          # non-expert state: the restore step's
            assert torch.equal(sd[key], clones[plan.step]["model"][key]), key
    assert any(".experts." in k for k in checked)


def _memory_versions(snapshot_dir: str, limit: int) -> dict[str, int]:
    """Per unit: the newest step a published snapshot holds it at (at or before ``limit``)."""
    out: dict[str, int] = {}
    for h in read_headers(snapshot_dir):
        if h["step"] > limit:
            continue
        for piece in h["pieces"]:
            out[piece["unit"]] = max(out.get(piece["unit"], -1), int(h["step"]))
    return out


@pytest.mark.parametrize("lose_newest_buffer", [False, True])
def test_restore_takes_the_newer_of_memory_and_storage_for_each_unit(tmp_path, lose_newest_buffer):
    """K=2 of 8 snapshotted, 1 persisted every other snapshot: memory holds recent versions
    of some experts, storage older or other ones. Each unit must come from whichever level
    has its newer version (memory on a tie), and hold that version's values. Losing the
    newest buffer (its header gone) makes storage the newer level for some units."""
    clones, snapshot_dir = train(tmp_path, keep_snapshots=True, k_snapshot=2, k_persist=1, persist_every=2)
    if lose_newest_buffer:
        newest = max(read_headers(snapshot_dir), key=lambda h: h["step"])
        os.remove(Path(snapshot_dir) / f"buf{newest['buffer']}.json")
    manifest = CheckpointStore(str(tmp_path / "ckpt")).latest_manifest()
    stored = {n: r.step for n, r in manifest.units.items()}
    mem_newest = max(h["step"] for h in read_headers(snapshot_dir))

    model, opt, _ = make(seed=99)
    ckpt = CheckpointManager(cfg_for(tmp_path, k_snapshot=2, k_persist=1, persist_every=2), model=model,
                             optimizer=opt)
    start = ckpt.restore()
    plan = ckpt.last_restore
    want_step = max(mem_newest, manifest.step)
    assert start == want_step + 1 and plan.step == want_step
    assert plan.from_memory == (mem_newest > manifest.step)
    memory = _memory_versions(snapshot_dir, plan.step)
    expected = {}
    for name in set(memory) | set(stored):
        mem, sto = memory.get(name), stored.get(name)
        if mem is not None and (sto is None or mem >= sto):
            expected[name] = ("snapshot", mem)
        else:
            expected[name] = ("persist", sto)
    got = {n: (s.level, s.version) for n, s in plan.sources.items()}
    assert got == expected
    experts = {n: v for n, v in got.items() if n.startswith("expert/")}
    # the case is not trivial: both levels serve experts, at different versions
    assert {lvl for lvl, _ in experts.values()} == {"snapshot", "persist"}
    if lose_newest_buffer:
        assert any(lvl == "persist" and memory.get(n, -1) >= 0 and v > memory[n] for n, (lvl, v) in experts.items())
    else:
        assert any(lvl == "snapshot" and v > stored.get(n, -1) for n, (lvl, v) in experts.items())
    assert len({v for _, v in experts.values()}) > 1
    assert_model_matches(model, plan, clones)
    ckpt.close()


def _corrupt_unit(storage: Path, rec) -> None:
    """Flip bytes inside the stored chunk of one unit (the object stays, its checksum fails)."""
    chunk = rec.chunks[0]
    path = storage / chunk.key
    assert path.is_file(), path
    with open(path, "r+b") as f:
        f.seek(chunk.start)
        data = f.read(min(64, chunk.stored_nbytes))
        f.seek(chunk.start)
        f.write(bytes(b ^ 0xFF for b in data))


def _pick_expert(manifest) -> str:
    """An expert persisted in the newest step that also has an older stored version."""
    for name, rec in sorted(manifest.units.items()):
        if rec.kind == "expert" and rec.step == manifest.step:
            return name
    raise AssertionError("no expert persisted at the newest step")


def _restore_after(tmp_path, corrupt: bool, caplog):
    clones, _ = train(tmp_path, keep_snapshots=False, k_snapshot=2, k_persist=2, keep_last=5)
    storage = tmp_path / "ckpt"
    store = CheckpointStore(str(storage))
    manifest = store.latest_manifest()
    unit = _pick_expert(manifest)
    older = max(store.read_manifest(s).units[unit].step for s in store.steps()
                if store.read_manifest(s).units[unit].step < manifest.step)
    if corrupt:
        _corrupt_unit(storage, manifest.units[unit])
    model, opt, _ = make(seed=99)
    ckpt = CheckpointManager(cfg_for(tmp_path, k_snapshot=2, k_persist=2, keep_last=5), model=model, optimizer=opt)
    with caplog.at_level(logging.WARNING, logger="moc"):
        start = ckpt.restore()
    plan = ckpt.last_restore
    ckpt.close()
    return start, plan, unit, older, manifest, clones, model


def test_a_corrupt_newest_object_falls_back_to_the_older_version_and_says_so(tmp_path, caplog):
    start, plan, unit, older, manifest, clones, model = _restore_after(tmp_path, True, caplog)
    assert start == manifest.step + 1 and not plan.from_memory
    src = plan.sources[unit]
    assert src.level == "persist" and src.version == older < manifest.step   # reported in the plan
    assert_model_matches(model, plan, clones)                                # and it is that version
    # every other unit kept its newest stored version
    for name, s in plan.sources.items():
        if name != unit:
            assert s.version == manifest.units[name].step, name
    text = caplog.text
    assert f"{unit} restored from step {older} (step {manifest.step} unreadable)" in text, text


def test_restoring_stale_experts_books_the_tokens_they_saw_since_their_version(tmp_path):
    """PLT: an expert restored from version v loses the tokens routed to it between v and
    the restore step S (counted from the manifests of v and S, not from the planner); its
    routing counter is rewound to v's."""
    train(tmp_path, keep_snapshots=False, k_snapshot=2, k_persist=2, keep_last=5)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    manifest = store.latest_manifest()
    cum_at = {s: store.read_manifest(s).plt["cum"] for s in store.steps()}
    expected: dict[str, int] = {}
    rewound: dict[tuple[str, int], int] = {}
    for rec in manifest.units.values():
        if rec.kind == "expert":
            layer, e = str(rec.layer), int(rec.expert)
            seen = cum_at[manifest.step][layer][e] - cum_at[rec.step][layer][e]
            expected[layer] = expected.get(layer, 0) + seen
            rewound[(layer, e)] = cum_at[rec.step][layer][e]
    assert sum(expected.values()) > 0          # some experts are stale and did see tokens since

    model, opt, _ = make(seed=99)
    ckpt = CheckpointManager(cfg_for(tmp_path, k_snapshot=2, k_persist=2, keep_last=5), model=model, optimizer=opt)
    assert ckpt.restore() == manifest.step + 1
    state = ckpt.plt_tracker.state()
    assert {layer: state["lost_tokens"][layer] for layer in expected} == expected
    assert ckpt.plt() > 0
    for (layer, e), cum in rewound.items():
        assert ckpt.plt_tracker.cum[layer][e] == cum, (layer, e)
    ckpt.close()


def _truncate_newest_experts(storage: Path, manifest) -> list[str]:
    """Truncate the newest step's expert object(s) before their first chunk: every expert
    saved at that step is unreadable there. Returns those experts."""
    hit = sorted(n for n, r in manifest.units.items() if r.kind == "expert" and r.step == manifest.step)
    chunks = [c for n in hit for c in manifest.units[n].chunks]
    for key in {c.key for c in chunks}:
        with open(storage / key, "r+b") as f:
            f.truncate(min(c.start for c in chunks if c.key == key))
    return hit


def _expected_loss(store, manifest, versions: dict[str, int]) -> dict[str, int]:
    """Tokens routed to each restored expert between its version and the restore step, per layer
    (counted from the manifests' own counters at each step)."""
    cum_at = {s: store.read_manifest(s).plt["cum"] for s in store.steps()}
    out: dict[str, int] = {}
    for name, rec in manifest.units.items():
        if rec.kind == "expert":
            layer, e = str(rec.layer), int(rec.expert)
            v = versions.get(name, rec.step)
            out[layer] = out.get(layer, 0) + cum_at[manifest.step][layer][e] - cum_at[v][layer][e]
    return out


def _restored(tmp_path, **kw):
    model, opt, _ = make(seed=99)
    ckpt = CheckpointManager(cfg_for(tmp_path, k_snapshot=2, k_persist=2, keep_last=5), model=model, optimizer=opt)
    start = ckpt.restore()
    state, plt, plan = ckpt.plt_tracker.state(), ckpt.status()["plt"], ckpt.last_restore
    ckpt.close()
    return start, state, plt, plan


def test_a_fallback_to_an_older_version_books_the_tokens_seen_since_that_version(tmp_path):
    train(tmp_path, keep_snapshots=False, k_snapshot=2, k_persist=2, keep_last=5)
    storage = tmp_path / "ckpt"
    store = CheckpointStore(str(storage))
    manifest = store.latest_manifest()
    intact = _restored(tmp_path)
    hit = _truncate_newest_experts(storage, manifest)
    older = {n: max(store.read_manifest(s).units[n].step for s in store.steps()
                    if store.read_manifest(s).units[n].step < manifest.step) for n in hit}
    start, state, plt, plan = _restored(tmp_path)
    assert start == manifest.step + 1 and {n: plan.sources[n].version for n in hit} == older
    expected = _expected_loss(store, manifest, older)
    assert {layer: state["lost_tokens"][layer] for layer in expected} == expected
    assert plt > intact[2], (plt, intact[2])
    for name, v in older.items():     # the counter rewound to the version actually restored
        rec = manifest.units[name]
        assert state["cum"][rec.layer][int(rec.expert)] == store.read_manifest(v).plt["cum"][rec.layer][int(rec.expert)]


def test_restore_units_after_a_fallback_books_the_tokens_seen_since_that_version(tmp_path):
    train(tmp_path, keep_snapshots=False, k_snapshot=2, k_persist=2, keep_last=5)
    storage = tmp_path / "ckpt"
    store = CheckpointStore(str(storage))
    manifest = store.latest_manifest()
    hit = _truncate_newest_experts(storage, manifest)
    name = hit[0]
    rec = manifest.units[name]
    older = max(store.read_manifest(s).units[name].step for s in store.steps()
                if store.read_manifest(s).units[name].step < manifest.step)
    layer, e = str(rec.layer), int(rec.expert)
    model, opt, task = make(seed=5)
    ckpt = CheckpointManager(cfg_for(tmp_path, k_snapshot=2, k_persist=2, keep_last=5), model=model, optimizer=opt)
    assert ckpt.restore() == manifest.step + 1
    for step in (13, 14):     # no checkpoint (interval 3): the expert is routed to, not saved
        train_step(model, opt, task, step, ckpt, batch=16)
    before = ckpt.plt_tracker.state()["lost_tokens"][layer]
    out = ckpt.restore_units([name])
    live = ckpt.plt_tracker.cum[layer][e]      # restore_units keeps the live counter (routing synced)
    ckpt.close()
    assert out[name]["level"] == "persist" and out[name]["version"] == older
    assert out[name]["lost_tokens"] == live - store.read_manifest(older).plt["cum"][layer][e] > 0
    assert ckpt.plt_tracker.state()["lost_tokens"][layer] == before + out[name]["lost_tokens"]
