"""A sidecar dialling a run's home presents its renewed client certificate without a restart:
cert-manager's csi-driver rewrites the files days before they expire, and a run may outlive
that margin. Real mutual TLS on loopback; the home's side reports the certificate it saw."""

from __future__ import annotations

import os
import shutil
from concurrent import futures

import grpc
import pytest
from spillway.sidecar.federation import peers
from spillway.sidecar.federation.peers import Home, LocalSidecar
from spillway.sidecar.transport import security
from spillway.sidecar.transport.listeners import TlsFiles
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support.tls import Ca


class _SeesClientCert(pb_grpc.ErrorSidecarServicer):
    """GetStatus answers with the common name of the client certificate of the call."""

    def GetStatus(self, request, context):
        names = context.auth_context().get("x509_common_name", [b"?"])
        return pb.SidecarStatus(instance_id=names[0].decode())


@pytest.fixture
def home(tmp_path):
    ca = Ca.create(tmp_path / "ca")
    leaf = ca.issue(tmp_path / "home", "home", dns=("localhost",), ips=("127.0.0.1",))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_ErrorSidecarServicer_to_server(_SeesClientCert(), server)
    creds = grpc.ssl_server_credentials(
        [(leaf.key.read_bytes(), leaf.cert.read_bytes())],
        root_certificates=ca.path.read_bytes(), require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    yield ca, f"127.0.0.1:{port}"
    server.stop(0).wait()


def _node(tmp_path, ca: Ca) -> LocalSidecar:
    """A node sidecar's TLS files, at fixed paths as the csi-driver mounts them."""
    mount = tmp_path / "tls"
    mount.mkdir()
    first = ca.issue(tmp_path / "first", "node-before")
    shutil.copy(first.cert, mount / "tls.crt")
    shutil.copy(first.key, mount / "tls.key")
    tls = TlsFiles(cert=str(mount / "tls.crt"), key=str(mount / "tls.key"), ca=str(ca.path),
                   client_auth="require")
    cfg = security.SecurityConfig(node_token=None, peer_token=None, admin_token=None,
                                  peer_identities=frozenset(), tls=tls, plaintext_allowed=False,
                                  advertised_address="", home_allowed=())
    return LocalSidecar("node", frozenset(), cfg)


def _renew(tmp_path, ca: Ca, name: str) -> None:
    """As the csi-driver does: new files written beside, then moved into place."""
    leaf = ca.issue(tmp_path / name, name)
    mount = tmp_path / "tls"
    for src, dst in ((leaf.cert, "tls.crt"), (leaf.key, "tls.key")):
        tmp = mount / f".{dst}.new"
        shutil.copy(src, tmp)
        os.replace(tmp, mount / dst)


def test_calls_after_a_renewal_present_the_new_certificate(home, tmp_path, monkeypatch):
    ca, address = home
    monkeypatch.setattr(peers, "_TLS_RECHECK_S", 0.0)
    remote = Home.connect(address, _node(tmp_path, ca))
    try:
        assert remote.instance_id(10) == "node-before"
        assert remote.instance_id(10) == "node-before"   # unchanged files: the same channel
        first = remote.channel
        _renew(tmp_path, ca, "node-after")
        assert remote.instance_id(10) == "node-after"
        assert remote.channel is not first
    finally:
        remote.close()


def test_files_caught_mid_rotation_keep_the_previous_certificate(home, tmp_path, monkeypatch):
    ca, address = home
    monkeypatch.setattr(peers, "_TLS_RECHECK_S", 0.0)
    remote = Home.connect(address, _node(tmp_path, ca))
    try:
        os.remove(tmp_path / "tls" / "tls.key")        # between the driver's two writes
        assert remote.instance_id(10) == "node-before"
        _renew(tmp_path, ca, "node-after")
        assert remote.instance_id(10) == "node-after"
    finally:
        remote.close()


def test_the_files_are_looked_at_once_per_interval_at_most(home, tmp_path, monkeypatch):
    ca, address = home
    monkeypatch.setattr(peers, "_TLS_RECHECK_S", 3600.0)
    remote = Home.connect(address, _node(tmp_path, ca))
    try:
        _renew(tmp_path, ca, "node-after")
        # within the recheck interval of connecting: still the channel it connected with
        assert remote.instance_id(10) == "node-before"
    finally:
        remote.close()
