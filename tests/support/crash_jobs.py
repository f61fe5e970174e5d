"""Jobs whose records kill or hang their Python worker, run as a Spark driver of its own.

Spark retries a task only with ``spark.task.maxFailures`` above 1, which ``local[N]`` (the test
session's master) does not have; ``local[2,4]`` does (4 attempts, Spark's cluster default), and
one process can hold one SparkContext. So tests/integration/spark/test_spark_crash.py runs this
file as its own process:

    python crash_jobs.py SIDECAR_ADDRESS METRICS_URL TOPIC_PREFIX SCENARIO...

and reads one JSON line per scenario from its stdout: what came out, the job's report (or the
message of the error that failed it), and the sidecar's ``spillway_record_errors_total`` for
the run read from METRICS_URL before the run ended. Each scenario is one `Job` (its own run,
its own DLQ topic ``<TOPIC_PREFIX>.<scenario>``).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
import uuid

from pyspark.sql import SparkSession

LOOPBACK = "127.0.0.1"
TIMEOUT_MS = 1500


def segfault() -> None:
    ctypes.string_at(0)   # reads address 0: SIGSEGV, as a C library fed a corrupt payload


def exits() -> None:
    os._exit(3)


def hangs() -> None:
    time.sleep(600)


def backtracks() -> None:
    # a regular expression that backtracks for ages, in C code holding the GIL
    re.match(r"(a+)+$", "a" * 64 + "b")


KILLERS = {"segfault": segfault, "exit": exits, "hang": hangs, "backtrack": backtracks}
FLAKY_DIR = tempfile.mkdtemp(prefix="spillway-flaky-")


def step(plan: dict[int, str]):
    """``fn(x) -> x * 10``, except for the records ``plan`` names: a killer, ``bad`` (a
    ValueError: a data error) or ``flaky`` (a ConnectionError the first two times it runs,
    in any process, then fine: a retriable failure, retried even in a guarded attempt, where
    a failure in the helper runs again in the worker)."""
    def fn(x):
        what = plan.get(int(x))
        if what in KILLERS:
            KILLERS[what]()
        elif what == "bad":
            raise ValueError(f"bad record {x}")
        elif what == "flaky":
            with open(os.path.join(FLAKY_DIR, str(x)), "a+") as f:
                f.write(".")
                f.seek(0)
                if len(f.read()) <= 2:
                    raise ConnectionError(f"lookup for {x} refused")
        return int(x) * 10
    return fn


def policy(topic: str | None, **extra: str) -> dict[str, str]:
    props = {"errors.tolerance": "all", **extra}
    if topic:
        props.update({
            "errors.deadletterqueue.topic.name": topic,
            "errors.deadletterqueue.context.headers.enable": "true",
            "errors.deadletterqueue.auto.create.topics.enable": "true",
            "errors.deadletterqueue.topic.replication.factor": "1"})
    return props


# --- the scenarios: (spark, job) -> sorted outputs -----------------------------------------------

def rows_rdd(plan, partitions=2, n=40):
    def run(spark, job):
        rdd = spark.sparkContext.parallelize(range(n), partitions)
        return sorted(job.map_partitions(rdd, step(plan)).collect())
    return run


def rows_frame(plan, n=40):
    def run(spark, job):
        df = spark.range(n).repartition(2)
        fn = step(plan)
        out = job.map_partitions(df, lambda row: (fn(row.id),), schema="v long")
        return sorted(r.v for r in out.collect())
    return run


def udf(plan, n=40):
    def run(spark, job):
        f = job.udf("long", error_column=True)(step(plan))
        rows = spark.range(n).repartition(2).select(f("id").alias("o")).collect()
        return sorted(r.o.value for r in rows if r.o.error is None)
    return run


def arrow(plan, n=40):
    """map_in_arrow: a batch with a killer kills its helper; bisection finds the record."""
    def run(spark, job):
        fn = step(plan)

        def batch(b):
            import pyarrow as pa

            return pa.RecordBatch.from_pydict({"v": [fn(x) for x in b.column("id").to_pylist()]})
        out = job.map_in_arrow(spark.range(n).repartition(2), batch, "v long")
        return sorted(r.v for r in out.collect())
    return run


def sink(plan, n=40):
    """foreach_partition: each chunk written to a file; what was written, once per record."""
    written = tempfile.mkdtemp(prefix="spillway-written-")

    def run(spark, job):
        fn = step(plan)

        def write(rows):
            values = [fn(r.id) for r in rows]
            with open(os.path.join(written, uuid.uuid4().hex), "w") as f:
                f.write(json.dumps(values))
        job.foreach_partition(spark.range(n).repartition(2), write, batch_size=8)
        seen = set()
        for name in os.listdir(written):
            with open(os.path.join(written, name)) as f:
                seen.update(json.load(f))
        return sorted(seen)
    return run


def deserialize(plan, n=40):
    """deserialize(value=fn) over Kafka-shaped rows: the killer's original bytes are kept."""
    def run(spark, job):
        from spillway.spark import KAFKA_SOURCE_SCHEMA

        fn = step(plan)
        rows = [(f"k{i}".encode(), str(i).encode(), "orders", 0, i, None, 0, [])
                for i in range(n)]
        df = spark.createDataFrame(rows, KAFKA_SOURCE_SCHEMA).repartition(2)
        out = job.deserialize(df, value=lambda v: fn(int(v)), value_type="long")
        return sorted(r.parsed_value for r in out.collect())
    return run


def example(name: str):
    """examples/<name>.py's ``run(spark, job)``, as its users run it."""
    def run(spark, job):
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from support.spark import load_example

        return sorted(tuple(r) for r in load_example(name).run(spark, job).collect())
    return run


SCENARIOS = {
    # name: (the run, its policy beyond errors.tolerance=all, with a DLQ topic)
    "rows-segfault": (rows_rdd({7: "segfault"}), {}, True),
    "frame-exit": (rows_frame({13: "exit"}), {}, True),
    "udf-segfault": (udf({7: "segfault"}), {}, True),
    "rows-hang": (rows_rdd({5: "hang"}), {"errors.record.timeout.ms": str(TIMEOUT_MS)}, True),
    "udf-backtrack": (udf({9: "backtrack"}), {"errors.record.timeout.ms": str(TIMEOUT_MS)},
                      True),
    "two-killers": (rows_rdd({3: "segfault", 8: "exit"}, partitions=1, n=20), {}, True),
    "mixed": (rows_rdd({4: "bad", 6: "flaky", 9: "segfault", 11: "bad", 15: "flaky"},
                       partitions=1, n=20), {"errors.retry.max.retries": "3"}, True),
    "arrow-segfault": (arrow({7: "segfault"}), {}, True),
    "sink-exit": (sink({13: "exit"}), {}, True),
    "deserialize-segfault": (deserialize({21: "segfault"}), {}, True),
    "example": (example("crash_isolation"), {"errors.record.timeout.ms": str(TIMEOUT_MS)},
                True),
    "none-segfault": (rows_rdd({7: "segfault"}), {"errors.tolerance": "none"}, False),
    "limit-crashes": (rows_rdd({3: "segfault", 23: "segfault"}),
                      {"errors.tolerance.max.errors": "1"}, False),
}


def report_of(job) -> dict:
    r = job.report
    return {"failed": r.failed, "by_category": r.by_category,
            "by_exception_class": r.by_exception_class,
            "records_processed": r.records_processed,
            "total_record_errors": r.total_record_errors,
            "total_records_skipped": r.total_records_skipped,
            "dlq_records_written": r.dlq_records_written, "run_id": r.run_id}


def record_errors(metrics_url: str, run_id: str) -> float:
    """The run's ``spillway_record_errors_total``, summed over its stages."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("spillway_record_errors_total{") and f'run="{run_id}"' in line)


def main(address: str, metrics_url: str, prefix: str, names: list[str]) -> None:
    from spillway.spark import Job

    spark = (SparkSession.builder.master("local[2,4]").appName("spillway-crash-tests")
             .config("spark.driver.host", LOOPBACK).config("spark.driver.bindAddress", LOOPBACK)
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.python.worker.reuse", "true").getOrCreate())
    spark.sparkContext.setLogLevel("FATAL")  # the crashed attempts are expected here
    try:
        for name in names:
            run, extra, dlq = SCENARIOS[name]
            topic = f"{prefix}.{name}" if dlq else None
            job = Job(f"crash-{name}", policy(topic, **extra), sidecar=address,
                      run_id=f"{name}-{uuid.uuid4().hex[:8]}")
            out, error, started = None, None, time.monotonic()
            with job:
                try:
                    out = run(spark, job)
                except Exception as exc:  # noqa: BLE001 - the scenario's outcome
                    error = Job.failure_message(exc)
                metric = record_errors(metrics_url, job.run_id)
            print(json.dumps({"name": name, "out": out, "error": error, "topic": topic,
                              "seconds": round(time.monotonic() - started, 1),
                              "record_errors_metric": metric, "report": report_of(job)}),
                  flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
