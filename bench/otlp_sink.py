"""Target 6's trace backend: an OTLP/gRPC receiver that counts the spans exporters send and
keeps nothing, so that the sampled variants pay for recording *and* exporting their spans (a
sidecar with no exporter records none: `spillway.sidecar.observability.exported`).

    python -m bench.otlp_sink [--listen 127.0.0.1:0]

Prints ``otlp sink listening on ADDR`` once serving; on SIGTERM/SIGINT prints
``spans N`` and exits.
"""

from __future__ import annotations

import argparse
import sys
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from .echo import serve_until_stopped


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0
        self._lock = threading.Lock()

    def Export(self, request, context):
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.spans += n
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def Export(self, request, context):
        return metrics_service_pb2.ExportMetricsServiceResponse()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.otlp_sink")
    ap.add_argument("--listen", default="127.0.0.1:0")
    args = ap.parse_args(argv)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
    traces = _Traces()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(traces, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(), server)
    host, _, _ = args.listen.rpartition(":")
    port = server.add_insecure_port(args.listen)
    server.start()
    print(f"otlp sink listening on {host}:{port}", flush=True)
    serve_until_stopped(server)
    print(f"spans {traces.spans}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
