"""A sidecar records spans only while something exports them
(`spillway.sidecar.observability.exported`): without a span processor every span is dropped,
yet what it propagates is a valid context of its parent's trace; a processor added later turns
recording on, under the configured sampler."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
from spillway.sidecar.observability import exported, telemetry

PARENT = SpanContext(trace_id=0x0AF7651916CD43DD8448EB211C80319C, span_id=0xB7AD6B7169203331,
                     is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED),
                     trace_state=TraceState([("vendor", "x")]))


def _child(tp):
    tracer = tp.get_tracer("t")
    return tracer.start_span("child", context=trace.set_span_in_context(
        NonRecordingSpan(PARENT)))


def test_without_a_processor_spans_are_dropped_but_stay_in_their_parents_trace():
    tp = exported.provider()
    assert not tp.exporting and not exported.exporting(tp)
    span = _child(tp)
    ctx = span.get_span_context()
    assert not span.is_recording()
    assert ctx.is_valid and ctx.trace_id == PARENT.trace_id and ctx.span_id != PARENT.span_id
    assert not ctx.trace_flags.sampled          # nothing of it was recorded
    assert ctx.trace_state == PARENT.trace_state
    root = tp.get_tracer("t").start_span("root")
    assert not root.is_recording() and root.get_span_context().is_valid


def test_a_processor_added_later_turns_recording_on_for_the_next_span():
    tp = exported.provider()
    tracer = tp.get_tracer("t")              # made before the processor: follows it too
    before = tracer.start_span("before")
    spans = InMemorySpanExporter()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    assert tp.exporting
    after = tracer.start_span("after", context=trace.set_span_in_context(
        NonRecordingSpan(PARENT)))
    assert after.is_recording() and after.get_span_context().trace_flags.sampled
    before.end()
    after.end()
    assert [s.name for s in spans.get_finished_spans()] == ["after"]


def test_the_configured_sampler_still_decides_while_exporting(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    tp = exported.provider()
    tp.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    assert not _child(tp).is_recording()
    assert "AlwaysOffSampler" in tp.sampler.get_description()


def test_a_sidecar_exports_only_with_an_endpoint(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    quiet = telemetry.setup()
    try:
        assert not quiet.exporting()
        assert not quiet.tracer.start_span("x").is_recording()
    finally:
        quiet.shutdown()
    # an endpoint nobody listens on: nothing is sent before a span ends
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9")
    loud = telemetry.setup()
    try:
        assert loud.exporting()
        span = loud.tracer.start_span("x")
        assert span.is_recording()
    finally:
        loud.tracer_provider.shutdown = lambda: None   # do not wait on the dead endpoint
        loud.shutdown()
    assert telemetry.Telemetry().exporting() is False   # telemetry off
