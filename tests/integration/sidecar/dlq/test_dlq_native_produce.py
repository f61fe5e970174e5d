"""The DLQ producer's C produce loop (`dlq/_produce.c`) on a real broker: the same records on
the topic as confluent-kafka's produce() writes, every delivery report once under its token,
and the same outcomes for what librdkafka refuses, a full queue and a rebuilt producer."""

from __future__ import annotations

import logging
import time
import types

import pytest
from confluent_kafka import KafkaError
from spillway.sidecar.core.model import DlqRecord
from spillway.sidecar.dlq import producer as producer_mod
from spillway.sidecar.dlq.producer import KafkaDlqProducer, Outcome, producer_config
from spillway.sidecar.errors import ConfigError
from support.kafka import create_topic, read_all

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(producer_mod._native is None,
                                 reason="dlq/_produce.c was not built here")]


def _records(topic: str, n: int) -> list[DlqRecord]:
    """Records with what a DLQ record may carry: no key, a key, header values of bytes, None
    and str, no headers at all, an empty value."""
    out = []
    for i in range(n):
        headers = () if i % 7 == 3 else (
            ("__connect.errors.topic", b"orders"), ("__connect.errors.exception.message",
                                                    f"bad record {i}".encode()),
            ("spillway.note", None), ("spillway.text", "ünïcode"), ("dup", b"1"), ("dup", b"2"))
        out.append(DlqRecord(topic=topic, key=None if i % 2 else f"k{i}".encode(),
                             value=b"" if i % 5 == 4 else b"v" * (i % 300), headers=headers,
                             record_id=f"r{i}", job="j", task_key="t"))
    return out


def _settle(prod: KafkaDlqProducer, want: int, timeout_s: float = 30.0):
    acked, parts, failed = [], [], []
    deadline = time.monotonic() + timeout_s
    while len(acked) + len(failed) < want and time.monotonic() < deadline:
        prod.poll(0.05)
        a, p, f = prod.take_reports()
        acked += a
        parts += p
        failed += f
    return acked, parts, failed


def _produced(broker, topic: str, native: bool, monkeypatch) -> list[tuple]:
    if not native:
        monkeypatch.setenv("SPILLWAY_NO_EXTENSIONS", "produce")
    prod = KafkaDlqProducer(producer_config(broker.bootstrap_servers, linger_ms=5,
                                            batch_size=100_000))
    monkeypatch.delenv("SPILLWAY_NO_EXTENSIONS", raising=False)
    assert prod.native is native
    records = _records(topic, 300)
    tokens = list(range(1000, 1300))
    assert prod.produce_many(tokens, records) == (300, None)
    acked, parts, failed = _settle(prod, 300)
    assert failed == [] and sorted(acked) == tokens   # each report once, under its token
    assert set(parts) <= {0, 1, 2}
    prod.close(10)
    return [(m.key(), m.value(), m.headers()) for m in read_all(broker.bootstrap_servers, topic,
                                                                idle_s=0.5)]


def test_same_records_as_confluent_kafka(broker, monkeypatch):
    topics = [f"dlq.native-{k}-{time.monotonic_ns()}" for k in ("c", "py")]
    for t in topics:
        create_topic(broker.bootstrap_servers, t, partitions=3)
    native = _produced(broker, topics[0], True, monkeypatch)
    python = _produced(broker, topics[1], False, monkeypatch)
    assert len(native) == 300
    assert sorted(native, key=repr) == sorted(python, key=repr)
    with_headers = [h for _, _, h in native if h]
    assert ("spillway.note", None) in with_headers[0] and ("dup", b"2") in with_headers[0]
    assert ("spillway.text", "ünïcode".encode()) in with_headers[0]


def test_refused_record_and_the_rest_of_the_batch(broker, topic_name):
    create_topic(broker.bootstrap_servers, topic_name)
    prod = KafkaDlqProducer(producer_config(broker.bootstrap_servers, linger_ms=5,
                                            batch_size=100_000,
                                            overrides={"message.max.bytes": 10_000}))
    records = _records(topic_name, 3)
    big = DlqRecord(topic=topic_name, key=None, value=b"x" * 20_000, headers=(),
                    record_id="big", job="j", task_key="t")
    n, refused = prod.produce_many([1, 2, 3], [records[0], big, records[1]])
    assert n == 1 and refused is not None
    assert refused.failure.code == KafkaError.MSG_SIZE_TOO_LARGE
    assert refused.failure.outcome is Outcome.REJECT
    assert prod.produce_many([3], [records[1]]) == (1, None)   # the drain goes on after it
    acked, _, failed = _settle(prod, 2)
    assert sorted(acked) == [1, 3] and failed == []   # the refused one has no report
    prod.close(10)


def test_full_queue_keeps_the_rest(broker, topic_name):
    create_topic(broker.bootstrap_servers, topic_name)
    prod = KafkaDlqProducer(producer_config(
        broker.bootstrap_servers, linger_ms=20_000, batch_size=100_000,
        overrides={"queue.buffering.max.messages": 10}))
    records = _records(topic_name, 25)
    n, refused = prod.produce_many(list(range(25)), records, max_wait_s=0.2)
    assert refused is None and n == 10   # librdkafka full (linger holds them): the rest kept
    with pytest.raises(BufferError):
        prod.produce(records[10], 10, max_wait_s=0.1)
    assert prod.flush(10) == 0
    assert sorted(_settle(prod, 10)[0]) == list(range(10))
    prod.close(10)


def test_failed_deliveries_are_reported_and_classified(unreachable):
    prod = KafkaDlqProducer(producer_config(unreachable, linger_ms=5, batch_size=100_000,
                                            overrides={"message.timeout.ms": 300}))
    assert prod.produce_many([7, 8], _records("dlq.nowhere", 2)) == (2, None)
    acked, _, failed = _settle(prod, 2, timeout_s=20)
    assert acked == [] and sorted(t for t, _ in failed) == [7, 8]
    assert {f.code for _, f in failed} == {KafkaError._MSG_TIMED_OUT}
    assert all(f.outcome is Outcome.RETRY and f.possibly_persisted for _, f in failed)
    prod.close(0)


def test_rebuild_drops_the_old_generations_reports(unreachable):
    prod = KafkaDlqProducer(producer_config(unreachable, linger_ms=5, batch_size=100_000))
    assert prod.produce_many([1, 2], _records("dlq.nowhere", 2)) == (2, None)
    prod.rebuild()   # purged: the old producer's reports (purge errors) are never taken
    assert prod.produce_many([3], _records("dlq.nowhere", 1)) == (1, None)
    time.sleep(0.3)
    prod.poll(0)
    assert prod.take_reports() == ([], [], [])
    assert prod.native and prod.outstanding() == 1
    prod.close(0)


def test_settings_name_their_own_plugins_and_not_the_sink(broker, topic_name):
    with pytest.raises(ConfigError, match="spillway.acks"):
        producer_config(broker.bootstrap_servers, linger_ms=5, batch_size=1000,
                        overrides={"spillway.acks": "0"})
    # a plugin of the operator's own is kept, this module's added after it
    prod = KafkaDlqProducer(producer_config(broker.bootstrap_servers, linger_ms=5,
                                            batch_size=1000,
                                            overrides={"plugin.library.paths": "/nonexistent"}))
    with pytest.raises(ConfigError, match="invalid DLQ producer settings"):
        prod.produce_many([1], _records(topic_name, 1))


def test_falls_back_to_produce_when_the_plugin_cannot_load(broker, topic_name, monkeypatch,
                                                           caplog):
    create_topic(broker.bootstrap_servers, topic_name)
    real = producer_mod._native
    monkeypatch.setattr(producer_mod, "_native", types.SimpleNamespace(
        Acks=real.Acks, produce=real.produce, __file__="/nonexistent/_produce.so"))
    prod = KafkaDlqProducer(producer_config(broker.bootstrap_servers, linger_ms=5,
                                            batch_size=1000))
    with caplog.at_level(logging.WARNING, logger="spillway.sidecar.dlq.producer"):
        assert prod.produce_many([1, 2], _records(topic_name, 2)) == (2, None)
    assert not prod.native and "C produce loop could not be loaded" in caplog.text
    assert sorted(_settle(prod, 2)[0]) == [1, 2]
    prod.close(10)


def test_bad_records_are_refused_by_name(broker, topic_name):
    prod = KafkaDlqProducer(producer_config(broker.bootstrap_servers, linger_ms=5,
                                            batch_size=1000))
    bad = [DlqRecord(topic=topic_name, key=None, value=3, headers=(), record_id="x", job="j",
                     task_key="t"),
           DlqRecord(topic=topic_name, key=None, value=b"", headers=(("h", 5),), record_id="x",
                     job="j", task_key="t"),
           DlqRecord(topic=topic_name, key=None, value=b"", headers=("h",), record_id="x",
                     job="j", task_key="t"),
           DlqRecord(topic=7, key=None, value=b"", headers=(), record_id="x", job="j",
                     task_key="t")]
    for rec, what in zip(bad, ("value", "header value", "header must be", "topic"),
                         strict=True):
        with pytest.raises(TypeError, match=what):
            prod.produce_many([1], [rec])
    assert prod.outstanding() == 0
    prod.close(0)


def test_no_sink_left_falls_back_to_produce(broker, topic_name, monkeypatch, caplog):
    """Acks() refuses past its registry's bound (256 alive): the producer is built without the
    C loop, says so, and produces all the same."""
    create_topic(broker.bootstrap_servers, topic_name)
    real = producer_mod._native

    def no_room():
        raise RuntimeError("too many acknowledgement sinks alive")

    monkeypatch.setattr(producer_mod, "_native", types.SimpleNamespace(
        Acks=no_room, produce=real.produce, __file__=real.__file__))
    prod = KafkaDlqProducer(producer_config(broker.bootstrap_servers, linger_ms=5,
                                            batch_size=1000))
    with caplog.at_level(logging.WARNING, logger="spillway.sidecar.dlq.producer"):
        assert prod.produce_many([1], _records(topic_name, 1)) == (1, None)
    assert not prod.native and "too many acknowledgement sinks" in caplog.text
    assert _settle(prod, 1)[0] == [1]
    prod.close(10)


def test_sinks_are_given_back(broker):
    """Each producer generation takes a sink and gives it back once its client is gone: far
    more generations than the registry holds come and go."""
    for _ in range(300):
        prod = KafkaDlqProducer(producer_config(broker.bootstrap_servers, linger_ms=5,
                                                batch_size=1000))
        assert prod.produce_many([], []) == (0, None)   # builds the client
        assert prod.native
        prod.close(0)


@pytest.mark.parametrize("off", [False, True])
def test_a_topic_librdkafka_refuses_is_refused_alike(unreachable, monkeypatch, off):
    """A topic name librdkafka will not take (over 512 bytes) is refused synchronously, as
    invalid, the same through the C loop as through produce()."""
    if off:
        monkeypatch.setenv("SPILLWAY_NO_EXTENSIONS", "produce")
    prod = KafkaDlqProducer(producer_config(unreachable, linger_ms=5, batch_size=1000))
    assert prod.native is not off
    rec = DlqRecord(topic="t" * 600, key=None, value=b"", headers=(), record_id="x", job="j",
                    task_key="t")
    n, refused = prod.produce_many([1], [rec])
    assert n == 0 and refused is not None
    assert refused.failure.code == KafkaError._INVALID_ARG
    assert refused.failure.outcome is Outcome.REJECT
    prod.close(0)


@pytest.mark.parametrize("native", [True, False])
def test_a_bounded_hand_over_stops_before_a_requests_worth(broker, topic_name, monkeypatch,
                                                           native):
    """`max_bytes` bounds what one call hands over by librdkafka's own bound of each record's
    size (the first is always taken), from `start` on: the drain hands a request's worth."""
    from spillway.sidecar.dlq.producer import wire_size

    create_topic(broker.bootstrap_servers, topic_name)
    if not native:
        monkeypatch.setenv("SPILLWAY_NO_EXTENSIONS", "produce")
    prod = KafkaDlqProducer(producer_config(broker.bootstrap_servers, linger_ms=5,
                                            batch_size=100_000))
    assert prod.native is native
    records = [DlqRecord(topic=topic_name, key=b"k", value=b"v" * 100,
                         headers=(("spillway.record.id", f"r{i}".encode()), ("n", None)),
                         record_id=f"r{i}", job="j", task_key="t") for i in range(20)]
    size = wire_size(records[0])
    assert size == 36 + 1 + 100 + (10 + 18 + 2) + (10 + 1)
    tokens = list(range(20))
    assert prod.produce_many(tokens, records, max_bytes=3 * size + size // 2) == (3, None)
    assert prod.produce_many(tokens, records, start=3, max_bytes=1) == (4, None)  # the first
    assert prod.produce_many(tokens, records, start=4, max_bytes=16 * (size + 1)) == (20, None)
    acked, _, failed = _settle(prod, 20)
    assert sorted(acked) == tokens and failed == []
    prod.close(10)
