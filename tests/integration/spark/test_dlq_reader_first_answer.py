"""`read_dlq`'s Kafka reads (the driver's end probe, an executor's range) against a broker whose
first answer comes late: the idle periods count from the broker's answers, so a slow first
fetch reads every record, and a broker that never answers is an error naming the partitions,
never a read that ends empty. No Spark: the two functions run as the driver and a task would."""

from __future__ import annotations

import pytest
from spillway.spark import _dlq_reader as reader
from support.kafka import FreezableBroker

pytestmark = pytest.mark.integration

TOPIC = "dlq.reader-first-answer"


@pytest.fixture
def frozen(tmp_path, monkeypatch):
    """Its own broker holding 10 records in each of 2 partitions (one produce batch each: Tansu
    reports that batch's first offset + 1 as the high watermark), and ``freeze(s)``."""
    b = FreezableBroker(str(tmp_path / "tansu.log"), TOPIC,
                        [{"value": b"v%d" % i, "partition": part}
                         for part in (0, 1) for i in range(10)],
                        producer_conf={"linger.ms": 50})
    monkeypatch.setattr(reader, "_TAIL_IDLE_S", 0.3)
    monkeypatch.setattr(reader, "_IDLE_S", 0.3)
    try:
        yield b.bootstrap, lambda s: b.freeze_reads(reader, monkeypatch, s)
    finally:
        b.close()


def test_the_end_probe_waits_for_a_slow_first_answer(frozen):
    bootstrap, freeze = frozen
    marks = {0: (0, 1), 1: (0, 1)}   # as a lagging watermark reports them
    freeze(1.5)
    consumer = reader._consumer(bootstrap, {})
    try:
        assert reader._true_ends(consumer, TOPIC, marks, timeout_s=20) == {0: 10, 1: 10}
    finally:
        consumer.close()


def test_the_end_probe_names_the_partitions_the_broker_never_answered(frozen):
    bootstrap, freeze = frozen
    freeze(30)
    consumer = reader._consumer(bootstrap, {})
    try:
        with pytest.raises(RuntimeError, match=rf"reading the end of {TOPIC}: the broker did not "
                                               r"answer for partition\(s\) 0, 1 within 1s"):
            reader._true_ends(consumer, TOPIC, {0: (0, 1), 1: (0, 1)}, timeout_s=1)
    finally:
        consumer.close()


def test_a_range_read_waits_for_a_slow_first_answer(frozen):
    bootstrap, freeze = frozen
    freeze(1.5)
    rows = list(reader._read_range(reader._Range(bootstrap, TOPIC, 1, 0, 10, ()),
                                   reader._Filter()))
    assert len(rows) == 10


def test_a_range_read_never_asks_for_more_than_the_range_holds(frozen, monkeypatch):
    """consume(n) returns once it has n records, or at its timeout: asked for 500 while a range
    held 4, each small range's read waited out the whole timeout (0.5 s) before its rows."""
    bootstrap, _ = frozen
    asked = []
    real = reader._consumer

    class Spy:
        def __init__(self, consumer):
            self._c = consumer

        def consume(self, num_messages, timeout):
            asked.append(num_messages)
            return self._c.consume(num_messages, timeout)

        def __getattr__(self, name):
            return getattr(self._c, name)

    monkeypatch.setattr(reader, "_consumer", lambda *a: Spy(real(*a)))
    rows = list(reader._read_range(reader._Range(bootstrap, TOPIC, 0, 3, 7, ()),
                                   reader._Filter()))
    offset = reader._COLUMNS.index("offset")
    assert [r[offset] for r in rows] == [3, 4, 5, 6]
    assert asked and asked[0] == 4 and all(n <= 4 for n in asked)
