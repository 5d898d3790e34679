"""``make gpu-check``: every GPU check of the project in one command, one summary file.

For the next person with a GPU (a bare H100/H200 whose ``python3`` has a CUDA torch and
nothing of this project): it

1. installs what this project needs and the interpreter lacks, from wheels carried with the
   tree in ``.whl/`` (``make gpu-wheels`` downloads them on a machine with the package
   index; the GPU image lacks ``zstandard``), into a private site directory passed to every
   child process (``PYTHONPATH``), never into the system;
2. runs the CUDA tests (``tests/gpu``, as ``make test-gpu``), each test's outcome kept: among
   them the two-rank NCCL job with a rank SIGKILLed and one SIGSTOPped, exact mode on CUDA
   (kill, restore, replay bit for bit), the moc snapshot path (side stream, page-locked
   buffers, no host sync) and the dispatch kernel;
3. runs a reduced ``benchmarks/gpu`` (``--quick``): moc's stall per checkpoint against DCP at
   its best, snapshot bandwidth, the MoE layer;
4. writes one summary (``--out``, default ``gpu-check.md`` here, and ``.json`` beside it):
   pass/fail per check, the bench's figures, GPU, driver, torch, CUDA and NCCL versions, the
   date, in at most ``--budget`` (8 minutes by default; each part has its own share). The
   figures the tests and the bench measure (NCCL re-forming by shrink vs abort + init, the
   MoE layer's bf16 throughput against a plain grouped-mm reference) come to it through
   ``$LAZARUS_GPU_FIGURES``, one JSON line each, and are listed in a table of their own.

Without a GPU it says so and exits 2 (nothing is faked here). Rerun: ``make gpu-check``
(``GPU_PY=python3`` by default for this target: the CUDA interpreter, no venv).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

#: import name -> distribution name of what the project needs at run time (pyproject's
#: dependencies) and what the CUDA tests import besides.
NEEDED = {"numpy": "numpy", "fsspec": "fsspec", "zstandard": "zstandard", "xxhash": "xxhash",
          "safetensors": "safetensors", "ninja": "ninja", "tqdm": "tqdm", "pytest": "pytest",
          "pytest_timeout": "pytest-timeout"}


@dataclass
class Check:
    name: str
    ok: bool
    seconds: float
    detail: str = ""


@dataclass
class Summary:
    machine: dict[str, str]
    checks: list[Check] = field(default_factory=list)
    tests: list[dict[str, str]] = field(default_factory=list)
    bench: str = ""
    figures: list[dict[str, object]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def versions() -> dict[str, str]:
    import torch
    out = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "python": platform.python_version(), "torch": torch.__version__,
           "cuda": str(torch.version.cuda), "host": platform.node()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpus"] = str(torch.cuda.device_count())
        try:
            out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            out["nccl"] = f"unknown ({exc})"
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            out["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout else "unknown"
        except (OSError, subprocess.TimeoutExpired):
            out["driver"] = "unknown (no nvidia-smi)"
    return out


def install_missing(wheels: Path, site: Path) -> Check:
    """Install the needed packages this interpreter lacks from ``wheels`` into ``site``."""
    t0 = time.perf_counter()
    missing = [dist for mod, dist in NEEDED.items() if importlib.util.find_spec(mod) is None]
    if not missing:
        return Check("dependencies", True, time.perf_counter() - t0, "all present")
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return Check("dependencies", False, time.perf_counter() - t0,
                     f"missing {missing} and no wheels in {wheels} (run `make gpu-wheels` where pip can reach "
                     "the index, and carry .whl/ with the tree)")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, found)],
                          capture_output=True, text=True, timeout=180)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    still = [dist for mod, dist in NEEDED.items() if importlib.util.find_spec(mod) is None]
    ok = proc.returncode == 0 and not still
    detail = f"installed from {wheels}: {missing}" if ok else \
        f"pip exit {proc.returncode}, still missing {still}: {proc.stderr[-800:]}"
    return Check("dependencies", ok, time.perf_counter() - t0, detail)


#: the file (JSON lines) where tests/gpu (``record_figure``) and the bench append their figures
FIGURES_ENV = "LAZARUS_GPU_FIGURES"


def child_env(site: Path, figures: Path | None = None) -> dict[str, str]:
    paths = [str(ROOT)] + ([str(site)] if site.is_dir() else []) + [os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), PYTHONUNBUFFERED="1")
    if figures is not None:
        env[FIGURES_ENV] = str(figures)
    return env


def read_figures(path: Path) -> list[dict[str, object]]:
    """The figures appended to ``path`` (a line that is not a JSON object is kept as text)."""
    if not path.exists():
        return []
    out: list[dict[str, object]] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            item = None
        out.append(item if isinstance(item, dict) else {"name": "unreadable", "text": line[:300]})
    return out


#: a skipped GPU test whose reason says so is not a failure: this GPU's NCCL cannot do it
NOT_ON_THIS_NCCL = "no NCCL shrink here"


def read_junit(junit: Path) -> list[dict[str, str]]:
    """One ``{"test", "outcome", "seconds", "why"}`` per test case of a JUnit report (none
    when the report is missing: pytest did not get that far)."""
    tests: list[dict[str, str]] = []
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome, why = "passed", ""
            for kind in ("failure", "error", "skipped"):
                el = case.find(kind)
                if el is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                    why = (el.get("message") or "")[:300]
            tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                          "seconds": case.get("time", ""), "why": why})
    return tests


def tests_ok(code: int, tests: list[dict[str, str]]) -> bool:
    """pytest passed, ran something, and skipped nothing but what this GPU's NCCL lacks
    (shrink needs NCCL >= 2.27: the trainer re-forms by abort + init there, which the other
    tests cover)."""
    skipped = [t for t in tests if t["outcome"] == "skipped" and NOT_ON_THIS_NCCL not in t["why"]]
    return code == 0 and bool(tests) and not skipped


def run_tests(env: dict[str, str], out: Path, timeout: float) -> tuple[Check, list[dict[str, str]]]:
    """``pytest -m gpu tests/gpu`` with a JUnit report: one outcome per test."""
    t0 = time.perf_counter()
    junit = out.with_suffix(".junit.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", f"--junitxml={junit}", "-p",
           "no:cacheprovider"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        tail, code = (proc.stdout + proc.stderr)[-3000:], proc.returncode
    except subprocess.TimeoutExpired as exc:
        tail, code = f"timed out after {timeout:.0f} s: {str(exc.stdout or '')[-2000:]}", -1
    tests = read_junit(junit)
    ok = tests_ok(code, tests)
    summary = re.findall(r"\d+ (?:passed|failed|skipped|error)", tail)
    return Check("tests/gpu", ok, time.perf_counter() - t0,
                 ", ".join(summary) + ("" if ok else f"; exit {code}; tail: {tail[-1500:]}")), tests


def run_bench(env: dict[str, str], out: Path, timeout: float) -> tuple[Check, str]:
    t0 = time.perf_counter()
    md = out.with_suffix(".bench.md")
    cmd = [sys.executable, str(HERE / "main.py"), "--quick", "--out", str(md)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        ok, tail = proc.returncode == 0 and md.exists(), (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        ok, tail = False, f"timed out after {timeout:.0f} s"
    text = md.read_text() if md.exists() else ""
    return Check("bench-gpu --quick", ok, time.perf_counter() - t0, "" if ok else tail), text


def write(summary: Summary, out: Path) -> None:
    m = summary.machine
    lines = [f"# make gpu-check: {'PASS' if summary.ok else 'FAIL'}", "",
             f"{m.get('date')}; GPU {m.get('gpu', 'none')} x{m.get('gpus', 0)}, driver {m.get('driver', '?')}; "
             f"torch {m.get('torch')} (CUDA {m.get('cuda')}, NCCL {m.get('nccl', '?')}); Python {m.get('python')}; "
             f"host {m.get('host')}", "", "| check | result | seconds | detail |", "|---|---|---:|---|"]
    for c in summary.checks:
        detail = c.detail.replace("\n", " ").replace("|", "/")[:600]
        lines.append(f"| {c.name} | {'pass' if c.ok else '**FAIL**'} | {c.seconds:.0f} | {detail} |")
    if summary.tests:
        lines += ["", "## tests/gpu", "", "| test | outcome | seconds |", "|---|---|---:|"]
        lines += [f"| {t['test']} | {t['outcome']}{(': ' + t['why']) if t['why'] else ''} | {t['seconds']} |"
                  for t in summary.tests]
    if summary.figures:
        lines += ["", "## figures", "", "| figure | values |", "|---|---|"]
        for f in summary.figures:
            values = ", ".join(f"{k} {v}" for k, v in f.items() if k != "name").replace("|", "/")
            lines.append(f"| {f.get('name')} | {values} |")
    if summary.bench:
        lines += ["", "## bench-gpu --quick", "", summary.bench]
    lines += ["", "Rerun: `make gpu-check` (see benchmarks/gpu/check.py)."]
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(
        {"ok": summary.ok, "machine": summary.machine, "checks": [asdict(c) for c in summary.checks],
         "tests": summary.tests, "figures": summary.figures}, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "gpu-check.md", help="summary file (.md; .json beside it)")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="wheels of missing packages")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for everything (default 8 minutes)")
    ap.add_argument("--skip-bench", action="store_true", help="the tests only")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("make gpu-check needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    summary = Summary(machine=versions())
    site = Path(tempfile.mkdtemp(prefix="moc-gpu-site-"))
    summary.checks.append(install_missing(args.wheels, site))
    figures = args.out.with_suffix(".figures.jsonl")
    figures.unlink(missing_ok=True)
    env = child_env(site, figures)
    left = lambda: args.budget - (time.perf_counter() - start)  # noqa: E731
    check, summary.tests = run_tests(env, args.out, timeout=max(60.0, left() * (0.6 if not args.skip_bench else 1)))
    summary.checks.append(check)
    if not args.skip_bench:
        check, summary.bench = run_bench(env, args.out, timeout=max(60.0, left() - 10))
        summary.checks.append(check)
    summary.figures = read_figures(figures)
    write(summary, args.out)
    print(args.out.read_text())
    return 0 if summary.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
