"""health.listen.address: a plaintext grpc.health.v1-only port next to a TLS listen.address, as
the Kubernetes DaemonSet's native gRPC probes use it (deploy/kubernetes)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from spillway.sidecar.errors import ConfigError
from spillway.sidecar.server import start_server
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support.tls import Ca, write_token

pytestmark = pytest.mark.integration


def _check(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_probe_port_answers_health_in_plaintext_and_nothing_else(tmp_path):
    ca = Ca.create(tmp_path / "ca")
    leaf = ca.issue(tmp_path / "tls", "sidecar", ips=("127.0.0.1",))
    running = start_server({
        "listen.address": "127.0.0.1:0",
        "tls.cert.file": str(leaf.cert), "tls.key.file": str(leaf.key),
        "tls.ca.file": str(ca.path),
        "auth.token.file": str(write_token(tmp_path / "node.token", "s3cret")),
        "health.listen.address": "127.0.0.1:0",
        "spool.enable": "false",
    })
    try:
        probe = running.probe_address
        assert probe and probe != running.address
        serving = health_pb2.HealthCheckResponse.SERVING
        assert _check(probe) == serving
        assert _check(probe, "spillway.v1.ErrorSidecar") == serving
        assert _check(probe, "spillway.liveness") == serving
        # the main port is TLS: a plaintext probe there cannot even complete a handshake
        with pytest.raises(grpc.RpcError) as info:
            _check(running.address)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        # no spillway.v1 method is reachable through the probe port
        with grpc.insecure_channel(probe) as ch:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.ErrorSidecarStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5)
        assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        running.stop(0.5)
    with pytest.raises(grpc.RpcError) as info:  # stopped with the sidecar
        _check(probe)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE


def test_probe_port_that_cannot_be_bound_stops_start_up_naming_the_property(tmp_path):
    first = start_server({"listen.address": "127.0.0.1:0", "spool.enable": "false",
                          "health.listen.address": "127.0.0.1:0"})
    try:
        with pytest.raises(ConfigError, match="health.listen.address"):
            start_server({"listen.address": "127.0.0.1:0", "spool.enable": "false",
                          "health.listen.address": first.probe_address})
    finally:
        first.stop(0.5)


def test_bad_probe_address_is_refused_naming_the_property():
    with pytest.raises(ConfigError, match="health.listen.address"):
        start_server({"listen.address": "127.0.0.1:0", "spool.enable": "false",
                      "health.listen.address": "no-port"})


def test_with_a_node_token_every_method_but_health_check_needs_a_credential(tmp_path):
    """Authentication wraps the server's handlers (security.Authenticating), the health
    service's too: Check stays open for probes, Watch and every spillway.v1 method are
    refused without a credential, and a method nobody serves is UNIMPLEMENTED."""
    token = write_token(tmp_path / "node", "node-secret")
    running = start_server({"listen.address": "127.0.0.1:0", "spool.enable": "false",
                            "auth.token.file": str(token)})
    try:
        assert _check(running.address) == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(running.address) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(),
                                                         timeout=5)
            with pytest.raises(grpc.RpcError) as refused:
                next(watch)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stub = pb_grpc.ErrorSidecarStub(ch)
            for call, request in ((stub.RegisterJob, pb.RegisterJobRequest(job="j")),
                                  (stub.GetStatus, pb.GetStatusRequest()),
                                  (stub.TallyFailures, pb.TallyRequest(job="j"))):
                with pytest.raises(grpc.RpcError) as refused:
                    call(request, timeout=5)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = stub.GetStatus(pb.GetStatusRequest(), timeout=5,
                                metadata=[("spillway-node-token", "node-secret")])
            assert ok.sidecar_id
            unknown = ch.unary_unary("/spillway.v1.ErrorSidecar/NoSuchMethod")
            with pytest.raises(grpc.RpcError) as missing:
                unknown(b"", timeout=5)
            assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        running.stop(1.0)
