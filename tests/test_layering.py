"""The package's layering: no import cycle among its modules, and nothing in it points outside the repository.

Imports are read from the source (`ast`), every one of them: at module level, inside functions (a deferred
import is still a dependency, only a later one), and under `TYPE_CHECKING`. A cycle means two modules that
cannot be understood, tested or replaced apart.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "litevlm"


def module_names(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `package` (a package is its __init__)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of `modules` that importing `name` runs last: `name` itself or its longest known prefix."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `module` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package that holds `module`
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import name` imports the submodule pkg.name when there is one, else pkg itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out |= {t for t in (_resolve(t, modules) for t in targets) if t and t != module}
    return out


def import_graph(package: Path) -> dict[str, set[str]]:
    modules = module_names(package)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module: the modules that import each other."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path a -> ... -> a) through each component of modules that import each other."""
    return [_cycle_in(comp, graph) for comp in components(graph)]


def _cycle_in(comp: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected component (breadth-first)."""
    start = min(comp)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(comp)} is strongly connected, so it holds a cycle")


def test_the_package_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    found = [f"{' -> '.join(_cycle_in(c, graph))}   (all of: {', '.join(sorted(c))})" for c in components(graph)]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_the_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    """A fake package: a imports b at the top, b imports a inside a function (relative import); c is fine."""
    pkg = tmp_path / "fake"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from fake.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n    return a\n")
    (pkg / "c.py").write_text("import fake.sub.b\nfrom fake import a\n")
    graph = import_graph(pkg)
    assert graph["fake.c"] == {"fake.sub.b", "fake.a"}
    assert cycles(graph) == [["fake.a", "fake.sub.b", "fake.a"]]
    (pkg / "sub" / "b.py").write_text("def f():\n    return 1\n")
    assert cycles(import_graph(pkg)) == []


# Notes kept beside the repository while it was written, which it does not hold (a research/ note the repository
# does hold is fine).
OUTSIDE = re.compile(r"\.\./shared|DESIGN\.md|STYLE\.md|research/[\w.-]+\.md")


def test_nothing_shipped_points_outside_the_repository():
    files = [ROOT / "README.md", *(p for p in sorted((ROOT / "src").rglob("*")) if p.is_file())]
    hits = []
    for path in files:
        if path.suffix in (".safetensors", ".so", ".pyc"):
            continue
        text = path.read_text(errors="replace")
        for m in OUTSIDE.finditer(text):
            if not (m.group(0).startswith("research/") and (ROOT / m.group(0)).is_file()):
                hits.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert not hits, "\n".join(hits)


def test_the_pointer_check_knows_the_notes():
    for text in ("../shared/notes", "DESIGN.md section 2", "see STYLE.md", "(research/drivelm.md section 8)"):
        assert OUTSIDE.search(text), text
    assert not OUTSIDE.search("research/cue_probe.py and README.md")
