"""Records that kill or hang their Python worker become dead letters (crash and timeout).

A native library fed a corrupt payload segfaults the Python worker (``ctypes.string_at(0)``
stands in for it here), and a record sends a regular expression into backtracking that would
outlast the job, inside C code no Python ``try`` or thread can stop. Neither raises. Without
spillway, Spark retries the task until it gives up ("Python worker exited unexpectedly
(crashed)"), or the task never ends. With it, Spark's retry of the task runs its records
guarded, and each becomes a failed record of its stage: category ``crash`` (the message says
``killed by signal 11 (SIGSEGV)``) or, past ``errors.record.timeout.ms``, ``timeout``, decided
by the policy: skipped and dead-lettered here, while every other record comes out once.

It needs Spark's task retries: on a cluster they are on by default (``spark.task.maxFailures``
= 4); locally use ``local[N,4]``, as below (plain ``local[N]`` does not retry a task).
See docs/POLICY.md, "When a record kills or hangs its worker".

    spillway serve --listen 127.0.0.1:50051 &        # the node's sidecar
    python examples/crash_isolation.py
"""

from __future__ import annotations

import ctypes
import re

from spillway.spark import KAFKA_SOURCE_SCHEMA, Job

_GREEDY = re.compile(r"(a+)+$")   # backtracks for ages on "aaaa...ab"


def parse(row):
    text = row.value.decode("latin-1")
    if text.startswith("\x00"):
        ctypes.string_at(0)           # the C library chokes on this payload: SIGSEGV
    if text.startswith("a"):
        _GREEDY.match(text)           # holds the GIL, uninterruptible: stopped past the limit
    return (row.offset, len(text))


def rows(n: int = 20):
    out = []
    for i in range(n):
        value = (b"\x00corrupt" if i == 5 else b"a" * 48 + b"b" if i == 11
                 else f"order-{i}".encode())
        out.append((f"k{i}".encode(), value, "orders", 0, i, None, 0, []))
    return out


def run(spark, job: Job):
    df = spark.createDataFrame(rows(), KAFKA_SOURCE_SCHEMA).repartition(2)
    return job.map_partitions(df, parse, schema="offset long, length int")


if __name__ == "__main__":
    import os
    import sys

    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = SparkSession.builder.master("local[2,4]").getOrCreate()   # 4 attempts per task
    with Job("example-crash", {
        "errors.tolerance": "all",               # skip what fails, crashes and hangs included
        "errors.record.timeout.ms": "5000",      # a record running longer is stopped
        "errors.log.enable": "true",
        # "errors.deadletterqueue.topic.name": "dlq.orders",   # with a Kafka-backed sidecar
    }) as job:
        print(sorted(run(spark, job).collect()))
    print(job.report.by_category)                # {'crash': 1, 'timeout': 1}
