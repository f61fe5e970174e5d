"""Executor-side tracing: one span per stage and partition, an ``exception`` event per failed
record, and the span's W3C context on each report.

If the executor's Python process has no OpenTelemetry SDK TracerProvider (the global provider is
still the API's proxy), `ensure_provider` installs one, configured only by the standard
environment variables, so that traceparents are valid and sampled-in by default:

- ``OTEL_SDK_DISABLED=true``: nothing is installed (spans are no-ops, reports carry no context);
- ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``: the sampler (default
  parentbased_always_on);
- ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``: the resource (service.name defaults to
  ``spillway-spark-executor``);
- ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``: spans are exported
  over OTLP (``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL``: grpc, the default, or http/protobuf),
  the exporter being imported only then. Without an endpoint nothing is exported.

A provider the application configured itself (SDK or not) is left alone. On Spark executors set
these with ``spark.executorEnv.OTEL_...``.
"""

from __future__ import annotations

import logging
import os
import threading

from opentelemetry import trace
from opentelemetry.context import Context

log = logging.getLogger("spillway.spark")

TRACER_NAME = "spillway.spark"
DEFAULT_SERVICE_NAME = "spillway-spark-executor"

_lock = threading.Lock()
_state: dict[str, object] = {"pid": None, "exporting": False, "warned": False}

# What to install when an endpoint is set but the exporter is missing (docs/OBSERVABILITY.md).
_INSTALL = {"grpc": "pip install 'spillway-spark[otlp]'",
            "http/protobuf": "pip install opentelemetry-exporter-otlp-proto-http"}


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def _exporter():
    """The OTLP span exporter the environment asks for, or None (logged) when unavailable."""
    protocol = (_env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or _env("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").lower()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            log.warning("spillway: OTEL_EXPORTER_OTLP_PROTOCOL=%s is not supported (grpc or "
                        "http/protobuf); executor spans are not exported", protocol)
            return None
    except ImportError:
        # one clear line per process (and not again in its forks), not Python's
        # "No module named 'opentelemetry.exporter'"
        if not _state["warned"]:
            _state["warned"] = True
            var = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
            var = var if _env(var) else "OTEL_EXPORTER_OTLP_ENDPOINT"
            log.warning("spillway: %s is set but this Python has no OTLP/%s span exporter, so "
                        "executor spans are not exported: %s", var, protocol, _INSTALL[protocol])
        return None
    return OTLPSpanExporter()  # reads the endpoint, headers, timeout... from OTEL_* itself


def ensure_provider() -> None:
    """Install an SDK TracerProvider when this process has none (once per process)."""
    pid = os.getpid()
    if _state["pid"] == pid:
        return
    with _lock:
        if _state["pid"] == pid:
            return
        _state["pid"] = pid
        _state["exporting"] = False
        if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            return  # the application configured tracing: respect it
        if _env("OTEL_SDK_DISABLED").lower() == "true":
            return
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        attrs = {} if _env("OTEL_SERVICE_NAME") or "service.name=" in _env(
            "OTEL_RESOURCE_ATTRIBUTES") else {SERVICE_NAME: DEFAULT_SERVICE_NAME}
        provider = TracerProvider(resource=Resource.create(attrs))  # sampler from OTEL_TRACES_*
        if _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _env("OTEL_EXPORTER_OTLP_ENDPOINT"):
            exporter = _exporter()
            if exporter is not None:
                provider.add_span_processor(BatchSpanProcessor(exporter))
                _state["exporting"] = True
        trace.set_tracer_provider(provider)


def tracer() -> trace.Tracer:
    ensure_provider()
    return trace.get_tracer(TRACER_NAME)


def span_name(stage_name: str, function_name: str) -> str:
    """``spillway.<stage> <function>``, e.g. ``spillway.TRANSFORMATION app.parse``."""
    return f"spillway.{stage_name} {function_name}".strip()


def flush_exported(timeout_ms: int = 2000) -> None:
    """Push finished spans out before Spark may kill the worker (only when we export them)."""
    if not _state["exporting"]:
        return
    provider = trace.get_tracer_provider()
    force_flush = getattr(provider, "force_flush", None)
    if callable(force_flush):
        force_flush(timeout_ms)


def start_span(name: str, parent: Context | None, attributes: dict) -> trace.Span:
    return tracer().start_span(name, context=parent, kind=trace.SpanKind.INTERNAL,
                               attributes=attributes)
