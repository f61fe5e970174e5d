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
    nothing new. Records acknowledged by Kafka before the call are below that watermark, so
    nothing they hold is missed, and a test no longer waits out a fixed idle period per read.

    Uses assign() (no group join) and does not trust the listed high watermark (Tansu's lags).
    """
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex}",
                  "enable.auto.commit": False, "auto.offset.reset": "earliest",
                  "enable.partition.eof": True})
    try:
        md = c.list_topics(topic, timeout=10)
        parts = set(md.topics[topic].partitions) if topic in md.topics else set()
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        out, at_end = [], set()
        last = start = ended = time.monotonic()
        while time.monotonic() - last < idle_s and time.monotonic() - start < timeout_s:
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
            if at_end >= parts and time.monotonic() - max(ended, last) >= settle_s:
                break
        return out
    finally:
        c.close()


def header_map(msg) -> dict[str, bytes]:
    """A consumed record's headers by name (the last value of a name given twice)."""
    return {k: v for k, v in (msg.headers() or [])}
