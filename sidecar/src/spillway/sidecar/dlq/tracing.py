"""One PRODUCER span per acknowledged DLQ batch (per topic and partition), linking to the trace
context of every record in it (OpenTelemetry messaging conventions for batch sends).

The span runs from the batch's first hand-off to the producer until Kafka acknowledged it.
Links are capped per span by the tracer provider's SpanLimits; batches are cut to fit.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags

from ..core.dlq_record import valid_traceparent

MAX_LINKS_PER_SPAN = 1000


def _context(traceparent: str) -> SpanContext | None:
    if not valid_traceparent(traceparent):
        return None
    _, trace_id, span_id, flags = traceparent.split("-")
    return SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True,
                       trace_flags=TraceFlags(int(flags, 16)))


def record_batch_spans(tracer: trace.Tracer, entries: Sequence, partitions: Sequence[int]) -> None:
    """`entries` carry `.rec` (a DlqRecord) and `.sent_ns`; `partitions` the acked partition."""
    groups: dict[tuple[str, int], list] = defaultdict(list)
    for e, p in zip(entries, partitions, strict=True):
        groups[(e.rec.topic, p)].append(e)
    end = time.time_ns()
    for (topic, partition), batch in groups.items():
        for i in range(0, len(batch), MAX_LINKS_PER_SPAN):
            chunk = batch[i:i + MAX_LINKS_PER_SPAN]
            links = [Link(ctx) for ctx in (_context(e.rec.traceparent) for e in chunk) if ctx]
            attrs = {
                "messaging.system": "kafka",
                "messaging.operation.type": "send",
                "messaging.operation.name": "send",
                "messaging.destination.name": topic,
                "messaging.batch.message_count": len(chunk),
                "spillway.jobs": sorted({e.rec.job for e in chunk}),
            }
            if partition >= 0:
                attrs["messaging.destination.partition.id"] = str(partition)
            span = tracer.start_span(f"send {topic}", kind=SpanKind.PRODUCER, links=links,
                                     attributes=attrs,
                                     start_time=min(e.sent_ns for e in chunk) or end,
                                     context=trace.set_span_in_context(trace.INVALID_SPAN))
            span.end(end_time=end)
