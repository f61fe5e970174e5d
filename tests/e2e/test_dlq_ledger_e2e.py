"""The DLQ's second life against `spillway serve` as its own process, local Spark and the
Tansu broker, with `spillway dlq redrive` run as its own process as an operator would:

- a second redrive of the same range adds nothing (it put 20 copies of 10 records into the
  target before the ledger);
- redrive after `Job.reprocess` sends only what reprocess did not fix: the records it fixed and
  the originals of those it dead-lettered again are resolved in the ledger, and its new dead
  letters keep the payload kind (``source``) of the originals, so redrive sends them to their
  source topic rather than refusing them as a stage's input;
- `read_dlq(resolved="hide")` shows what is left; nothing redriven or reprocessed carries the
  dead letter's traceparent.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import datetime

import pytest
from pyspark import cloudpickle
from support import serve
from support.kafka import create_topic, read_all

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/


def _redrive(broker, topic, target, *extra):
    out = subprocess.run(
        [sys.executable, "-m", "spillway.sidecar.cli", "dlq", "redrive", "--bootstrap-servers",
         broker.bootstrap_servers, "--topic", topic, "--target", target, "--idle-ms", "500",
         "--no-progress", *extra], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip().splitlines()[-1]


def _source_rows(source, n_good=10, n_fixable=5, n_broken=5):
    """Kafka-shaped rows of `source`: good JSON, ``id=N`` text (json.loads fails, the fixed
    parser reads it), and bytes nothing parses."""
    from spillway.spark import KAFKA_SOURCE_SCHEMA  # noqa: F401 - the rows' schema

    ts = datetime(2026, 1, 1)
    values = ([json.dumps({"id": i}).encode() for i in range(n_good)]
              + [f"id={100 + i}".encode() for i in range(n_fixable)]
              + [b"\xff{oops" + bytes([i]) for i in range(n_broken)])
    return [(f"k{i}".encode(), v, source, 0, i, ts, 0, [("app", b"orders")])
            for i, v in enumerate(values)]


def parse_fixed(row):
    text = row.value.decode("utf-8")  # the broken ones still fail here
    if text.startswith("id="):
        return (int(text[3:]),)
    return (json.loads(text)["id"],)


@pytest.fixture
def sidecar_proc(broker, tmp_path):
    proc, address = serve.spawn(
        ["--listen", "127.0.0.1:0", "--bootstrap-servers", broker.bootstrap_servers,
         "--set", f"spool.dir={tmp_path / 'spool'}", "--set", "producer.linger.ms=5"],
        stderr=subprocess.DEVNULL)
    yield address
    serve.stop(proc)


def _job(address, topic):
    from spillway.spark import Job

    return Job(f"ledger-{uuid.uuid4().hex[:6]}", {
        "errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
        "errors.deadletterqueue.context.headers.enable": "true",
        "errors.deadletterqueue.auto.create.topics.enable": "true",
        "errors.deadletterqueue.topic.replication.factor": "1"}, sidecar=address)


def _dead_letter(spark, job, source):
    from spillway.spark import KAFKA_SOURCE_SCHEMA

    df = spark.createDataFrame(_source_rows(source), KAFKA_SOURCE_SCHEMA)
    parsed = job.deserialize(df, value=json.loads, value_type="struct<id:int>")
    assert parsed.count() == 10


def test_a_second_redrive_adds_nothing(spark, broker, sidecar_proc):
    from spillway.spark import read_dlq

    topic, source = f"dlq.e2e-{uuid.uuid4().hex[:8]}", f"orders-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap_servers, source)
    job = _job(sidecar_proc, topic)
    _dead_letter(spark, job, source)
    dlq = read_dlq(spark, topic, bootstrap_servers=broker.bootstrap_servers).collect()
    assert len(dlq) == 10 and {r.payload for r in dlq} == {"source"}

    first = _redrive(broker, topic, source)
    assert first.startswith("scanned=10 matched=10 redriven=10 "), first
    second = _redrive(broker, topic, source)
    assert second.startswith("scanned=10 matched=10 redriven=0 "), second
    assert "skipped (resolved)=10" in second
    sent = read_all(broker.bootstrap_servers, source, idle_s=0.5)
    assert len(sent) == 10 and sorted(m.value() for m in sent) == sorted(r.value for r in dlq)
    dead_tp = {r.trace_id for r in dlq}
    for m in sent:
        h = dict(m.headers())
        assert h["spillway.redrive.count"] == b"1" and h["app"] == b"orders"
        assert "traceparent" not in h or h["traceparent"].decode().split("-")[1] not in dead_tp
        assert h["spillway.redrive.link"].decode().split("-")[1] in dead_tp
    left = read_dlq(spark, topic, bootstrap_servers=broker.bootstrap_servers, resolved="hide")
    assert left.count() == 0


def test_redrive_after_reprocess_sends_only_what_reprocess_did_not_fix(spark, broker,
                                                                      sidecar_proc):
    from spillway.spark import read_dlq

    topic, source = f"dlq.e2e-{uuid.uuid4().hex[:8]}", f"orders-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap_servers, source)
    job = _job(sidecar_proc, topic)
    _dead_letter(spark, job, source)
    dlq = read_dlq(spark, topic, bootstrap_servers=broker.bootstrap_servers)
    fixed = job.reprocess(dlq, parse_fixed, schema="id int").collect()
    assert sorted(r.id for r in fixed) == [100, 101, 102, 103, 104]

    rows = read_dlq(spark, topic, bootstrap_servers=broker.bootstrap_servers).collect()
    again = [r for r in rows if r.redrive_count == 1]
    assert len(rows) == 15 and len(again) == 5
    originals = {r.record_id: r for r in rows if r.redrive_count is None}
    for r in again:
        assert r.payload == "source"          # the kind of the dead letter it came from
        assert r.value.startswith(b"\xff{oops")
        assert r.trace_id not in {o.trace_id for o in originals.values()}  # a new trace
        assert r.resolution is None
    assert sorted(r.resolution for r in originals.values()) == \
        ["reprocessed"] * 5 + ["superseded"] * 5

    line = _redrive(broker, topic, source)
    assert line.startswith("scanned=15 matched=15 redriven=5 "), line
    assert "skipped (resolved)=10" in line and "skipped (stage input)=0" in line
    sent = read_all(broker.bootstrap_servers, source, idle_s=0.5)
    assert sorted(m.value() for m in sent) == sorted(r.value for r in again)
    assert _redrive(broker, topic, source).startswith("scanned=15 matched=15 redriven=0 ")
    assert read_dlq(spark, topic, bootstrap_servers=broker.bootstrap_servers,
                    resolved="hide").count() == 0
