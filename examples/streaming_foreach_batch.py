"""Structured Streaming: `Job.map_in_pandas` on a stream and `Job.foreach_batch` as its sink.

Each micro-batch commits only after its tasks passed their flush barrier, i.e. after every
record it dead-lettered is acknowledged by Kafka. Record ids carry the micro-batch id.

    python examples/streaming_foreach_batch.py   # with a sidecar at $SPILLWAY_SIDECAR_ADDRESS
"""

from __future__ import annotations

from spillway.spark import Job


def enrich(pdf):
    if (pdf["value"] % 10 == 3).any():
        raise ValueError("values ending in 3 are poison")
    return pdf.assign(double=pdf["value"] * 2)[["value", "double"]]


def start(spark, job: Job, write, checkpoint: str):
    """Start the query; `write(rows, batch_id)` is called per chunk of each micro-batch."""
    stream = (spark.readStream.format("rate").option("rowsPerSecond", 20)
              .option("numPartitions", 2).load())
    enriched = job.map_in_pandas(stream.select("value"), enrich, "value long, double long")
    return (enriched.writeStream.foreachBatch(job.foreach_batch(write))
            .option("checkpointLocation", checkpoint)
            .trigger(processingTime="1 second").start())


if __name__ == "__main__":
    import os
    import sys
    import tempfile
    import time

    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = SparkSession.builder.master("local[2]").getOrCreate()
    def write(rows, batch_id):
        print(f"batch {batch_id}: {len(rows)} rows")

    # `with`: the run is registered, and ended at its sidecar(s) once the query has stopped
    with Job("example-streaming", {"errors.tolerance": "all"}) as job, \
            tempfile.TemporaryDirectory() as checkpoint:
        query = start(spark, job, write, checkpoint)
        time.sleep(10)
        query.stop()
        print(job.summary())
