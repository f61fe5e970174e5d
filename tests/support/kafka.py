"""Reading and preparing topics on the test broker with an independent client (confluent-kafka)."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic


def create_topic(bootstrap: str, name: str, partitions: int = 1) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.create_topics([NewTopic(name, num_partitions=partitions,
                                             replication_factor=1)]).values():
        fut.result(10)


def read_all(bootstrap: str, topic: str, idle_s: float = 2.0, timeout_s: float = 60.0):
    """Every record of every partition of `topic`, read until `idle_s` passes with nothing new.

    Uses assign() (no group join) and does not trust the high watermark (Tansu's lags).
    """
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex}",
                  "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    try:
        md = c.list_topics(topic, timeout=10)
        parts = md.topics[topic].partitions if topic in md.topics else {}
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        out, last, start = [], time.monotonic(), time.monotonic()
        while time.monotonic() - last < idle_s and time.monotonic() - start < timeout_s:
            msgs = c.consume(1000, 0.2)
            for m in msgs:
                if m.error():
                    continue
                out.append(m)
            if msgs:
                last = time.monotonic()
        return out
    finally:
        c.close()
