"""Spark plumbing for the targets: shipping the workload module to workers, per-variant executor
environments, the Python worker processes (for profiles and their CPU) and timing an action."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping

from .. import proctree
from ..infra import child_pids, cmdline, descendants

_registered = False


def ship_workloads() -> None:
    """Pickle bench's workload functions by value: Spark's workers need not import ``bench``."""
    global _registered
    if _registered:
        return
    from pyspark import cloudpickle

    from .. import peers, records, workloads

    cloudpickle.register_pickle_by_value(workloads)
    cloudpickle.register_pickle_by_value(peers)
    cloudpickle.register_pickle_by_value(records)
    _registered = True


@contextlib.contextmanager
def executor_env(spark, env: Mapping[str, str]) -> Iterator[None]:
    """Python functions wrapped inside this block run in workers with ``env`` set.

    PySpark copies ``SparkContext.environment`` into every Python function when the plan is
    built, and keeps one worker daemon per distinct environment, so variants with different
    environments never share a worker process (nor a process-wide tracer provider).
    """
    sc = spark.sparkContext
    saved = dict(sc.environment)
    sc.environment.update(env)
    try:
        yield
    finally:
        sc.environment.clear()
        sc.environment.update(saved)


def python_daemons() -> list[int]:
    """PySpark worker daemons started by this driver's JVM, without the workers they forked
    (which carry the same command line): profile them with py-spy --subprocesses."""
    ours = [p for p in descendants(os.getpid()) if "pyspark.daemon" in cmdline(p)]
    forked = {c for p in ours for c in child_pids(p)}
    return [p for p in ours if p not in forked]


class WorkerCpu:
    """CPU seconds this driver's PySpark workers use from now on: every daemon's tree, its
    forked workers live or exited (`proctree.TreeCpu`: a daemon ignores SIGCHLD, so an exited
    worker's CPU is in no counter that a reading at the end would find)."""

    def __init__(self) -> None:
        self._tree = proctree.TreeCpu(python_daemons).start()

    def used(self) -> float:
        return self._tree.stop()


def timed_workers(action: Callable[[], object]) -> tuple[float, float]:
    """The action's wall seconds, and the CPU seconds this driver's PySpark workers used over
    it (`WorkerCpu`)."""
    workers = WorkerCpu()
    seconds = timed(action)
    return seconds, workers.used()


def timed(action: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    action()
    return time.perf_counter() - t0
