"""Native deserialization (`job.deserialize(df, value="json" | "csv" | "avro")`): Spark parses in
the JVM, only the corrupt rows reach Python and the sidecar; the real sidecar, Tansu broker and
local Spark of the conftest fixtures."""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
import uuid

import pytest
from pyspark import cloudpickle
from pyspark.sql import Row
from pyspark.testing import assertDataFrameEqual
from spillway.spark import KAFKA_SOURCE_SCHEMA, Job, UnsupportedOnThisSparkError
from support.kafka import header_map, read_all

pytestmark = pytest.mark.integration

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _job(sidecar, topic, **extra):
    job = Job(f"native-{uuid.uuid4().hex[:8]}", {
        "errors.tolerance": "all",
        "errors.deadletterqueue.topic.name": topic,
        "errors.deadletterqueue.context.headers.enable": "true",
        "errors.deadletterqueue.auto.create.topics.enable": "true",
        "errors.deadletterqueue.topic.replication.factor": "1",
        **extra}, sidecar=sidecar.address)
    job.register()
    return job


def kafka_rows(values: list[bytes | None], topic: str = "orders", partition: int = 3):
    ts = dt.datetime(2024, 5, 1, 12, 0, 0)
    return [(f"k{i}".encode(), v, topic, partition, 100 + i, ts, 0,
             [("origin", b"test"), ("seq", str(i).encode())]) for i, v in enumerate(values)]


JSON_VALUES = [json.dumps({"id": i, "amount": i * 1.5}).encode() for i in range(12)]
JSON_VALUES[2] = b"{broken"                       # syntax
JSON_VALUES[5] = b'{"id": "five", "amount": 1}'   # does not fit the declared type
JSON_VALUES[7] = None                             # a tombstone: not corrupt, parsed as null
JSON_VALUES[9] = b""                              # empty: corrupt


def test_json_corrupt_rows_are_dead_lettered_with_original_bytes_and_coordinates(
        spark, sidecar, broker, topic_name):
    job = _job(sidecar, topic_name)
    df = spark.createDataFrame(kafka_rows(JSON_VALUES), KAFKA_SOURCE_SCHEMA)
    out = job.deserialize(df, value="json", value_type="struct<id:int,amount:double>")
    assert out.columns == list(df.columns) + ["parsed_value"]
    assert out.schema["parsed_value"].dataType.simpleString() == "struct<id:int,amount:double>"
    good = [i for i in range(12) if i not in (2, 5, 9)]
    assertDataFrameEqual(out.select("offset", "value", "parsed_value"), spark.createDataFrame(
        [(100 + i, JSON_VALUES[i], None if i == 7 else Row(id=i, amount=i * 1.5))
         for i in good], "offset long, value binary, parsed_value struct<id:int,amount:double>"))

    s = job.summary()
    assert (s.total_records_skipped, s.dlq_records_written) == (3, 3)
    assert s.by_stage == {"VALUE_CONVERTER": 3}
    assert s.by_category == {"data": 3}
    msgs = sorted(read_all(broker.bootstrap_servers, topic_name),
                  key=lambda m: int(header_map(m)["__connect.errors.offset"]))
    assert [(m.key(), m.value()) for m in msgs] == [
        (b"k2", b"{broken"), (b"k5", b'{"id": "five", "amount": 1}'), (b"k9", b"")]
    h = header_map(msgs[0])
    assert h["origin"] == b"test" and h["seq"] == b"2"            # the original headers
    assert h["__connect.errors.topic"] == b"orders"
    assert h["__connect.errors.partition"] == b"3"
    assert h["__connect.errors.offset"] == b"102"
    assert h["spillway.record.id"] == b"orders/3/102"
    assert h["__connect.errors.stage"] == b"VALUE_CONVERTER"
    assert h["__connect.errors.class.name"] == b"spark:from_json"
    assert h["__connect.errors.exception.class.name"] == \
        b"spillway.spark._native.CorruptRecordError"
    msg = h["__connect.errors.exception.message"].decode()
    assert "from_json" in msg and "struct<id:int,amount:double>" in msg and "corrupt" in msg
    assert "does not fit" in header_map(msgs[1])["__connect.errors.exception.message"].decode()
    assert "empty" in header_map(msgs[2])["__connect.errors.exception.message"].decode()


def test_good_rows_never_reach_python(spark, sidecar, topic_name, tmp_path):
    """The plan's good branch has no Python node; the reporting branch's Python sees only the
    corrupt rows (counted by the sidecar: records_processed is what Python processed)."""
    job = _job(sidecar, topic_name)
    values = [json.dumps({"id": i}).encode() for i in range(200)]
    values[17] = b"not json"
    df = spark.createDataFrame(kafka_rows(values), KAFKA_SOURCE_SCHEMA).repartition(4)
    out = job.deserialize(df, value="json", value_type="id int")
    plan = out._jdf.queryExecution().optimizedPlan()
    assert plan.nodeName() == "Union"
    good, report = (plan.children().apply(i).toString() for i in (0, 1))
    assert "from_json" in good and "MapInArrow" not in good and "Python" not in good, good
    assert "MapInArrow" in report
    assert out.count() == 199
    s = job.summary()
    assert s.total_records_skipped == 1
    assert s.records_processed == 1   # only the corrupt row went through Python


def test_tolerance_none_fails_the_action(spark, sidecar, topic_name):
    job = Job(f"native-none-{uuid.uuid4().hex[:8]}", {"errors.tolerance": "none"},
              sidecar=sidecar.address)
    df = spark.createDataFrame(kafka_rows([b'{"id":1}', b"{nope"]), KAFKA_SOURCE_SCHEMA)
    with pytest.raises(Exception) as info:
        job.deserialize(df, value="json", value_type="id int").collect()
    message = Job.failure_message(info.value)
    assert message.startswith(f"ToleranceExceededError: spillway job '{job.name}' failed in "
                              f"stage VALUE_CONVERTER"), message
    assert "CorruptRecordError" in str(info.value) and "errors.tolerance=none" in message
    assert job.summary().failed


def test_csv_key_and_json_value_report_the_step_that_failed(spark, sidecar, broker, topic_name):
    job = _job(sidecar, topic_name)
    rows = kafka_rows([b'{"id":%d}' % i for i in range(6)])
    rows = [(f"{i},tenant{i}".encode(),) + r[1:] for i, r in enumerate(rows)]
    rows[1] = (b"1,tenant1,extra",) + rows[1][1:]        # one field too many: corrupt key
    rows[4] = rows[4][:1] + (b"[1",) + rows[4][2:]       # corrupt value
    df = spark.createDataFrame(rows, KAFKA_SOURCE_SCHEMA)
    out = job.deserialize(df, key="csv", key_type="n int, tenant string", value="json",
                          value_type="id int", value_options={"allowComments": True})
    got = out.select("offset", "parsed_key.tenant", "parsed_value.id")
    assertDataFrameEqual(got, spark.createDataFrame(
        [(100 + i, f"tenant{i}", i) for i in (0, 2, 3, 5)],
        "offset long, tenant string, id int"))
    msgs = sorted(read_all(broker.bootstrap_servers, topic_name), key=lambda m: m.key())
    assert [(m.key(), m.value(), header_map(m)["__connect.errors.stage"],
             header_map(m)["__connect.errors.class.name"]) for m in msgs] == [
        (b"1,tenant1,extra", b'{"id":1}', b"KEY_CONVERTER", b"spark:from_csv"),
        (b"4,tenant4", b"[1", b"VALUE_CONVERTER", b"spark:from_json")]


def test_native_value_with_a_python_key(spark, sidecar, broker, topic_name):
    job = _job(sidecar, topic_name)
    rows = kafka_rows([b'{"id":%d}' % i for i in range(5)])
    rows[3] = (b"\xff",) + rows[3][1:]
    rows[1] = rows[1][:1] + (b"{",) + rows[1][2:]
    df = spark.createDataFrame(rows, KAFKA_SOURCE_SCHEMA)

    def decode_key(b):
        return b.decode("ascii")

    out = job.deserialize(df, key=decode_key, value="json", value_type="id int")
    assert out.columns[-2:] == ["parsed_value", "parsed_key"]
    assertDataFrameEqual(out.select("parsed_key", "parsed_value.id"), spark.createDataFrame(
        [(f"k{i}", i) for i in (0, 2, 4)], "parsed_key string, id int"))
    msgs = sorted(read_all(broker.bootstrap_servers, topic_name), key=lambda m: m.key())
    assert [(header_map(m)["__connect.errors.stage"], header_map(m)["__connect.errors.class.name"])
            for m in msgs] == [(b"VALUE_CONVERTER", b"spark:from_json"),
                               (b"KEY_CONVERTER", decode_key.__module__.encode()
                                + b".test_native_value_with_a_python_key.<locals>.decode_key")]


def test_ratio_limit_counts_every_row(spark, sidecar, topic_name):
    """With errors.tolerance.max.ratio the reporting branch counts every row, so 1 corrupt row
    in 40 is a ratio of 0.025, within 0.1, not 1 error in 1 processed record."""
    job = _job(sidecar, topic_name, **{"errors.tolerance.max.ratio": "0.1",
                                       "errors.tolerance.min.records": "1"})
    values = [b'{"id":%d}' % i for i in range(40)]
    values[30] = b"{"
    df = spark.createDataFrame(kafka_rows(values), KAFKA_SOURCE_SCHEMA).repartition(2)
    assert job.deserialize(df, value="json", value_type="id int").count() == 39
    s = job.summary()
    assert (s.failed, s.total_records_skipped, s.records_processed) == (False, 1, 40)


def test_avro_without_the_package_is_a_clear_error_at_call_time(spark, sidecar, topic_name):
    job = _job(sidecar, topic_name)
    df = spark.createDataFrame(kafka_rows([b"\x02"]), KAFKA_SOURCE_SCHEMA)
    schema = json.dumps({"type": "record", "name": "r", "fields": [{"name": "id",
                                                                      "type": "int"}]})
    jars = spark.sparkContext.getConf().get("spark.jars", "") or ""
    if "spark-avro" in jars:
        pytest.skip("spark-avro is on this session's classpath")
    with pytest.raises(UnsupportedOnThisSparkError, match="spark-avro"):
        job.deserialize(df, value="avro", value_type=schema)


def test_bad_arguments_are_refused_on_the_driver(spark, sidecar, topic_name):
    job = _job(sidecar, topic_name)
    df = spark.createDataFrame(kafka_rows([b"{}"]), KAFKA_SOURCE_SCHEMA)
    with pytest.raises(ValueError, match="mode='FAILFAST' is not supported"):
        job.deserialize(df, value="json", value_type="id int", value_options={"mode": "FAILFAST"})
    with pytest.raises(ValueError, match="columnNameOfCorruptRecord is spillway's"):
        job.deserialize(df, value="json", value_type="id int",
                        value_options={"columnNameOfCorruptRecord": "_bad"})
    with pytest.raises(ValueError, match="unknown format 'xml'"):
        job.deserialize(df, value="xml", value_type="id int")
    with pytest.raises(ValueError, match="from_csv parses into a struct type, got string"):
        job.deserialize(df, value="csv")
    with pytest.raises(ValueError, match="value_options: only with a native format"):
        job.deserialize(df, value=json.loads, value_options={"allowComments": "true"})
    with pytest.raises(ValueError, match="the Avro schema as a JSON string"):
        job.deserialize(df, value="avro", value_type="struct<id:int>")
    with pytest.raises(ValueError, match="__spillway_corrupt"):
        job.deserialize(df, value="json", value_type="__spillway_corrupt string")
    # a permissive mode spelled by the user is fine
    out = job.deserialize(df, value="json", value_type="id int",
                          value_options={"mode": "permissive"})
    assert out.select("parsed_value.id").collect() == [Row(id=None)]


def test_streaming_dataframe(spark, sidecar, broker, topic_name, tmp_path):
    job = _job(sidecar, topic_name)
    source = (spark.readStream.format("rate").option("rowsPerSecond", 50)
              .option("numPartitions", 2).load().selectExpr(
                  "cast(concat('k', value) as binary) as key",
                  "case when value % 10 = 3 then cast('{bad' as binary)"
                  " else cast(to_json(named_struct('id', value)) as binary) end as value",
                  "'rate' as topic", "0 as partition", "value as offset", "timestamp",
                  "0 as timestampType",
                  "array(named_struct('key', 'src', 'value', cast('rate' as binary))) as headers"))
    parsed = job.deserialize(source, value="json", value_type="id long")
    seen: list[int] = []

    def on_batch(batch_df, batch_id):
        seen.extend(r.id for r in batch_df.select("parsed_value.id").collect())

    query = (parsed.writeStream.foreachBatch(on_batch)
             .option("checkpointLocation", str(tmp_path / "cp"))
             .trigger(processingTime="500 milliseconds").start())
    try:
        deadline = time.monotonic() + 120  # a loaded machine takes long per micro-batch
        while time.monotonic() < deadline and not (
                seen and job.summary().dlq_records_written >= 2):
            assert query.exception() is None, query.exception()
            time.sleep(0.2)
    finally:
        query.stop()
    assert seen and all(i % 10 != 3 for i in seen)
    dead = {int(header_map(m)["__connect.errors.offset"])
            for m in read_all(broker.bootstrap_servers, topic_name)}
    assert len(dead) >= 2 and all(o % 10 == 3 for o in dead)
    assert not set(seen) & dead
