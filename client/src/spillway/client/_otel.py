"""A CLIENT span per sidecar call, with the trace context sent in the call's metadata.

Only the OpenTelemetry API is used: without an SDK configured in the process the span is a
no-op, and the metadata carries the caller's context only when that context is valid. The span
follows the OpenTelemetry RPC conventions: named ``spillway.v1.ErrorSidecar/<Method>``, kind
CLIENT, with ``rpc.system``, ``rpc.service``, ``rpc.method``, ``server.address`` and
``rpc.grpc.status_code``; the sidecar's server span joins the same trace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

SERVICE = "spillway.v1.ErrorSidecar"
_tracer = trace.get_tracer("spillway.client")


def traced_call(method: str, target: str, call: Callable[[list[tuple[str, str]]], Any]) -> Any:
    """Run ``call(metadata)`` inside a CLIENT span for ``method`` on ``target``."""
    attributes = {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": method,
                  "server.address": target}
    with _tracer.start_as_current_span(f"{SERVICE}/{method}", kind=SpanKind.CLIENT,
                                       attributes=attributes, record_exception=False,
                                       set_status_on_exception=False) as span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        try:
            result = call(list(carrier.items()))
        except grpc.RpcError as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else None
            if isinstance(code, grpc.StatusCode):
                span.set_attribute("rpc.grpc.status_code", code.value[0])
            span.set_status(Status(StatusCode.ERROR, f"{getattr(code, 'name', 'UNKNOWN')}"))
            raise
        span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.OK.value[0])
        return result
