"""The layering rules, checked on the source (``ast``: no module is imported).

storage_backends at the bottom; moc over it; lazarus over both; the examples, demos,
benchmarks and tests on top, outside the installed packages. Nothing imports upward, and no
two product modules import each other, directly or round a circle (imports inside functions
count: deferring one hides a circle, it does not remove it; so do ``if TYPE_CHECKING:``
blocks: a module that needs another's type only can name the few methods it uses in a
``Protocol``, as ``moc._export.plan.CheckpointSource`` does).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: what each installed package may import from this repository
ALLOWED = {"storage_backends": {"storage_backends"},
           "moc": {"storage_backends", "moc"},
           "lazarus": {"storage_backends", "moc", "lazarus"}}
OURS = {"storage_backends", "moc", "lazarus", "examples", "benchmarks", "tests"}


def _module(path: Path) -> tuple[str, ...]:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def imports_of(path: Path, known: set[str] = frozenset()) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every import in ``path`` naming one of our packages,
    relative ones resolved; ``from pkg import mod`` names ``pkg.mod`` when that is in ``known``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = parts[:-1]   # of a module, and of a package's __init__ alike
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package[: len(package) - (node.level - 1)], *([node.module] if node.module else [])]
                            if node.level else [node.module or ""])
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out += [(node.lineno, n) for n in names if n.split(".")[0] in OURS]
    return out


def product_graph() -> dict[str, dict[str, int]]:
    """module -> {product module it imports: line}."""
    files = {".".join(_module(p)): p for pkg in ALLOWED for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        deps: dict[str, int] = {}
        for line, target in imports_of(path, set(files)):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.setdefault(target, line)
        graph[name] = deps
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_resolves_relative_and_deferred_imports() -> None:
    def tops(*path: str) -> set[str]:
        return {n.split(".")[0] for _, n in imports_of(ROOT.joinpath(*path))}

    assert tops("moc", "_policy.py") == {"moc"}   # relative imports only
    assert tops("lazarus", "runtime", "worker", "_moc_groups.py") == {"moc", "lazarus"}
    assert tops("examples", "lazarus_demo.py") == {"examples", "moc"}
    graph = product_graph()
    assert "moc._export" in graph["moc._store.store"]
    assert "moc._store.store" not in graph["moc._export.plan"]   # a Protocol there, not an import
    assert "lazarus.runtime.worker._backend" in graph["lazarus.runtime.worker._worker_state"]   # TYPE_CHECKING


def test_circles_are_found() -> None:
    assert circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert circles({"a": {"b": 1}, "b": {}}) == []


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_package_imports_upward(package: str) -> None:
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}"
           for path in sorted((ROOT / package).rglob("*.py"))
           for line, name in imports_of(path) if name.split(".")[0] not in ALLOWED[package]]
    assert not bad, f"{package} may import only {sorted(ALLOWED[package])}: " + "; ".join(bad)


def test_lazarus_uses_only_public_moc_names() -> None:
    """lazarus reaches moc through its public modules (``moc``, ``moc.elastic``, ...), never
    an underscore module: moc may then rearrange its inside without breaking the runtime."""
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}"
           for path in sorted((ROOT / "lazarus").rglob("*.py"))
           for line, name in imports_of(path, {"moc." + p.stem for p in (ROOT / "moc").glob("_*")})
           if name.split(".")[0] == "moc" and any(part.startswith("_") for part in name.split(".")[1:])]
    assert not bad, "lazarus may import only moc's public modules: " + "; ".join(bad)


def test_no_import_circles() -> None:
    graph = product_graph()
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(
        ", ".join(f"{a} -> {b} (line {graph[a][b]})" for a in c for b in graph[a] if b in c) for c in found)


#: the most lines a module of the installed packages may have: past it, split it into
#: cohesive modules (docs/architecture.md says where things live)
MAX_LINES = 800


@pytest.mark.parametrize("package", ["moc", "lazarus"])
def test_no_module_is_too_long(package: str) -> None:
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / package).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them): {long}"

