"""Operating a DLQ topic: `tail` (read it, readable) and `redrive` (publish records again).

Both read with ``assign()`` (no consumer group: nothing is committed, nothing joins) and read to
the end by waiting until the topic is idle, since a broker's high watermark may lag (Tansu's does).

Redrive keeps the DLQ ledger (`ledger`, ``<topic>.ledger``): it skips records the ledger says
were resolved (redriven before, fixed or dead-lettered again by `Job.reprocess`) and records a
``redriven`` resolution for each record Kafka acknowledged, so that a second redrive of the same
range sends nothing. A redriven record starts a new trace linked to the DLQ record's (its
``traceparent`` is never copied).

Redrive re-publishes the original key, value and headers of matching DLQ records to a target
topic, without the error-context headers and spillway's own headers, and with a
``spillway.redrive.count`` header added or incremented. A record whose count has reached
``--max-redrives`` is left where it is and counted (loop protection): a record that keeps failing
comes back to the DLQ with its count (the DLQ copies original headers), so it cannot cycle for
ever. Context-only DLQ records (``copy.record.enable=false``) carry no original record and are
skipped. Kafka cannot delete single records: a redriven record stays in the DLQ topic, and the
ledger is what tells a later run it was dealt with.

The pure parts (rendering, filters, header rewriting) are separate functions; the Kafka parts
are thin loops around them.
"""

from __future__ import annotations

import base64
import functools
import logging
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TextIO

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from spillway.client import dlq_ledger

from ..core.dlq_record import (
    CONNECT_PREFIX,
    DLQ_PREFIX,
    H_COPIED,
    H_JOB,
    H_PAYLOAD,
    H_REDRIVE_COUNT,
    H_RUN_ID,
    H_TIMESTAMP,
    H_TRACEPARENT,
    H_TRACESTATE,
    SPILLWAY_PREFIX,
)
from ..core.model import Header
from ..core.names import invalid_topic_message, valid_topic_name
from ..errors import DlqError
from . import ledger


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
    c = {"bootstrap.servers": bootstrap, "group.id": f"spillway-dlq-tool-{uuid.uuid4().hex}",
         "enable.auto.commit": False, "auto.offset.reset": "earliest",
         "enable.partition.eof": False}
    c.update(conf or {})
    return Consumer(_quiet(c))


def _quiet(conf: dict[str, Any]) -> dict[str, Any]:
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
               should_stop: Callable[[], bool] = lambda: False) -> Iterator[DlqMessage]:
    """Every record of `topic` (all partitions) from the beginning, or from the `newest` records
    of each partition; stops after `idle_s` without news unless `follow`."""
    consumer = _consumer(bootstrap, consumer_conf)
    try:
        parts = _partitions(consumer, topic, timeout_s)
        assignment = []
        for p in parts:
            start = -2  # OFFSET_BEGINNING
            if newest is not None:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, p),
                                                           timeout=timeout_s)
                start = max(low, high - newest)
            assignment.append(TopicPartition(topic, p, start))
        consumer.assign(assignment)
        last = time.monotonic()
        while not should_stop():
            msgs = consumer.consume(500, 0.2)
            for m in msgs:
                if m.error():
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        continue
                    raise DlqError(f"reading {topic!r} failed: {m.error()}")
                ts_type, ts = m.timestamp()
                yield DlqMessage(m.topic(), m.partition(), m.offset(),
                                 ts if ts_type != 0 else None, m.key(), m.value(),
                                 tuple(m.headers() or ()))
            if msgs:
                last = time.monotonic()
            elif not follow and time.monotonic() - last >= idle_s:
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


# --- redrive (pure parts) --------------------------------------------------------------------


def parse_time_ms(text: str) -> int:
    """ISO 8601 to ms since the epoch; a time without zone is UTC."""
    try:
        dt = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"not an ISO 8601 time: {text!r} (e.g. 2024-05-01T12:00:00Z)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)


def _context_prefix(msg: DlqMessage) -> str | None:
    """Which context family the record was written with (None: context headers were off)."""
    names = {n for n, _ in msg.headers}
    if DLQ_PREFIX + "group" in names or DLQ_PREFIX + "stage" in names:
        return DLQ_PREFIX
    if CONNECT_PREFIX + "connector.name" in names or CONNECT_PREFIX + "stage" in names:
        return CONNECT_PREFIX
    return None


@dataclass(frozen=True, slots=True)
class RedriveFilter:
    stage: str | None = None
    exception_class: str | None = None  # exact, or the class's simple name
    job: str | None = None
    since_ms: int | None = None  # inclusive
    until_ms: int | None = None  # exclusive

    def matches(self, msg: DlqMessage) -> bool:
        prefix = _context_prefix(msg)
        if self.stage is not None:
            if prefix is None or msg.text(prefix + "stage") != self.stage:
                return False
        if self.exception_class is not None:
            cls = msg.text(prefix + "exception.class.name") if prefix else None
            if cls is None or not (cls == self.exception_class
                                   or cls.endswith("." + self.exception_class)):
                return False
        if self.job is not None:
            job = msg.text(H_JOB)
            if job is None and prefix is not None:
                job = msg.text(prefix + ("group" if prefix == DLQ_PREFIX else "connector.name"))
            if job != self.job:
                return False
        if self.since_ms is not None or self.until_ms is not None:
            when: int | None = None
            raw = msg.text(H_TIMESTAMP)
            if raw is not None and raw.isdigit():
                when = int(raw)
            elif msg.timestamp_ms is not None:
                when = msg.timestamp_ms
            if when is None:
                return False
            if self.since_ms is not None and when < self.since_ms:
                return False
            if self.until_ms is not None and when >= self.until_ms:
                return False
        return True


def redrive_count(msg: DlqMessage) -> int:
    raw = msg.text(H_REDRIVE_COUNT)
    return int(raw) if raw is not None and raw.strip().isdigit() else 0


def original_headers(msg: DlqMessage) -> list[Header]:
    """The DLQ record's headers without the error-context family it was written with, without
    spillway's own headers (the redrive count is handled by the caller) and without its trace
    context (the dead-letter's, which a redriven record links to but never continues)."""
    prefix = _context_prefix(msg)
    out: list[Header] = []
    for name, value in msg.headers:
        if prefix is not None and name.startswith(prefix):
            continue
        if name.startswith(SPILLWAY_PREFIX) or name in (H_TRACEPARENT, H_TRACESTATE):
            continue
        out.append((name, value))
    return out


def is_context_only(msg: DlqMessage) -> bool:
    return msg.text(H_COPIED) == "false"


def stage_input_to_source(msg: DlqMessage, target: str) -> bool:
    """True when `msg`'s key/value are not the source record as read (``spillway.payload`` is
    not ``source``: a stage's input, e.g. a transformed row as JSON, or a record written before
    the header existed) and `target` is its source topic, or may be (written without context
    headers, so its source topic is unknown). A record whose context headers name no source
    topic did not come from Kafka: no source topic to protect."""
    if msg.text(H_PAYLOAD) == "source":
        return False
    prefix = _context_prefix(msg)
    if prefix is None:
        return True
    return msg.text(prefix + "topic") == target


# Record ids a redrive run remembers to skip repeats (a DLQ topic may hold a record twice):
# past this many, ids are no longer remembered and a repeat may be redriven again (counted).
MAX_REMEMBERED_IDS = 1_000_000


# --- redrive (Kafka) -------------------------------------------------------------------------


@dataclass(slots=True)
class RedriveSummary:
    scanned: int = 0
    matched: int = 0
    redriven: int = 0
    skipped_loop: int = 0
    skipped_context_only: int = 0
    skipped_stage_input: int = 0
    skipped_repeat: int = 0
    skipped_resolved: int = 0
    unremembered: int = 0   # redriven after MAX_REMEMBERED_IDS: repeats not detectable
    failed: int = 0
    ledger_failed: int = 0  # redriven but not recorded in the ledger
    errors: list[str] = field(default_factory=list)

    def line(self, dry_run: bool) -> str:
        verb = "would redrive" if dry_run else "redriven"
        return (f"scanned={self.scanned} matched={self.matched} {verb}={self.redriven} "
                f"skipped (loop protection)={self.skipped_loop} "
                f"skipped (context-only)={self.skipped_context_only} "
                f"skipped (stage input)={self.skipped_stage_input} "
                f"skipped (already redriven)={self.skipped_repeat} "
                f"skipped (resolved)={self.skipped_resolved} failed={self.failed}"
                + (f" not in ledger={self.ledger_failed}" if self.ledger_failed else ""))


def redrive(bootstrap: str, topic: str, target: str, *, flt: RedriveFilter | None = None,
            rate_per_s: float | None = None, dry_run: bool = False, max_redrives: int = 3,
            out: TextIO = sys.stdout, idle_s: float = 2.0, flush_timeout_s: float = 30.0,
            client_conf: Mapping[str, Any] | None = None,
            sleep: Callable[[float], None] = time.sleep, allow_stage_input: bool = False,
            progress: TextIO | None = None, progress_every_s: float = 2.0,
            ledger_topic: str | None = None, use_ledger: bool = True,
            tracer: Any = None) -> RedriveSummary:
    """Re-publish matching records of the DLQ `topic` to `target`; see the module docstring.

    ``allow_stage_input``: also send records whose key/value are a stage's input (not the
    source record) to their source topic. ``progress``: where to print running counts (every
    ``progress_every_s`` and at the end), e.g. stderr. ``ledger_topic``: where resolutions
    are (default ``<topic>.ledger``); ``use_ledger=False``: neither read nor write it.
    ``tracer``: for the redriven records' new spans (default: the global provider's)."""
    if target == topic:
        raise DlqError(f"the redrive target must not be the DLQ topic itself ({topic!r})")
    ledger_topic = ledger_topic or dlq_ledger.ledger_topic(topic)
    if use_ledger and not valid_topic_name(ledger_topic):
        raise DlqError(f"ledger topic: {invalid_topic_message(ledger_topic)} "
                       f"(--ledger-topic, or run with --no-ledger)")
    if use_ledger and ledger_topic in (topic, target):
        raise DlqError(f"the ledger topic must be neither the DLQ topic nor the target "
                       f"({ledger_topic!r})")
    if max_redrives < 0:
        raise ValueError("--max-redrives must be >= 0")
    flt = flt or RedriveFilter()
    summary = RedriveSummary()
    producer: Producer | None = None
    if not dry_run:
        conf = {"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
                "allow.auto.create.topics": False, "linger.ms": 20,
                "client.id": "spillway-dlq-redrive"}
        conf.update(client_conf or {})
        producer = Producer(_quiet(conf))
        try:
            md = producer.list_topics(timeout=10)
        except KafkaException as exc:
            raise DlqError(f"cannot read the cluster's metadata: {exc}") from exc
        if target not in md.topics or md.topics[target].error is not None:
            raise DlqError(f"redrive target topic {target!r} does not exist")
        if use_ledger and topic in md.topics:
            ledger.ensure_ledger_topic(conf, ledger_topic,
                                       len(md.topics[topic].partitions or {0: None}))
    resolved: dict[str, dlq_ledger.Resolution] = {}
    if use_ledger:
        resolved = _read_ledger(bootstrap, ledger_topic, idle_s, client_conf)
        if progress is not None:
            print(f"redrive: the ledger {ledger_topic!r} holds {len(resolved)} resolution(s)",
                  file=progress, flush=True)

    def delivered(resolution: bytes | None, key: str, err: KafkaError | None,
                  _msg: Any) -> None:
        if err is None:
            summary.redriven += 1
            if resolution is not None:
                # only once Kafka has the redriven record: a crash in between redrives it
                # again next time (at least once), never marks an unsent record resolved.
                # Produced by the main loop: a callback must not meet a full queue.
                to_record.append((key.encode(), resolution))
        else:
            summary.failed += 1
            if len(summary.errors) < 10:
                summary.errors.append(str(err))

    def ledger_written(err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            summary.ledger_failed += 1
            if len(summary.errors) < 10:
                summary.errors.append(f"ledger {ledger_topic!r}: {err}")

    to_record: deque[tuple[bytes, bytes]] = deque()

    def record_resolutions(wait: bool) -> None:
        while to_record and producer is not None:
            key, value = to_record[0]
            try:
                producer.produce(ledger_topic, key=key, value=value, on_delivery=ledger_written)
            except BufferError:
                if not wait:
                    return
                producer.poll(0.1)
                continue
            to_record.popleft()

    started = time.monotonic()
    sent = 0
    seen: set[str] = set()
    shown = started

    def show(final: bool = False) -> None:
        if progress is not None:
            print(f"redrive {'done' if final else 'progress'}: {summary.line(dry_run)} "
                  f"({time.monotonic() - started:.0f}s)", file=progress, flush=True)

    for msg in read_topic(bootstrap, topic, idle_s=idle_s, consumer_conf=client_conf):
        summary.scanned += 1
        if progress is not None and time.monotonic() - shown >= progress_every_s:
            shown = time.monotonic()
            if producer is not None:
                producer.poll(0)
            show()
        if not flt.matches(msg):
            continue
        summary.matched += 1
        where = f"{msg.topic}[{msg.partition}]@{msg.offset}"
        rid = msg.text("spillway.record.id") or "-"
        if is_context_only(msg):
            summary.skipped_context_only += 1
            print(f"skip {where} record {rid}: context-only (no original record to redrive)",
                  file=out)
            continue
        ident = ledger.message_key(msg)
        done = resolved.get(ident)
        if done is not None:
            summary.skipped_resolved += 1
            print(f"skip {where} record {rid}: {dlq_ledger.describe(done)} (ledger)", file=out)
            continue
        if ident in seen:
            summary.skipped_repeat += 1
            print(f"skip {where} record {rid}: already redriven in this run", file=out)
            continue
        count = redrive_count(msg)
        if count >= max_redrives:
            summary.skipped_loop += 1
            print(f"skip {where} record {rid}: redriven {count} times already "
                  f"(--max-redrives {max_redrives})", file=out)
            continue
        if not allow_stage_input and stage_input_to_source(msg, target):
            summary.skipped_stage_input += 1
            print(f"skip {where} record {rid}: its key/value are the "
                  f"{msg.text(H_PAYLOAD) or 'unstated (older)'} payload of a stage, not the "
                  f"source record, and {target!r} is (or may be) its source topic "
                  f"(--allow-stage-input sends it anyway)", file=out)
            continue
        if len(seen) < MAX_REMEMBERED_IDS:
            seen.add(ident)
        else:
            summary.unremembered += 1
        headers = original_headers(msg) + [(H_REDRIVE_COUNT, str(count + 1).encode())]
        if dry_run or producer is None:
            summary.redriven += 1
            print(f"would redrive {where} record {rid} -> {target} "
                  f"(redrive count {count} -> {count + 1})", file=out)
            continue
        if rate_per_s:
            due = started + sent / rate_per_s
            while (wait := due - time.monotonic()) > 0:
                producer.poll(0)
                sleep(min(wait, 0.1))
        parent = msg.text(H_TRACEPARENT)
        if parent:
            headers.append((dlq_ledger.H_REDRIVE_LINK, parent.encode("ascii", "replace")))
        headers += ledger.new_trace_headers(parent, target, tracer)
        record = dlq_ledger.encode(dlq_ledger.Resolution(
            "redriven", int(time.time() * 1000), "spillway dlq redrive", job=msg.text(H_JOB) or "",
            run_id=msg.text(H_RUN_ID) or "", record_id=rid if rid != "-" else "",
            dlq=where, target=target)) if use_ledger else None
        on_delivery = functools.partial(delivered, record, ident)
        while True:
            try:
                producer.produce(target, value=msg.value, key=msg.key, headers=headers,
                                 on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
        record_resolutions(wait=False)
        sent += 1
    if producer is not None:
        deadline = time.monotonic() + flush_timeout_s
        while True:  # a flush delivers records whose resolutions are then to be written
            record_resolutions(wait=True)
            left = producer.flush(max(0.0, deadline - time.monotonic()))
            if left or not to_record or time.monotonic() >= deadline:
                break
        if left:  # give up on them: their purge is reported (and counted) as a failure
            summary.errors.append(f"{left} record(s) not acknowledged within "
                                  f"{flush_timeout_s:g}s")
            producer.purge()
            producer.flush(1.0)
        if to_record:
            summary.ledger_failed += len(to_record)
            to_record.clear()
    for err in summary.errors:
        print(f"error: {err}", file=out)
    if summary.ledger_failed:
        print(f"warning: {summary.ledger_failed} redriven record(s) are not in the ledger "
              f"{ledger_topic!r}: a later redrive would send them again", file=out)
    if summary.unremembered:
        print(f"note: {summary.unremembered} record(s) redriven after {MAX_REMEMBERED_IDS} ids "
              f"were remembered: repeats among them were not detected", file=out)
    show(final=True)
    print(summary.line(dry_run), file=out, flush=True)
    return summary


def _read_ledger(bootstrap: str, ledger_topic: str, idle_s: float,
                 conf: Mapping[str, Any] | None) -> dict[str, dlq_ledger.Resolution]:
    """The ledger's resolutions; none when the ledger topic does not exist (yet)."""
    try:
        return ledger.read_resolutions(read_topic(bootstrap, ledger_topic, idle_s=idle_s,
                                                  consumer_conf=conf))
    except TopicNotFoundError:
        return {}


def parse_rate(text: str) -> float:
    """``100``, ``100/s`` or ``2.5/s`` records per second."""
    raw = text.strip().lower().removesuffix("/s")
    try:
        rate = float(raw)
    except ValueError:
        raise ValueError(f"not a rate: {text!r} (e.g. 100/s)") from None
    if rate <= 0:
        raise ValueError(f"the rate must be > 0, got {text!r}")
    return rate
