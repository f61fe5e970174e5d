"""A Spark session's files off Spark, for tests that run a wrapper's executor-side function in
the test process (stand-in DataFrames): what the driver ships (`_token.SessionFiles`) lands in
a directory that pyspark's ``SparkFiles`` reads as a Python worker's root, as on an executor."""

from __future__ import annotations

import shutil
from pathlib import Path


class LocalSparkFiles:
    """`spillway.spark._token.SessionFiles` over a directory: `add` copies the file there."""

    keep_local = False

    def __init__(self, root: Path, key: str = "local:test") -> None:
        self.root = Path(root)
        self.key = key
        self.added: list[str] = []

    def add(self, path: str) -> None:
        self.added.append(Path(path).name)
        shutil.copyfile(path, self.root / Path(path).name)


def as_executor_files(monkeypatch, root: Path) -> None:
    """Make pyspark's ``SparkFiles`` answer as in a Python worker whose task files are in
    ``root`` (what pyspark's worker sets before it runs a task)."""
    from pyspark import SparkFiles

    monkeypatch.setattr(SparkFiles, "_root_directory", str(root))
    monkeypatch.setattr(SparkFiles, "_is_running_on_worker", True)


def ship_to(monkeypatch, root: Path) -> LocalSparkFiles:
    """Every wrapper of `spillway.spark.job` ships the run's token to ``root``, which this
    process then reads as its task files."""
    from spillway.spark import _ship

    files = LocalSparkFiles(root)
    monkeypatch.setattr(_ship, "session_files", lambda data: files)
    as_executor_files(monkeypatch, root)
    return files
