"""docs/ARCHITECTURE.md matches the tree: every source module has its row (a newcomer finds its
room), and every module a row names exists."""

from __future__ import annotations

import re
from pathlib import Path
from support import paths

ROOT = paths.ROOT
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = {
    "spillway.client": ROOT / "client/src/spillway/client",
    "spillway.sidecar": ROOT / "sidecar/src/spillway/sidecar",
    "spillway.spark": ROOT / "spark_integration/src/spillway/spark",
}


def _sections() -> dict[str, str]:
    """Each `## / ###` section's text, by the package its heading names in backticks."""
    out: dict[str, str] = {}
    for part in re.split(r"^#{2,3} ", DOC.read_text(encoding="utf-8"), flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        m = re.match(r"`(spillway\.[a-z_.]+)`", heading)
        if m:
            out[m.group(1)] = body
    return out


def _named(body: str) -> set[str]:
    """Module files a section's table rows name (`x.py`, `sub/x.py`; `a.py`, `b.py` in a row)."""
    rows = [line for line in body.splitlines() if line.startswith("| `")]
    return {m for row in rows for m in re.findall(r"`([a-z_/]+\.py)`", row.split("|")[1])}


def _modules(folder: Path) -> set[str]:
    """A package's own modules (its subpackages have sections of their own)."""
    return {p.name for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}


def test_every_module_has_a_row_and_every_row_a_module():
    sections = _sections()
    expected = {name: _modules(path) for name, path in PACKAGES.items()}
    sidecar = PACKAGES["spillway.sidecar"]
    for sub in sorted(p.parent for p in sidecar.glob("*/__init__.py")):
        expected[f"spillway.sidecar.{sub.name}"] = _modules(sub)
    for package, modules in expected.items():
        assert package in sections, f"docs/ARCHITECTURE.md has no section for {package}"
        named = _named(sections[package])
        assert not modules - named, f"{package}: no row for {sorted(modules - named)}"
        assert not named - modules, f"{package}: rows for missing modules {sorted(named - modules)}"


def test_the_readme_points_to_it():
    assert "(docs/ARCHITECTURE.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_failing_record_walk_names_files_that_exist():
    """The walk of one failing record names real files (`pkg/module.py`, under a package)."""
    text = DOC.read_text(encoding="utf-8")
    walk = text.split("## One failing record, end to end", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+/[a-z_]+\.py)`", walk))
    assert len(named) > 20, "the walk names the files it goes through"
    roots = {"spark": PACKAGES["spillway.spark"], "client": PACKAGES["spillway.client"]}
    sidecar = PACKAGES["spillway.sidecar"]
    missing = [n for n in sorted(named)
               if not ((roots[n.split("/")[0]] / n.split("/", 1)[1]) if n.split("/")[0] in roots
                       else (sidecar / n)).exists()]
    assert not missing, f"docs/ARCHITECTURE.md's walk names missing files: {missing}"
