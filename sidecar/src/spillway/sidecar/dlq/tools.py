"""Operating a DLQ topic: read it (`read_topic`, `tail`: readable blocks).

Reading uses ``assign()`` (no consumer group: nothing is committed, nothing joins) and reads to
the end by waiting until the topic is idle, since a broker's high watermark may lag (Tansu's
does); `offset_span` is that watermark's estimate of how many records there are, for progress.
``spillway dlq redrive`` is `redrive.py` (its pure rules in `redrive_rules.py`).
"""

from __future__ import annotations

import base64
import logging
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TextIO

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from ..core.model import Header
from ..errors import DlqError


@dataclass(frozen=True, slots=True)
class DlqMessage:
    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    key: bytes | None
    value: bytes | None
    headers: tuple[Header, ...]

    def header(self, name: str) -> bytes | None:
        for n, v in self.headers:
            if n == name:
                return v
        return None

    def text(self, name: str) -> str | None:
        v = self.header(name)
        return v.decode("utf-8", "replace") if v is not None else None


class TopicNotFoundError(DlqError):
    """The topic to read does not exist."""


# --- rendering (pure) ------------------------------------------------------------------------


def render_bytes(data: bytes | None, max_bytes: int = 300) -> str:
    """UTF-8 text when printable (newlines kept), else ``hex:`` (short) or ``base64:``;
    truncated to `max_bytes` with the number of bytes left out."""
    if data is None:
        return "(null)"
    cut = data[:max_bytes]
    more = len(data) - len(cut)
    suffix = f" …(+{more} bytes)" if more else ""
    try:
        text = cut.decode("utf-8")
    except UnicodeDecodeError as exc:
        # a multi-byte character cut at the end is still text
        text = cut[:exc.start].decode("utf-8") if more and exc.start >= len(cut) - 3 else None
        if text is not None:
            suffix = f" …(+{len(data) - exc.start} bytes)"
    if text is not None and all(c.isprintable() or c in "\n\t" for c in text):
        return text + suffix
    if len(cut) <= 32:
        return "hex:" + cut.hex() + suffix
    return "base64:" + base64.b64encode(cut).decode() + suffix


def _ts(ms: int | None) -> str:
    if ms is None or ms < 0:
        return "-"
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="milliseconds")


def format_message(msg: DlqMessage, *, max_bytes: int = 300) -> str:
    """One readable block per DLQ record."""
    lines = [f"── {msg.topic} [{msg.partition}] @{msg.offset}  {_ts(msg.timestamp_ms)}",
             f"key:   {render_bytes(msg.key, max_bytes)}",
             f"value: {render_bytes(msg.value, max_bytes)}"]
    if msg.headers:
        lines.append("headers:")
        for name, value in msg.headers:
            text = render_bytes(value, max_bytes).replace("\n", "\n" + " " * 6)
            lines.append(f"  {name}: {text}")
    else:
        lines.append("headers: (none)")
    return "\n".join(lines)


# --- reading ---------------------------------------------------------------------------------


def _consumer(bootstrap: str, conf: Mapping[str, Any] | None) -> Consumer:
    # fetch.wait.max.ms: a broker holds a fetch of an empty partition this long before its end
    # is answered (500 by default), and the idle period only starts once every one answered
    c = {"bootstrap.servers": bootstrap, "group.id": f"spillway-dlq-tool-{uuid.uuid4().hex}",
         "enable.auto.commit": False, "auto.offset.reset": "earliest", "fetch.wait.max.ms": 100}
    c.update(conf or {})
    c["enable.partition.eof"] = True   # a partition's end is its answer (`read_topic`)
    return Consumer(quiet(c))


def quiet(conf: dict[str, Any]) -> dict[str, Any]:
    """librdkafka's log through Python logging: everything with --log-level DEBUG, otherwise
    only its critical lines (a wrong broker is then our one error line, not ~190 of its own)."""
    logger = logging.getLogger("spillway.dlq.librdkafka")
    conf.setdefault("logger", logger)
    conf.setdefault("log_level", 7 if logger.isEnabledFor(logging.DEBUG) else 2)
    return conf


def _partitions(consumer: Consumer, topic: str, timeout_s: float) -> list[int]:
    try:
        md = consumer.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise DlqError(f"cannot read the cluster's metadata: {exc}") from exc
    meta = md.topics.get(topic)
    if meta is None or meta.error is not None:
        raise TopicNotFoundError(f"topic {topic!r} does not exist")
    return sorted(meta.partitions)


def read_topic(bootstrap: str, topic: str, *, newest: int | None = None, follow: bool = False,
               idle_s: float = 2.0, timeout_s: float = 10.0,
               consumer_conf: Mapping[str, Any] | None = None,
               should_stop: Callable[[], bool] = lambda: False,
               on_span: Callable[[int | None], None] | None = None) -> Iterator[DlqMessage]:
    """Every record of `topic` (all partitions) from the beginning, or from the `newest` records
    of each partition; stops after `idle_s` without news unless `follow`. ``on_span``: called
    once before the first record with how many records the watermarks say there are to read
    (None when they could not be read).

    The idle period counts from the broker's answers, not from the start: until every partition
    has answered once (a record, or its end), a slow first fetch (a loaded machine, a remote
    cluster's connections and authentication) is not "nothing new" that would end the read
    empty. A partition with no answer within `timeout_s` is a DlqError naming it."""
    consumer = _consumer(bootstrap, consumer_conf)
    try:
        parts = _partitions(consumer, topic, timeout_s)
        assignment = []
        span: int | None = 0
        for p in parts:
            start = -2  # OFFSET_BEGINNING
            if newest is not None or on_span is not None:
                try:
                    low, high = consumer.get_watermark_offsets(TopicPartition(topic, p),
                                                               timeout=timeout_s)
                except KafkaException:
                    if newest is not None:
                        raise
                    low = high = None
                if newest is not None:
                    start = max(low, high - newest)
                if span is not None and low is not None:
                    span += high - (low if start < 0 else start)
                else:
                    span = None
            assignment.append(TopicPartition(topic, p, start))
        if on_span is not None:
            on_span(span)
        consumer.assign(assignment)
        unanswered = set(parts)
        began = last = time.monotonic()
        while not should_stop():
            msgs = consumer.consume(500, 0.2)
            for m in msgs:
                if m.error():
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        unanswered.discard(m.partition())
                        continue
                    raise DlqError(f"reading {topic!r} failed: {m.error()}")
                unanswered.discard(m.partition())
                ts_type, ts = m.timestamp()
                yield DlqMessage(m.topic(), m.partition(), m.offset(),
                                 ts if ts_type != 0 else None, m.key(), m.value(),
                                 tuple(m.headers() or ()))
            now = time.monotonic()
            if msgs:
                last = now
            elif follow:
                continue
            elif unanswered:
                if now - began >= timeout_s:
                    raise DlqError(
                        f"reading {topic!r}: the broker did not answer for partition(s) "
                        f"{', '.join(map(str, sorted(unanswered)))} within {timeout_s:g}s")
            elif now - last >= idle_s:
                return
    finally:
        consumer.close()


def tail(bootstrap: str, topic: str, *, from_beginning: bool = False,
         max_records: int | None = None, follow: bool = False, out: TextIO = sys.stdout,
         idle_s: float = 2.0, max_bytes: int = 300,
         consumer_conf: Mapping[str, Any] | None = None) -> int:
    """Print DLQ records. From the beginning, or (default) the newest `max_records` (10 when
    unset) first; with `follow`, then every new one. Returns how many were printed."""
    printed = 0
    newest = None if from_beginning else (max_records or 10)
    limit = max_records
    if not from_beginning and not follow:
        # the newest N overall: each partition's newest N, then the N latest of those
        msgs = list(read_topic(bootstrap, topic, newest=newest, idle_s=idle_s,
                               consumer_conf=consumer_conf))
        msgs.sort(key=lambda m: (m.timestamp_ms or 0, m.partition, m.offset))
        for m in msgs[-(newest or 10):]:
            print(format_message(m, max_bytes=max_bytes), file=out, flush=True)
            printed += 1
        return printed
    for m in read_topic(bootstrap, topic, newest=newest, follow=follow, idle_s=idle_s,
                        consumer_conf=consumer_conf):
        print(format_message(m, max_bytes=max_bytes), file=out, flush=True)
        printed += 1
        if limit is not None and printed >= limit:
            break
    return printed
