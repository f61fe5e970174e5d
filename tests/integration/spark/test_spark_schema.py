"""Outputs that do not fit the declared schema are that record's failure, never a dead task;
a task that does die is explained by its real cause. Real local Spark, real sidecar, real Tansu."""

from __future__ import annotations

import json
import sys
import uuid

import pytest
from pyspark import cloudpickle
from spillway.spark import KAFKA_SOURCE_SCHEMA, Job
from support.kafka import read_all

pytestmark = pytest.mark.integration

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _job(sidecar, topic):
    job = Job(f"schema-{uuid.uuid4().hex[:8]}", {
        "errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
        "errors.deadletterqueue.context.headers.enable": "true",
        "errors.deadletterqueue.auto.create.topics.enable": "true",
        "errors.deadletterqueue.topic.replication.factor": "1"}, sidecar=sidecar.address)
    job.register()
    return job


def test_deserialize_dead_letters_a_value_that_does_not_fit_value_type(spark, sidecar, broker,
                                                                       topic_name):
    """The README's pattern: an order whose amount is "abc" is a VALUE_CONVERTER data error
    with its raw bytes in the DLQ, not pyarrow's ArrowInvalid killing the task."""
    import datetime as dt

    job = _job(sidecar, topic_name)
    docs = [{"id": 0, "amount": 1.5}, {"id": 1, "amount": "abc"}, {"id": 2, "amount": 7}]
    ts = dt.datetime(2024, 5, 1)
    rows = [(f"k{d['id']}".encode(), json.dumps(d).encode(), "orders", 0, d["id"], ts, 0, [])
            for d in docs]
    df = spark.createDataFrame(rows, KAFKA_SOURCE_SCHEMA).coalesce(1)
    out = job.deserialize(df, value=json.loads, value_type="struct<id:int,amount:double>")
    got = sorted((r.parsed_value.id, r.parsed_value.amount) for r in out.collect())
    assert got == [(0, 1.5), (2, 7.0)]                   # an int amount is a double to Arrow
    [msg] = read_all(broker.bootstrap_servers, topic_name)
    h = dict(msg.headers())
    assert (msg.key(), msg.value()) == (b"k1", rows[1][1])       # the raw bytes
    assert h["__connect.errors.stage"] == b"VALUE_CONVERTER"
    assert h["spillway.error.category"] == b"data"
    assert h["__connect.errors.exception.class.name"] == b"spillway.spark._schema.OutputSchemaError"
    message = h["__connect.errors.exception.message"].decode()
    assert "VALUE_CONVERTER" in message and "field amount" in message and "'abc'" in message


def test_vectorized_and_udf_outputs_that_do_not_fit_are_reported_per_record(spark, sidecar,
                                                                            topic_name):
    import pyarrow as pa

    job = _job(sidecar, topic_name)
    df = spark.range(0, 16, numPartitions=2)

    def label(pdf):                      # row 7's score is text: the declared type is double
        return pdf.assign(score=[("n/a" if i == 7 else i * 0.5) for i in pdf["id"]])

    out = job.map_in_pandas(df, label, "id long, score double", name="label")
    assert sorted(r.id for r in out.collect()) == [i for i in range(16) if i != 7]

    def as_text(batch):                  # a string column cast to the declared int: "x" fails
        ids = batch.column("id").to_pylist()
        return pa.RecordBatch.from_arrays(
            [batch.column("id"), pa.array(["x" if i == 5 else str(i) for i in ids])],
            names=["id", "n"])

    out = job.map_in_arrow(df, as_text, "id long, n int", name="as_text")
    assert sorted((r.id, r.n) for r in out.collect()) == [(i, i) for i in range(16) if i != 5]

    @job.udf("int", error_column=True, name="to_count")
    def to_count(s):
        return "many" if s == "b" else len(s)

    words = spark.createDataFrame([("a",), ("b",), ("cc",)], "s string").coalesce(1)
    got = {r.s: r.r for r in words.select("s", to_count("s").alias("r")).collect()}
    assert (got["a"].value, got["cc"].value, got["b"].value) == (1, 2, None)
    assert got["b"].error.exception_class == "spillway.spark._schema.OutputSchemaError"
    assert "int" in got["b"].error.message and "'many'" in got["b"].error.message

    s = job.summary()
    assert s.total_record_failures == 3 and s.by_category == {"data": 3}
    assert s.by_exception_class == {"spillway.spark._schema.OutputSchemaError": 3}


def test_failure_message_gives_the_real_cause_of_a_dead_task(spark):
    def boom(x):
        return {}["missing"]

    with pytest.raises(Exception) as failed:
        spark.sparkContext.parallelize([1], 1).map(boom).collect()
    assert "An exception was thrown from the Python worker" not in Job.failure_message(
        failed.value)
    assert Job.failure_message(failed.value) == "KeyError: 'missing'"
