"""The documentation: the MkDocs site builds with --strict (no broken link or anchor), and
every code block marked ``<!-- runs -->`` in README.md and docs/*.md runs as pasted."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
_BLOCK = re.compile(r"<!-- runs -->\n```python\n(.*?)\n```", re.S)


def _snippets():
    for page in PAGES:
        text = open(page).read()
        for i, m in enumerate(_BLOCK.finditer(text)):
            yield pytest.param(m.group(1), id=f"{os.path.relpath(page, ROOT)}#{i}")


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f",
                          os.path.join(ROOT, "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "site" / "trainers" / "index.html").exists()


def test_every_guide_is_in_the_site_and_linked_from_the_readme():
    nav = open(os.path.join(ROOT, "mkdocs.yml")).read()
    readme = open(os.path.join(ROOT, "README.md")).read()
    for page in PAGES[1:]:
        name = os.path.basename(page)
        assert name in nav, f"docs/{name} is not in mkdocs.yml's nav"
        if name != "index.md":
            assert f"(docs/{name})" in readme, f"README.md does not link docs/{name}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("code", list(_snippets()))
def test_snippet_runs_as_pasted(code, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=280, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
