"""A real OTLP/gRPC receiver for tests: TraceService and MetricsService from opentelemetry-proto,
served by a real grpc.server on loopback, collecting what exporters send."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    service: str
    attributes: dict
    events: list  # (name, attributes)
    links: list   # (trace_id, span_id)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class OtlpReceiver:
    spans: list[ReceivedSpan] = field(default_factory=list)
    metric_names: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: grpc.Server | None = None
    port: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpReceiver:
        receiver = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                got = []
                for rs in request.resource_spans:
                    service = _attrs(rs.resource.attributes).get("service.name", "")
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            got.append(ReceivedSpan(
                                trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                                parent_span_id=s.parent_span_id.hex(), name=s.name,
                                kind=s.kind, service=service, attributes=_attrs(s.attributes),
                                events=[(e.name, _attrs(e.attributes)) for e in s.events],
                                links=[(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links],
                            ))
                with receiver._lock:
                    receiver.spans.extend(got)
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                with receiver._lock:
                    for rm in request.resource_metrics:
                        for sm in rm.scope_metrics:
                            receiver.metric_names.update(m.name for m in sm.metrics)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.stop(1).wait()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]
