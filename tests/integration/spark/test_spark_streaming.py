"""Structured Streaming through spillway: the rate source shaped like Kafka records, deserialized
(mapInArrow) and transformed (mapInPandas), written with foreachBatch; the real sidecar and a
real Tansu broker hold the DLQ."""

from __future__ import annotations

import json
import sys
import time
import uuid

import pytest
from pyspark import cloudpickle
from spillway.spark import Job
from support.kafka import read_all

pytestmark = pytest.mark.integration

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def sidecar_props():
    # a slow producer: without the flush barrier, batches would commit before the acks
    return {"producer.linger.ms": "100"}


KAFKA_SHAPED = [
    "cast(concat('k', value) as binary) as key",
    "case when value % 10 = 3 then cast('{bad' as binary)"
    " else cast(to_json(named_struct('id', value)) as binary) end as value",
    "'rate' as topic", "0 as partition", "value as offset", "timestamp", "0 as timestampType",
    "array(named_struct('key', 'src', 'value', cast('rate' as binary))) as headers",
]


def enrich(pdf):
    ids = pdf["parsed_value"].map(lambda v: v["id"])
    if (ids % 10 == 7).any():
        raise ValueError(f"cannot enrich {sorted(int(i) for i in ids if i % 10 == 7)}")
    return pdf.assign(id=ids, twice=ids * 2)[["id", "twice"]]


def test_streaming_micro_batches_commit_only_after_their_dlq_records_are_acknowledged(
        spark, sidecar, broker, topic_name, tmp_path):
    job = Job(f"stream-{uuid.uuid4().hex[:8]}", {
        "errors.tolerance": "all",
        "errors.deadletterqueue.topic.name": topic_name,
        "errors.deadletterqueue.context.headers.enable": "true",
        "errors.deadletterqueue.auto.create.topics.enable": "true",
        "errors.deadletterqueue.topic.replication.factor": "1",
    }, sidecar=sidecar.address)
    job.register()
    out_dir = tmp_path / "out"
    out_dir.mkdir()

    source = (spark.readStream.format("rate").option("rowsPerSecond", 40)
              .option("numPartitions", 2).load().selectExpr(*KAFKA_SHAPED))
    parsed = job.deserialize(source, value=json.loads, value_type="struct<id:long>")
    enriched = job.map_in_pandas(parsed, enrich, "id long, twice long")

    def write(rows, batch_id):  # idempotent: one file per (batch, id)
        for r in rows:
            (out_dir / f"{batch_id}-{r.id}").write_text(str(r.twice))

    write_batch = job.foreach_batch(write)
    committed: list[tuple[int, int, int]] = []

    def on_batch(batch_df, batch_id):
        write_batch(batch_df, batch_id)
        s = job.summary()  # what the sidecar has when the batch is about to commit
        committed.append((batch_id, s.total_records_skipped, s.dlq_records_written))

    query = (enriched.writeStream.foreachBatch(on_batch)
             .option("checkpointLocation", str(tmp_path / "checkpoint"))
             .trigger(processingTime="700 milliseconds").start())
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (
                len(committed) >= 3 and committed[-1][1] >= 4):
            assert query.exception() is None, query.exception()
            time.sleep(0.2)
    finally:
        query.stop()
    assert len(committed) >= 3 and committed[-1][1] >= 4, committed
    for batch_id, skipped, acknowledged in committed:
        assert skipped == acknowledged, f"batch {batch_id}: {skipped} skipped, {acknowledged} acked"

    done = {b for b, _, _ in committed}
    written = {int(p.name.split("-")[1]) for p in out_dir.iterdir()
               if int(p.name.split("-")[0]) in done}
    assert written and all(i % 10 not in (3, 7) for i in written)
    top = max(written)
    dlq = {}
    for m in read_all(broker.bootstrap_servers, topic_name):
        h = dict(m.headers())
        dlq[int(h["__connect.errors.offset"])] = (h["__connect.errors.stage"],
                                                  h["spillway.record.id"])
    assert {o: st for o, (st, _) in dlq.items() if o < top} == {
        o: b"VALUE_CONVERTER" if o % 10 == 3 else b"TRANSFORMATION"
        for o in range(top) if o % 10 in (3, 7)}
    assert written | {o for o in dlq if o < top} >= set(range(top))
    assert all(rid == f"rate/0/{o}".encode() for o, (_, rid) in dlq.items())
