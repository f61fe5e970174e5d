"""A plaintext listener serving only ``grpc.health.v1``, for probes that cannot speak TLS.

The kubelet's native gRPC probes (and most load-balancer health checks) dial without TLS and
without credentials, so they cannot reach a sidecar whose ``listen.address`` serves TLS.
``health.listen.address`` opens a second, separate gRPC server carrying the sidecar's own
HealthServicer (the same answers: NOT_SERVING under backpressure and during a graceful stop) and
nothing else: no spillway.v1 method is reachable through it, so it needs no TLS or token.

Readiness probes ask for ``spillway.v1.ErrorSidecar`` (NOT_SERVING while reports are refused for
backpressure); liveness probes ask for ``spillway.liveness``, SERVING for as long as the process
answers at all (until a graceful stop): a sidecar applying backpressure must not be restarted.
"""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from spillway.sidecar.errors import ConfigError

PROP = "health.listen.address"
LIVENESS_SERVICE = "spillway.liveness"
# Probes make unary Checks; a few Watch streams may wait, more are refused (RESOURCE_EXHAUSTED)
# rather than queued without bound.
MAX_WORKERS = 2
MAX_CONCURRENT_RPCS = 8


def start_probe_server(address: str, servicer: health.HealthServicer, *,
                       reuse_port: bool = False) -> tuple[grpc.Server, str]:
    """Serve ``servicer`` on ``address`` (host:port, plaintext); returns the server and the
    address actually bound (port 0 picks a free one). ``reuse_port``: shared by the processes
    of ``sidecar.processes`` (processes.py)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="spillway-probe"),
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        options=[("grpc.so_reuseport", int(reuse_port))],
    )
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:  # newer grpcio raises where older ones return 0
        bound = 0
    if bound == 0:
        server.stop(0)
        raise ConfigError(PROP, f"cannot bind {address} (in use, or not an address of this "
                                f"host)")
    servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    server.start()
    host = address.rpartition(":")[0]
    return server, f"{host}:{bound}"
