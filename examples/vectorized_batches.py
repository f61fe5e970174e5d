"""Stage TRANSFORMATION, vectorized: `Job.map_in_pandas` and `Job.map_in_arrow`.

The function runs on whole Arrow batches; only when it raises is the batch bisected to find the
failing rows, which are reported while the other rows still flow. The function must be
row-wise (map / filter / explode), not an aggregate over its batch.

    python examples/vectorized_batches.py   # with a sidecar at $SPILLWAY_SIDECAR_ADDRESS
"""

from __future__ import annotations

from spillway.spark import Job


def score(pdf):
    if (pdf["id"] == 42).any():
        raise ValueError("model cannot score id 42")
    return pdf.assign(score=pdf["id"] * 0.5)


def only_even(batch):
    import pyarrow.compute as pc

    if pc.any(pc.equal(batch.column("id"), 13)).as_py():
        raise ZeroDivisionError("id 13")
    return batch.filter(pc.equal(pc.bit_wise_and(batch.column("id"), 1), 0))


def run(spark, job: Job):
    df = spark.range(0, 100, numPartitions=2)
    scored = job.map_in_pandas(df, score, "id long, score double")
    evens = job.map_in_arrow(df, only_even, "id long")
    return scored, evens


if __name__ == "__main__":
    import os
    import sys

    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = SparkSession.builder.master("local[2]").getOrCreate()
    with Job("example-vectorized", {"errors.tolerance": "all"}) as job:   # ends the run after
        scored, evens = run(spark, job)
        print(scored.count(), evens.count())   # 99 50
        print(job.summary().by_exception_class)
