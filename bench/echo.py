"""Baseline of target 2: a bare gRPC echo server of the same spillway.v1 service, with the
sidecar's server options and thread pool, whose servicer answers SKIP without doing anything.

    python -m bench.echo [--listen 127.0.0.1:0] [--workers 32]

Prints ``echo sidecar listening on ADDR`` once serving, then serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc


class EchoServicer(pb_grpc.ErrorSidecarServicer):
    """Every record is answered SKIP; nothing is decided, counted, spooled or produced."""

    def RegisterJob(self, request, context):
        return pb.RegisterJobResponse(job=request.job, effective_properties=request.properties)

    def ReportFailures(self, request, context):
        return pb.ReportFailuresResponse(verdicts=[
            pb.Verdict(record_id=r.record_id, action=pb.ACTION_SKIP, reason="echo")
            for r in request.records])

    def FlushTask(self, request, context):
        return pb.FlushTaskResponse(dlq_records_acknowledged=0)


def serve(listen: str, workers: int) -> tuple[grpc.Server, str]:
    # The same options as spillway.sidecar.server.start_server.
    from spillway.sidecar.server import MAX_MESSAGE_BYTES, SERVICE_NAME

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="spillway-rpc"),
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.so_reuseport", 0)],
    )
    pb_grpc.add_ErrorSidecarServicer_to_server(EchoServicer(), server)
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    host, _, _ = listen.rpartition(":")
    port = server.add_insecure_port(listen)
    server.start()
    for name in ("", SERVICE_NAME):
        hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, f"{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.echo")
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--workers", type=int, default=32)  # start_server's max_workers default
    args = ap.parse_args(argv)
    server, address = serve(args.listen, args.workers)
    print(f"echo sidecar listening on {address}", flush=True)
    serve_until_stopped(server)
    return 0


def serve_until_stopped(server: grpc.Server) -> None:
    """Serve until SIGTERM or SIGINT, then stop `server` (a second's grace)."""
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    server.stop(1).wait()


if __name__ == "__main__":
    sys.exit(main())
