"""In real Python workers: a wrapper's partitions (and a UDF's tasks) run with the job's young
collection threshold, and the workers' next plain tasks with their own again."""

from __future__ import annotations

import gc
import sys
import uuid

import pytest
from pyspark import cloudpickle
from spillway.spark import Job

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def young_threshold(_row):
    return gc.get_threshold()[0]


def plain_thresholds(rows):
    for _ in rows:
        yield gc.get_threshold()[0]


@pytest.mark.parametrize("threshold", [20_000, 0], ids=["default", "left alone"])
def test_wrappers_run_with_the_jobs_threshold_and_give_the_workers_theirs_back(
        spark, sidecar, threshold):
    kwargs = {} if threshold == 20_000 else {"gc_young_threshold": 0}
    job = Job(f"gc-{uuid.uuid4().hex[:8]}", {"errors.tolerance": "all"},
              sidecar=sidecar.address, **kwargs)
    job.register()
    sc = spark.sparkContext
    own = set(sc.parallelize(range(8), 4).mapPartitions(plain_thresholds).collect())
    assert len(own) == 1   # the workers' own young threshold (CPython's 700 unless set)
    (own_threshold,) = own
    expected = threshold or own_threshold

    rdd = sc.parallelize(range(40), 4)
    assert set(job.map_partitions(rdd, young_threshold).collect()) == {expected}
    df = spark.range(0, 40, numPartitions=4)
    rows = job.map_partitions(df, lambda r: (young_threshold(r),), schema="t long").collect()
    assert {r.t for r in rows} == {expected}

    @job.udf("long")
    def in_udf(v):
        return young_threshold(v)

    assert {r.t for r in df.select(in_udf("id").alias("t")).collect()} == {expected}
    job.close()
    after = set(sc.parallelize(range(8), 4).mapPartitions(plain_thresholds).collect())
    assert after == {own_threshold}
