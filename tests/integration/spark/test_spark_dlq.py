"""The DLQ as a dataset: `read_dlq` reads dead letters written by a real job through a real
sidecar back from the Tansu broker as a DataFrame; the top-causes example runs on it."""

from __future__ import annotations

import sys
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from pyspark import cloudpickle
from spillway.spark import DLQ_SCHEMA, KAFKA_SOURCE_SCHEMA, Job, read_dlq
from support.orders import order_rows, parse, parse_fixed
from support.spark import load_example

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/


@pytest.fixture(scope="module")
def dead_letters(spark, sidecar, broker):
    """A job that dead-lettered 6 records (3 JSONDecodeError, 3 KeyError) into a 2-partition
    DLQ topic; returns (topic, job name, time before the run)."""
    topic = f"dlq.read-{uuid.uuid4().hex[:8]}"
    name = f"read-dlq-{uuid.uuid4().hex[:6]}"
    job = Job(name, {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
                     "errors.deadletterqueue.context.headers.enable": "true",
                     "errors.deadletterqueue.auto.create.topics.enable": "true",
                     "errors.deadletterqueue.topic.partitions": "2",
                     "errors.deadletterqueue.topic.replication.factor": "1"},
              sidecar=sidecar.address)
    job.register()
    before = datetime.now(timezone.utc) - timedelta(seconds=1)
    df = spark.createDataFrame(order_rows(), KAFKA_SOURCE_SCHEMA).repartition(3)
    assert job.map_partitions(df, parse, schema="id int, amount double").count() == 24
    return topic, name, before


def test_read_dlq_returns_typed_context_columns(spark, broker, dead_letters):
    topic, name, before = dead_letters
    df = read_dlq(spark, topic, bootstrap_servers=broker.bootstrap_servers)
    assert df.rdd.getNumPartitions() == 2            # one Spark partition per Kafka partition
    assert [f.name for f in df.schema.fields] == [
        c.strip().split(" ")[0] for c in DLQ_SCHEMA.replace(
            "array<struct<key:string,value:binary>>", "x").split(",")]
    rows = df.collect()
    assert len(rows) == 6
    assert {r.partition for r in rows} == {0, 1}
    by_source = {r.source_offset: r for r in rows}
    assert sorted(by_source) == [103, 107, 113, 117, 123, 127]
    r = by_source[103]
    assert (r.job, r.stage, r.source_topic, r.source_partition) == (
        name, "TRANSFORMATION", "orders", 3 % 3)
    assert r.exception_class == "json.decoder.JSONDecodeError"
    assert r.category == "data" and r.attempts == 1 and r.value == b"{oops"
    assert r.payload == "stage-input"       # a transformation's input (not a deserializer's)
    assert r.run_id                          # the job's run
    assert r.key == b"k3" and ("source", b"example") in [(h.key, h.value) for h in r.headers]
    assert r.record_id and r.function.endswith("parse") and "Traceback" in r.stacktrace
    assert r.dead_lettered_at.timestamp() >= before.timestamp()  # Spark: naive, local time
    assert r.trace_id and len(r.trace_id) == 32
    assert by_source[107].exception_class == "builtins.KeyError"
    assert by_source[107].exception_message == "'amount'"


@pytest.mark.slow
def test_read_dlq_filters_and_bounds(spark, broker, dead_letters):
    topic, name, before = dead_letters
    read = lambda **kw: read_dlq(spark, topic, bootstrap_servers=broker.bootstrap_servers, **kw)  # noqa: E731
    assert read(exception_class="KeyError").count() == 3
    assert read(exception_class="json.decoder.JSONDecodeError").count() == 3
    assert read(exception_class="Error").count() == 0       # a simple name, not a suffix
    assert read(job=name, stage="TRANSFORMATION").count() == 6
    assert read(job="another-job").count() == 0
    assert read(stage="SINK").count() == 0
    assert read(since=before).count() == 6
    assert read(since=datetime.now(timezone.utc) + timedelta(hours=1)).count() == 0
    assert read(until=before.isoformat()).count() == 0
    # offset bounds, per partition: nothing after "latest", the first record of each partition
    assert read(start="latest").count() == 0
    first = read(end={0: 1, 1: 1}).collect()
    assert sorted((r.partition, r.offset) for r in first) == [(0, 0), (1, 0)]
    with pytest.raises(ValueError, match="until"):
        read(since="2026-01-02T00:00:00Z", until="2026-01-01T00:00:00Z")
    with pytest.raises(ValueError, match="start"):
        read(start=-5)
    with pytest.raises(LookupError, match="does not exist"):
        read_dlq(spark, "dlq.no-such-topic", bootstrap_servers=broker.bootstrap_servers,
                 timeout_s=5)


def test_top_causes_example(spark, broker, dead_letters):
    topic, name, _ = dead_letters
    t0 = time.monotonic()
    out = load_example("dlq_top_causes").top_causes(spark, topic, broker.bootstrap_servers,
                                                    job=name).collect()
    assert [(r.exception_class, r.records) for r in out] == [
        ("builtins.KeyError", 3), ("json.decoder.JSONDecodeError", 3)]
    assert all(r.stage == "TRANSFORMATION" and r.partitions == 3 for r in out)
    assert out[0].first_seen <= out[0].last_seen
    print(f"top causes in {time.monotonic() - t0:.1f}s")


@pytest.mark.slow
def test_reprocess_sends_fixed_records_on_and_dead_letters_the_rest_again(spark, sidecar,
                                                                          broker):
    topic = f"dlq.reprocess-{uuid.uuid4().hex[:8]}"
    job = Job(f"reprocess-{uuid.uuid4().hex[:6]}", {
        "errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
        "errors.deadletterqueue.context.headers.enable": "true",
        "errors.deadletterqueue.auto.create.topics.enable": "true",
        "errors.deadletterqueue.topic.replication.factor": "1"}, sidecar=sidecar.address)
    job.register()
    df = spark.createDataFrame(order_rows(), KAFKA_SOURCE_SCHEMA)
    assert job.map_partitions(df, parse, schema="id int, amount double").count() == 24
    read = lambda: read_dlq(spark, topic, bootstrap_servers=broker.bootstrap_servers)  # noqa: E731
    first = read().collect()
    assert len(first) == 6

    before = job.summary()
    out = job.reprocess(read(), parse_fixed, schema="id int, amount double").collect()
    # the KeyError records now succeed; the undecodable ones are dead-lettered again
    assert sorted((r.id, r.amount) for r in out) == [(7, 0.0), (17, 0.0), (27, 0.0)]
    # counted in the run that reprocessed them (docs/DLQ.md): its records processed grow by
    # the 6 rows reprocessed, its errors and dead letters by the 3 that failed again
    after = job.summary()
    assert after.records_processed == before.records_processed + 6
    assert after.total_record_errors == before.total_record_errors + 3
    assert after.dlq_records_written == before.dlq_records_written + 3
    rows = read().collect()
    again = [r for r in rows if r.redrive_count == 1]
    assert len(rows) == 9 and len(again) == 3
    originals = {r.source_offset: r.record_id for r in first}
    for r in again:
        h = {x.key: x.value for x in r.headers}
        # the original record, its first id and source, and where it failed this time
        assert r.value == b"{oops" and r.key == f"k{r.source_offset - 100}".encode()
        assert h["source"] == b"example"
        assert h["spillway.redrive.of"].decode() == originals[r.source_offset]
        assert r.record_id == originals[r.source_offset] + "#redrive1"
        assert r.source_topic == "orders" and r.exception_class.endswith("JSONDecodeError")

        assert r.payload == "stage-input"        # the kind the first dead letter had
        assert r.resolution is None               # it carries the record on, unresolved
        assert h["spillway.redrive.from"].decode() in {o.ledger_key for o in first}
    # the ledger: the fixed records are reprocessed, the failed ones superseded by their
    # new dead letters
    by_key = {r.ledger_key: r.resolution for r in rows}
    assert sorted(by_key[o.ledger_key] for o in first) == ["reprocessed"] * 3 + ["superseded"] * 3
    hide = lambda: read_dlq(spark, topic, bootstrap_servers=broker.bootstrap_servers,  # noqa: E731
                            resolved="hide")
    assert sorted(r.record_id for r in hide().collect()) == sorted(r.record_id for r in again)
    assert read_dlq(spark, topic, bootstrap_servers=broker.bootstrap_servers,
                    resolved="only").count() == 6
    with pytest.raises(ValueError, match="resolved"):
        read_dlq(spark, topic, bootstrap_servers=broker.bootstrap_servers, resolved="all")

    # a second reprocess leaves out what the ledger says is resolved, and (loop protection,
    # max_redrives=1) the records sent round once
    out = job.reprocess(read(), parse_fixed, schema="id int, amount double",
                        max_redrives=1).collect()
    assert out == [] and read().count() == 9
    # told to include resolved records, the originals run again under the same ids, so the
    # failing ones are not dead-lettered a second time
    out = job.reprocess(read(), parse_fixed, schema="id int, amount double",
                        max_redrives=1, include_resolved=True).collect()
    assert len(out) == 3 and read().count() == 9
    with pytest.raises(ValueError, match="max_redrives"):
        job.reprocess(read(), parse_fixed, max_redrives=0)
    with pytest.raises(ValueError, match="missing columns"):
        job.reprocess(df, parse_fixed)
