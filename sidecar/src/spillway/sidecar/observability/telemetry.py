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

import bisect
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from spillway.sidecar.observability import exported

log = logging.getLogger("spillway.sidecar.observability.telemetry")

SCHEMA_URL = "https://opentelemetry.io/schemas/1.44.0"
SERVICE_NAME = "spillway-sidecar"

# KIP metric name -> (spillway metric name, instrument kind, unit, description).
# docs/OBSERVABILITY.md carries this table for users
# (tests/unit/sidecar/observability/test_observability_doc.py).
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
    "last-error-timestamp": ("spillway.last_error.timestamp", "gauge", "s",
                             "KIP-298: time of the last error, seconds since the Unix epoch"),
    "dropped-records": ("spillway.records.dropped", "counter", "{record}",
                        "KIP-1033: records skipped without a DLQ"),
    "dlq-records-written": ("spillway.dlq.records", "counter", "{record}",
                            "KIP-1191 DeadLetterQueueRecordCount: records acknowledged by Kafka"),
    "deadletterqueue-produce-requests": ("spillway.dlq.produce.requests", "counter",
                                         "{request}", "KIP-298/KIP-1191: DLQ produce requests"),
    "deadletterqueue-produce-failures": ("spillway.dlq.produce.failures", "counter",
                                         "{record}", "KIP-298/KIP-1191: DLQ records that "
                                         "failed to produce"),
    "spool-depth": ("spillway.spool.records", "gauge", "{record}",
                    "DLQ records durable in the spool, not yet acknowledged by Kafka"),
    "spool-bytes": ("spillway.spool.size", "gauge", "By", "bytes held by the spool"),
    # the high-water marks, so that an alert can compare the spool's fill with them
    "spool-max-records": ("spillway.spool.records.limit", "gauge", "{record}",
                          "spool.max.records: the spool's high-water mark in records "
                          "(backpressure past it)"),
    "spool-max-bytes": ("spillway.spool.size.limit", "gauge", "By",
                        "spool.max.bytes: the spool's high-water mark in bytes "
                        "(backpressure past it)"),
    "write-retries": ("spillway.dlq.write.retries", "counter", "{retry}",
                      "status-store KIP: DLQ write retries"),
    "write-successes": ("spillway.dlq.write.successes", "counter", "{record}",
                        "status-store KIP: DLQ writes that succeeded"),
    "write-failures": ("spillway.dlq.write.failures", "counter", "{record}",
                       "status-store KIP: DLQ writes that failed after retries"),
    "rejected-records": ("spillway.dlq.rejected", "counter", "{record}",
                         "DLQ records Kafka can never accept, kept aside (not lost)"),
    "records-refused": ("spillway.records.refused", "counter", "{record}",
                        "records of reports refused for backpressure (RESOURCE_EXHAUSTED): "
                        "not decided, not counted as failures; the executor keeps them"),
    "backpressure": ("spillway.backpressure", "gauge", "1",
                     "1 while reports are refused for backpressure (health NOT_SERVING)"),
    "kafka-reachable": ("spillway.kafka.reachable", "gauge", "1",
                        "1 while the sidecar's Kafka answers its check (health service "
                        "spillway.kafka), 0 once a check failed"),
    "retry-budget-exhausted": ("spillway.retry_budget.exhausted", "counter", "{retry}",
                               "retries a job's retry budget deferred (the record still "
                               "retries, later) or refused past the record's retry timeout"),
    "held-records": ("spillway.dlq.held", "gauge", "{record}",
                     "DLQ records held for their run's home to confirm (provisional "
                     "verdicts, guarded reports)"),
    "held-reports-confirmed": ("spillway.home.confirmed", "counter", "{report}",
                               "held reports their run's home answered"),
    "home-confirm-calls": ("spillway.home.confirm.calls", "counter", "{call}",
                           "calls that confirmed held reports with a run's home (several "
                           "reports a call)"),
    "held-records-released": ("spillway.dlq.held.released", "counter", "{record}",
                              "held records the home called new: produced"),
    "held-records-dropped": ("spillway.dlq.held.dropped", "counter", "{record}",
                             "held records already in the DLQ through another copy: dropped"),
    "budget-slices-granted": ("spillway.home.slices.granted", "counter", "{slice}",
                              "slices of limited runs' error budgets granted to this node"),
    "slice-records-answered": ("spillway.home.slices.answered", "counter", "{record}",
                               "records this node answered under budget slices"),
    "jobs": ("spillway.jobs", "gauge", "{job}", "job runs registered (live) on this sidecar"),
    "jobs-failed": ("spillway.jobs.failed", "gauge", "{job}",
                    "live job runs whose tolerance was exceeded"),
    "jobs-ended": ("spillway.jobs.ended", "counter", "{job}",
                   "job runs ended by EndJob (Job.close(), spillway job end)"),
    "jobs-expired": ("spillway.jobs.expired", "counter", "{job}",
                     "job runs ended by job.idle.timeout.ms (no call for that long)"),
    # totals that outlive the runs (service/ended.py): the live runs' counts plus the ended
    # runs', so a run shorter than a scrape interval still counts
    "runs-ended": ("spillway.runs.ended", "counter", "{run}",
                   "job runs homed here that ended, by outcome: completed (EndJob), failed "
                   "(past errors.tolerance), expired (job.idle.timeout.ms)"),
    "sidecar-record-failures": ("spillway.sidecar.record.failures", "counter", "{failure}",
                                "total-record-failures of every run, live and ended"),
    "sidecar-record-errors": ("spillway.sidecar.record.errors", "counter", "{error}",
                              "total-record-errors of every run, live and ended"),
    "sidecar-records-skipped": ("spillway.sidecar.records.skipped", "counter", "{record}",
                                "total-records-skipped of every run, live and ended"),
    "sidecar-retries": ("spillway.sidecar.retries", "counter", "{retry}",
                        "total-retries of every run, live and ended"),
    "sidecar-errors-logged": ("spillway.sidecar.errors.logged", "counter", "{error}",
                              "total-errors-logged of every run, live and ended"),
    "sidecar-records-dropped": ("spillway.sidecar.records.dropped", "counter", "{record}",
                                "dropped-records of every run, live and ended"),
    "sidecar-dlq-records": ("spillway.sidecar.dlq.records", "counter", "{record}",
                            "dlq-records-written of every run, live and ended (records "
                            "acknowledged by Kafka after their run ended too)"),
}
# Labelled by job (and stage); every other metric is one sidecar-wide series.
PER_JOB = frozenset({"total-record-failures", "total-record-errors", "total-records-skipped",
                     "total-retries", "total-errors-logged", "last-error-timestamp",
                     "dropped-records", "dlq-records-written"})
SIDECAR_WIDE = frozenset(METRICS) - PER_JOB
# Rows are in KIP units; these are scaled to the exported unit (the KIP's ms -> seconds).
_SCALE = {"last-error-timestamp": 0.001}

# The verdict-duration histogram's bucket boundaries, in seconds: a verdict takes from tens of
# microseconds (a cached classification) to seconds (a home sidecar across the network, a
# spool fsync under load).
VERDICT_DURATION_BOUNDARIES: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0)
VERDICT_DURATION = ("spillway.verdict.duration", "s",
                    "time to answer a ReportFailures call (decide + spool)")

# A row: (KIP metric name, attributes such as job/stage, value).
Row = tuple[str, Mapping[str, str], float]
RowSource = Callable[[], Iterable[Row]]

_UNIT_SUFFIX = {"s": "seconds", "By": "bytes", "ms": "milliseconds", "1": ""}


def prometheus_name(name: str, kind: str, unit: str) -> str:
    """The Prometheus name of an OTel instrument, as the OTel-to-Prometheus compatibility spec
    derives it: dots become underscores, the unit is appended (annotations in braces are not
    units), counters end in ``_total``."""
    out = name.replace(".", "_")
    suffix = "" if unit.startswith("{") else _UNIT_SUFFIX.get(unit, unit)
    if suffix and not out.endswith("_" + suffix):
        out += "_" + suffix
    if kind == "counter":
        out += "_total"
    return out


def otlp_configured(signal: str) -> bool:
    """Whether the standard environment names an OTLP endpoint for ``signal`` ("TRACES",
    "METRICS"), or for all signals."""
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"))


class DurationHistogram:
    """Verdict durations in fixed buckets, sidecar-wide: one series set whatever the number of
    jobs (a per-job label would multiply 18 series by every job). Recording is a bisect and
    three additions under a lock; the Prometheus collector reads it."""

    def __init__(self, boundaries: Sequence[float] = VERDICT_DURATION_BOUNDARIES) -> None:
        self.boundaries = tuple(boundaries)
        self._lock = threading.Lock()
        self._counts = [0] * (len(self.boundaries) + 1)
        self._sum = 0.0

    def record(self, seconds: float) -> None:
        i = bisect.bisect_left(self.boundaries, seconds)
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def snapshot(self) -> tuple[list[int], float]:
        """(count per bucket, the last one past every boundary; sum of the values)."""
        with self._lock:
            return list(self._counts), self._sum


@dataclass
class Telemetry:
    tracer_provider: object | None = None
    meter_provider: object | None = None
    prometheus_port: int = 0  # the bound port of the Prometheus endpoint (0: none)
    tracer: trace.Tracer = field(default_factory=lambda: trace.NoOpTracer())
    verdict_duration: object | None = None  # OTel histogram, seconds (only with OTLP metrics)
    durations: DurationHistogram = field(default_factory=DurationHistogram)
    # the Prometheus endpoint (prometheus.py), started by bootstrap; stopped by shutdown()
    http_server: object | None = field(default=None, repr=False)
    _sources: list[RowSource] = field(default_factory=list)
    _snap_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _snap: tuple[float, dict[str, list[tuple[Mapping[str, str], float]]]] | None = \
        field(default=None, repr=False)

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

    def rows_by_name(self, max_age_s: float = 0.0) -> dict[str, list[tuple[Mapping[str, str],
                                                                         float]]]:
        """The rows grouped by KIP name, scaled to the exported unit. One collection reads
        every instrument: with ``max_age_s`` a snapshot that recent is reused, so the sources
        are read once per collection, not once per instrument."""
        now = time.monotonic()
        with self._snap_lock:
            if self._snap is not None and now - self._snap[0] <= max_age_s:
                return self._snap[1]
            by: dict[str, list[tuple[Mapping[str, str], float]]] = {k: [] for k in METRICS}
            for n, a, v in self.rows():
                lst = by.get(n)
                if lst is not None:
                    lst.append((a, v * _SCALE[n] if n in _SCALE else v))
            self._snap = (now, by)
            return by

    def record_verdict_duration(self, seconds: float) -> None:
        self.durations.record(seconds)
        if self.verdict_duration is not None:
            self.verdict_duration.record(seconds)

    def exporting(self) -> bool:
        """Whether this sidecar's spans are exported (else none is recorded: `exported`).
        Asked by the DLQ drain once per acknowledged batch."""
        return self.tracer_provider is not None and exported.exporting(self.tracer_provider)

    def shutdown(self) -> None:
        """Flush spans and metrics (graceful stop)."""
        for provider in (self.tracer_provider, self.meter_provider):
            if provider is not None:
                try:
                    provider.shutdown()
                except Exception:
                    log.exception("telemetry shutdown failed")
        if self.http_server is not None:
            self.http_server.shutdown()


# The gRPC server span's attributes (as opentelemetry-instrumentation-grpc records them).
_RPC_SYSTEM, _RPC_SERVICE, _RPC_METHOD = "rpc.system", "rpc.service", "rpc.method"
_RPC_STATUS = "rpc.grpc.status_code"
# Codes a server span reports as an error (the instrumentation's `_server_status`); the others
# are the caller's problem, not the server's.
_SERVER_ERRORS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL",
                            "UNAVAILABLE", "DATA_LOSS"})


class ServerSpans:
    """One SERVER span per gRPC call, continuing the caller's trace context (W3C traceparent in
    the metadata, or whatever OTEL_PROPAGATORS names), with the attributes and status the
    OpenTelemetry grpc instrumentation gives it: name = the full method, rpc.system/service/
    method, rpc.grpc.status_code, rpc.user_agent, net.peer.*; an exception other than an abort
    is recorded on it.

    Only a sampled call pays for that: the sampler (parent-based by default) decides first, and
    an unsampled call gets the SDK's non-recording span, made current so that the spans under
    it (decision, spool) are not sampled either, and nothing else: no attributes, no peer
    parsing, no wrapped servicer context. Wrapping happens once per method
    (`security.Authenticating`'s ``around``), inside authentication."""

    def __init__(self, tracer_provider) -> None:
        self._tracer = tracer_provider.get_tracer("spillway.sidecar.grpc", schema_url=SCHEMA_URL)

    def wrap(self, method: str, behavior: Callable, streaming_response: bool) -> Callable:
        from opentelemetry import context as otel_context
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind, Status, StatusCode

        start_span, server = self._tracer.start_span, SpanKind.SERVER
        attach, detach, in_context = otel_context.attach, otel_context.detach, \
            trace.set_span_in_context
        service, _, name = method.lstrip("/").partition("/")
        static = {_RPC_SYSTEM: "grpc", _RPC_STATUS: 0}  # copied by the SDK, shared safely
        if name:
            static.update({_RPC_METHOD: name, _RPC_SERVICE: service})

        def begin(context):
            md = context.invocation_metadata() or ()
            carrier = {m.key: m.value for m in md}
            parent = extract(carrier)
            span = start_span(method, context=parent, kind=server, attributes=static)
            if span.is_recording():
                span.set_attributes(_peer_attributes(context.peer(), carrier))
            return span, attach(in_context(span, parent))

        def finish(span, token, context) -> None:
            detach(token)
            if span.is_recording():
                code = context.code()
                if code is not None:
                    span.set_attribute(_RPC_STATUS, code.value[0])
                    if code.name in _SERVER_ERRORS:
                        details = context.details()
                        span.set_status(Status(StatusCode.ERROR, f"{code}:{details}"))
                span.end()

        def record(span, exc: Exception) -> None:
            # an abort raises a bare Exception after setting the code: that is the status
            if type(exc) is not Exception and span.is_recording():
                span.record_exception(exc)

        if streaming_response:
            def traced_stream(request, context):
                span, token = begin(context)
                try:
                    yield from behavior(request, context)
                except Exception as exc:
                    record(span, exc)
                    raise
                finally:
                    finish(span, token, context)
            return traced_stream

        def traced(request, context):
            span, token = begin(context)
            try:
                return behavior(request, context)
            except Exception as exc:
                record(span, exc)
                raise
            finally:
                finish(span, token, context)
        return traced


def _peer_attributes(peer: str, metadata: Mapping[str, object]) -> dict[str, str]:
    out: dict[str, str] = {}
    agent = metadata.get("user-agent")
    if isinstance(agent, str):
        out["rpc.user_agent"] = agent
    if peer.startswith(("ipv4:", "ipv6:")):
        from urllib.parse import unquote

        ip, _, port = peer.split(",")[0].split(":", 1)[1].rpartition(":")
        ip = unquote(ip)
        out["net.peer.ip"], out["net.peer.port"] = ip, port
        if ip in ("[::1]", "127.0.0.1"):
            out["net.peer.name"] = "localhost"
    return out


def setup(*, service_name: str = SERVICE_NAME, sidecar_id: str = "",
          max_links: int = 1024, install_global: bool = False) -> Telemetry:
    """Build SDK tracer and meter providers for one sidecar and return their handle (the
    Prometheus endpoint, which reads this handle, is started by `bootstrap.start_server`).

    The providers are passed explicitly to what uses them (several sidecars may share a test
    process); `install_global` also makes them the process-wide defaults (the CLI does).
    """
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                               service_name),
                                "service.instance.id": sidecar_id or "unknown"})
    # One DLQ batch span links to every record it carries: allow as many links as a batch.
    # Spans are recorded only while a processor exports them (`exported`).
    tp = exported.provider(resource=resource, span_limits=SpanLimits(max_links=max_links))
    if otlp_configured("TRACES"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    readers = []
    if otlp_configured("METRICS"):
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    tel = Telemetry(tracer_provider=tp)
    mp = MeterProvider(resource=resource, metric_readers=readers)
    tel.meter_provider = mp
    if install_global:
        trace.set_tracer_provider(tp)
        metrics.set_meter_provider(mp)
    if readers:  # OTLP: the same series through the SDK's instruments
        meter = mp.get_meter("spillway.sidecar", schema_url=SCHEMA_URL)
        register_instruments(meter, tel)
        name, unit, desc = VERDICT_DURATION
        tel.verdict_duration = meter.create_histogram(
            name, unit=unit, description=desc,
            explicit_bucket_boundaries_advisory=list(VERDICT_DURATION_BOUNDARIES))
    tel.tracer = tp.get_tracer("spillway.sidecar", schema_url=SCHEMA_URL)
    return tel


def register_instruments(meter: metrics.Meter, tel: Telemetry) -> None:
    """One observable instrument per KIP metric, fed from the telemetry's row sources."""

    def callback_for(kip_name: str):
        def cb(_options: CallbackOptions) -> Iterable[Observation]:
            # one snapshot per export: every instrument's callback runs in the same collection
            return [Observation(v, dict(a)) for a, v in tel.rows_by_name(1.0)[kip_name]]

        return cb

    for kip_name, (name, kind, unit, desc) in METRICS.items():
        make = meter.create_observable_counter if kind == "counter" else \
            meter.create_observable_gauge
        make(name, callbacks=[callback_for(kip_name)], unit=unit, description=desc)


