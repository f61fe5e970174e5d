"""A small local Spark session for tests: 2 cores, few shuffle partitions, no UI, loopback only."""

from __future__ import annotations

import os
import sys

LOOPBACK = "127.0.0.1"


def pin_loopback(env: dict | None = None) -> dict:
    """Spark on loopback only: with a host name that resolves to 127.0.0.1 Spark picks the
    machine's interface address for its driver ("using 192.0.2.2 instead"). ``env`` (default:
    this process's environment, which Spark's JVMs and executors inherit) gets SPARK_LOCAL_IP."""
    target = os.environ if env is None else env
    target["SPARK_LOCAL_IP"] = LOOPBACK
    return target


# Every JVM the suite starts (local Spark, the standalone cluster's master, workers, drivers and
# executors, the demo and compat jobs) is short-lived and handles little data: the client JIT
# only (no C2 compiler threads) and the serial collector halve the CPU a JVM spends starting
# (measured: a local session started and two small jobs, 22-28 -> 13-14 CPU s), which on two
# cores is wall time for every other test. Not verifying the bytecode of the jars' classes (the
# JDK's own never are) takes another tenth (23.3 -> 20.5 CPU s, 2026-12-07): the jars are the
# ones pip installed, and a test JVM loads some 16,000 classes from them. JAVA_TOOL_OPTIONS
# reaches them all through the environment; one set already is left alone. Each JVM notes it
# on stderr ("Picked up ...").
TEST_JVM_OPTIONS = ("-XX:TieredStopAtLevel=1 -XX:+UseSerialGC "
                    "-XX:+UnlockDiagnosticVMOptions -XX:-BytecodeVerificationRemote")


def quick_jvms(env: dict | None = None) -> dict:
    target = os.environ if env is None else env
    target.setdefault("JAVA_TOOL_OPTIONS", TEST_JVM_OPTIONS)
    return target


def local_spark(app: str = "spillway-tests", cores: int = 2):
    from pyspark.sql import SparkSession

    # Executors must run the same interpreter (and so see the same installed packages).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    pin_loopback()
    return (
        SparkSession.builder.master(f"local[{cores}]")
        .appName(app)
        .config("spark.driver.host", LOOPBACK)
        .config("spark.driver.bindAddress", LOOPBACK)
        .config("spark.ui.enabled", "false")
        # started before pytest captures output (conftest): no progress bars in the test log
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.driver.memory", "1g")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.python.worker.reuse", "true")
        .getOrCreate()
    )


def load_example(name: str):
    """examples/<name>.py as a module, pickled by value: Spark's workers cannot import
    examples/."""
    import importlib.util

    from pyspark import cloudpickle

    from support.paths import EXAMPLES

    spec = importlib.util.spec_from_file_location(f"spillway_example_{name}",
                                                  EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module


class FakeTaskContext:
    """Spark's TaskContext as an executor's wrappers read it: ``get()`` answers the class
    attribute ``_taskContext`` (pyspark's layout: a UDF reads it per row). Set it with
    ``monkeypatch.setattr`` so that it is undone after the test."""

    _taskContext = None

    def __init__(self, tid, partition=0):
        self.tid, self.partition = tid, partition

    @classmethod
    def get(cls):
        return cls._taskContext

    def taskAttemptId(self):
        return self.tid

    def stageId(self):
        return 1

    def partitionId(self):
        return self.partition

    def attemptNumber(self):
        return 0

    def getLocalProperty(self, key):
        return None
