"""``moc inspect`` at many-layer scale: the per-layer summary, the expert-age heatmap and
the ``--memory`` restore preview, checked against what ``restore()`` then really does.

The store comes from a real run (tests/helpers/workers/inspect_writer.py, 8 MoE layers x 64 experts, K of
E saved per checkpoint): one process trains 6 steps and is killed, a second restores from
its memory snapshot (booking PLT), trains to step 21 and is killed too, leaving three
snapshot buffers (steps 12, 16, 20) newer than or equal to storage's newest step (16).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch

from moc import CheckpointManager, CheckpointStore, MoCConfig
from moc._inspect.plot import heatmap_geometry
from moc.cli import main
from tests.helpers.moc_helpers import make

WORKERS = os.path.join(os.path.dirname(__file__), "..", "helpers", "workers")
LAYERS, EXPERTS = 8, 64


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moc.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory):
    """(store, shm) of a job killed twice; every test works on its own copy."""
    root = tmp_path_factory.mktemp("inspect-run")
    store, shm = root / "store", root / "shm"
    for steps in (6, 22):
        res = subprocess.run([sys.executable, os.path.join(WORKERS, "inspect_writer.py"), str(store), str(shm),
                              "--layers", str(LAYERS), "--experts", str(EXPERTS), "--steps", str(steps), "--crash"],
                             capture_output=True, text=True, timeout=110)
        assert res.returncode == 0, res.stderr[-2000:]
    return store, shm


@pytest.fixture
def run_copy(crashed_run, tmp_path):
    store, shm = crashed_run
    shutil.copytree(store, tmp_path / "store")
    shutil.copytree(shm, tmp_path / "shm")
    return tmp_path / "store", tmp_path / "shm"


def fresh_restore(store, shm) -> tuple[CheckpointManager, int]:
    model, opt, _ = make(1, num_experts=EXPERTS, layers=LAYERS, dim=4, hidden=4)
    cfg = MoCConfig(storage=str(store), snapshot_dir=str(shm), interval=4, k_snapshot=8, k_persist=2,
                    persist_every=2, dynamic_k=False)
    mgr = CheckpointManager(cfg, model=model, optimizer=opt)
    return mgr, mgr.restore()


# -- the default summary -------------------------------------------------------------------
def test_default_summary_fits_a_screen_and_matches_the_manifest(run_copy, capsys):
    store, _ = run_copy
    assert main(["inspect", str(store)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) < 80
    assert f"layout   per-expert modules: {LAYERS} MoE layers x {EXPERTS} experts" in out
    assert "MoE layers: layers.*.moe" in out
    m = CheckpointStore(str(store)).latest_manifest()
    assert m.step == 16
    layers = m.layers()
    plt = m.plt
    rows = {ln.split()[0]: ln.split() for ln in lines if ln.split() and ln.split()[0].isdigit() and len(ln.split()) > 8}
    assert sorted(rows, key=int) == [str(i) for i in range(LAYERS)]
    ages_seen = set()
    for i in range(LAYERS):
        ages = sorted(m.step - r.step for r in layers[f"layers.{i}.moe"].values())
        ages_seen |= set(ages)
        row = rows[str(i)]
        assert row[1] == str(EXPERTS)
        assert (int(row[2]), int(row[4])) == (ages[0], ages[-1])
        assert row[9] == f"{100 * plt['lost_tokens'][f'layers.{i}.moe'] / plt['total_tokens']:.3f}%"
        assert int(row[10]) == sum(plt["unsaved"][f"layers.{i}.moe"])
    assert len(ages_seen) >= 3          # partial K: experts of different ages
    assert any(float(r[9].rstrip("%")) > 0 for r in rows.values())  # the recovery booked PLT

    # --units is the per-unit table: a line per unit, far more than a screen.
    assert main(["inspect", str(store), "--units"]) == 0
    units_out = capsys.readouterr().out
    assert len(units_out.splitlines()) > LAYERS * EXPERTS
    assert "expert/layers.3.moe/17" in units_out


def test_summary_groups_layers_beyond_sixty(tmp_path, capsys):
    from tests.moc.test_store import expert_tree

    cs = CheckpointStore(str(tmp_path / "many"))
    units = {"module/emb": ({"model": {"emb.weight": torch.zeros(2, 2)}}, {"kind": "module"})}
    for layer in range(150):
        for e in range(2):
            units[f"expert/blocks.{layer}.ffn/{e}"] = (expert_tree(layer, e, 1.0),
                                                      {"kind": "expert", "layer": f"blocks.{layer}.ffn", "expert": e})
    cs.save(0, units)
    assert main(["inspect", str(tmp_path / "many")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) < 80
    assert any("(3 layers per row" in ln for ln in lines)
    assert any(ln.startswith("0-2 ") for ln in lines) and any(ln.startswith("147-149 ") for ln in lines)


def test_json_keeps_everything_and_adds_the_summary(run_copy, capsys):
    store, _ = run_copy
    assert main(["inspect", str(store), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert len([u for u in info["units"] if u["kind"] == "expert"]) == LAYERS * EXPERTS
    assert set(info["layers"]) == {f"layers.{i}.moe" for i in range(LAYERS)}
    s = info["summary"]
    assert s["layout"]["description"] == f"per-expert modules: {LAYERS} MoE layers x {EXPERTS} experts"
    assert s["layout"]["kind"] == "per_expert"
    assert [r["layer"] for r in s["layers"]] == [f"layers.{i}.moe" for i in range(LAYERS)]
    for r in s["layers"]:
        assert r["age_max"] == max(info["layers"][r["layer"]]["ages"])
        assert r["age_min"] == min(info["layers"][r["layer"]]["ages"])
    assert s["experts"]["units"] == LAYERS * EXPERTS
    assert s["non_expert"]["version_steps"] == [info["step"]]


def test_layout_description_from_the_manifest_is_printed(tmp_path, capsys):
    from tests.moc.test_store import expert_tree

    cs = CheckpointStore(str(tmp_path / "fused"))
    units = {f"expert/l0/{e}": (expert_tree(0, e, 1.0), {"kind": "expert", "layer": "l0", "expert": e})
             for e in range(4)}
    units["module/emb"] = ({"model": {"emb.weight": torch.zeros(2, 2)}}, {"kind": "module"})
    cs.save(0, units, meta={"layout": {
        "kind": "hf_fused", "description": "transformers 5.x fused experts (gate_up_proj / down_proj)",
        "experts_per_layer": {"l0": 4}}})
    assert main(["inspect", str(tmp_path / "fused")]) == 0
    out = capsys.readouterr().out
    assert "layout   transformers 5.x fused experts (gate_up_proj / down_proj) (1 MoE layers x 4 experts)" in out


# -- the heatmap ---------------------------------------------------------------------------
def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_png_heatmap_has_the_expected_size_and_shows_the_ages(run_copy, tmp_path, capsys):
    import matplotlib.image

    store, _ = run_copy
    out = tmp_path / "ages.png"
    assert main(["inspect", str(store), "--png", str(out)]) == 0
    geo = heatmap_geometry(LAYERS, EXPERTS)
    assert png_size(out) == (geo["width"], geo["height"])
    assert f"heatmap  {out} ({geo['width']} x {geo['height']} px)" in capsys.readouterr().out
    img = matplotlib.image.imread(out)
    from moc._inspect.plot import LEFT, TOP

    # The map's pixels: several distinct colours (ages 0, 8, 16 -> different colours).
    region = img[TOP + 2: TOP + geo["map_h"] - 2, LEFT + 2: LEFT + geo["map_w"] - 2, :3]
    colours = {tuple((px * 255).round().astype(int)) for px in region.reshape(-1, 3)[::7]}
    assert len(colours) >= 3


def test_heatmap_geometry_readable_at_deepseek_v3_scale():
    geo = heatmap_geometry(58, 256)
    assert geo["cell_w"] >= 4 and geo["cell_h"] >= 12
    assert geo["width"] <= 1800 and geo["height"] <= 1000   # one screen
    with pytest.raises(ValueError, match="at least one MoE layer"):
        heatmap_geometry(0, 8)


# -- --memory: the restore preview ---------------------------------------------------------
def _sources(mgr: CheckpointManager) -> dict[str, tuple[str, int]]:
    names = {"snapshot": "memory", "persist": "storage"}
    return {n: (names[s.level], s.version) for n, s in mgr.last_restore.sources.items()}


@pytest.mark.parametrize("damage", ["intact", "torn"])
def test_memory_preview_is_what_restore_does(run_copy, tmp_path, capsys, damage):
    store, shm = run_copy
    folder = shm / "rank0"
    headers = {int(p.name[3]): json.loads(p.read_text()) for p in folder.glob("buf?.json")}
    assert sorted(h["step"] for h in headers.values()) == [12, 16, 20]
    if damage == "torn":
        # The newest snapshot's header no longer matches its checksum, and the step-12
        # buffer lost its header (what a process killed while refilling it leaves).
        newest = max(headers, key=lambda i: headers[i]["step"])
        oldest = min(headers, key=lambda i: headers[i]["step"])
        body = headers[newest]
        body["step"] = 21
        (folder / f"buf{newest}.json").write_text(json.dumps(body))
        (folder / f"buf{oldest}.json").unlink()

    # A lazarus agent's layout: <snapshot-dir>/<node>/<worker>/buf*.
    agent = tmp_path / "agent"
    shutil.copytree(folder, agent / "n0" / "worker0")

    # The per-rank parent in a fresh process (the CLI as a user runs it), the rank's own
    # folder and the agent layout in this one.
    res = run_cli("inspect", str(store), "--memory", str(shm), "--json")
    assert res.returncode == 0, res.stderr
    reports = {shm: json.loads(res.stdout)["memory"]}
    for where in (folder, agent):
        assert main(["inspect", str(store), "--memory", str(where), "--json"]) == 0
        reports[where] = json.loads(capsys.readouterr().out)["memory"]
    rep = reports[shm]

    def choices(r):  # folder names differ between the three views; the choices must not
        return {n: (u["source"], u["version"]) for n, u in r["plan"]["units"].items()}, r["plan"]["step"]

    assert choices(reports[folder]) == choices(rep) == choices(reports[agent])
    assert reports[agent]["folders"] == [os.path.join("n0", "worker0")]
    states = {b["buffer"]: (b["state"], b["step"]) for b in rep["buffers"]}
    if damage == "intact":
        assert sorted(states.values()) == [("complete", 12), ("complete", 16), ("complete", 20)]
    else:
        assert states[newest] == ("torn", None) and states[oldest] == ("torn", None)
        notes = {b["buffer"]: b["note"] for b in rep["buffers"]}
        assert "checksum" in notes[newest] and "no process maps it" in notes[oldest]

    assert main(["inspect", str(store), "--memory", str(shm)]) == 0
    text = capsys.readouterr().out
    assert len(text.splitlines()) < 80
    assert f"restore() takes step {rep['plan']['step']} from" in text

    mgr, start = fresh_restore(store, shm)
    try:
        plan = rep["plan"]
        assert start == plan["resume_step"] == mgr.last_restore.step + 1
        assert plan["from_memory"] == mgr.last_restore.from_memory
        predicted = {n: (u["source"], u["version"]) for n, u in plan["units"].items()}
        assert predicted == _sources(mgr)
        used = {src for src, _ in predicted.values()}
        assert used == {"memory", "storage"}         # both sources exercised
        # Tokens the restore booked as lost, per layer, as predicted.
        before = mgr.last_restore.plt.get("lost_tokens") or {}
        tracker = mgr.plt_tracker
        for layer, row in plan["layers"].items():
            booked = sum(tracker.lost[lv][layer] for lv in ("snapshot", "persist")) - int(before.get(layer, 0))
            assert booked == row["lost_tokens"], layer
        if damage == "intact":
            assert plan["step"] == 20 and plan["from_memory"]
        else:
            assert plan["step"] == 16 and not plan["from_memory"]
    finally:
        mgr.close(flush=False, keep_snapshots=True, raise_errors=False)


def test_memory_reports_a_buffer_being_filled(run_copy, capsys):
    store, shm = run_copy
    mgr, _ = fresh_restore(store, shm)
    try:
        buf = mgr.pool.acquire()          # what the next checkpoint does: header off, then fill
        buf.ensure(1 << 16)
        assert main(["inspect", str(store), "--memory", str(shm), "--json"]) == 0
        rep = json.loads(capsys.readouterr().out)["memory"]
        b = next(b for b in rep["buffers"] if b["buffer"] == buf.index)
        assert b["state"] == "being filled" and str(os.getpid()) in b["note"] and not b["used"]
        complete = sorted(b["step"] for b in rep["buffers"] if b["state"] == "complete")
        assert len(complete) == 2
        memory_versions = {u["version"] for u in rep["plan"]["units"].values() if u["source"] == "memory"}
        assert memory_versions and memory_versions <= set(complete)   # nothing from the buffer being filled
    finally:
        mgr.close(flush=False, keep_snapshots=True, raise_errors=False)


def test_memory_without_buffers_plans_from_storage(run_copy, tmp_path, capsys):
    store, _ = run_copy
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(store), "--memory", str(tmp_path / "empty")]) == 0
    out = capsys.readouterr().out
    assert "no snapshot buffers found" in out
    assert "restore() takes step 16 from storage (storage's newest step: 16) and resumes at step 17" in out


# -- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize("extra,fragment", [
    (["--memory", "{tmp}/nope"], "--memory {tmp}/nope: no such directory"),
    (["--memory", "{tmp}/afile"], "--memory {tmp}/afile: not a directory"),
    (["--png", "{tmp}/nodir/x.png"], "--png {tmp}/nodir/x.png: directory {tmp}/nodir does not exist"),
    (["--png", "{tmp}/x.jpg"], "--png {tmp}/x.jpg: the file name must end in .png"),
    (["--memory", "{tmp}", "--step", "16"], "--step cannot be combined with --memory"),
])
def test_bad_paths_give_one_line_and_exit_2(run_copy, tmp_path, capsys, extra, fragment):
    store, _ = run_copy
    (tmp_path / "afile").write_text("x")
    assert main(["inspect", str(store), *[a.format(tmp=tmp_path) for a in extra]]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == ""
    assert len(lines) == 1 and lines[0].startswith("moc inspect: error: ") and fragment.format(tmp=tmp_path) in lines[0]
    assert not (tmp_path / "x.jpg").exists()


def test_bad_memory_path_from_the_command_line(run_copy, tmp_path):
    store, _ = run_copy
    res = run_cli("inspect", str(store), "--memory", str(tmp_path / "gone"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip() == f"moc inspect: error: --memory {tmp_path / 'gone'}: no such directory"


def test_png_without_matplotlib_says_which_extra_installs_it(run_copy, tmp_path):
    store, _ = run_copy
    code = ("import sys; sys.modules['matplotlib'] = None\n"     # as if it were not installed
            "from moc.cli import main; sys.exit(main(sys.argv[1:]))")
    res = subprocess.run([sys.executable, "-c", code, "inspect", str(store), "--png", str(tmp_path / "a.png")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert lines == ['moc inspect: error: --png needs matplotlib, which is not installed: '
                     'pip install "moc-lazarus[plot]"'], res.stderr
    assert not (tmp_path / "a.png").exists()
