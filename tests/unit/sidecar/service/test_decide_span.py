"""The decision span summarises a report: counts per action and category, a few verdict events."""

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from spillway.sidecar.core.model import Action, Category, Verdict
from spillway.sidecar.service.reporting import MAX_VERDICT_EVENTS, annotate


class _Rec:
    def __init__(self, record_id):
        self.record_id = record_id


def _span(verdicts, ids=None):
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    records = [_Rec(i) for i in (ids or [v.record_id for v in verdicts])]
    with tp.get_tracer("t").start_as_current_span("spillway.decide") as span:
        annotate(span, verdicts, records)
    [finished] = exporter.get_finished_spans()
    return finished


def _v(i, action, category=Category.DATA):
    return Verdict(f"r{i}", action, category, f"reason {i}", 1)


def test_a_large_report_gets_counts_and_a_capped_number_of_events():
    verdicts = [_v(i, Action.SKIP) for i in range(300)]
    verdicts[250] = _v(250, Action.RETRY, Category.RETRIABLE)
    verdicts[260] = _v(260, Action.FAIL, Category.ABORTABLE)
    span = _span(verdicts)
    a = span.attributes
    assert a["spillway.verdicts.skip"] == 298
    assert a["spillway.verdicts.retry"] == 1 and a["spillway.verdicts.fail"] == 1
    assert a["spillway.verdicts.category.data"] == 298
    assert a["spillway.verdicts.category.retriable"] == 1
    assert a["spillway.verdicts.category.abortable"] == 1
    assert a["spillway.verdicts.events.omitted"] == 300 - MAX_VERDICT_EVENTS
    ids = [e.attributes["spillway.record.id"] for e in span.events]
    assert len(ids) == MAX_VERDICT_EVENTS
    # the outliers are always among them, in record order with the first SKIPs
    assert ids == [f"r{i}" for i in range(MAX_VERDICT_EVENTS - 2)] + ["r250", "r260"]
    assert all(e.name == "spillway.verdict" for e in span.events)


def test_a_small_report_gets_an_event_per_record():
    span = _span([_v(i, Action.SKIP) for i in range(3)])
    assert [e.attributes["spillway.action"] for e in span.events] == ["SKIP"] * 3
    assert span.attributes["spillway.verdicts.events.omitted"] == 0


def test_records_answered_by_one_span_are_named_by_their_own_ids():
    """A run of records decided alike shares one verdict with no record id (a span): each
    event names its record."""
    run = Verdict("", Action.SKIP, Category.DATA, "skipped", 1)
    span = _span([run] * 3, ids=["a", "b", "c"])
    assert [e.attributes["spillway.record.id"] for e in span.events] == ["a", "b", "c"]
