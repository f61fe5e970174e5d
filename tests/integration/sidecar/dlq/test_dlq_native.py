"""The native DLQ producer (`dlq/_rdkafka.c`, `dlq/native.py`) against confluent-kafka's, on a
real Tansu broker: the same records land with the same keys, values and headers, and the same
delivery reports come back; what it refuses, and how; where it is used."""

from __future__ import annotations

import logging
import time

import pytest
from spillway.sidecar.core.model import DlqRecord
from spillway.sidecar.dlq import DlqPipeline, native
from spillway.sidecar.dlq.producer import KafkaDlqProducer, Outcome, producer_config
from spillway.sidecar.errors import ConfigError
from support.kafka import create_topic, read_all
from support.native import skip_without_a_c_compiler

pytestmark = pytest.mark.integration

needs_native = pytest.mark.skipif(native.unavailable() is not None,
                                  reason=f"no native producer here: {native.unavailable()}")


def test_the_native_producer_is_built_and_loads_where_a_c_compiler_is():
    """`make test` builds the extension where it can; a silent fallback would only show in the
    benchmarks. It loads the librdkafka confluent-kafka ships."""
    skip_without_a_c_compiler()
    assert native.unavailable() is None


def _records(topic: str, n: int) -> list[DlqRecord]:
    out = []
    for i in range(n):
        headers = (("spillway.record.id", f"r{i}".encode()), ("a.str", "text é"),
                   ("a.null", None), ("dup", b"1"), ("dup", b"2"), ("empty", b""))
        out.append(DlqRecord(topic=topic, key=None if i % 7 == 0 else f"k{i}".encode(),
                             value=None if i % 11 == 0 else bytes([i % 256]) * (i % 300),
                             headers=headers if i % 5 else (), record_id=f"r{i}", job="j",
                             task_key="j/0.0.0/1"))
    return out


def _produce_all(producer: KafkaDlqProducer, recs: list[DlqRecord]) -> dict[int, int]:
    tokens = list(range(1000, 1000 + len(recs)))
    n, refused = producer.produce_many(tokens, recs)
    assert (n, refused) == (len(recs), None)
    assert producer.flush(30) == 0
    acked, partitions, failed = producer.take_reports()
    assert failed == []
    assert sorted(acked) == tokens
    return dict(zip(acked, partitions))


def _landed(msgs) -> list:
    return sorted(((m.key(), m.value(), tuple(m.headers() or ())) for m in msgs),
                  key=repr)


@needs_native
def test_native_and_confluent_land_the_same_records_and_reports(broker, topic_name):
    create_topic(broker.bootstrap_servers, topic_name, partitions=3)
    recs = _records(topic_name, 300)
    conf = producer_config(broker.bootstrap_servers, linger_ms=5, batch_size=100_000)
    fast = KafkaDlqProducer(conf)
    slow = KafkaDlqProducer(conf, native_ok=False)
    assert fast._native and not slow._native
    try:
        placed = _produce_all(fast, recs)
        assert set(placed.values()) <= {0, 1, 2} and len(set(placed.values())) > 1
        first = read_all(broker.bootstrap_servers, topic_name)
        _produce_all(slow, recs)
        both = read_all(broker.bootstrap_servers, topic_name)
    finally:
        fast.close(5)
        slow.close(5)
    assert len(first) == 300 and len(both) == 600
    mine = _landed(first)
    assert _landed(both) == sorted(mine * 2, key=repr)
    # what went in came out: str header values as UTF-8, None as a null value, order kept
    by_key = {m.key(): m for m in first}
    m = by_key[b"k1"]
    assert m.headers() == [("spillway.record.id", b"r1"), ("a.str", "text é".encode()),
                           ("a.null", None), ("dup", b"1"), ("dup", b"2"), ("empty", b"")]
    assert by_key[b"k5"].headers() is None and by_key[b"k5"].value() == bytes([5]) * 5
    assert any(m.key() is None and m.value() is None for m in first)   # no key, no value


@needs_native
def test_a_record_kafka_refuses_is_refused_by_name_and_the_rest_go_on(broker, topic_name):
    create_topic(broker.bootstrap_servers, topic_name)
    conf = producer_config(broker.bootstrap_servers, linger_ms=5, batch_size=100_000,
                           overrides={"message.max.bytes": "10000"})
    p = KafkaDlqProducer(conf)
    recs = _records(topic_name, 3)
    recs[1] = DlqRecord(topic=topic_name, key=b"big", value=b"x" * 20_000, headers=(),
                        record_id="big", job="j", task_key="j/0.0.0/1")
    try:
        n, refused = p.produce_many([1, 2, 3], recs)
        assert n == 1 and refused is not None
        assert refused.failure.name == "MSG_SIZE_TOO_LARGE"
        assert refused.failure.outcome is Outcome.REJECT
        n, refused = p.produce_many([3], recs[2:])
        assert (n, refused) == (1, None)
        assert p.flush(30) == 0
        assert sorted(p.take_reports()[0]) == [1, 3]
    finally:
        p.close(5)


@needs_native
def test_a_full_queue_takes_what_fits_and_no_more():
    # nothing listens on port 1: records queue up in librdkafka until its bound
    conf = producer_config("127.0.0.1:1", linger_ms=5, batch_size=100_000,
                           overrides={"queue.buffering.max.messages": "10"})
    p = KafkaDlqProducer(conf)
    try:
        n, refused = p.produce_many(list(range(25)), _records("t", 25), max_wait_s=0.2)
        assert (n, refused) == (10, None)
        assert p.outstanding() == 10
        with pytest.raises(BufferError):
            p.produce(_records("t", 1)[0], 99, max_wait_s=0.1)
    finally:
        p.close(0)


@needs_native
def test_bad_settings_and_bad_records_are_refused_by_name():
    with pytest.raises(ConfigError, match="no.such.setting"):
        KafkaDlqProducer(producer_config("127.0.0.1:1", linger_ms=5, batch_size=1000,
                                         overrides={"no.such.setting": "1"}))._get()
    with pytest.raises(ConfigError, match="delivery report"):
        producer_config("127.0.0.1:1", linger_ms=5, batch_size=1000,
                        overrides={"delivery.report.only.error": "true"})
    p = KafkaDlqProducer(producer_config("127.0.0.1:1", linger_ms=5, batch_size=1000))
    h = p._get()
    rec = _records("t", 2)[1]
    bad = [DlqRecord(topic="t", key="a str key", value=None, headers=(), record_id="x",
                     job="j", task_key="j/0.0.0/1"),
           DlqRecord(topic="t", key=None, value=None, headers=(("h", 3),), record_id="x",
                     job="j", task_key="j/0.0.0/1"),
           DlqRecord(topic="t", key=None, value=None, headers=((b"h", b""),), record_id="x",
                     job="j", task_key="j/0.0.0/1"),
           DlqRecord(topic="t", key=None, value=None, headers="h: v", record_id="x",
                     job="j", task_key="j/0.0.0/1"),
           DlqRecord(topic="t", key=None, value=None, headers=(("h", b"v", b"w"),),
                     record_id="x", job="j", task_key="j/0.0.0/1")]
    try:
        for b in bad:
            with pytest.raises(TypeError, match="DLQ record 1"):
                h.produce_records([rec, b], [1, 2], 1)
        with pytest.raises(ValueError, match="one token per record"):
            h.produce_records([rec], [1, 2], 0)
        with pytest.raises(ValueError, match="start"):
            h.produce_records([rec], [1], 2)
        assert h.produce_records([rec], [1], 1) == (0, 0, "")
        # headers as lists are headers too (DlqRecords hold tuples)
        listed = DlqRecord(topic="t", key=None, value=None, headers=[["h", b"v"]],
                           record_id="x", job="j", task_key="j/0.0.0/1")
        assert h.produce_records([listed], [7], 0) == (1, 0, "")
        h.purge()       # what was queued would now be reported failed (_PURGE_QUEUE)
        p.poll(0.2)
        _, _, failed = p.take_reports()
        assert [token for token, _ in failed] == [7]    # nothing refused was queued
    finally:
        p.close(0)
    with pytest.raises(RuntimeError, match="closed"):
        h.produce_records([rec], [1], 0)
    with pytest.raises(RuntimeError, match="closed"):
        h.poll(0)


@needs_native
def test_librdkafkas_log_lines_and_errors_reach_python(caplog):
    errors = []
    p = KafkaDlqProducer(producer_config("127.0.0.1:1", linger_ms=5, batch_size=1000,
                                         overrides={"debug": "generic"}))
    p._on_error = errors.append
    with caplog.at_level(logging.DEBUG, logger="spillway.dlq.librdkafka"):
        p._get()
        deadline = time.monotonic() + 20
        while not errors and time.monotonic() < deadline:
            p.poll(0.1)
    p.close(0)
    assert any(r.name == "spillway.dlq.librdkafka" for r in caplog.records)
    assert errors and all(e.code() < 0 for e in errors)   # e.g. _TRANSPORT, _ALL_BROKERS_DOWN


def test_producer_native_false_and_a_factory_use_confluent_kafka(tmp_path):
    off = DlqPipeline("127.0.0.1:1", spool_enable=False, native_producer=False)
    assert not off._producer._native
    made = []
    faked = DlqPipeline("127.0.0.1:1", spool_enable=False,
                        producer_factory=lambda conf: made.append(conf))
    assert not faked._producer._native
    on = DlqPipeline("127.0.0.1:1", spool_enable=False)
    assert on._producer._native == (native.unavailable() is None)


class _Taken:
    """What `_rdkafka.Producer.take` gives, crafted: the wrapper's reading of it."""

    def __init__(self, taken) -> None:
        self.taken = taken

    def take(self):
        return self.taken

    def fatal(self):
        return 47, "the producer's epoch is fenced"


def test_reports_errors_and_a_loss_are_read_as_confluent_kafka_would_give_them():
    from spillway.sidecar.dlq.producer import _Deliveries, classify

    d, errors = _Deliveries(), []
    h = native.NativeHandle.__new__(native.NativeHandle)
    h._deliveries, h._on_error, h._logger = d, errors.append, logging.getLogger("t")
    h._p = _Taken(([1, 2], [0, 1], [(3, -192)], [(0, -150, "fatal error")],
                   [(7, 0, "FAC: a line")], 0, True))
    h._serve()
    assert (d.acked, d.partitions) == ([1, 2], [0, 1])
    assert d.failed[0][0] == 3 and d.failed[0][1].name() == "_MSG_TIMED_OUT"
    assert errors[0].code() == 47 and errors[0].fatal()     # the real code of the fatal error
    assert classify(errors[0]).outcome is Outcome.REBUILD
    # a delivery report C could not store: the producer is rebuilt, its records produced again
    assert errors[1].fatal() and classify(errors[1]).outcome is Outcome.REBUILD


@pytest.mark.parametrize("why", [None, "the C extension was not built"])
def test_a_sidecar_without_the_native_producer_says_so_and_why_at_start(why, monkeypatch,
                                                                        caplog):
    from spillway.sidecar.server import start_server

    monkeypatch.setattr(native, "unavailable", lambda: why)
    with caplog.at_level(logging.WARNING, logger="spillway.sidecar.runtime.bootstrap"):
        running = start_server({"listen.address": "127.0.0.1:0", "spool.enable": "false",
                                "bootstrap.servers": "127.0.0.1:1"})
        running.stop(0)
    said = [r.getMessage() for r in caplog.records if "confluent-kafka's produce()" in
            r.getMessage()]
    assert len(said) == (1 if why else 0)
    assert not why or why in said[0]


@needs_native
def test_closing_while_another_thread_flushes_is_refused_not_a_crash():
    import threading

    p = KafkaDlqProducer(producer_config("127.0.0.1:1", linger_ms=5, batch_size=1000))
    h = p._get()
    assert h.produce_records(_records("t", 1), [1], 0) == (1, 0, "")   # held: no broker
    flushing = threading.Thread(target=h.flush, args=(2.0,))
    flushing.start()
    time.sleep(0.3)
    with pytest.raises(RuntimeError, match="another thread"):
        h.close()
    flushing.join()
    h.purge()
    h.close()
    with pytest.raises(RuntimeError, match="closed"):
        h.flush(0)
