"""No import circles between the project's modules (beside test_packaging's purity checks).

A circle means neither module can be read, tested or moved without the other. The graph is built
with `ast` from client/src, sidecar/src and spark_integration/src (the generated code in
client/src/spillway/v1 aside, which imports only itself):
- imports inside functions count: a deferred import hides a circle from the interpreter, not
  from a reader, who still has to know both modules to change either;
- imports under ``if TYPE_CHECKING:`` count too: they run never, but a module that names
  another's type for its annotations cannot be read without it, and one that imports it back
  that way is one module in two files;
- a package's ``__init__`` importing its own submodules (to re-export them) is not an edge:
  otherwise every submodule that imports a sibling through the package would close a circle
  with it, and, worse, a real circle between two submodules would hide inside the package's.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support import paths

ROOT = paths.ROOT
SOURCES = ("client/src", "sidecar/src", "spark_integration/src")
GENERATED = ROOT / "client" / "src" / "spillway" / "v1"

# Circles known and owned by a follow-up, each as the set of its modules. Shrinks only: a new
# circle fails the test, and so does an entry here that is no longer a circle.
# (spark job <-> _native was one until spark/job.py was split, issue 22.)
KNOWN: dict[frozenset[str], str] = {}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for src in SOURCES:
        base = ROOT / src
        for path in sorted(base.rglob("*.py")):
            if GENERATED in path.parents:
                continue
            name = ".".join(path.relative_to(base).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imported(tree: ast.Module, name: str, is_package: bool) -> set[str]:
    """Dotted names `tree` imports, at run time or under TYPE_CHECKING (absolute; `from x import
    y` yields x and x.y)."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_package = path.name == "__init__.py"
        for target in _imported(tree, name, is_package):
            while target and target not in mods:  # `from pkg.mod import func` -> pkg.mod
                target = target.rpartition(".")[0]
            if not target or target == name:
                continue
            if is_package and target.startswith(name + "."):  # re-exporting its own
                continue
            edges[name].add(target)
    return edges


def _circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(frozenset(comp))
    return out


def _circles_found() -> list[frozenset[str]]:
    return _circles(_graph())


def test_the_graph_sees_the_project_and_its_imports():
    edges = _graph()
    assert "spillway.sidecar.runtime.bootstrap" in edges and "spillway.spark" in edges
    assert not any(m.startswith("spillway.v1") for m in edges)  # generated code aside
    assert "spillway.sidecar.service.sidecar" in edges["spillway.sidecar.runtime.bootstrap"]
    # TYPE_CHECKING imports count: bootstrap names processes' ProcessRole only for annotations
    assert "spillway.sidecar.runtime.processes" in edges["spillway.sidecar.runtime.bootstrap"]
    # a package's __init__ re-exporting its submodules is no edge
    assert not any(m.startswith("spillway.sidecar.dlq.") for m in edges["spillway.sidecar.dlq"])


def test_the_circle_finder_finds_a_circle_through_a_deferred_import():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"d"}}
    assert _circles(edges) == [frozenset({"a", "b", "c"})]
    tree = ast.parse("def f():\n    from . import c\nif TYPE_CHECKING:\n    from . import d\n")
    assert _imported(tree, "pkg.a", False) == {"pkg", "pkg.c", "pkg.d"}


def test_no_import_circle_between_the_projects_modules():
    found = _circles_found()
    unknown = [sorted(c) for c in found if c not in KNOWN]
    assert not unknown, f"import circles: {unknown} (move the shared part to a module both import)"


def test_every_known_circle_is_still_one():
    found = set(_circles_found())
    gone = [sorted(c) for c in KNOWN if c not in found]
    assert not gone, f"no longer circles, remove them from KNOWN: {gone}"
