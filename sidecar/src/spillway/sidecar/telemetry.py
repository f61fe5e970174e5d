"""OpenTelemetry for the sidecar: traces and the KIP metric set, exported by OTLP and Prometheus.

Follows OpenTelemetry semantic conventions schema 1.44.0 (messaging attributes are still
incubating there; we use messaging.system, messaging.destination.name,
messaging.destination.partition.id, messaging.batch.message_count, messaging.operation.*).

Sampling and exporters follow the standard OTEL_* environment variables (the SDK reads
OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG itself; default parentbased_always_on).
Traces and metrics go to OTLP/gRPC when OTEL_EXPORTER_OTLP_ENDPOINT (or the signal-specific
variable) is set; metrics are also served for Prometheus on `metrics.prometheus.port`.

Metrics are observable instruments whose callbacks read the counters the policy engine and DLQ
pipeline already keep, so the hot path pays nothing for them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation

log = logging.getLogger("spillway.sidecar.telemetry")

SCHEMA_URL = "https://opentelemetry.io/schemas/1.44.0"
SERVICE_NAME = "spillway-sidecar"

# KIP metric name -> (spillway metric name, instrument kind, unit, description).
# docs/OBSERVABILITY.md carries this table for users.
METRICS: dict[str, tuple[str, str, str, str]] = {
    "total-record-failures": ("spillway.record.failures", "counter", "{failure}",
                              "KIP-298: every failed attempt of a record"),
    "total-record-errors": ("spillway.record.errors", "counter", "{error}",
                            "KIP-298: failures after retries were exhausted or not retriable"),
    "total-records-skipped": ("spillway.records.skipped", "counter", "{record}",
                              "KIP-298: records skipped (dead-lettered or only logged)"),
    "total-retries": ("spillway.retries", "counter", "{retry}",
                      "KIP-298: RETRY verdicts given"),
    "total-errors-logged": ("spillway.errors.logged", "counter", "{error}",
                            "KIP-298: errors logged or written to the DLQ"),
    "last-error-timestamp": ("spillway.last_error.timestamp", "gauge", "ms",
                             "KIP-298: epoch ms of the last error"),
    "dropped-records": ("spillway.records.dropped", "counter", "{record}",
                        "KIP-1033: records skipped without a DLQ"),
    "deadletterqueue-produce-requests": ("spillway.dlq.produce.requests", "counter",
                                         "{request}", "KIP-298/KIP-1191: DLQ produce requests"),
    "deadletterqueue-produce-failures": ("spillway.dlq.produce.failures", "counter",
                                         "{record}", "KIP-298/KIP-1191: DLQ records that "
                                         "failed to produce"),
    "dlq-records-written": ("spillway.dlq.records", "counter", "{record}",
                            "KIP-1191 DeadLetterQueueRecordCount: records acknowledged by Kafka"),
    "spool-depth": ("spillway.spool.records", "gauge", "{record}",
                    "DLQ records durable in the spool, not yet acknowledged by Kafka"),
    "spool-bytes": ("spillway.spool.size", "gauge", "By", "bytes held by the spool"),
    "write-retries": ("spillway.dlq.write.retries", "counter", "{retry}",
                      "status-store KIP: DLQ write retries"),
    "write-successes": ("spillway.dlq.write.successes", "counter", "{record}",
                        "status-store KIP: DLQ writes that succeeded"),
    "write-failures": ("spillway.dlq.write.failures", "counter", "{record}",
                       "status-store KIP: DLQ writes that failed after retries"),
    "rejected-records": ("spillway.dlq.rejected", "counter", "{record}",
                         "DLQ records Kafka can never accept, kept aside (not lost)"),
}

# A row: (KIP metric name, attributes such as job/stage/task, value).
Row = tuple[str, Mapping[str, str], float]
RowSource = Callable[[], Iterable[Row]]


def _otlp_configured(signal: str) -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"))


@dataclass
class Telemetry:
    tracer_provider: object | None = None
    meter_provider: object | None = None
    prometheus_port: int = 0
    tracer: trace.Tracer = field(default_factory=lambda: trace.NoOpTracer())
    verdict_duration: object | None = None  # histogram, seconds
    _http_server: object | None = field(default=None, repr=False)
    _sources: list[RowSource] = field(default_factory=list)

    def add_source(self, source: RowSource) -> None:
        self._sources.append(source)

    def rows(self) -> list[Row]:
        out: list[Row] = []
        for src in self._sources:
            try:
                out.extend(src())
            except Exception:  # a broken source must not break every other metric
                log.exception("metric source failed")
        return out

    def shutdown(self) -> None:
        """Flush spans and metrics (graceful stop)."""
        for provider in (self.tracer_provider, self.meter_provider):
            if provider is not None:
                try:
                    provider.shutdown()
                except Exception:
                    log.exception("telemetry shutdown failed")
        if self._http_server is not None:
            self._http_server.shutdown()


def setup(*, service_name: str = SERVICE_NAME, prometheus_port: int = 0,
          prometheus_host: str = "127.0.0.1", sidecar_id: str = "",
          max_links: int = 1024, install_global: bool = False) -> Telemetry:
    """Build SDK tracer and meter providers for one sidecar and return their handle.

    The providers are passed explicitly to what uses them (several sidecars may share a test
    process); `install_global` also makes them the process-wide defaults (the CLI does).
    """
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                               service_name),
                                "service.instance.id": sidecar_id or "unknown"})
    # One DLQ batch span links to every record it carries: allow as many links as a batch.
    tp = TracerProvider(resource=resource, span_limits=SpanLimits(max_links=max_links))
    if _otlp_configured("TRACES"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    readers = []
    if _otlp_configured("METRICS"):
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    tel = Telemetry(tracer_provider=tp, prometheus_port=prometheus_port)
    if prometheus_port:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        readers.append(PrometheusMetricReader(registry=registry))
        server, _thread = start_http_server(prometheus_port, addr=prometheus_host,
                                            registry=registry)
        tel._http_server = server
        tel.prometheus_port = server.server_port
    mp = MeterProvider(resource=resource, metric_readers=readers)
    tel.meter_provider = mp
    if install_global:
        trace.set_tracer_provider(tp)
        metrics.set_meter_provider(mp)
    meter = mp.get_meter("spillway.sidecar", schema_url=SCHEMA_URL)
    register_instruments(meter, tel)
    tel.verdict_duration = meter.create_histogram(
        "spillway.verdict.duration", unit="s",
        description="time to answer a ReportFailures call (decide + spool)")
    tel.tracer = tp.get_tracer("spillway.sidecar", schema_url=SCHEMA_URL)
    return tel


def register_instruments(meter: metrics.Meter, tel: Telemetry) -> None:
    """One observable instrument per KIP metric, fed from the telemetry's row sources."""

    def callback_for(kip_name: str):
        def cb(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v, dict(a)) for n, a, v in tel.rows() if n == kip_name]

        return cb

    for kip_name, (name, kind, unit, desc) in METRICS.items():
        make = meter.create_observable_counter if kind == "counter" else \
            meter.create_observable_gauge
        make(name, callbacks=[callback_for(kip_name)], unit=unit, description=desc)


