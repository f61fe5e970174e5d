"""The DLQ as a DataFrame: the top failure causes of a job, with `spillway.spark.read_dlq`.

Reads the DLQ topic from the executors with confluent-kafka (no Spark Kafka connector jar),
one Spark partition per Kafka partition, and groups the dead letters by stage, exception class
and message: what to fix first.

    spillway serve --listen 127.0.0.1:50051 --bootstrap-servers localhost:9092 &
    python examples/dlq_top_causes.py localhost:9092 dlq.orders [job] [since]
"""

from __future__ import annotations

from pyspark.sql import functions as F

from spillway.spark import read_dlq


def top_causes(spark, topic: str, bootstrap_servers: str, *, job: str | None = None,
               since=None, limit: int = 10):
    """The `limit` most frequent (stage, exception class, message) of the DLQ topic, with how
    many records, how many distinct source partitions, and the first and last time seen."""
    dlq = read_dlq(spark, topic, bootstrap_servers=bootstrap_servers, job=job, since=since)
    return (dlq.groupBy("stage", "exception_class", "exception_message")
            .agg(F.count("*").alias("records"),
                 F.countDistinct("source_topic", "source_partition").alias("partitions"),
                 F.min("dead_lettered_at").alias("first_seen"),
                 F.max("dead_lettered_at").alias("last_seen"))
            .orderBy(F.desc("records"), "stage", "exception_class", "exception_message")
            .limit(limit))


if __name__ == "__main__":
    import os
    import sys

    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    bootstrap, topic = sys.argv[1], sys.argv[2]
    job = sys.argv[3] if len(sys.argv) > 3 else None
    since = sys.argv[4] if len(sys.argv) > 4 else None
    spark = SparkSession.builder.master("local[2]").getOrCreate()
    top_causes(spark, topic, bootstrap, job=job, since=since).show(truncate=60)
