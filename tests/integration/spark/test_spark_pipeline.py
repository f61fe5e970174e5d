"""spillway.spark end to end on one machine: the real sidecar servicer, a real Tansu broker for
the DLQ and a real local Spark session (the conftest fixtures)."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import sys
import uuid

import pytest
from pyspark import cloudpickle
from pyspark.sql import Row
from pyspark.testing import assertDataFrameEqual
from spillway.spark import KAFKA_SOURCE_SCHEMA, Job, RetriableError
from support.kafka import header_map, read_all
from support.orders import bump

pytestmark = pytest.mark.integration

# Spark's Python workers cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

OUT_SCHEMA = "id int, amount double"


def _props(topic: str, **extra: str) -> dict[str, str]:
    return {
        "errors.tolerance": "all",
        "errors.deadletterqueue.topic.name": topic,
        "errors.deadletterqueue.context.headers.enable": "true",
        "errors.deadletterqueue.auto.create.topics.enable": "true",
        "errors.deadletterqueue.topic.replication.factor": "1",
        "errors.retry.timeout": "30000",
        "errors.retry.initial.backoff.ms": "50",
        **extra,
    }


def _job(sidecar, topic, **extra):
    job = Job(f"it-{uuid.uuid4().hex[:8]}", _props(topic, **extra), sidecar=sidecar.address)
    job.register()
    return job


def kafka_rows(n: int, poison: dict[int, bytes] | None = None, topic: str = "orders"):
    """n records shaped like Spark's Kafka source; value is JSON unless poisoned."""
    poison = poison or {}
    ts = dt.datetime(2024, 5, 1, 12, 0, 0)
    return [(f"k{i}".encode(), poison.get(i, json.dumps({"id": i, "amount": i * 1.5}).encode()),
             topic, 0, i, ts, 0, [("origin", b"test"), ("seq", str(i).encode())])
            for i in range(n)]


def parse_order(row):
    doc = json.loads(row.value)
    return Row(id=doc["id"], amount=float(doc["amount"]))


def _expected(spark, ids):
    return spark.createDataFrame([(i, i * 1.5) for i in ids], OUT_SCHEMA)


def test_transient_failure_is_retried_and_poison_is_dead_lettered(spark, sidecar, broker,
                                                                  topic_name, tmp_path):
    job = _job(sidecar, topic_name)
    marker = str(tmp_path / "failed-once")

    def parse(row):
        if row.offset == 7 and not os.path.exists(marker):  # fails once, in whichever worker
            open(marker, "w").close()
            raise RetriableError("inventory service busy")
        return parse_order(row)

    df = spark.createDataFrame(kafka_rows(20, poison={13: b"{not json"}), KAFKA_SOURCE_SCHEMA)
    out = job.map_partitions(df, parse, schema=OUT_SCHEMA)
    assertDataFrameEqual(out, _expected(spark, [i for i in range(20) if i != 13]))

    # flush barrier: once the action returned, the DLQ record is acknowledged by Kafka
    summary = job.summary()
    assert (summary.total_retries, summary.total_records_skipped,
            summary.dlq_records_written) == (1, 1, 1)
    assert summary.by_stage == {"TRANSFORMATION": 2}
    assert summary.records_processed == 20

    [msg] = read_all(broker.bootstrap_servers, topic_name)
    assert (msg.key(), msg.value()) == (b"k13", b"{not json")
    h = header_map(msg)
    assert h["origin"] == b"test" and h["seq"] == b"13"  # original headers copied
    assert h["__connect.errors.topic"] == b"orders"
    assert h["__connect.errors.offset"] == b"13"
    assert h["__connect.errors.stage"] == b"TRANSFORMATION"
    assert h["__connect.errors.exception.class.name"] == b"json.decoder.JSONDecodeError"
    assert h["__connect.errors.class.name"].endswith(b"test_transient_failure_is_retried_and_"
                                                     b"poison_is_dead_lettered.<locals>.parse")
    assert h["spillway.record.id"] == b"orders/0/13"
    assert re.fullmatch(rb"00-[0-9a-f]{32}-[0-9a-f]{16}-0[13]", h["traceparent"])


def test_tolerance_none_fails_the_job_naming_stage_and_exception(spark, sidecar, topic_name):
    job = Job(f"it-none-{uuid.uuid4().hex[:8]}", {"errors.tolerance": "none"},
              sidecar=sidecar.address)
    df = spark.createDataFrame(kafka_rows(6, poison={4: b"\xff"}), KAFKA_SOURCE_SCHEMA)
    with pytest.raises(Exception) as info:
        job.map_partitions(df, parse_order, schema=OUT_SCHEMA).collect()
    text = str(info.value)
    assert "ToleranceExceededError" in text
    assert "stage TRANSFORMATION" in text
    assert "UnicodeDecodeError" in text
    assert "errors.tolerance=none" in text
    assert Job.failure_message(info.value).startswith(
        f"ToleranceExceededError: spillway job '{job.name}' failed in stage TRANSFORMATION")
    summary = job.summary()
    assert summary.failed and "errors.tolerance=none" in summary.failure_reasons[0]


def test_rdd_in_rdd_out_with_positional_ids(spark, sidecar, topic_name, broker):
    job = _job(sidecar, topic_name)
    rdd = spark.sparkContext.parallelize(range(10), 2)
    out = job.map_partitions(rdd, lambda x: 100 // (x - 6), name="divide")
    assert len(out.take(2)) == 2  # Spark stops reading early: no flush needed, no error
    assert sorted(out.collect()) == sorted(100 // (x - 6) for x in range(10) if x != 6)
    [msg] = read_all(broker.bootstrap_servers, topic_name)
    assert (header_map(msg)["spillway.record.id"]
            == f"TRANSFORMATION:{job.name}/divide#1:p1:r1".encode())
    assert msg.value() == b"6"  # a record without Kafka bytes is dead-lettered as JSON


def test_deserialize_reports_key_and_value_converter_stages(spark, sidecar, broker, topic_name):
    job = _job(sidecar, topic_name)
    rows = kafka_rows(8, poison={2: b"[broken"})
    rows[5] = (b"\xffbad-key",) + rows[5][1:]

    def decode_key(b):
        return b.decode("ascii").removeprefix("k")

    def decode_value(b):
        return json.loads(b)

    df = spark.createDataFrame(rows, KAFKA_SOURCE_SCHEMA)
    out = job.deserialize(df, key=decode_key, key_type="string", value=decode_value,
                          value_type="struct<id:int,amount:double>")
    assert out.columns[:8] == list(df.columns) and out.columns[8:] == ["parsed_key",
                                                                      "parsed_value"]
    got = out.select("offset", "parsed_key", "parsed_value.id", "value")
    assertDataFrameEqual(got, spark.createDataFrame(
        [(i, str(i), i, rows[i][1]) for i in range(8) if i not in (2, 5)],
        "offset long, parsed_key string, id int, value binary"))
    msgs = sorted(read_all(broker.bootstrap_servers, topic_name), key=lambda m: m.key())
    assert [(m.key(), header_map(m)["__connect.errors.stage"]) for m in msgs] == [
        (b"k2", b"VALUE_CONVERTER"), (b"\xffbad-key", b"KEY_CONVERTER")]
    assert msgs[0].value() == b"[broken"
    assert header_map(msgs[0])["__connect.errors.class.name"].endswith(b"decode_value")
    assert header_map(msgs[1])["__connect.errors.class.name"].endswith(b"decode_key")


def _has_bad(ids, bad):
    return bool(set(int(i) for i in ids) & bad)


def test_map_in_pandas_isolates_failing_rows_by_bisection(spark, sidecar, broker, topic_name):
    job = _job(sidecar, topic_name)
    bad = {17, 42}

    def score(pdf):
        if _has_bad(pdf["id"], bad):
            raise ValueError(f"cannot score {sorted(set(pdf['id']) & bad)}")
        return pdf.assign(score=pdf["id"] * 0.5)

    df = spark.range(0, 60, numPartitions=2)
    out = job.map_in_pandas(df, score, "id long, score double")
    assertDataFrameEqual(out, spark.createDataFrame(
        [(i, i * 0.5) for i in range(60) if i not in bad], "id long, score double"))
    summary = job.summary()
    assert summary.total_record_failures == 2 and summary.records_processed == 60
    msgs = read_all(broker.bootstrap_servers, topic_name)
    assert sorted(json.loads(m.value())["id"] for m in msgs) == sorted(bad)


def test_map_in_arrow_isolates_failing_rows(spark, sidecar, topic_name):
    import pyarrow.compute as pc

    job = _job(sidecar, topic_name)

    def halve(batch):
        if pc.any(pc.equal(batch.column("id"), 5)).as_py():
            raise ZeroDivisionError("row 5")
        return batch

    out = job.map_in_arrow(spark.range(0, 12, numPartitions=2), halve, "id long")
    assert sorted(r.id for r in out.collect()) == [i for i in range(12) if i != 5]
    assert job.summary().by_exception_class == {"builtins.ZeroDivisionError": 1}


def test_udf_turns_failures_into_null_or_an_error_column(spark, sidecar, topic_name):
    job = _job(sidecar, topic_name)

    @job.udf("int")
    def parse_int(s):
        return int(s)

    @job.udf("int", error_column=True, name="parse_int_err")
    def parse_int_err(s):
        return int(s)

    df = spark.createDataFrame([("1",), ("x",), ("3",)], "s string").coalesce(1)
    got = df.select("s", parse_int("s").alias("n")).collect()
    assert sorted((r.s, r.n) for r in got) == [("1", 1), ("3", 3), ("x", None)]
    got = {r.s: r.r for r in df.select("s", parse_int_err("s").alias("r")).collect()}
    assert got["1"].value == 1 and got["1"].error is None
    assert got["x"].value is None
    err = got["x"].error
    assert (err.stage, err.exception_class, err.dead_lettered) == (
        "TRANSFORMATION", "builtins.ValueError", True)
    assert "invalid literal" in err.message and err.reason.startswith("skipped")
    assert job.summary().dlq_records_written == 2


def test_sink_retries_transient_writes_and_dead_letters_unwritable_rows(
        spark, sidecar, broker, topic_name, tmp_path):
    job = _job(sidecar, topic_name)
    out_dir, marker = tmp_path / "sink", str(tmp_path / "sink-failed-once")
    out_dir.mkdir()

    def write(rows):
        for r in rows:
            if r.id == 9:
                raise ValueError("row 9 rejected by the sink")
            if r.id == 4 and bump(marker) <= 3:  # in its chunk of 4, its half, then alone
                raise RetriableError("sink throttled")
        for r in rows:  # idempotent: one file per id
            (out_dir / str(r.id)).write_text(str(r.id))

    job.foreach_partition(spark.range(0, 16, numPartitions=2), write, batch_size=4)
    assert sorted(int(p.name) for p in out_dir.iterdir()) == [i for i in range(16) if i != 9]
    [msg] = read_all(broker.bootstrap_servers, topic_name)
    assert header_map(msg)["__connect.errors.stage"] == b"TASK_PUT"
    assert json.loads(msg.value()) == {"id": 9}
    assert job.summary().total_retries == 1


def test_unreachable_sidecar_fails_the_task_clearly_but_clean_partitions_never_call(spark,
                                                                                   sidecar):
    from spillway.client import SidecarUnavailableError
    from support.ports import free_port

    dead = f"127.0.0.1:{free_port()}"
    # on the driver: declaring the job is the reachability check, naming the address
    with pytest.raises(SidecarUnavailableError, match=dead):
        Job(f"it-dead-{uuid.uuid4().hex[:8]}", {"errors.tolerance": "all"}, sidecar=dead
            ).map_partitions(spark.sparkContext.parallelize([1]), parse_order)
    # on executors whose node sidecar is gone: clean partitions make no call
    env = spark.sparkContext.environment
    try:
        env["SPILLWAY_SIDECAR_ADDRESS"] = dead
        job = Job(f"it-dead-{uuid.uuid4().hex[:8]}", {"errors.tolerance": "all"},
                  sidecar=sidecar.address)
        df = spark.createDataFrame(kafka_rows(6), KAFKA_SOURCE_SCHEMA)
        assertDataFrameEqual(job.map_partitions(df, parse_order, schema=OUT_SCHEMA),
                             _expected(spark, range(6)))
        bad = spark.createDataFrame(kafka_rows(6, poison={1: b"?"}), KAFKA_SOURCE_SCHEMA)
        with pytest.raises(Exception) as info:
            job.map_partitions(bad, parse_order, schema=OUT_SCHEMA).collect()
    finally:
        del env["SPILLWAY_SIDECAR_ADDRESS"]
    text = str(info.value)
    assert "SidecarUnavailableError" in text and dead in text
    assert "SPILLWAY_SIDECAR_ADDRESS" in text


def test_executors_report_to_their_own_nodes_sidecar_which_defers_to_the_home(
        spark, sidecar, broker, tmp_path):
    """The executors' environment names another sidecar than the driver's: the executors
    register the job there themselves, naming the driver's sidecar as its home, and that home
    makes the decisions (so job-wide counts live there)."""
    from spillway.sidecar.server import start_server

    other = start_server({"listen.address": "127.0.0.1:0",
                          "spool.dir": str(tmp_path / "spool-b"),
                          # it dials the driver's sidecar, on this host, as the job's home
                          "home.allowed.addresses": "127.0.0.0/8"})
    env = spark.sparkContext.environment
    try:
        env["SPILLWAY_SIDECAR_ADDRESS"] = other.address
        job = Job(f"it-node-{uuid.uuid4().hex[:8]}", {"errors.tolerance": "all"},
                  sidecar=sidecar.address)
        job.register()  # on the driver's sidecar only
        rdd = spark.sparkContext.parallelize(range(4), 1)
        assert sorted(job.map_partitions(rdd, lambda x: 1 // (x - 2)).collect()) == [-1, -1, 1]
        on_node = job.summary([other.address])
        on_driver = job.summary()
        both = job.summary([sidecar.address, other.address])
    finally:
        del env["SPILLWAY_SIDECAR_ADDRESS"]
        other.stop(0.5)
    run = other.sidecar.registry.get(job.name, job.run_id)
    assert run is not None and run.home is not None  # the node's sidecar forwards to the home
    assert (on_node.total_record_failures, on_node.records_processed) == (0, 0)
    assert (on_driver.total_record_failures, on_driver.records_processed) == (1, 4)
    assert both.total_record_failures == 1 and set(both.per_sidecar) == {sidecar.address,
                                                                          other.address}


def test_wrappers_pipelined_in_one_task_both_count_their_records(spark, sidecar, topic_name):
    job = _job(sidecar, topic_name)
    df = spark.createDataFrame(kafka_rows(40, poison={i: b"{bad" for i in range(3, 40, 10)}),
                               KAFKA_SOURCE_SCHEMA).coalesce(1)
    parsed = job.deserialize(df, value=json.loads, value_type="struct<id:int,amount:double>")

    def drop_sevens(pdf):
        ids = pdf["parsed_value"].map(lambda v: v["id"])
        if (ids % 10 == 7).any():
            raise ValueError("sevens")
        return pdf.assign(id=ids)[["id"]]

    assert job.map_in_pandas(parsed, drop_sevens, "id int").count() == 32
    s = job.summary()
    assert s.by_stage == {"VALUE_CONVERTER": 4, "TRANSFORMATION": 4}
    assert s.records_processed == 40 + 36
