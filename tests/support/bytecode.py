"""Bytecode for the repository's own Python, written once before the suite starts.

The machines the suite runs on may set PYTHONDONTWRITEBYTECODE. Then every process the suite
starts (each `spillway serve`, CLI call, demo, Spark Python worker) compiles every spillway
module it imports from source, every time: a CLI call that refuses a bad flag took 1.4 CPU s
instead of 1.0, tests/e2e/test_cli.py 36 CPU s instead of 24 (2026-12-07). Not writing
bytecode does not stop reading it: the processes use the caches written here. A source changed
afterwards is compiled in memory as usual (a cache records its source's mtime and size), so a
stale cache costs time, never correctness.
"""

from __future__ import annotations

import compileall

from support.paths import ROOT

TREES = ("client/src", "sidecar/src", "spark_integration/src", "tests", "examples")


def precompile() -> None:
    for tree in TREES:
        compileall.compile_dir(ROOT / tree, quiet=2)
