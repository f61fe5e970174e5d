"""Fixtures of the platform recipe tests: the bundle an operator would upload, built once per
test run (the checks every platform shares are in tests/support/recipes.py)."""

from __future__ import annotations

import fcntl
import os
import shutil

import pytest
from support.recipes import build_bundle


@pytest.fixture(scope="session")
def bundle(tmp_path_factory):
    """Built once per test run: under pytest-xdist the workers share the run's temporary
    directory (each worker's is below it), and the first to get there builds it."""
    if os.geteuid() != 0:
        pytest.skip("the platform recipes run as root, as their platforms run them")
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = shared / "deploy-bundle"
    with open(shared / "deploy-bundle.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".complete").exists():
            shutil.rmtree(out, ignore_errors=True)
            build_bundle(out)
            (out / ".complete").touch()
    return out
