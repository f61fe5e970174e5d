"""The copyable examples in examples/ run as documented, on the session's Spark and a real
sidecar (no DLQ topic: skipped records are counted and dropped)."""

from __future__ import annotations

import time
import uuid

import pytest
from spillway.spark import Job
from support.spark import load_example

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sidecar_props():
    return {"bootstrap.servers": ""}  # the examples run without a DLQ topic


@pytest.fixture
def job(sidecar):
    job = Job(f"example-{uuid.uuid4().hex[:8]}", {
        "errors.tolerance": "all", "errors.retry.timeout": "30000",
        "errors.retry.initial.backoff.ms": "50"}, sidecar=sidecar.address)
    job.register()
    return job


def test_transform_rows(spark, job):
    out = load_example("transform_rows").run(spark, job).collect()
    assert sorted(r.id for r in out) == [i for i in range(20) if i != 13]
    s = job.summary()
    assert (s.total_retries, s.total_records_skipped) == (1, 1)


def test_deserialize_kafka(spark, job):
    out = load_example("deserialize_kafka").run(spark, job)
    assert sorted(r.offset for r in out.collect()) == [0, 1, 3, 4, 6, 7]
    assert job.summary().by_stage == {"KEY_CONVERTER": 1, "VALUE_CONVERTER": 1}


def test_vectorized_batches(spark, job):
    scored, evens = load_example("vectorized_batches").run(spark, job)
    assert (scored.count(), evens.count()) == (99, 50)
    assert job.summary().by_exception_class == {"builtins.ValueError": 1,
                                                "builtins.ZeroDivisionError": 1}


def test_udf_errors(spark, job):
    rows = {r.s: r for r in load_example("udf_errors").run(spark, job).collect()}
    assert (rows["1"].n, rows["3"].n, rows["two"].n) == (1, 3, None)
    assert rows["two"].r.error.exception_class == "builtins.ValueError"
    assert rows["1"].r.error is None and rows["1"].r.value == 1


def test_sink_writes(spark, job, tmp_path):
    load_example("sink_writes").run(spark, job, str(tmp_path))
    assert sorted(int(p.stem) for p in tmp_path.iterdir()) == [i for i in range(20) if i != 9]
    assert job.summary().by_stage == {"TASK_PUT": 1}


def test_streaming_foreach_batch(spark, job, tmp_path):
    out = tmp_path / "out"
    out.mkdir()

    def write(rows, batch_id):
        for r in rows:
            (out / str(r.value)).write_text(str(r.double))

    query = load_example("streaming_foreach_batch").start(spark, job, write, str(tmp_path / "ckpt"))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(list(out.iterdir())) < 10:
            assert query.exception() is None
            time.sleep(0.2)
    finally:
        query.stop()
    values = sorted(int(p.name) for p in out.iterdir())
    assert len(values) >= 10 and all(v % 10 != 3 for v in values)
