"""``spillway dlq redrive``: publish DLQ records again, to a target topic.

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

A missing target is created only when asked (`NewTarget`, ``--create-target``), under the
operator's prefix rule and with a replication factor the cluster can honour; it is not a DLQ
topic, so it does not get KIP-1191's opt-in. The pure rules (filters, headers, reasons, summary
and progress lines) are `redrive_rules`; this module is the Kafka loop around them.
"""

from __future__ import annotations

import functools
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from confluent_kafka import KafkaError, KafkaException, Producer
from spillway.client import dlq_ledger

from ..core.dlq_record import H_JOB, H_REDRIVE_COUNT, H_RUN_ID, H_TRACEPARENT
from ..core.guardrails import DEFAULT_REQUIRED_PREFIX, check_created_name
from ..core.names import invalid_topic_message, valid_topic_name
from ..errors import DlqError
from . import ledger
from .admin import TopicAdmin, check_layout, check_replication
from .redrive_rules import (
    MAX_REMEMBERED_IDS,
    UNKNOWN_SOURCE,
    RedriveFilter,
    RedriveSummary,
    is_context_only,
    original_headers,
    progress_line,
    redrive_count,
    stage_input_conflict,
    stage_input_skip,
)
from .tools import DlqMessage, TopicNotFoundError, quiet, read_topic

# how long a topic just created may take to show in the cluster's metadata
_NEW_TOPIC_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class NewTarget:
    """``--create-target``: create the target when it is missing, with these, and only under
    the operator's prefix rule (``dlq.topic.required.prefix``)."""

    partitions: int = 1
    replication_factor: int = 3
    required_prefix: str = DEFAULT_REQUIRED_PREFIX


def prepare_target(admin: TopicAdmin, target: str, new: NewTarget | None, *, dry_run: bool,
                   out: TextIO, timeout_s: float = 10.0) -> bool:
    """Make sure `target` exists: True when this call created it (or, dry, would). Refused
    (TopicGuardrailError, a ValueError) when `new` breaks the operator's rules; DlqError when
    it is missing and `new` is None."""
    if new is not None:
        check_layout(new.partitions, new.replication_factor)
    meta, brokers = admin.lookup(target, timeout_s)
    if meta is not None:
        return False
    if new is None:
        raise DlqError(f"redrive target topic {target!r} does not exist: create it, or add "
                       f"--create-target (with --partitions and --replication-factor) to have "
                       f"this redrive create it")
    check_created_name(target, new.required_prefix, "--target")
    check_replication(new.replication_factor, brokers, servers=admin.servers, topic=target,
                      setting="--replication-factor")
    what = (f"target topic {target!r} ({new.partitions} partition(s), replication factor "
            f"{new.replication_factor})")
    if dry_run:
        print(f"would create the {what}", file=out, flush=True)
        return True
    admin.create(target, new.partitions, new.replication_factor, timeout_s, dlq=False)
    deadline = time.monotonic() + _NEW_TOPIC_WAIT_S
    while admin.lookup(target, timeout_s)[0] is None:
        if time.monotonic() >= deadline:
            raise DlqError(f"created the {what}, but it did not show in the cluster's metadata "
                           f"within {_NEW_TOPIC_WAIT_S:g}s; run the redrive again")
        time.sleep(0.1)
    print(f"created the {what}", file=out, flush=True)
    return True


def redrive(bootstrap: str, topic: str, target: str, *, flt: RedriveFilter | None = None,
            rate_per_s: float | None = None, dry_run: bool = False, max_redrives: int = 3,
            out: TextIO = sys.stdout, idle_s: float = 2.0, flush_timeout_s: float = 30.0,
            client_conf: Mapping[str, Any] | None = None,
            sleep: Callable[[float], None] = time.sleep, allow_stage_input: bool = False,
            progress: TextIO | None = None, progress_every_s: float = 2.0,
            ledger_topic: str | None = None, use_ledger: bool = True,
            tracer: Any = None, create_target: NewTarget | None = None) -> RedriveSummary:
    """Re-publish matching records of the DLQ `topic` to `target`; see the module docstring.

    ``allow_stage_input``: also send records whose key/value are a stage's input (not the
    source record) to a target that is, or may be, their source topic. ``progress``: where to
    print the total, running counts with an ETA (every ``progress_every_s``) and the final
    counts, e.g. stderr. ``ledger_topic``: where resolutions are (default ``<topic>.ledger``);
    ``use_ledger=False``: neither read nor write it. ``tracer``: for the redriven records' new
    spans (default: the global provider's). ``create_target``: create a missing target; stage
    inputs of unknown source may go to a target this call created (it was nobody's source)."""
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
    admin = TopicAdmin.connect(quiet({"bootstrap.servers": bootstrap, **(client_conf or {})}))
    # a topic this run creates was nobody's source: stage inputs of unknown source may go there
    fresh_target = prepare_target(admin, target, create_target, dry_run=dry_run, out=out)
    producer: Producer | None = None
    if not dry_run:
        conf = {"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
                "allow.auto.create.topics": False, "linger.ms": 20,
                "client.id": "spillway-dlq-redrive"}
        conf.update(client_conf or {})
        producer = Producer(quiet(conf))
        try:
            md = producer.list_topics(timeout=10)
        except KafkaException as exc:
            raise DlqError(f"cannot read the cluster's metadata: {exc}") from exc
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
    span: list[int | None] = [None]   # how many records the watermarks list, once known

    def spanned(total: int | None) -> None:
        span[0] = total
        if progress is not None and total is not None:
            print(f"redrive: {total} record(s) to scan in {topic!r} (its watermarks)",
                  file=progress, flush=True)

    read_failed: list[DlqError] = []

    def records() -> Iterator[DlqMessage]:
        """The DLQ topic's records. A read that fails once records were sent ends them: what
        was sent is still flushed and written to the ledger below, then the error is raised."""
        try:
            yield from read_topic(bootstrap, topic, idle_s=idle_s, consumer_conf=client_conf,
                                  on_span=spanned)
        except DlqError as exc:
            if not sent:
                raise
            read_failed.append(exc)

    for msg in records():
        summary.scanned += 1
        if progress is not None and time.monotonic() - shown >= progress_every_s:
            shown = time.monotonic()
            if producer is not None:
                producer.poll(0)
            print(progress_line(summary, span[0], shown - started, dry_run), file=progress,
                  flush=True)
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
        conflict = None if allow_stage_input else stage_input_conflict(msg, target)
        if conflict == UNKNOWN_SOURCE and fresh_target:
            conflict = None
        if conflict is not None:
            summary.skipped_stage_input += 1
            summary.stage_input_unknown_source += conflict == UNKNOWN_SOURCE
            print(f"skip {where} record {rid}: {stage_input_skip(msg, target, conflict)}",
                  file=out)
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
    refusals = summary.refusals(target, max_redrives, dry_run)
    if refusals is not None:
        print(refusals, file=out)
    if progress is not None:
        print(f"redrive done in {time.monotonic() - started:.1f}s: {summary.line(dry_run)}",
              file=progress, flush=True)
    print(summary.line(dry_run), file=out, flush=True)
    if read_failed:
        raise read_failed[0]
    return summary


def _read_ledger(bootstrap: str, ledger_topic: str, idle_s: float,
                 conf: Mapping[str, Any] | None) -> dict[str, dlq_ledger.Resolution]:
    """The ledger's resolutions; none when the ledger topic does not exist (yet)."""
    try:
        return ledger.read_resolutions(read_topic(bootstrap, ledger_topic, idle_s=idle_s,
                                                  consumer_conf=conf))
    except TopicNotFoundError:
        return {}

