"""Stage TRANSFORMATION in a scalar UDF: `Job.udf` turns failures into null (and a report),
or, with ``error_column=True``, into a struct column with the error next to the value.

    python examples/udf_errors.py           # with a sidecar at $SPILLWAY_SIDECAR_ADDRESS
"""

from __future__ import annotations

from spillway.spark import Job


def run(spark, job: Job):
    @job.udf("int")
    def to_int(s):
        return int(s)

    @job.udf("int", error_column=True, name="to_int_with_error")
    def to_int_with_error(s):
        return int(s)

    df = spark.createDataFrame([("1",), ("two",), ("3",)], "s string")
    return df.select("s", to_int("s").alias("n"), to_int_with_error("s").alias("r"))


if __name__ == "__main__":
    import os
    import sys

    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = SparkSession.builder.master("local[2]").getOrCreate()
    with Job("example-udf", {"errors.tolerance": "all"}) as job:   # ends the run after the block
        run(spark, job).select("s", "n", "r.value", "r.error.exception_class").show(
            truncate=False)
