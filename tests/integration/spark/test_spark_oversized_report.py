"""A Spark task whose batch of failed records is larger than the sidecar's whole DLQ spool: the
sidecar answers FAILED_PRECONDITION (not "retry later"), the executor's client splits the
report and sends the halves (spark/_runtime.py waits out the backpressure between them), and
every record is dead-lettered exactly once. Real local Spark, real sidecar, real Tansu."""

from __future__ import annotations

import sys
import uuid

import pytest
from pyspark import cloudpickle
from spillway.spark import KAFKA_SOURCE_SCHEMA, Job
from support.kafka import read_all
from test_spark_pipeline import OUT_SCHEMA, kafka_rows, parse_order

pytestmark = pytest.mark.integration

cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROWS = 300
SPOOL_BYTES = 262_144


@pytest.fixture(scope="module")
def sidecar_props():
    return {"spool.max.bytes": str(SPOOL_BYTES)}


def test_a_batch_larger_than_the_spool_is_split_and_dead_lettered_once(spark, sidecar, broker,
                                                                       topic_name):
    job = Job(f"it-big-{uuid.uuid4().hex[:8]}", {
        "errors.tolerance": "all",
        "errors.deadletterqueue.topic.name": topic_name,
        "errors.deadletterqueue.auto.create.topics.enable": "true",
        "errors.deadletterqueue.topic.replication.factor": "1",
    }, sidecar=sidecar.address)
    # every row poison, 2 KB each: one partition's report of 256 records (the batch size)
    # is ~1 MB with the DLQ context, four times the spool
    poison = {i: b"{" + b"x" * 2000 for i in range(ROWS)}
    df = spark.createDataFrame(kafka_rows(ROWS, poison=poison), KAFKA_SOURCE_SCHEMA)
    out = job.map_partitions(df.coalesce(1), parse_order, schema=OUT_SCHEMA)
    assert out.count() == 0

    summary = job.summary()
    assert summary.total_records_skipped == ROWS
    assert summary.dlq_records_written == ROWS
    assert not summary.failed
    keys = sorted(m.key() for m in read_all(broker.bootstrap_servers, topic_name))
    assert keys == sorted(f"k{i}".encode() for i in range(ROWS))  # each once
    job.close()
