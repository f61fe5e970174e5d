"""Reading and preparing topics on the test broker with an independent client (confluent-kafka)."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic


def create_topic(bootstrap: str, name: str, partitions: int = 1,
                 config: dict[str, str] | None = None) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.create_topics([NewTopic(name, num_partitions=partitions,
                                             replication_factor=1,
                                             config=config or {})]).values():
        fut.result(10)


def topic_config(bootstrap: str, name: str) -> dict[str, str]:
    """The topic's configuration as the broker describes it (Tansu: only what was set)."""
    from confluent_kafka.admin import ConfigResource, ResourceType

    admin = AdminClient({"bootstrap.servers": bootstrap})
    (fut,) = admin.describe_configs([ConfigResource(ResourceType.TOPIC, name)]).values()
    return {k: e.value for k, e in fut.result(10).items()}


def read_all(bootstrap: str, topic: str, idle_s: float = 2.0, timeout_s: float = 60.0,
             settle_s: float = 0.3):
    """Every record of every partition of `topic`, read until each partition has reported its
    end (partition EOF: the consumer is at the high watermark of the broker's own fetch answer)
    and `settle_s` more passes with nothing new; should no EOF come, until `idle_s` passes with
    nothing new after the broker's first answer. Records acknowledged by Kafka before the call
    are below that watermark, so nothing they hold is missed, and a test no longer waits out a
    fixed idle period per read. The idle clock starts at the first answer, not at the call: on a
    loaded machine connecting and the first fetch can take longer than `idle_s`, and that is not
    "nothing new" (it read an empty topic that held 30 records once, in CI).

    Uses assign() (no group join) and does not trust the listed high watermark (Tansu's lags).
    A topic that does not exist reads as empty.
    """
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex}",
                  "enable.auto.commit": False, "auto.offset.reset": "earliest",
                  "enable.partition.eof": True})
    try:
        start = time.monotonic()
        parts = _partitions(c, topic, start + timeout_s)
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        out, at_end = [], set()
        last = ended = None             # when the broker last answered; when an EOF last came
        while parts and time.monotonic() - start < timeout_s:
            if last is not None and time.monotonic() - last >= idle_s:
                break
            msgs = c.consume(1000, 0.1)
            for m in msgs:
                err = m.error()
                if err is None:
                    out.append(m)
                    at_end.discard(m.partition())
                elif err.code() == KafkaError._PARTITION_EOF and m.partition() not in at_end:
                    at_end.add(m.partition())
                    ended = time.monotonic()
            if msgs:
                last = time.monotonic()
            if ended is not None and at_end >= parts and \
                    time.monotonic() - max(ended, last) >= settle_s:
                break
        return out
    finally:
        c.close()


def _partitions(consumer: Consumer, topic: str, deadline: float) -> set[int]:
    """The topic's partitions; none if it does not exist. Asked again while the answer is
    transient (an error other than unknown topic, or no partitions yet)."""
    while True:
        md = consumer.list_topics(topic, timeout=10)
        meta = md.topics.get(topic)
        if meta is None:
            return set()
        if meta.error is not None and meta.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
            return set()
        if (meta.error is None and meta.partitions) or time.monotonic() >= deadline:
            return set(meta.partitions)
        time.sleep(0.1)


def header_map(msg) -> dict[str, bytes]:
    """A consumed record's headers by name (the last value of a name given twice)."""
    return {k: v for k, v in (msg.headers() or [])}


class FreezableBroker:
    """A Tansu broker of a test's own holding a topic's records, whose readers can be made to
    find it frozen (SIGSTOP) from the moment they assign their partitions: the broker's first
    answer comes late, as from a loaded machine or a remote cluster's handshakes."""

    def __init__(self, log_path: str, topic: str, messages, *, partitions: int = 2,
                 producer_conf: dict | None = None) -> None:
        """``messages``: keyword arguments of one ``produce()`` each."""
        from confluent_kafka import Producer
        from spillway.sidecar.runtime.embedded import EmbeddedBroker

        self.broker = EmbeddedBroker(log_path=log_path).start()
        self.bootstrap = self.broker.bootstrap_servers
        self._timers: list = []
        create_topic(self.bootstrap, topic, partitions=partitions)
        p = Producer({"bootstrap.servers": self.bootstrap, **(producer_conf or {})})
        for kw in messages:
            p.produce(topic, **kw)
        assert p.flush(10) == 0
        del p   # an open connection holds Tansu's stop for 5 s

    def freeze_reads(self, module, monkeypatch, seconds: float) -> None:
        """The consumers ``module._consumer`` makes from now on freeze the broker for
        ``seconds`` as they assign their partitions."""
        import threading

        make, broker, timers = module._consumer, self.broker, self._timers

        class Freezing:
            def __init__(self, consumer):
                self._consumer = consumer

            def assign(self, partitions):
                broker.pause()
                timer = threading.Timer(seconds, broker.resume)
                timer.daemon = True
                timer.start()
                timers.append(timer)
                return self._consumer.assign(partitions)

            def __getattr__(self, name):
                return getattr(self._consumer, name)

        monkeypatch.setattr(module, "_consumer", lambda *args: Freezing(make(*args)))

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self.broker.resume()
        self.broker.stop()
