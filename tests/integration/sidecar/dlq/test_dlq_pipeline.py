"""DlqPipeline against a real Tansu broker: exactly-once landing with headers, wait_task,
restart recovery, backpressure, spool-less mode, missing topics, records Kafka refuses."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from spillway.sidecar.core.dlq_record import build_dlq_record
from spillway.sidecar.core.model import (
    Action,
    Category,
    DlqRecord,
    ExceptionInfo,
    FailedRecord,
    SourceCoordinates,
    Stage,
    StageRef,
    TaskIdentity,
    Verdict,
    task_key,
)
from spillway.sidecar.core.settings import job_settings
from spillway.sidecar.dlq import DlqPipeline
from spillway.sidecar.errors import BackpressureError, DlqError, FlushTimeoutError
from support.kafka import create_topic, read_all

pytestmark = pytest.mark.integration


def records(topic: str, n: int, *, job: str = "job", tk: str = "job/0.0.0/1", start: int = 0,
            size: int = 20) -> list[DlqRecord]:
    return [DlqRecord(topic=topic, key=f"k{i}".encode(), value=b"v" * size,
                      headers=(("spillway.record.id", f"r{i}".encode()),), record_id=f"r{i}",
                      job=job, task_key=tk) for i in range(start, start + n)]


def ids(msgs) -> Counter:
    return Counter(dict(m.headers())["spillway.record.id"].decode() for m in msgs)


@pytest.fixture
def pipelines():
    made: list[DlqPipeline] = []

    def make(bootstrap: str, spool_dir: str, **kw) -> DlqPipeline:
        p = DlqPipeline(bootstrap, spool_dir=spool_dir, **kw).start()
        made.append(p)
        return p

    yield make
    for p in made:
        p.shutdown(0.5)


def test_records_land_exactly_once_with_their_headers(broker, topic_name, tmp_path, pipelines):
    create_topic(broker.bootstrap_servers, topic_name, partitions=3)
    settings = job_settings("orders-etl", {
        "errors.deadletterqueue.topic.name": topic_name,
        "errors.deadletterqueue.context.headers.enable": "true",
    })
    acked = Counter()
    p = pipelines(broker.bootstrap_servers, str(tmp_path),
                  on_ack=lambda job, n: acked.update({job: n}))
    tasks = [TaskIdentity(stage_id=1, partition_id=i, attempt_number=0, task_attempt_id=100 + i,
                          executor_id="1", host="h") for i in range(4)]

    def report(task: TaskIdentity) -> None:
        for batch in range(5):
            dlq = []
            for j in range(50):
                rid = f"{task.partition_id}-{batch}-{j}"
                failed = FailedRecord(
                    record_id=rid, stage=StageRef(Stage.TRANSFORMATION),
                    exception=ExceptionInfo("builtins.ValueError", message="bad €",
                                            stack_trace="Traceback\n  x"),
                    function_name="etl.parse", source=SourceCoordinates("orders", 2, 1000 + j),
                    key=rid.encode(), value=b"\x00\xffpayload", headers=(("orig", None),),
                    traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
                verdict = Verdict(rid, Action.SKIP, Category.DATA, "data error", attempt=1)
                dlq.append(build_dlq_record(settings, failed, verdict, task, now_ms=1,
                                            sidecar_id="s1"))
            p.submit(dlq)

    threads = [threading.Thread(target=report, args=(t,)) for t in tasks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for t in tasks:
        assert p.wait_task(task_key("orders-etl", t), 30) == 250
    assert p.force_flush(10)

    msgs = read_all(broker.bootstrap_servers, topic_name, idle_s=0.5)
    got = ids(msgs)
    assert len(got) == 1000 and set(got.values()) == {1}  # every record, exactly once
    m = next(m for m in msgs if m.key() == b"2-3-7")
    h = dict(m.headers())
    assert m.value() == b"\x00\xffpayload"
    assert h["orig"] is None
    assert h["__connect.errors.topic"] == b"orders"
    assert h["__connect.errors.offset"] == b"1007"
    assert h["__connect.errors.connector.name"] == b"orders-etl"
    assert h["__connect.errors.task.id"] == b"1.2"
    assert h["__connect.errors.exception.message"].decode() == "bad €"
    assert h["spillway.task"] == b"1.2.0 tid=102 executor=1 host=h"
    assert h["traceparent"] == b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    stats = p.stats()
    assert stats["dlq-records-written"] == 1000
    assert stats["deadletterqueue-produce-requests"] == 1000
    assert stats["deadletterqueue-produce-failures"] == 0
    assert stats["spool-depth"] == 0
    assert acked == {"orders-etl": 1000}


def test_wait_task_counts_only_its_own_records(broker, topic_name, tmp_path, pipelines):
    create_topic(broker.bootstrap_servers, topic_name)
    p = pipelines(broker.bootstrap_servers, str(tmp_path))
    assert p.wait_task("job/9.9.9/9", 0.01) == 0  # nothing submitted: answers at once
    p.submit(records(topic_name, 30, tk="job/0.1.0/11"))
    p.submit(records(topic_name, 12, tk="job/0.2.0/12", start=100))
    p.submit(records(topic_name, 5, tk="job/0.1.0/11", start=200))
    assert p.wait_task("job/0.2.0/12", 30) == 12
    assert p.wait_task("job/0.1.0/11", 30) == 35
    assert p.wait_task("job/0.1.0/11", 0) == 35  # asked again: same answer
    # a record reported again by a retried task attempt while spooled is stored once, and the
    # new attempt's barrier still waits for it
    p.submit(records(topic_name, 3, tk="job/0.1.1/13", start=200))
    assert p.wait_task("job/0.1.1/13", 30) == 3
    assert p.force_flush(10)
    assert len(read_all(broker.bootstrap_servers, topic_name, idle_s=0.5)) >= 47


def test_unreachable_kafka_times_out_then_a_restart_delivers_the_spool(
        broker, topic_name, tmp_path, pipelines, unreachable):
    create_topic(broker.bootstrap_servers, topic_name)
    dead = unreachable  # nothing listens there
    p = pipelines(dead, str(tmp_path), producer_overrides={"message.timeout.ms": "1000"})
    p.submit(records(topic_name, 40, tk="job/0.0.0/7"))
    t0 = time.monotonic()
    with pytest.raises(FlushTimeoutError, match="40 DLQ record\\(s\\) of task job/0.0.0/7 not "
                                                "acknowledged by Kafka within 0.5s"):
        p.wait_task("job/0.0.0/7", 0.5)
    assert time.monotonic() - t0 < 5.0  # its deadline, with room for a busy machine
    t0 = time.monotonic()
    assert p.shutdown(1.0) is False  # never hangs on a broker that is not there
    assert time.monotonic() - t0 < 5.0
    # restarted over the same spool dir with a reachable broker: the records are drained
    again = pipelines(broker.bootstrap_servers, str(tmp_path))
    assert again.stats()["spool-depth"] == 40
    assert again.force_flush(20)
    assert again.stats()["spool-depth"] == 0
    assert ids(read_all(broker.bootstrap_servers, topic_name, idle_s=0.5)) == Counter(
        {f"r{i}": 1 for i in range(40)})


def test_spool_high_water_mark_gives_backpressure_never_a_silent_drop(tmp_path, pipelines,
                                                                     unreachable):
    dead = unreachable
    p = pipelines(dead, str(tmp_path), max_records=100, max_bytes=10_000_000)
    p.submit(records("dlq.x", 90))
    with pytest.raises(BackpressureError, match="spool.max.records=100"):
        p.submit(records("dlq.x", 20, start=1000))
    stats = p.stats()
    assert stats["spool-depth"] == 90
    assert stats["backpressure-rejections"] == 1
    p.submit(records("dlq.x", 10, start=2000))
    assert p.stats()["spool-high-water"] == 1.0


def test_without_the_spool_records_still_reach_kafka(broker, topic_name, tmp_path, pipelines):
    create_topic(broker.bootstrap_servers, topic_name)
    p = pipelines(broker.bootstrap_servers, "", spool_enable=False)
    p.submit(records(topic_name, 200, tk="job/0.0.0/3"))
    assert p.wait_task("job/0.0.0/3", 30) == 200
    assert not list(tmp_path.iterdir())  # nothing written to disk
    assert ids(read_all(broker.bootstrap_servers, topic_name, idle_s=0.5)) == Counter(
        {f"r{i}": 1 for i in range(200)})


def test_a_missing_topic_is_never_auto_created_and_its_records_wait(
        broker, topic_name, tmp_path, pipelines):
    p = pipelines(broker.bootstrap_servers, str(tmp_path),
                  producer_overrides={"message.timeout.ms": "500"}, retry_backoff_max_ms=300)
    p.submit(records(topic_name, 25, tk="job/0.0.0/5"))
    with pytest.raises(FlushTimeoutError):
        p.wait_task("job/0.0.0/5", 2.0)
    stats = p.stats()
    assert stats["deadletterqueue-produce-failures"] >= 25
    assert stats["write-retries"] >= 1
    assert stats["spool-depth"] == 25
    from confluent_kafka.admin import AdminClient
    assert topic_name not in AdminClient(
        {"bootstrap.servers": broker.bootstrap_servers}).list_topics(timeout=10).topics
    create_topic(broker.bootstrap_servers, topic_name)  # the operator creates it
    assert p.wait_task("job/0.0.0/5", 30) == 25
    assert ids(read_all(broker.bootstrap_servers, topic_name, idle_s=0.5)) == Counter(
        {f"r{i}": 1 for i in range(25)})


def test_a_record_kafka_refuses_is_set_aside_counted_and_not_looped(
        broker, topic_name, tmp_path, pipelines):
    create_topic(broker.bootstrap_servers, topic_name)
    p = pipelines(broker.bootstrap_servers, str(tmp_path),
                  producer_overrides={"message.max.bytes": "20000"})
    tk = "job/0.0.0/8"
    batch = records(topic_name, 10, tk=tk)
    batch.insert(4, records(topic_name, 1, tk=tk, start=99, size=50_000)[0])
    p.submit(batch)
    with pytest.raises(DlqError, match="1 DLQ record\\(s\\) of task job/0.0.0/8 can never be "
                                       "written to Kafka \\(MSG_SIZE_TOO_LARGE"):
        p.wait_task(tk, 30)
    assert p.force_flush(10)
    time.sleep(0.5)  # nothing more happens: no loop
    stats = p.stats()
    assert stats["dlq-records-written"] == 10
    assert stats["deadletterqueue-produce-requests"] == 11
    assert stats["deadletterqueue-produce-failures"] == 1
    assert stats["write-failures"] == 1
    assert stats["rejected-records"] == 1
    assert stats["write-retries"] == 0
    assert stats["spool-depth"] == 0
    (rejected,) = p.store.rejected()
    assert rejected.record.record_id == "r99" and rejected.error.startswith("MSG_SIZE_TOO_LARGE")
    assert ids(read_all(broker.bootstrap_servers, topic_name, idle_s=0.5)) == Counter(
        {f"r{i}": 1 for i in range(10)})


def test_producer_passthrough_cannot_weaken_the_guarantees(tmp_path):
    from spillway.sidecar.errors import ConfigError

    with pytest.raises(ConfigError, match="producer.kafka.enable.idempotence: cannot be "
                                          "overridden"):
        DlqPipeline("127.0.0.1:1", spool_dir=str(tmp_path),
                    producer_overrides={"producer.kafka.enable.idempotence": "false"})
    with pytest.raises(ConfigError, match="producer.kafka.acks"):
        DlqPipeline("127.0.0.1:1", spool_dir=str(tmp_path), producer_overrides={"acks": "1"})


@pytest.mark.parametrize("value", [None, "true", "false"])
def test_producer_native_is_accepted_and_said_to_have_no_effect_once_at_start(value, caplog):
    """producer.native is deprecated: a configuration that still sets it starts, and a
    warning says once that it has no effect and what decides instead; unset, nothing is
    said."""
    import logging

    from spillway.sidecar.server import start_server

    props = {"listen.address": "127.0.0.1:0", "spool.enable": "false",
             "bootstrap.servers": "127.0.0.1:1"}
    if value is not None:
        props["producer.native"] = value
    with caplog.at_level(logging.WARNING, logger="spillway.sidecar.runtime.bootstrap"):
        running = start_server(props)
        running.stop(0)
    said = [r.getMessage() for r in caplog.records if "producer.native" in r.getMessage()]
    assert len(said) == (0 if value is None else 1)
    assert not said or ("no effect" in said[0] and "SPILLWAY_NO_EXTENSIONS=produce" in said[0])


@pytest.mark.parametrize("off", [False, True])
def test_a_sidecar_says_when_its_c_produce_loop_is_turned_off(off, caplog, monkeypatch):
    import logging

    from spillway.sidecar.server import start_server

    if off:
        monkeypatch.setenv("SPILLWAY_NO_EXTENSIONS", "produce")
    props = {"listen.address": "127.0.0.1:0", "spool.enable": "false",
             "bootstrap.servers": "127.0.0.1:1"}
    with caplog.at_level(logging.WARNING, logger="spillway.sidecar.runtime.bootstrap"):
        running = start_server(props)
        running.stop(0)
    said = [r.getMessage() for r in caplog.records if "C produce loop" in r.getMessage()]
    assert len(said) == (1 if off else 0)
    assert not said or "turned off (SPILLWAY_NO_EXTENSIONS)" in said[0]


def test_producer_native_still_refuses_a_value_that_is_not_a_boolean():
    from spillway.sidecar.core import config
    from spillway.sidecar.errors import ConfigError

    with pytest.raises(ConfigError, match="producer.native"):
        config.parse({"producer.native": "fast"})


@pytest.mark.parametrize("native", [True, False])
def test_librdkafka_holds_the_request_in_flight_and_the_next_at_most(
        broker, topic_name, tmp_path, pipelines, monkeypatch, native):
    """librdkafka's idempotent producer sends a partition's next request only once the last is
    answered; while records it could send wait for that, its broker thread polls without
    sleeping (docs/design/failure-path.md, round eleven). The drain hands it one request's worth
    at a time, the next waiting behind it: librdkafka never holds more than two requests' worth
    of records (its own statistics count them, every 10 ms)."""
    import json

    if not native:
        monkeypatch.setenv("SPILLWAY_NO_EXTENSIONS", "produce")
    create_topic(broker.bootstrap_servers, topic_name)
    held: list[int] = []
    p = pipelines(broker.bootstrap_servers, str(tmp_path), batch_size=100_000,
                  producer_overrides={"statistics.interval.ms": 10,
                                      "stats_cb": lambda s: held.append(json.loads(s)["msg_cnt"])})
    trace = b"t" * 900   # a stack trace's size
    recs = [DlqRecord(topic=topic_name, key=None, value=b"v" * 200,
                      headers=(("spillway.record.id", f"r{i:04}".encode()),
                               ("__connect.errors.exception.stacktrace", trace)),
                      record_id=f"r{i}", job="job", task_key="job/0.0.0/1") for i in range(4000)]
    # librdkafka's bound of each record in a request: 36 + 200 + (10 + 18 + 5) + (10 + 37 + 900)
    # = 1,216 bytes; 100,000 - 4,096 bytes a request: 78 records
    per_request = (100_000 - 4096) // 1216
    for k in range(0, len(recs), 1000):
        p.submit(recs[k:k + 1000])
    assert p.wait_task("job/0.0.0/1", 60) == 4000
    assert max(held) <= 2 * per_request, max(held)
    assert max(held) > 0   # the statistics saw records held
    assert ids(read_all(broker.bootstrap_servers, topic_name)) == \
        Counter(f"r{i:04}" for i in range(4000))
