"""A Spark job through a sidecar of two processes (``sidecar.processes=2``, `spillway serve` as its
own process): executors' Python workers land on either process, the run keeps one home, every
failed record is dead-lettered once and the driver's close() reaches the home."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
from pyspark import cloudpickle
from spillway.spark import KAFKA_SOURCE_SCHEMA, Job
from support import serve
from support.kafka import read_all

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/


def parse(row):
    order = json.loads(row.value)
    return (order["id"],)


@pytest.fixture(scope="module")
def two_processes(broker, tmp_path_factory):
    spool = tmp_path_factory.mktemp("two-processes")
    proc, address = serve.spawn(
        ["--listen", "127.0.0.1:0", "--bootstrap-servers", broker.bootstrap_servers,
         "--set", f"spool.dir={spool}", "--set", "producer.linger.ms=5",
         "--set", "sidecar.processes=2"], stderr=subprocess.DEVNULL)
    yield address
    serve.stop(proc, 30)


def test_a_job_over_two_processes_dead_letters_each_failed_record_once(spark, broker,
                                                                       two_processes):
    topic = f"dlq.two-{uuid.uuid4().hex[:8]}"
    rows = [(f"k{i}".encode(), b"{oops" if i % 5 == 0 else json.dumps({"id": i}).encode(),
             "orders", 0, i, None, 0, []) for i in range(400)]
    with Job(f"two-{uuid.uuid4().hex[:6]}",
             {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
              "errors.deadletterqueue.auto.create.topics.enable": "true",
              "errors.deadletterqueue.topic.replication.factor": "1"},
             sidecar=two_processes) as job:
        df = spark.createDataFrame(rows, KAFKA_SOURCE_SCHEMA).repartition(8)
        assert job.map_partitions(df, parse, schema="id int").count() == 320
    report = job.report
    assert report.total_record_errors == 80 and report.dlq_records_written == 80
    assert not report.unreachable
    keys = sorted(m.key() for m in read_all(broker.bootstrap_servers, topic))
    assert keys == sorted(f"k{i}".encode() for i in range(0, 400, 5))
