"""A short client program with one spillway job that fails on some records, run in its own
process by tests/integration/spark/test_token_not_in_logs.py: on classic Spark (under spark-submit,
so Spark logs as it does for an application: INFO) or as a Spark Connect client, which also
runs a streaming query (its executors claim the run's escrowed token).

    python token_job.py classic|connect SPARK_CONNECT_URL|- SIDECAR TOPIC OUT_DIR

It writes to OUT_DIR: ``token`` (the run's job token, 0600: what the test searches the logs
for; never printed) and ``result.json`` (the counts, and how often the token occurs in what it
shipped to Spark: the pickled functions on classic Spark, the serialized plans on Spark
Connect). A Connect client ends its session with an execution still open, so the server logs
that execution's plan (the issue's scenario)."""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path


def parse(row):
    return (row.id, int(row.v))


def parse_tuple(t):
    return (t[0], int(t[1]))


def flaky_enrich(pdf):
    bad = pdf["value"] % 10 == 3
    if bad.any():
        raise ValueError(f"cannot enrich {sorted(int(v) for v in pdf['value'][bad])}")
    return pdf.assign(twice=pdf["value"] * 2)[["value", "twice"]]


def stream(spark, job, seconds: float = 120.0) -> tuple[int, bytes]:
    """A rate stream through job.map_in_pandas into a memory sink over Spark Connect, run until
    it reported failures: its micro-batches read no session file, so its executors claim the
    run's escrowed token. Returns the failures it reported and its serialized plan."""
    import time

    before = job.summary().total_record_failures
    source = (spark.readStream.format("rate").option("rowsPerSecond", 20)
              .option("numPartitions", 2).load())
    enriched = job.map_in_pandas(source, flaky_enrich, "value long, twice long")
    plan = enriched._plan.to_proto(spark.client).SerializeToString()
    query = (enriched.writeStream.format("memory").queryName(f"q{uuid.uuid4().hex[:8]}")
             .trigger(processingTime="1 second").start())
    try:
        deadline = time.monotonic() + seconds
        while job.summary().total_record_failures - before < 4 and time.monotonic() < deadline:
            if query.exception() is not None:
                raise RuntimeError(f"the stream failed: {query.exception()}")
            time.sleep(0.5)
    finally:
        query.stop()
    return job.summary().total_record_failures - before, plan


def main(mode: str, url: str, sidecar: str, topic: str, out: Path) -> None:
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession
    from spillway.spark import Job

    if mode == "classic":
        spark = SparkSession.builder.getOrCreate()
    else:
        spark = SparkSession.builder.remote(url).getOrCreate()
    job = Job(f"token-{uuid.uuid4().hex[:8]}", {
        "errors.tolerance": "all",
        "errors.deadletterqueue.topic.name": topic,
        "errors.deadletterqueue.auto.create.topics.enable": "true",
        "errors.deadletterqueue.topic.replication.factor": "1"}, sidecar=sidecar)
    job.register()
    token = job.registration.job_token.reveal()
    fd = os.open(out / "token", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)

    rows = [(i, "bad" if i % 10 == 3 else str(i)) for i in range(30)]   # 3 failures
    df = spark.createDataFrame(rows, "id int, v string").repartition(3)
    parsed = job.map_partitions(df, parse, schema="id int, n int")
    to_int = job.udf("int")(int)
    with_udf = df.select("id", to_int("v").alias("n"))
    result = {"parsed": parsed.count(),
              "udf_nulls": with_udf.filter("n is null").count()}
    if mode == "classic":
        out_rdd = job.map_partitions(df.rdd.map(tuple), parse_tuple)
        result["rdd"] = out_rdd.count()
        shipped = [cloudpickle.dumps(out_rdd.func), cloudpickle.dumps(to_int.func)]
    else:
        shipped = [frame._plan.to_proto(spark.client).SerializeToString()
                   for frame in (parsed, with_udf)]
    result["shipped"] = len(shipped)
    result["token_in_shipped"] = sum(b.count(token.encode()) for b in shipped)
    summary = job.summary()
    result.update(failures=summary.total_record_failures, skipped=summary.total_records_skipped,
                  dlq=summary.dlq_records_written, processed=summary.records_processed)
    if mode == "connect":
        result["stream_failures"], plan = stream(spark, job)
        shipped.append(plan)
        result["shipped"] = len(shipped)
        result["token_in_shipped"] = sum(b.count(token.encode()) for b in shipped)
    job.close()
    if mode == "connect":
        rows_left = parsed.toLocalIterator()   # an execution the client never releases
        result["first"] = next(rows_left) is not None
    (out / "result.json").write_text(json.dumps(result))
    spark.stop()


if __name__ == "__main__":
    mode, url, sidecar_address, dlq_topic, out_dir = sys.argv[1:6]
    main(mode, url, sidecar_address, dlq_topic, Path(out_dir))
