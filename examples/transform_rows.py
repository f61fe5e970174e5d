"""Stage TRANSFORMATION: a per-row function over Kafka-shaped records with `Job.map_partitions`.

A transient failure (a marker exception) is retried per the job's policy; a poison record is
skipped and, with a DLQ topic configured, dead-lettered with its original bytes and headers.

    spillway serve --listen 127.0.0.1:50051 &        # the node's sidecar
    python examples/transform_rows.py
"""

from __future__ import annotations

import json

from spillway.spark import KAFKA_SOURCE_SCHEMA, Job, RetriableError

_calls: dict[int, int] = {}


def parse(row):
    order = json.loads(row.value)  # poison: json.JSONDecodeError -> data error, skipped
    if order.get("flaky") and _calls.setdefault(order["id"], 0) < 1:
        _calls[order["id"]] += 1
        raise RetriableError("price service busy")  # retried after the sidecar's delay
    return (order["id"], float(order["amount"]))


def rows(n: int = 20):
    import datetime

    ts = datetime.datetime(2026, 1, 1)
    out = []
    for i in range(n):
        value = b"{oops" if i == 13 else json.dumps(
            {"id": i, "amount": i * 1.5, "flaky": i == 7}).encode()
        out.append((f"k{i}".encode(), value, "orders", 0, i, ts, 0, [("source", b"example")]))
    return out


def run(spark, job: Job):
    df = spark.createDataFrame(rows(), KAFKA_SOURCE_SCHEMA)
    return job.map_partitions(df, parse, schema="id int, amount double")


if __name__ == "__main__":
    import os
    import sys

    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = SparkSession.builder.master("local[2]").getOrCreate()
    with Job("example-transform", {        # registers the run; ends it when the block is done
        "errors.tolerance": "all",           # skip poison records instead of failing
        "errors.retry.timeout": "30000",     # retry retriable failures for up to 30 s
        "errors.log.enable": "true",
        # "errors.deadletterqueue.topic.name": "dlq.orders",   # with a Kafka-backed sidecar
    }) as job:
        print(sorted(run(spark, job).collect()))
        print(job.summary())
