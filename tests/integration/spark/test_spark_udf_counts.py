"""A UDF's processed counts on classic Spark: every row is in the job's summary once the action
returns (a UDF sees no partition end: its counts leave the worker when pyspark ends the task,
never parked in a worker that may exit before its next task). The Connect tier checks the same
through a Connect server (tests/integration/spark/test_spark_connect.py)."""

from __future__ import annotations

import sys
import uuid

import pytest
from pyspark import cloudpickle
from spillway.spark import Job

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_a_udf_counts_every_row_by_the_time_the_action_returns(spark, sidecar):
    job = Job(f"udf-counts-{uuid.uuid4().hex[:8]}", {"errors.tolerance": "all"},
              sidecar=sidecar.address)
    job.register()

    @job.udf("double")
    def amount(v):
        if v % 25 == 3:
            raise ValueError(f"bad amount {v}")
        return v * 1.5

    df = spark.range(0, 200, numPartitions=5)
    assert df.select(amount("id").alias("a")).where("a is null").count() == 8
    s = job.summary()
    assert (s.records_processed, s.total_record_failures) == (200, 8)
    evens = df.where("id % 2 = 0").select(amount("id").alias("a"))      # a second query
    assert evens.where("a is null").count() == 4
    report = job.close()
    assert (report.records_processed, report.total_record_failures) == (300, 12)


def test_spark_workers_call_the_user_function_from_the_native_per_row_function(spark, sidecar):
    """Where spillway-spark was built with its extension (here it is: tests/unit/
    spark/test_spark_udf.py checks the build), the user function's caller in a Python worker is
    pyspark's own loop, not a Python frame of spillway's (`spark/_udfcall.c`)."""
    from spillway.spark import _udf

    if _udf._NativeCall is None:
        pytest.skip("spillway-spark was installed without its C extension (no C compiler)")
    job = Job(f"udf-native-{uuid.uuid4().hex[:8]}", {"errors.tolerance": "all"},
              sidecar=sidecar.address)
    job.register()

    @job.udf("string")
    def caller(v):
        frame = sys._getframe(1)
        return f"{frame.f_globals.get('__name__')}.{frame.f_code.co_name}"

    callers = {r.c for r in spark.range(0, 20, numPartitions=2)
               .select(caller("id").alias("c")).collect()}
    assert callers and not any(c.startswith("spillway.") for c in callers), callers
    job.close()
