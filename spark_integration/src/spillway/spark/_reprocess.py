"""`Job.reprocess`: run a fixed function over dead-lettered records, from a `read_dlq` frame.

Each DLQ record the ledger does not already call resolved becomes the Kafka-shaped row it was
(Spark's Kafka source schema, `KAFKA_SOURCE_SCHEMA`): its original key, value and headers
(without the error-context headers, spillway's own and the dead-letter's trace context), at its
source coordinates when it has them (else at its place in the DLQ topic), plus headers that
carry its history:

- ``spillway.redrive.count``: how many times it was sent round (added, or incremented), the
  loop protection `spillway dlq redrive` uses: records already at ``max_redrives`` are left out;
- ``spillway.redrive.of``: the record id it had when first dead-lettered;
- ``spillway.redrive.from`` / ``.dlq``: the DLQ record's ledger key and DLQ topic;
- ``spillway.redrive.payload``: what its key/value are (``source`` or ``stage-input``), which a
  record dead-lettered again keeps;
- ``spillway.redrive.link``: the dead-letter's traceparent: the task's span links to it (a new
  trace, never a child of the old one).

The rows then go through `Job.map_partitions` with the job's policy: what now succeeds is the
output; what still fails is dead-lettered again (its DLQ record copies those headers, so the
next round sees the count) under the record id ``<first id>#redrive<count>``, which is stable
across Spark's task retries (one dead letter per record id) and distinct per round. Records
without a copy of the original (``copy.record.enable=false``) are left out.

When a task has finished (its dead letters acknowledged by Kafka), it records in the DLQ ledger
(`spillway.client.dlq_ledger`) what it resolved: ``reprocessed`` for each record that succeeded,
``superseded`` for each one dead-lettered again. A ledger that cannot be written fails the task
(Spark runs it again; the ids keep its dead letters single).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from spillway.client import dlq_ledger, kafka_auth
from spillway.client.dlq_ledger import (
    H_REDRIVE_DLQ,
    H_REDRIVE_FROM,
    H_REDRIVE_LINK,
    H_REDRIVE_PAYLOAD,
)

from ._runtime import JobSpec, TaskSession, WrapperSpec

REDRIVE_COUNT = "spillway.redrive.count"
REDRIVE_OF = "spillway.redrive.of"
_STRIPPED = ("__connect.errors.", "__dlq.errors.", "spillway.")
_TRACE = ("traceparent", "tracestate")
MAX_LINKS = 128  # per task span (the SDK's default SpanLimits keep no more)
LEDGER_FLUSH_S = 30.0
_ENSURED: set[str] = set()  # ledger topics this executor process saw exist (or created)


def redrive_frame(dlq_df: Any, max_redrives: int, include_resolved: bool = False) -> Any:
    """The Kafka-shaped rows to reprocess (see the module docstring)."""
    from pyspark.sql import functions as F

    missing = {"key", "value", "headers", "topic", "partition", "offset", "timestamp",
               "record_id", "redrive_count", "record_copied", "source_topic",
               "source_partition", "source_offset", "payload", "ledger_key",
               "resolution"} - set(dlq_df.columns)
    if missing:
        raise ValueError(f"dlq_df: expected a read_dlq DataFrame; missing columns "
                         f"{sorted(missing)}")
    count = F.coalesce(F.col("redrive_count"), F.lit(0))
    first_id = F.coalesce(
        F.get(F.filter("headers", lambda h: h["key"] == REDRIVE_OF), 0)["value"]
        .cast("string"),
        F.col("record_id"), F.concat_ws("/", "topic", "partition", "offset"))
    kept = F.filter("headers", lambda h: ~(h["key"].startswith(_STRIPPED[0])
                                           | h["key"].startswith(_STRIPPED[1])
                                           | h["key"].startswith(_STRIPPED[2])
                                           | h["key"].isin(*_TRACE)))
    link = F.get(F.filter("headers", lambda h: h["key"] == "traceparent"), 0)["value"]

    def header(name: str, value: Any) -> Any:
        return F.struct(F.lit(name).alias("key"), value.cast("binary").alias("value"))

    history = F.array(
        header(REDRIVE_COUNT, (count + 1).cast("string")),
        header(REDRIVE_OF, first_id),
        header(H_REDRIVE_FROM, F.col("ledger_key")),
        header(H_REDRIVE_DLQ, F.col("topic")),
        header(H_REDRIVE_PAYLOAD, F.coalesce(F.col("payload"), F.lit("stage-input"))),
        header(H_REDRIVE_LINK, F.coalesce(link, F.lit(b"").cast("binary"))))
    has_source = F.col("source_topic").isNotNull() & F.col("source_partition").isNotNull() \
        & F.col("source_offset").isNotNull()
    return (dlq_df
            .where((F.col("record_copied").isNull() | F.col("record_copied"))
                   & (count < F.lit(max_redrives))
                   & (F.lit(include_resolved) | F.col("resolution").isNull()))
            .select(F.col("key"), F.col("value"),
                    F.when(has_source, F.col("source_topic")).otherwise(F.col("topic"))
                    .alias("topic"),
                    F.when(has_source, F.col("source_partition")).otherwise(F.col("partition"))
                    .cast("int").alias("partition"),
                    F.when(has_source, F.col("source_offset")).otherwise(F.col("offset"))
                    .cast("long").alias("offset"),
                    F.col("timestamp"), F.lit(0).alias("timestampType"),
                    F.concat(kept, history).alias("headers")))


def redrive_record_id(row: Any) -> str:
    """``<first record id>#redrive<count>`` from the row's history headers."""
    first, count = None, None
    for h in row["headers"] or ():
        key, value = h[0], h[1]   # a Row(key, value), or a (key, value) pair
        if key == REDRIVE_OF and value is not None:
            first = bytes(value).decode("utf-8", "replace")
        elif key == REDRIVE_COUNT and value is not None:
            count = bytes(value).decode("ascii", "replace")
    if first is None or count is None:  # not a row of redrive_frame: its own coordinates
        return f"{row['topic']}/{row['partition']}/{row['offset']}#redrive"
    return f"{first}#redrive{count}"


# --- executor side: the ledger ---------------------------------------------------------------


def _history(headers: Any) -> dict[str, bytes]:
    """The reprocess history headers of a row's (Row(key, value) or (key, value)) or a
    report's (pb.Header) headers."""
    out: dict[str, bytes] = {}
    for h in headers or ():
        key, value = (h.key, h.value) if hasattr(h, "key") and not isinstance(h, tuple) \
            else (h[0], h[1])
        if isinstance(key, str) and key.startswith("spillway.redrive.") and value is not None:
            out.setdefault(key, bytes(value))
    return out


class Ledger:
    """Where a reprocess run records its resolutions: the DLQ topics `read_dlq` read in this
    driver (bootstrap servers, consumer settings, ledger topic). Pickled to the executors."""

    def __init__(self, job: str, sources: Mapping[str, tuple[str, tuple, str]]) -> None:
        self.job = job
        self.sources = dict(sources)

    def bind(self, spec: JobSpec, wrapper: WrapperSpec,
             fn: Callable[[Any], Any]) -> tuple[TaskSession, Callable[[Any], Any]]:
        session = ReprocessSession(spec, wrapper, self)

        def run(row: Any) -> Any:
            hist = _history(row["headers"])
            session.link(hist.get(H_REDRIVE_LINK))
            out = fn(row)
            session.note("reprocessed", hist, "")
            return out

        return session, run


class ReprocessSession(TaskSession):
    """A task session that notes what it resolved and writes it to the ledger once its dead
    letters are acknowledged (after the flush barrier)."""

    def __init__(self, spec: JobSpec, wrapper: WrapperSpec, ledger: Ledger) -> None:
        super().__init__(spec, wrapper)
        self.ledger = ledger
        # (DLQ topic, ledger key) -> (resolution, first record id, new record id): one entry per
        # row of the task until it ends (about 150 bytes each)
        self.notes: dict[tuple[str, str], tuple[str, bytes, str]] = {}
        self._links: set[bytes] = set()

    def link(self, traceparent: bytes | None) -> None:
        """Link this task's span to a dead letter's trace (once each, up to MAX_LINKS)."""
        if not traceparent or traceparent in self._links or len(self._links) >= MAX_LINKS:
            return
        self._links.add(traceparent)
        from spillway.client.report import extract_context
        from opentelemetry import trace

        ctx = trace.get_current_span(extract_context(traceparent.decode("ascii", "replace")))
        sc = ctx.get_span_context()
        if sc.is_valid and self.span.is_recording():
            self.span.add_link(sc, {"spillway.link": "dead-lettered"})

    def note(self, resolution: str, hist: Mapping[str, bytes], new_record_id: str) -> None:
        key, dlq = hist.get(H_REDRIVE_FROM), hist.get(H_REDRIVE_DLQ)
        if not key or not dlq:
            return  # not a row of redrive_frame: nothing to resolve
        k = (dlq.decode("utf-8", "replace"), key.decode("ascii", "replace"))
        if self.notes.get(k, ("",))[0] == "superseded":
            return  # dead-lettered again: that stands
        self.notes[k] = (resolution, hist.get(REDRIVE_OF, b""), new_record_id)

    def skipped(self, records: Sequence[Any], verdicts: Sequence[Any]) -> None:
        super().skipped(records, verdicts)
        for record, verdict in zip(records, verdicts):
            if verdict.dead_lettered:
                self.note("superseded", _history(record.headers), record.record_id)

    def close(self, ok: bool, exc: BaseException | None = None) -> None:
        super().close(ok, exc)  # the flush barrier: dead letters acknowledged first
        if ok and self.notes:
            write_resolutions(self.ledger, self.notes, self.spec.run_id)
            self.notes = {}


def write_resolutions(ledger: Ledger, notes: Mapping[tuple[str, str], tuple], run: str) -> int:
    """Produce the notes to their ledgers and wait for Kafka's acknowledgement; LedgerError
    (naming the ledger) when a DLQ topic's ledger is unknown or a write fails."""
    import confluent_kafka
    import confluent_kafka.admin
    from confluent_kafka import Producer

    by_dlq: dict[str, list] = {}
    for (dlq, key), note in notes.items():
        by_dlq.setdefault(dlq, []).append((key, note))
    now = int(time.time() * 1000)
    written = 0
    for dlq, items in by_dlq.items():
        source = ledger.sources.get(dlq)
        if source is None:
            raise dlq_ledger.LedgerError(
                f"reprocess cannot record what it resolved: the DLQ topic {dlq!r} was not read "
                f"with read_dlq in this driver, so its ledger is unknown (read it with "
                f"read_dlq, or pass ledger=False to Job.reprocess)")
        bootstrap, conf, topic = source
        conf = kafka_auth.resolve(dict(conf))   # ${env:...} references read here, not shipped
        if topic not in _ENSURED:
            dlq_ledger.ensure_topic(confluent_kafka, {"bootstrap.servers": bootstrap, **dict(conf)},
                                    topic, 1)
            _ENSURED.add(topic)
        errors: list[str] = []
        producer = Producer({"bootstrap.servers": bootstrap, **dict(conf), "acks": "all",
                             "enable.idempotence": True, "linger.ms": 5, "log_level": 2,
                             "allow.auto.create.topics": False})

        def done(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(str(err))

        for key, (resolution, first_id, new_id) in items:
            value = dlq_ledger.encode(dlq_ledger.Resolution(
                resolution, now, f"reprocess {ledger.job}",
                record_id=first_id.decode("utf-8", "replace"),
                new_record_id=new_id, run=run))
            while True:
                try:
                    producer.produce(topic, key=key.encode(), value=value, on_delivery=done)
                    break
                except BufferError:
                    producer.poll(0.1)
        left = producer.flush(LEDGER_FLUSH_S)
        if left or errors:
            raise dlq_ledger.LedgerError(
                f"reprocess could not record {left + len(errors)} of {len(items)} "
                f"resolution(s) in the ledger {topic!r}"
                + (f": {errors[0]}" if errors else f" within {LEDGER_FLUSH_S:g}s")
                + " (the task fails; Spark runs it again)")
        written += len(items)
    return written
