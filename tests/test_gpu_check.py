"""``benchmarks/gpu/check.py`` (``make gpu-check``) on this CPU-only machine: it refuses to
pretend without a GPU, installs missing packages from carried wheels into a private site
directory (a real wheel, a real pip), and names the fix when no wheel is there."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import check  # noqa: E402


def _wheel(dirpath: Path, name: str) -> Path:
    """A minimal pure-Python wheel of a module ``name`` (what pip installs from .whl/)."""
    dist = f"{name}-1.0.dist-info"
    path = dirpath / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", "VALUE = 42\n")
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_says_so_and_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "check.py"), "--out",
                           str(tmp_path / "s.md")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr
    assert not (tmp_path / "s.md").exists()


def test_a_missing_package_is_installed_from_the_carried_wheels(tmp_path: Path, monkeypatch) -> None:
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels, "moc_gpu_check_probe")
    monkeypatch.setattr(check, "NEEDED", {"moc_gpu_check_probe": "moc-gpu-check-probe", "torch": "torch"})
    monkeypatch.setattr(sys, "path", list(sys.path))
    site = tmp_path / "site"
    got = check.install_missing(wheels, site)
    assert got.ok, got.detail
    assert "moc-gpu-check-probe" in got.detail
    assert (site / "moc_gpu_check_probe" / "__init__.py").exists()
    env = check.child_env(site)
    out = subprocess.run([sys.executable, "-c", "import moc_gpu_check_probe as m; print(m.VALUE)"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "42", out.stderr


def test_no_wheel_for_a_missing_package_names_the_fix(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(check, "NEEDED", {"moc_gpu_check_absent": "moc-gpu-check-absent"})
    got = check.install_missing(tmp_path / "nowhere", tmp_path / "site")
    assert not got.ok
    assert "moc-gpu-check-absent" in got.detail and "make gpu-wheels" in got.detail


def test_the_summary_fails_when_any_check_fails(tmp_path: Path) -> None:
    s = check.Summary(machine={"date": "d", "torch": "t"})
    s.checks = [check.Check("dependencies", True, 1.0, "all present"), check.Check("tests/gpu", False, 9.0, "1 failed")]
    s.tests = [{"test": "a::b", "outcome": "failed", "seconds": "1", "why": "boom"}]
    out = tmp_path / "g.md"
    check.write(s, out)
    text = out.read_text()
    assert text.startswith("# make gpu-check: FAIL") and "| tests/gpu | **FAIL** |" in text and "failed: boom" in text
    assert '"ok": false' in out.with_suffix(".json").read_text()


def test_figures_the_tests_record_reach_the_summary(tmp_path: Path) -> None:
    """A child process (as tests/gpu and the bench run) appends figures through
    ``record_figure`` to the file the check names in its environment; the summary lists
    them, and a line that is not JSON is kept as text, not dropped."""
    figures = tmp_path / "g.figures.jsonl"
    env = check.child_env(tmp_path / "no-site", figures)
    code = ("import sys; sys.path.insert(0, 'tests/gpu'); from gpu_common import record_figure; "
            "record_figure('nccl_reform_3_to_2', unit='s', reinit=1.25, shrink=0.5); "
            "record_figure('moe_bf16_vs_grouped_mm', ratio=0.91)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with figures.open("a") as f:
        f.write("not json\n")
    s = check.Summary(machine={"date": "d", "torch": "t"})
    s.checks = [check.Check("tests/gpu", True, 1.0, "1 passed")]
    s.figures = check.read_figures(figures)
    out = tmp_path / "g.md"
    check.write(s, out)
    text = out.read_text()
    assert "| nccl_reform_3_to_2 | unit s, reinit 1.25, shrink 0.5 |" in text
    assert "| moe_bf16_vs_grouped_mm | ratio 0.91 |" in text
    assert "| unreadable | text not json |" in text
    assert '"ratio": 0.91' in out.with_suffix(".json").read_text()
    assert check.read_figures(tmp_path / "absent.jsonl") == []


def test_only_a_missing_nccl_shrink_may_skip_on_a_gpu(tmp_path: Path) -> None:
    """A real pytest's JUnit report: a test skipped because this NCCL cannot shrink is not a
    failure of the GPU check; any other skip (a CUDA toolchain missing, say) is."""
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_ran():\n    pass\n"
        "def test_shrink():\n    pytest.skip('no NCCL shrink here: NCCL 2.21.5 < 2.27')\n"
        "def test_kernel():\n    pytest.skip('no CUDA toolchain to build the dispatch kernel')\n")

    def report(select: str) -> tuple[int, list[dict[str, str]]]:
        junit = tmp_path / f"{select}.xml"
        code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", select,
                               f"--junitxml={junit}", str(tmp_path / "test_x.py")], cwd=tmp_path,
                              capture_output=True).returncode
        return code, check.read_junit(junit)

    code, tests = report("ran or shrink")
    assert sorted(t["outcome"] for t in tests) == ["passed", "skipped"] and check.tests_ok(code, tests)
    code, tests = report("ran or kernel")
    assert not check.tests_ok(code, tests)
    assert not check.tests_ok(0, [])                              # nothing ran: not a pass
