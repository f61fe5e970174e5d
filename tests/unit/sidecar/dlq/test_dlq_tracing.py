"""The batch produce spans: one per acknowledged topic-partition batch, links to the records'
trace contexts, capped."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from spillway.sidecar.core.model import DlqRecord
from spillway.sidecar.dlq.tracing import MAX_LINKS_PER_SPAN, record_batch_spans


@dataclass
class Entry:
    rec: DlqRecord
    sent_ns: int = 1


def entry(i: int, traceparent: str) -> Entry:
    return Entry(DlqRecord(topic="dlq.t", key=None, value=b"v", headers=(), record_id=str(i),
                           job="job", task_key="t", traceparent=traceparent))


def tp(n: int) -> str:
    return f"00-{n + 1:032x}-{n + 1:016x}-01"


def spans_of(entries, partitions):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    record_batch_spans(provider.get_tracer("t"), entries, partitions)
    return exporter.get_finished_spans()


def test_a_small_batch_links_once_per_record():
    (span,) = spans_of([entry(i, tp(0)) for i in range(3)], [0, 0, 0])
    assert len(span.links) == 3
    assert span.attributes["messaging.batch.message_count"] == 3
    assert "spillway.links.dropped" not in span.attributes


def test_a_large_batch_links_each_trace_context_once_up_to_the_cap():
    entries = [entry(i, tp(i % 10)) for i in range(1_000)] + [entry(1_000, "")]
    (span,) = spans_of(entries, [2] * len(entries))
    assert {ln.context.span_id for ln in span.links} == {n + 1 for n in range(10)}
    assert len(span.links) == 10
    assert span.attributes["messaging.batch.message_count"] == 1_001
    assert span.attributes["messaging.destination.partition.id"] == "2"


def test_links_past_the_cap_are_counted_not_kept():
    n = MAX_LINKS_PER_SPAN + 50
    (span,) = spans_of([entry(i, tp(i)) for i in range(n)], [0] * n)
    assert len(span.links) == MAX_LINKS_PER_SPAN
    assert span.attributes["spillway.links.dropped"] == 50


def test_one_span_per_partition():
    spans = spans_of([entry(0, tp(0)), entry(1, tp(1)), entry(2, tp(2))], [0, 1, 0])
    assert sorted(s.attributes["messaging.batch.message_count"] for s in spans) == [1, 2]


class _Untouchable:
    """A DLQ record whose trace context and job must not be read (a span not recorded)."""

    topic = "dlq.t"

    @property
    def traceparent(self):
        raise AssertionError("read for a span that is not recorded")

    job = traceparent


def test_a_span_not_recorded_reads_no_record_past_its_topic_and_hand_off():
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    entries = [Entry(_Untouchable(), sent_ns=5) for _ in range(300)]
    record_batch_spans(provider.get_tracer("t"), entries, [i % 3 for i in range(300)])
    assert exporter.get_finished_spans() == ()


def test_the_spans_start_at_the_first_hand_off_of_the_records_acknowledged_with_them():
    entries = [entry(0, tp(0)), entry(1, tp(1)), entry(2, tp(2))]
    entries[0].sent_ns, entries[1].sent_ns, entries[2].sent_ns = 3_000, 1_000, 2_000
    spans = spans_of(entries, [0, 1, 0])
    assert sorted((s.attributes["messaging.destination.partition.id"],
                   s.attributes["messaging.batch.message_count"], len(s.links))
                  for s in spans) == [("0", 2, 2), ("1", 1, 1)]
    assert {s.start_time for s in spans} == {1_000}
    assert all(s.end_time >= s.start_time and s.attributes["spillway.jobs"] == ("job",)
               for s in spans)
