"""The DLQ ledger on Kafka, for `spillway dlq redrive`: read what is resolved, make sure the
ledger topic exists, and the pure parts of a redriven record's trace context.

The format (keys, values, resolutions) is `spillway.client.dlq_ledger`, shared with
spillway-spark's `read_dlq` and `Job.reprocess`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import confluent_kafka
import confluent_kafka.admin
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from spillway.client import dlq_ledger
from spillway.client.dlq_ledger import Resolution

from ..core.dlq_record import H_JOB, H_RECORD_ID, H_RUN_ID, H_TRACEPARENT, valid_traceparent
from ..errors import DlqError

# A redrive keeps the ledger in memory: past this many resolutions it stops rather than
# redrive records it could not check (scope the run with --since/--until, or --no-ledger).
MAX_LEDGER_KEYS = 5_000_000

TRACER_NAME = "spillway.dlq.redrive"
_PROPAGATOR = TraceContextTextMapPropagator()


def message_key(msg: Any) -> str:
    """`ledger_key` of a `tools.DlqMessage`."""
    return dlq_ledger.ledger_key(msg.text(H_JOB), msg.text(H_RUN_ID),
                                 msg.text(H_RECORD_ID), msg.key, msg.value,
                                 topic=msg.topic, partition=msg.partition, offset=msg.offset)


def read_resolutions(messages: Any, *, limit: int = MAX_LEDGER_KEYS) -> dict[str, Resolution]:
    """Key -> latest resolution over `messages` (a ledger topic read with `tools.read_topic`);
    records that are not resolutions are ignored. DlqError past `limit` keys."""
    out: dict[str, Resolution] = {}
    for m in messages:
        if m.key is None:
            continue
        r = dlq_ledger.decode(m.value)
        if r is None:
            continue
        key = m.key.decode("ascii", "replace")
        if key not in out and len(out) >= limit:
            raise DlqError(f"the ledger {m.topic!r} holds more than {limit} resolutions; "
                           f"scope the redrive with --since/--until, or run it with --no-ledger")
        out[key] = r
    return out


def ensure_ledger_topic(conf: Mapping[str, Any], topic: str, partitions: int,
                        timeout_s: float = 10.0) -> bool:
    """`dlq_ledger.ensure_topic`, its errors as DlqError (naming --no-ledger)."""
    try:
        return dlq_ledger.ensure_topic(confluent_kafka, dict(conf), topic, partitions, timeout_s)
    except dlq_ledger.LedgerError as exc:
        raise DlqError(f"{exc}; or run with --no-ledger") from exc


def new_trace_headers(original_traceparent: str | None, target: str,
                      tracer: trace.Tracer | None = None) -> list[tuple[str, bytes]]:
    """A redriven record's trace context: a new span (a new trace) linked to the DLQ record's,
    when a tracer provider records spans; none otherwise. Never the DLQ record's own."""
    links = []
    if original_traceparent and valid_traceparent(original_traceparent):
        ctx = trace.get_current_span(
            _PROPAGATOR.extract({"traceparent": original_traceparent})).get_span_context()
        links.append(Link(ctx, {"spillway.link": "dead-lettered"}))
    tracer = tracer or trace.get_tracer(TRACER_NAME)
    span = tracer.start_span(f"redrive {target}", context=Context(), links=links,
                             kind=trace.SpanKind.PRODUCER,
                             attributes={"messaging.destination.name": target,
                                         "messaging.operation": "publish"})
    try:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
        return [(k, v.encode("ascii")) for k, v in carrier.items()
                if k == H_TRACEPARENT or k == "tracestate"]
    finally:
        span.end()


def setup_tracing() -> None:
    """Export the redrive's spans over OTLP when the standard environment asks for it
    (``OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT``), as the sidecar does."""
    from spillway.sidecar.observability import telemetry

    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return
    if telemetry.otlp_configured("TRACES"):
        telemetry.setup(service_name="spillway-dlq-redrive", install_global=True)


def shutdown_tracing() -> None:
    shutdown = getattr(trace.get_tracer_provider(), "shutdown", None)
    if callable(shutdown):
        shutdown()
