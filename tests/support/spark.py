"""A small local Spark session for tests: 2 cores, few shuffle partitions, no UI."""

from __future__ import annotations

import os
import sys


def local_spark(app: str = "spillway-tests", cores: int = 2):
    from pyspark.sql import SparkSession

    # Executors must run the same interpreter (and so see the same installed packages).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    return (
        SparkSession.builder.master(f"local[{cores}]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        # started before pytest captures output (conftest): no progress bars in the test log
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.driver.memory", "1g")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.python.worker.reuse", "true")
        .getOrCreate()
    )
