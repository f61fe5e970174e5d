"""Where the repository is, for tests that read its files (docs, deploy/, examples/, bench/):
one place, so a test module's depth under tests/ does not matter."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DOCS = ROOT / "docs"
