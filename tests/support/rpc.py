"""Calling a sidecar by hand over gRPC: the generated stub, a run's job token as metadata, the
status a refused call ends with, what health answers, the port of an address."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spillway.v1 import sidecar_pb2_grpc as pb_grpc


def stub(sidecar) -> pb_grpc.ErrorSidecarStub:
    """The generated stub on a plaintext channel to a running sidecar (anything with
    ``.address``)."""
    return pb_grpc.ErrorSidecarStub(grpc.insecure_channel(sidecar.address))


def md(token: str) -> list[tuple[str, str]]:
    """A run's job token, as every job-scoped call carries it."""
    return [("spillway-job-token", token)]


def error(call) -> tuple[grpc.StatusCode, str]:
    """Run ``call``, which must fail with a gRPC error: its status code and details."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def health(channel) -> int:
    """grpc.health.v1's answer for the whole server on ``channel`` (a 5 s deadline)."""
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                     timeout=5).status


def health_at(address: str) -> int:
    """`health` over a plaintext channel to ``address``, closed afterwards."""
    with grpc.insecure_channel(address) as ch:
        return health(ch)


def port_of(address: str) -> int:
    """The port of ``host:port`` (a bracketed IPv6 host included)."""
    return int(address.rpartition(":")[2])


def serve_servicer(servicer, *, port: int = 0, with_health: bool = False):
    """A test's own ErrorSidecar servicer on a real in-process ``grpc.server`` on loopback
    (``port`` 0: one picked by the server); with ``with_health``, grpc.health.v1 answering
    SERVING too. Returns (server, target); the caller stops the server."""
    from concurrent import futures

    from grpc_health.v1 import health

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_ErrorSidecarServicer_to_server(servicer, server)
    if with_health:
        hs = health.HealthServicer()
        hs.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, f"127.0.0.1:{port}"
