"""`ruff check` over the repository with the rules pyproject.toml names ([tool.ruff]: pyflakes,
pycodestyle errors, lines of at most 100 characters; generated code excluded), so that `make
test` runs the linter. ruff is pinned in requirements/dev.txt and runs from the same venv."""

from __future__ import annotations

import subprocess
import sys

from support import paths

ROOT = paths.ROOT


def test_ruff_check_passes_with_the_configured_rules():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                           "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert "No module named ruff" not in proc.stderr, (
        "ruff is not installed in this venv: it is pinned in requirements/dev.txt (make venv)")
    assert proc.returncode == 0, f"ruff check found problems:\n{proc.stdout}{proc.stderr}"
