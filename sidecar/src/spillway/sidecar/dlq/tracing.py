"""One PRODUCER span per acknowledged DLQ batch (per topic and partition), linking to the trace
context of the records in it (OpenTelemetry messaging conventions for batch sends).

The span runs from the batch's first hand-off to the producer until Kafka acknowledged it.
Links are capped at MAX_LINKS_PER_SPAN (the SDK's default SpanLimits keep no more anyway): a
batch of up to that many records links once per record; a larger one links each distinct trace
context once, and what passes the cap is counted in ``spillway.links.dropped``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from operator import attrgetter

from opentelemetry import trace
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

from ..core.dlq_record import valid_traceparent

MAX_LINKS_PER_SPAN = 128
_sent_of = attrgetter("sent_ns")
_topic_of = attrgetter("rec.topic")


def _context(traceparent: str) -> SpanContext | None:
    if not valid_traceparent(traceparent):
        return None
    _, trace_id, span_id, flags = traceparent.split("-")
    return SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True,
                       trace_flags=TraceFlags(int(flags, 16)))


def _link_contexts(batch: Sequence) -> tuple[list[SpanContext], int]:
    """The trace contexts the batch's span links to, and how many were left out past the
    cap."""
    if len(batch) <= MAX_LINKS_PER_SPAN:
        parents = [e.rec.traceparent for e in batch]
    else:
        parents = list(dict.fromkeys(e.rec.traceparent for e in batch))
    links: list[SpanContext] = []
    cache: dict[str, SpanContext | None] = {}
    dropped = 0
    for tp in parents:
        if not tp:
            continue
        if len(links) >= MAX_LINKS_PER_SPAN:
            dropped += 1
            continue
        ctx = cache[tp] if tp in cache else cache.setdefault(tp, _context(tp))
        if ctx is not None:
            links.append(ctx)
    return links, dropped


def record_batch_spans(tracer: trace.Tracer, entries: Sequence, partitions: Sequence[int]) -> None:
    """`entries` carry `.rec` (a DlqRecord) and `.sent_ns`; `partitions` the acked partition.

    Each span is started before its records are looked at one by one: at a low sampling ratio
    most are not recorded, and then a record costs only its share of finding the topics and
    partitions (C loops). A recorded span gets its record count, jobs and links once started.
    Its start is the first hand-off among the records acknowledged with it (one drain step's
    acknowledgements, mostly handed to the producer together)."""
    if not entries:
        return
    end = time.time_ns()
    start = min(map(_sent_of, entries)) or end
    topics = set(map(_topic_of, entries))
    if len(topics) == 1:   # the common case: one DLQ topic
        (only,) = topics
        keys = [(only, p) for p in sorted(set(partitions))]
    else:
        keys = sorted(set(zip(map(_topic_of, entries), partitions, strict=True)))
    no_parent = trace.set_span_in_context(trace.INVALID_SPAN)
    groups: dict[tuple[str, int], list] | None = None   # made for the first recorded span
    for topic, partition in keys:
        attrs = {
            "messaging.system": "kafka",
            "messaging.operation.type": "send",
            "messaging.operation.name": "send",
            "messaging.destination.name": topic,
        }
        if partition >= 0:
            attrs["messaging.destination.partition.id"] = str(partition)
        span = tracer.start_span(f"send {topic}", kind=SpanKind.PRODUCER, attributes=attrs,
                                 start_time=start, context=no_parent)
        if span.is_recording():
            if groups is None:
                groups = defaultdict(list)
                for e, p in zip(entries, partitions, strict=True):
                    groups[(e.rec.topic, p)].append(e)
            batch = groups[(topic, partition)]
            links, dropped = _link_contexts(batch)
            for ctx in links:
                span.add_link(ctx)
            span.set_attribute("messaging.batch.message_count", len(batch))
            span.set_attribute("spillway.jobs", sorted({e.rec.job for e in batch}))
            if dropped:
                span.set_attribute("spillway.links.dropped", dropped)
        span.end(end_time=end)
