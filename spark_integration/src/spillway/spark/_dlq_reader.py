"""`read_dlq`: a DLQ topic as a Spark DataFrame, read from the executors with confluent-kafka.

    from spillway.spark import read_dlq
    dlq = read_dlq(spark, "dlq.orders", bootstrap_servers="kafka:9092",
                   since="2024-05-01T00:00:00Z", stage="TRANSFORMATION")
    dlq.groupBy("exception_class").count().orderBy("count", ascending=False).show()

The Spark Kafka connector jar is not needed: the driver resolves, per Kafka partition, the
offset range to read (``start`` / ``end``: ``"earliest"``, ``"latest"``, an offset, a
``{partition: offset}`` mapping, or a time via ``since``, which starts each partition at the
first record stamped at or after it); then each Spark partition reads one Kafka partition's
range with ``assign()`` (no consumer group, nothing committed). The frame is fixed at the
offsets resolved when `read_dlq` was called: records written later are not in it.

Columns: the Kafka coordinates (``topic``, ``partition``, ``offset``, ``timestamp``), ``key``,
``value`` and ``headers`` as Spark's Kafka source has them, and spillway's context headers as
typed columns (null when the record does not carry the header): ``job``, ``run_id``, ``stage``,
``record_id``, ``source_topic``, ``source_partition``, ``source_offset``, ``function``,
``exception_class``, ``exception_message``, ``stacktrace``, ``category``, ``attempts``,
``dead_lettered_at``, ``task``, ``sidecar``, ``trace_id``, ``payload`` (``source`` or
``stage-input``), ``record_copied``, ``redrive_count``. Context headers are read from either
family (``__connect.errors.*`` or ``__dlq.errors.*``), whichever the record was written with.
Then the DLQ ledger's view of each record (`spillway.client.dlq_ledger`): ``ledger_key`` and
``resolution`` (``redriven``, ``reprocessed``, ``superseded``; null while unresolved), read from
the ledger topic (``<topic>.ledger``) beside the DLQ. ``resolved="hide"`` leaves resolved records
out, ``"only"`` keeps only them.

Filters (applied while reading, before rows reach Spark): ``job``, ``stage``,
``exception_class`` (qualified name, or the simple name), ``since`` (inclusive) and ``until``
(exclusive) on the time the record was dead-lettered (``spillway.timestamp``; the Kafka
timestamp when absent), as ``spillway dlq redrive`` filters.

On Spark Connect (no SparkContext on the client) the frame is ``spark.range`` with one row per
Kafka partition, mapped with ``mapInArrow`` to that partition's records: the same columns and
rows, read by the Connect server's executors (which need confluent-kafka and pyarrow).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from spillway.client import dlq_ledger, kafka_auth

from ._compat import arrow_conversions, is_connect, parse_ddl

CONNECT = "__connect.errors."
DLQ = "__dlq.errors."

#: The DataFrame's schema (DDL).
DLQ_SCHEMA = (
    "topic string, partition int, offset long, timestamp timestamp, "
    "key binary, value binary, headers array<struct<key:string,value:binary>>, "
    "job string, run_id string, stage string, record_id string, source_topic string, "
    "source_partition int, source_offset long, function string, exception_class string, "
    "exception_message string, stacktrace string, category string, attempts int, "
    "dead_lettered_at timestamp, task string, sidecar string, trace_id string, "
    "payload string, record_copied boolean, redrive_count int, ledger_key string, "
    "resolution string")

#: The ledger topic's rows (latest resolution per key).
LEDGER_SCHEMA = "ledger_key string, resolution string, ledger_partition int, ledger_offset long"
RESOLVED_MODES = ("show", "hide", "only")

_IDLE_S = 5.0  # a partition whose end offset is not reached after this long without news ends
# ...counted from the broker's first answer for it (a record or its end): a slow first fetch is
# not "no news"; no first answer within this long is an error, not a read that ends empty
_FIRST_ANSWER_S = 60.0
_ARROW_ROWS = 4096  # rows per Arrow batch on Spark Connect
_TAIL_IDLE_S = 1.0  # the driver's read of each partition's last batch ends after this long idle


def _ms(value: Any, what: str) -> int | None:
    """A time as ms since the epoch: datetime (naive = UTC), ISO 8601 text, or a number of ms."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{what}: expected a datetime, ISO 8601 text or ms, got a bool")
    if isinstance(value, int | float):
        return int(value)
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.strip())
        except ValueError:
            raise ValueError(f"{what}: not an ISO 8601 time: {value!r} "
                             f"(e.g. 2024-05-01T12:00:00Z)") from None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return int(value.timestamp() * 1000)
    raise TypeError(f"{what}: expected a datetime, ISO 8601 text or ms, "
                    f"got {type(value).__name__}")


@dataclass(frozen=True)
class _Filter:
    job: str | None = None
    stage: str | None = None
    exception_class: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None

    def keep(self, row: dict) -> bool:
        if self.job is not None and row["job"] != self.job:
            return False
        if self.stage is not None and row["stage"] != self.stage:
            return False
        if self.exception_class is not None:
            cls = row["exception_class"]
            if cls is None or not (cls == self.exception_class
                                   or cls.endswith("." + self.exception_class)):
                return False
        if self.since_ms is not None or self.until_ms is not None:
            when = row["_when"]
            if when is None:
                return False
            if self.since_ms is not None and when < self.since_ms:
                return False
            if self.until_ms is not None and when >= self.until_ms:
                return False
        return True


@dataclass(frozen=True)
class _Range:
    """One Kafka partition's offsets to read: [start, end)."""

    bootstrap: str
    topic: str
    partition: int
    start: int
    end: int
    conf: tuple[tuple[str, str], ...]
    kind: str = "dlq"   # or "ledger"


def _text(v: bytes | None) -> str | None:
    return v.decode("utf-8", "replace") if v is not None else None


def _int(v: bytes | None) -> int | None:
    if v is None:
        return None
    try:
        return int(v.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return None


def _trace_id(traceparent: str | None) -> str | None:
    parts = traceparent.split("-") if traceparent else []
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


def to_row(topic: str, partition: int, offset: int, *, ts_ms: int | None, key: bytes | None,
           value: bytes | None, headers: list[tuple[str, bytes | None]]) -> dict:
    """A DLQ record as a row dict (`DLQ_SCHEMA`'s columns, plus ``_when``, the dead-letter time
    in ms the time filters use). Pure: unit-tested without Kafka."""
    h: dict[str, bytes | None] = {}
    for name, v in headers:
        h.setdefault(name, v)  # a record never carries two of one name; first wins if so
    fam = DLQ if (DLQ + "group" in h or DLQ + "stage" in h) else CONNECT

    def ctx(name: str) -> bytes | None:
        return h.get(fam + name)

    job = _text(h.get("spillway.job")) or _text(
        ctx("group") if fam == DLQ else ctx("connector.name"))
    dead_ms = _int(h.get("spillway.timestamp"))
    when = dead_ms if dead_ms is not None else ts_ms
    copied = _text(h.get("spillway.record.copied"))
    run_id, record_id = _text(h.get("spillway.run.id")), _text(h.get("spillway.record.id"))
    return {
        "topic": topic, "partition": partition, "offset": offset,
        "timestamp": (datetime.fromtimestamp(ts_ms / 1000, timezone.utc)
                      if ts_ms is not None else None),
        "key": key, "value": value,
        "headers": [(n, v) for n, v in headers],
        "job": job, "run_id": run_id,
        "stage": _text(ctx("stage")), "record_id": record_id,
        "source_topic": _text(ctx("topic")), "source_partition": _int(ctx("partition")),
        "source_offset": _int(ctx("offset")), "function": _text(ctx("class.name")),
        "exception_class": _text(ctx("exception.class.name")),
        "exception_message": _text(ctx("exception.message")),
        "stacktrace": _text(ctx("exception.stacktrace")),
        "category": _text(h.get("spillway.error.category")),
        "attempts": _int(h.get("spillway.attempts")),
        "dead_lettered_at": (datetime.fromtimestamp(dead_ms / 1000, timezone.utc)
                             if dead_ms is not None else None),
        "task": _text(h.get("spillway.task")), "sidecar": _text(h.get("spillway.sidecar")),
        "trace_id": _trace_id(_text(h.get("traceparent"))),
        "payload": _text(h.get("spillway.payload")),
        "record_copied": None if copied is None else copied == "true",
        "redrive_count": _int(h.get("spillway.redrive.count")),
        "ledger_key": dlq_ledger.ledger_key(job, run_id, record_id, key, value, topic=topic,
                                            partition=partition, offset=offset),
        "_when": when,
    }


_COLUMNS = ["topic", "partition", "offset", "timestamp", "key", "value", "headers", "job",
            "run_id", "stage", "record_id", "source_topic", "source_partition", "source_offset",
            "function", "exception_class", "exception_message", "stacktrace", "category",
            "attempts", "dead_lettered_at", "task", "sidecar", "trace_id", "payload",
            "record_copied", "redrive_count", "ledger_key"]
_ALL_COLUMNS = _COLUMNS + ["resolution"]


def _consumer(bootstrap: str, conf: Mapping[str, str]):
    try:
        from confluent_kafka import Consumer
    except ImportError as exc:  # pragma: no cover - install problem
        raise ImportError("read_dlq needs confluent-kafka on the driver and the executors: "
                          "pip install 'spillway-spark[kafka]'") from exc
    c = {"bootstrap.servers": bootstrap, "group.id": f"spillway-read-dlq-{uuid.uuid4().hex}",
         "enable.auto.commit": False, "enable.partition.eof": True,
         "auto.offset.reset": "earliest", "log_level": 2}
    c.update(kafka_auth.resolve(conf))   # where the consumer runs: the plan keeps references
    return Consumer(c)


def _read_range(r: _Range, flt: _Filter) -> Iterator[tuple]:
    """Executor side: the rows of one Kafka partition's [start, end), filtered."""
    if r.end <= r.start:
        return
    from confluent_kafka import KafkaError, TopicPartition

    consumer = _consumer(r.bootstrap, dict(r.conf))
    try:
        consumer.assign([TopicPartition(r.topic, r.partition, r.start)])
        began = time.monotonic()
        last = None   # the broker's last answer
        nxt = r.start
        while nxt < r.end:
            # at most what the range still holds: consume() returns once it has that many, so
            # a small range is not held for the whole timeout waiting for 500 (0.5 s a range)
            msgs = consumer.consume(min(500, r.end - nxt), 0.5)
            if not msgs:
                if last is None:
                    if time.monotonic() - began > _FIRST_ANSWER_S:
                        raise RuntimeError(
                            f"reading {r.topic}[{r.partition}]: the broker did not answer "
                            f"within {_FIRST_ANSWER_S:g}s")
                elif time.monotonic() - last > _IDLE_S:
                    return  # the broker's watermark ran ahead of what it serves: stop
                continue
            last = time.monotonic()
            for m in msgs:
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise RuntimeError(f"reading {r.topic}[{r.partition}] failed: {err}")
                off = m.offset()
                if off >= r.end:
                    return
                nxt = off + 1
                if r.kind == "ledger":
                    res = dlq_ledger.decode(m.value())
                    if res is not None and m.key() is not None:
                        yield (m.key().decode("ascii", "replace"), res.resolution,
                               m.partition(), off)
                    continue
                ts_type, ts = m.timestamp()
                row = to_row(m.topic(), m.partition(), off,
                             ts_ms=ts if ts_type != 0 else None, key=m.key(), value=m.value(),
                             headers=list(m.headers() or ()))
                if flt.keep(row):
                    yield tuple(row[c] for c in _COLUMNS) + (None,)
    finally:
        consumer.close()


def _bound(spec: Any, partition: int, what: str) -> Any:
    if isinstance(spec, Mapping):
        return spec.get(partition, "earliest" if what == "start" else "latest")
    return spec


def _resolve(consumer, topic: str, partitions: list[int], start: Any, end: Any, *,
             since_ms: int | None, timeout_s: float) -> list[tuple[int, int, int]]:
    """(partition, start, end) per partition, on the driver."""
    from confluent_kafka import TopicPartition

    starts_at_time: dict[int, int] = {}
    if since_ms is not None:
        found = consumer.offsets_for_times(
            [TopicPartition(topic, p, since_ms) for p in partitions], timeout=timeout_s)
        for tp in found:
            if tp.offset >= 0:
                starts_at_time[tp.partition] = tp.offset
    marks = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
             for p in partitions}
    true_end = _true_ends(consumer, topic, marks, timeout_s)
    out = []
    for p in partitions:
        low, high = marks[p][0], true_end[p]
        s, e = _bound(start, p, "start"), _bound(end, p, "end")
        s = low if s in ("earliest", None) else high if s == "latest" else _offset(s, "start")
        e = high if e in ("latest", None) else low if e == "earliest" else _offset(e, "end")
        s = max(s, low)
        e = min(e, high)
        if since_ms is not None:
            # records stamped before `since` were dead-lettered before it (a DLQ record is
            # produced after it was dead-lettered): skip them; none at or after it: nothing
            s = max(s, starts_at_time.get(p, high))
        out.append((p, s, e))
    return out


def _true_ends(consumer, topic: str, marks: Mapping[int, tuple[int, int]],
               timeout_s: float) -> dict[int, int]:
    """Each partition's end (last offset + 1), read rather than trusted: some brokers' high
    watermark lags (Tansu reports the last batch's first offset + 1). Reads from just before
    the reported watermark until nothing new comes for `_TAIL_IDLE_S`."""
    from confluent_kafka import KafkaError, TopicPartition

    ends = {p: high for p, (_, high) in marks.items()}
    probe = [TopicPartition(topic, p, max(low, high - 1)) for p, (low, high) in marks.items()
             if high > low]
    if not probe:
        return ends
    consumer.assign(probe)
    deadline = time.monotonic() + timeout_s
    last = time.monotonic()
    unanswered = {tp.partition for tp in probe}   # the idle period counts once all answered
    while unanswered or time.monotonic() - last < _TAIL_IDLE_S:
        if time.monotonic() >= deadline:
            if unanswered:
                raise RuntimeError(
                    f"reading the end of {topic}: the broker did not answer for partition(s) "
                    f"{', '.join(map(str, sorted(unanswered)))} within {timeout_s:g}s")
            break
        msgs = consumer.consume(500, 0.2)
        for m in msgs:
            unanswered.discard(m.partition())
            if m.error() is None:
                ends[m.partition()] = max(ends[m.partition()], m.offset() + 1)
                last = time.monotonic()
            elif m.error().code() != KafkaError._PARTITION_EOF:
                raise RuntimeError(f"reading the end of {topic}[{m.partition()}] failed: "
                                   f"{m.error()}")
    consumer.unassign()
    return ends


def _offset(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{what}: expected 'earliest', 'latest', an offset >= 0 or a "
                         f"{{partition: offset}} mapping, got {v!r}")
    return v


def read_dlq(spark: Any, topic: str, *, bootstrap_servers: str,
             start: Any = "earliest", end: Any = "latest",
             job: str | None = None, stage: str | None = None,
             exception_class: str | None = None, since: Any = None, until: Any = None,
             kafka_config: Mapping[str, str] | None = None, timeout_s: float = 30.0,
             resolved: str = "show", ledger_topic: str | None = None) -> Any:
    """The records of the DLQ `topic` as a DataFrame (`DLQ_SCHEMA`), one Spark partition per
    Kafka partition; see the module docstring for bounds, columns and filters.

    ``kafka_config``: extra consumer settings (SASL, TLS) for the driver and the executors.
    ``resolved``: ``"show"`` (every record, with its ``resolution``), ``"hide"`` (only what
    the ledger does not say was resolved) or ``"only"``. ``ledger_topic``: default
    ``<topic>.ledger``. Raises ValueError naming the bad argument, LookupError when the topic
    does not exist.
    """
    if resolved not in RESOLVED_MODES:
        raise ValueError(f"resolved: expected one of {RESOLVED_MODES}, got {resolved!r}")
    if not isinstance(topic, str) or not topic:
        raise ValueError("topic: expected a topic name")
    if not bootstrap_servers:
        raise ValueError("bootstrap_servers: required (host:port[,host:port])")
    for name, v in (("job", job), ("stage", stage), ("exception_class", exception_class)):
        if v is not None and not isinstance(v, str):
            raise TypeError(f"{name}: expected a string, got {type(v).__name__}")
    since_ms, until_ms = _ms(since, "since"), _ms(until, "until")
    if since_ms is not None and until_ms is not None and until_ms <= since_ms:
        raise ValueError(f"until ({until!r}) must be later than since ({since!r})")
    for what, spec in (("start", start), ("end", end)):
        if not isinstance(spec, Mapping) and spec not in ("earliest", "latest", None):
            _offset(spec, what)
    conf = {str(k): str(v) for k, v in (kafka_config or {}).items()}
    if (secret := kafka_auth.literal_secret(conf)) is not None:   # it would ride in the plan
        raise ValueError(f"kafka_config: {secret} must be a reference to where the secret is "
                         f"(${{directory:/dir:file}}, ${{env:NAME}}): a literal one travels to "
                         f"the executors in the plan, which Spark may log")
    consumer = _consumer(bootstrap_servers, conf)
    try:
        md = consumer.list_topics(topic, timeout=timeout_s)
        meta = md.topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise LookupError(f"DLQ topic {topic!r} does not exist on {bootstrap_servers}")
        partitions = sorted(meta.partitions)
        ranges = _resolve(consumer, topic, partitions, start, end, since_ms=since_ms,
                          timeout_s=timeout_s)
        ledger = ledger_topic or dlq_ledger.ledger_topic(topic)
        lmeta = consumer.list_topics(ledger, timeout=timeout_s).topics.get(ledger)
        ledger_ranges = []
        if lmeta is not None and lmeta.error is None and lmeta.partitions:
            ledger_ranges = _resolve(consumer, ledger, sorted(lmeta.partitions), "earliest",
                                     "latest", since_ms=None, timeout_s=timeout_s)
    finally:
        consumer.close()
    frozen = tuple(sorted(conf.items()))
    specs = [_Range(bootstrap_servers, topic, p, s, e, frozen) for p, s, e in ranges]
    flt = _Filter(job=job, stage=stage, exception_class=exception_class,
                  since_ms=since_ms, until_ms=until_ms)
    _SOURCES[topic] = (bootstrap_servers, frozen, ledger)
    dlq = _frame(spark, specs, flt, DLQ_SCHEMA)
    if not ledger_ranges:  # no ledger yet: nothing was resolved
        return dlq if resolved != "only" else dlq.limit(0)
    from pyspark.sql import functions as F

    lspecs = [_Range(bootstrap_servers, ledger, p, s, e, frozen, "ledger")
              for p, s, e in ledger_ranges]
    # a key's latest resolution (a key always lands in one partition: its latest offset)
    latest = (_frame(spark, lspecs, flt, LEDGER_SCHEMA).groupBy("ledger_key")
              .agg(F.max_by("resolution", "ledger_offset").alias("_resolution")))
    joined = (dlq.join(F.broadcast(latest), "ledger_key", "left")
              .withColumn("resolution", F.col("_resolution")).select(*_ALL_COLUMNS))
    if resolved == "hide":
        return joined.where(F.col("resolution").isNull())
    if resolved == "only":
        return joined.where(F.col("resolution").isNotNull())
    return joined


# DLQ topic -> (bootstrap servers, consumer settings, ledger topic) of this process's read_dlq
# calls: where `Job.reprocess` records what it resolved (bounded: one entry per DLQ topic read).
_SOURCES: dict[str, tuple[str, tuple[tuple[str, str], ...], str]] = {}


def ledger_sources() -> dict[str, tuple[str, tuple[tuple[str, str], ...], str]]:
    return dict(_SOURCES)


def _frame(spark: Any, specs: list[_Range], flt: _Filter, ddl: str) -> Any:
    if is_connect(spark):  # no SparkContext over Spark Connect: a DataFrame of range indexes
        return _connect_frame(spark, specs, flt, ddl)
    rdd = spark.sparkContext.parallelize(specs, len(specs)).flatMap(
        lambda r: _read_range(r, flt))
    return spark.createDataFrame(rdd, ddl)


def _connect_frame(spark: Any, specs: list[_Range], flt: _Filter, ddl: str) -> Any:
    """The same frame on Spark Connect: ``spark.range`` with one index per Spark partition,
    each mapped (``mapInArrow``) to the rows of its Kafka partition's range."""
    schema = parse_ddl(ddl)  # on the client: executors have no session to parse with
    read = functools.partial(_read_ranges_arrow, tuple(specs), flt, schema)
    return spark.range(0, len(specs), 1, len(specs)).mapInArrow(read, schema)


def _read_ranges_arrow(specs: tuple[_Range, ...], flt: _Filter, schema: Any,
                       batches: Iterator[Any]) -> Iterator[Any]:
    """Executor side of `_connect_frame`: Arrow batches of up to `_ARROW_ROWS` rows."""
    _, to_arrow = arrow_conversions()
    for batch in batches:
        for i in batch.column(0).to_pylist():
            rows: list[tuple] = []
            for row in _read_range(specs[i], flt):
                rows.append(row)
                if len(rows) >= _ARROW_ROWS:
                    yield from to_arrow(rows, schema, False).to_batches()
                    rows = []
            if rows:
                yield from to_arrow(rows, schema, False).to_batches()
