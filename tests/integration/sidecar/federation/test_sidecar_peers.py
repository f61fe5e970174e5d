"""The home is who it claims to be: a node sidecar refuses a home address that reaches another
instance, or itself for a job homed elsewhere (the loopback default on every node)."""

from __future__ import annotations

import grpc
import pytest

from spillway.v1 import sidecar_pb2 as pb
from support import rpc
from spillway.v1 import sidecar_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def nodes():
    from spillway.sidecar.server import start_server

    started = [start_server({"listen.address": "127.0.0.1:0", "telemetry.enable": "false",
                             "sidecar.id": f"node-{n}", "home.allowed.addresses": "127.0.0.0/8"})
               for n in "ab"]
    yield started
    for s in started:
        s.stop(0.5)


RUN = "app-peers-0001"


def test_register_answers_the_home_address_and_instance(nodes):
    a, _ = nodes
    reg = rpc.stub(a).RegisterJob(pb.RegisterJobRequest(job="named", run_id=RUN), timeout=10)
    status = rpc.stub(a).GetStatus(pb.GetStatusRequest(), timeout=5)
    assert reg.home == a.address == status.advertised_address
    assert reg.home_instance_id == status.instance_id == a.sidecar.instance_id


def test_home_address_reaching_this_sidecar_for_a_job_homed_elsewhere_is_refused(nodes):
    a, b = nodes
    reg = rpc.stub(a).RegisterJob(pb.RegisterJobRequest(job="loop", run_id=RUN), timeout=10)
    # every node on the loopback default: HOME names "my own address" on node b
    code, details = rpc.error(lambda: rpc.stub(b).RegisterJob(pb.RegisterJobRequest(
        job="loop", run_id=RUN, home=b.address, home_instance_id=reg.home_instance_id),
        metadata=rpc.md(reg.job_token), timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert (f"the job's home is instance {reg.home_instance_id} but HOME {b.address} reaches "
            f"this sidecar (instance {b.sidecar.instance_id})") in details
    assert "advertised.address" in details
    code, _ = rpc.error(lambda: rpc.stub(b).GetJobSummary(
        pb.GetJobSummaryRequest(job="loop", run_id=RUN), metadata=rpc.md(reg.job_token), timeout=5))
    assert code == grpc.StatusCode.NOT_FOUND  # node b decides nothing locally for it


def test_home_address_reaching_another_instance_is_refused(nodes):
    a, b = nodes
    code, details = rpc.error(lambda: rpc.stub(b).RegisterJob(pb.RegisterJobRequest(
        job="other", run_id=RUN, home=a.address, home_instance_id="0123456789abcdef"),
        metadata=[("spillway-job-token", "executor-token")], timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"reaches sidecar instance {a.sidecar.instance_id}" in details
    assert "0123456789abcdef" in details


def test_home_at_its_instance_is_accepted(nodes):
    a, b = nodes
    reg = rpc.stub(a).RegisterJob(pb.RegisterJobRequest(job="ok", run_id=RUN), timeout=10)
    fwd = rpc.stub(b).RegisterJob(pb.RegisterJobRequest(
        job="ok", run_id=RUN, home=reg.home, home_instance_id=reg.home_instance_id),
        metadata=rpc.md(reg.job_token), timeout=10)
    assert (fwd.home, fwd.home_instance_id) == (reg.home, reg.home_instance_id)


def test_a_home_that_does_not_take_this_sidecar_for_a_peer_is_a_clear_error(tmp_path):
    """Node tokens on both sidecars but no peer credential: the home refuses the forwarding
    sidecar, and the executor learns it is a sidecar configuration problem, not its token."""
    from spillway.sidecar.server import start_server
    from support.tls import write_token

    token = str(write_token(tmp_path / "node", "n0de"))
    home, node = (start_server({"listen.address": "127.0.0.1:0", "telemetry.enable": "false",
                                "auth.token.file": token,
                                "home.allowed.addresses": "127.0.0.0/8"}) for _ in range(2))
    try:
        md = [("spillway-node-token", "n0de")]
        reg = rpc.stub(home).RegisterJob(pb.RegisterJobRequest(job="j", run_id=RUN), metadata=md,
                                      timeout=10)
        code, details = rpc.error(lambda: rpc.stub(node).RegisterJob(pb.RegisterJobRequest(
            job="j", run_id=RUN, home=reg.home, home_instance_id=reg.home_instance_id),
            metadata=md + rpc.md(reg.job_token), timeout=10))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "does not recognise this sidecar as a peer" in details
        assert "auth.peer.token.file" in details
    finally:
        home.stop(0.2)
        node.stop(0.2)


def test_a_peer_is_named_by_its_certificate_uri_or_dns_name(tmp_path):
    """auth.peer.identities matches a verified client certificate's SAN URI (e.g. a SPIFFE id)
    or DNS name; another certificate from the same CA is authenticated but not a peer."""
    from spillway.sidecar.server import start_server
    from support.tls import Ca

    ca = Ca.create(tmp_path / "ca")
    srv = ca.issue(tmp_path / "srv", "sidecar")
    spiffe = "spiffe://cluster/ns/spark/sa/spillway-sidecar"
    peer = ca.issue(tmp_path / "peer", "peer", dns=(), ips=(), uris=(spiffe,))
    other = ca.issue(tmp_path / "other", "executor-9", dns=("executor-9",), ips=())
    running = start_server({"listen.address": "127.0.0.1:0", "telemetry.enable": "false",
                            "tls.cert.file": str(srv.cert), "tls.key.file": str(srv.key),
                            "tls.ca.file": str(ca.path), "auth.peer.identities": spiffe})

    def stub(leaf):
        creds = grpc.ssl_channel_credentials(ca.path.read_bytes(), leaf.key.read_bytes(),
                                             leaf.cert.read_bytes())
        return pb_grpc.ErrorSidecarStub(grpc.secure_channel(running.address, creds))

    try:
        task = pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=1)
        reg = stub(other).RegisterJob(pb.RegisterJobRequest(job="j", run_id=RUN), timeout=10)
        probe = pb.ReportFailuresRequest(job="j", run_id=RUN, task=task, decide_only=True)
        code, details = rpc.error(lambda: stub(other).ReportFailures(
            probe, metadata=rpc.md(reg.job_token), timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "cert:executor-9" in details
        # a peer: honoured
        stub(peer).ReportFailures(probe, metadata=rpc.md(reg.job_token), timeout=10)
    finally:
        running.stop(0.2)
