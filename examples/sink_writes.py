"""Stage TASK_PUT (sink): `Job.foreach_partition` writes chunks of rows; a failed chunk is
bisected, unwritable rows are dead-lettered and transient errors retried per the verdicts.

Chunks may be written more than once (a chunk failing half-way is re-written in halves), so the
write must be idempotent (an upsert, or keyed files as here).

    python examples/sink_writes.py          # with a sidecar at $SPILLWAY_SIDECAR_ADDRESS
"""

from __future__ import annotations

import os

from spillway.spark import Job


def make_writer(directory: str):
    def write(rows):
        for r in rows:
            if r.id == 9:
                raise ValueError("row 9 violates a constraint")   # dead-lettered, TASK_PUT
        for r in rows:                                            # idempotent: one file per id
            with open(os.path.join(directory, f"{r.id}.txt"), "w") as fh:
                fh.write(str(r.id))

    return write


def run(spark, job: Job, directory: str) -> None:
    job.foreach_partition(spark.range(0, 20, numPartitions=2), make_writer(directory),
                          batch_size=8)


if __name__ == "__main__":
    import sys
    import tempfile

    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = SparkSession.builder.master("local[2]").getOrCreate()
    # `with`: registers the run, and ends it at its sidecar(s) when the block is done
    with Job("example-sink", {"errors.tolerance": "all"}) as job, \
            tempfile.TemporaryDirectory() as out:
        run(spark, job, out)
        print(sorted(int(f.split(".")[0]) for f in os.listdir(out)))   # 0..19 without 9
