"""Spans are recorded only while something exports them.

A sidecar with no trace exporter (no OTLP endpoint, no span processor added) used to record
every span its sampler let through and drop it at the end: the server span of each call with
its peer attributes, the decision and spool spans, one DLQ batch span per acknowledged batch
with a link per record. Nobody ever saw them, and they cost a home ~130 µs of CPU per call
(measured; on a node, per report and per batch, the change is within the noise:
docs/OBSERVABILITY.md).

So the sidecar's tracer provider (`provider`) knows whether it has a span processor, and its
sampler drops every span while it has none. A dropped span is still a valid span context with
the trace id of its parent (the executor's, from the call's metadata), so what the sidecar
propagates stays valid: a DLQ record of a record reported without a trace context carries the
decision's context, now with the sampled flag clear (nothing of it was recorded). A processor
added later (a test's in-memory exporter, say) turns recording on from the next span.
"""

from __future__ import annotations

from collections.abc import Callable


def provider(**kwargs):
    """An SDK `TracerProvider` (``kwargs`` are its own) whose spans are recorded only once a
    span processor is added: its sampler (from OTEL_TRACES_SAMPLER, as the SDK reads it)
    decides while one is; every span is dropped before. ``.exporting`` says which."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
    from opentelemetry.trace import get_current_span

    class _WhileExported(Sampler):
        def __init__(self, inner: Sampler, exporting: Callable[[], bool]) -> None:
            self._inner, self._exporting = inner, exporting

        # `Sampler.should_sample(parent_context, trace_id, name, kind, attributes, links,
        # trace_state)`: the SDK's tracer passes the first six by position, and its own
        # wrapping samplers (ParentBased, AlwaysRecord) pass all seven by position, so none may
        # be keyword-only. This one needs only the parent; the rest go to the inner sampler as
        # they came, by position or by name.
        def should_sample(self, parent_context, *args, **kwargs) -> SamplingResult:
            if self._exporting():
                return self._inner.should_sample(parent_context, *args, **kwargs)
            parent = get_current_span(parent_context).get_span_context()
            return SamplingResult(Decision.DROP, None,
                                  parent.trace_state if parent.is_valid else None)

        def get_description(self) -> str:
            return f"WhileExported{{{self._inner.get_description()}}}"

    class _Provider(TracerProvider):
        exporting = False

        def add_span_processor(self, span_processor) -> None:
            super().add_span_processor(span_processor)
            self.exporting = True

    tp = _Provider(**kwargs)
    # tracers take the provider's sampler when they are made: set before any is
    tp.sampler = _WhileExported(tp.sampler, lambda: tp.exporting)
    return tp


def exporting(tracer_provider) -> bool:
    """Whether spans of this provider reach an exporter (True for one not made here)."""
    return getattr(tracer_provider, "exporting", True)


__all__ = ["exporting", "provider"]
