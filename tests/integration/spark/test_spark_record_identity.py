"""Record identity on real Spark: two different bad records never collapse into one. The issue's
jobs as a user writes them - one parsing function over two DataFrames, one `@job.udf` in two
queries - each count, log and dead-letter both bad records (real sidecar, Tansu, local Spark)."""

from __future__ import annotations

import json
import sys
import uuid

import pytest
from pyspark import cloudpickle
from pyspark.sql import Row
from spillway.spark import Job
from support.kafka import header_map, read_all

pytestmark = pytest.mark.integration

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _job(sidecar, topic):
    job = Job(f"ident-{uuid.uuid4().hex[:8]}", {
        "errors.tolerance": "all",
        "errors.log.enable": "true",
        "errors.deadletterqueue.topic.name": topic,
        "errors.deadletterqueue.context.headers.enable": "true",
        "errors.deadletterqueue.auto.create.topics.enable": "true",
        "errors.deadletterqueue.topic.replication.factor": "1",
    }, sidecar=sidecar.address)
    job.register()
    return job


def parse(row):
    doc = json.loads(row.payload)
    return Row(id=doc["id"], amount=float(doc["amount"]))


def _frame(spark, kind, bad_at):
    rows = [(json.dumps({"id": i, "amount": i * 2.0, "kind": kind}),) for i in range(6)]
    rows[bad_at] = (f"{{{kind} is not json",)
    return spark.createDataFrame(rows, "payload string").coalesce(1)


def test_one_function_over_two_dataframes_dead_letters_both_bad_records(spark, sidecar, broker,
                                                                       topic_name):
    job = _job(sidecar, topic_name)
    orders, refunds = _frame(spark, "orders", 3), _frame(spark, "refunds", 3)
    a = job.map_partitions(orders, parse, schema="id int, amount double")
    b = job.map_partitions(refunds, parse, schema="id int, amount double")
    assert a.count() == 5 and b.count() == 5
    a.count()      # a second action over the same wrapped DataFrame: the same records again
    report = job.close()
    assert (report.total_record_failures, report.total_record_errors,
            report.total_errors_logged, report.dlq_records_written) == (3, 2, 2, 2)
    assert report.record_id_collisions == 0      # the two calls got ids of their own
    msgs = read_all(broker.bootstrap_servers, topic_name)
    assert sorted(m.value() for m in msgs) == [b'{"payload":"{orders is not json"}',
                                               b'{"payload":"{refunds is not json"}']
    ids = {header_map(m)["spillway.record.id"] for m in msgs}
    assert len(ids) == 2


def test_one_udf_in_two_queries_dead_letters_both_bad_values(spark, sidecar, broker, topic_name):
    job = _job(sidecar, topic_name)

    @job.udf("double")
    def amount(v):
        if v < 0:
            raise ValueError(f"negative amount {v}")
        return v * 1.1

    orders = spark.createDataFrame([(float(i),) for i in range(6)], "a double").coalesce(1)
    refunds = spark.createDataFrame([(float(i),) for i in range(6)], "a double").coalesce(1)
    orders = orders.selectExpr("CASE WHEN a = 3 THEN -1.0 ELSE a END AS a")
    refunds = refunds.selectExpr("CASE WHEN a = 3 THEN -1.0 ELSE a END AS a")
    assert orders.select(amount("a")).collect()[3][0] is None
    assert refunds.select(amount("a")).collect()[3][0] is None
    report = job.close()
    assert (report.total_record_failures, report.total_record_errors,
            report.total_errors_logged, report.dlq_records_written) == (2, 2, 2, 2)
    msgs = read_all(broker.bootstrap_servers, topic_name)
    assert [m.value() for m in msgs] == [b"-1.0", b"-1.0"]   # identical payloads, two uses
    assert len({header_map(m)["spillway.record.id"] for m in msgs}) == 2


def test_a_record_id_function_that_is_not_unique_loses_nothing(spark, sidecar, broker,
                                                               topic_name):
    job = _job(sidecar, topic_name)
    df = spark.createDataFrame([(f"{{bad {i}",) for i in range(4)], "payload string")
    out = job.map_partitions(df.coalesce(1), parse, schema="id int, amount double",
                             record_id=lambda row: "same-id")
    assert out.count() == 0
    report = job.close()
    assert (report.total_record_errors, report.dlq_records_written,
            report.record_id_collisions) == (4, 4, 3)
    assert len(read_all(broker.bootstrap_servers, topic_name)) == 4
