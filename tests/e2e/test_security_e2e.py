"""Transport and authentication attacks against `spillway serve` as its own process.

Each attack is refused with its status code and a message naming what is wrong, and leaves the
victim job, the sidecar and its health untouched. TLS material is generated per test with
`cryptography` (tests/support/tls.py); nothing secret is committed.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2

from spillway.client import SidecarAuthError, SidecarClient, SidecarTlsError
from spillway.client.errors import SidecarUnavailableError
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support import rpc
from support import serve
from support.tls import Ca, write_token

pytestmark = pytest.mark.e2e

NODE, PEER = "node-token-0123456789", "peer-token-9876543210"


RUN = "app-security-0001"  # every job-scoped call names its run


def _spawn(args, env=None):
    return serve.spawn(["--set", "telemetry.enable=false", *args],
                       extra_env={"GRPC_VERBOSITY": "NONE", **(env or {})})


_stop = serve.stop


def _records(prefix, n):
    return [pb.FailedRecord(
        record_id=f"{prefix}-{i}", stage=pb.STAGE_TRANSFORMATION, function_name="app.f",
        value=b"secret payload",
        exception=pb.ExceptionInfo(class_name="builtins.ValueError",
                                   class_chain=["builtins.ValueError", "builtins.Exception"]))
        for i in range(n)]


TASK = pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=7)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A sidecar with a node token and a peer token, on loopback."""
    d = tmp_path_factory.mktemp("guarded")
    proc, address = _spawn(["--listen", "127.0.0.1:0",
                            "--token-file", str(write_token(d / "node", NODE)),
                            "--peer-token-file", str(write_token(d / "peer", PEER))])
    yield address
    _stop(proc)


def test_missing_and_wrong_node_token_are_refused(guarded, tmp_path):
    ch = grpc.insecure_channel(guarded)
    stub = pb_grpc.ErrorSidecarStub(ch)
    code, details = rpc.error(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "spillway-node-token" in details
    code, details = rpc.error(lambda: stub.RegisterJob(
        pb.RegisterJobRequest(job="j"), metadata=[("spillway-node-token", NODE + "x")],
        timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "does not match" in details
    assert NODE not in details
    assert rpc.health(ch) == health_pb2.HealthCheckResponse.SERVING  # probes need no token

    # the client side: a clear error naming the setting, then success with the token file
    with pytest.raises(SidecarAuthError, match="SPILLWAY_TOKEN_FILE") as err:
        SidecarClient(guarded, token_file="").status()
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    wrong = write_token(tmp_path / "wrong", "nope")
    with pytest.raises(SidecarAuthError, match="does not match"):
        SidecarClient(guarded, token_file=str(wrong)).status()
    good = write_token(tmp_path / "good", NODE)
    assert SidecarClient(guarded, token_file=str(good)).status().sidecar_id


def test_sidecar_only_fields_from_a_non_peer_change_nothing(guarded):
    ch = grpc.insecure_channel(guarded)
    stub = pb_grpc.ErrorSidecarStub(ch)
    node = [("spillway-node-token", NODE)]
    props = {"errors.tolerance": "all", "errors.tolerance.max.errors": "1"}
    reg = stub.RegisterJob(pb.RegisterJobRequest(job="victim", run_id=RUN, properties=props),
                           metadata=node, timeout=10)
    job_token = [("spillway-job-token", reg.job_token)]
    node = node + job_token  # the attacker even holds the run's token: still refused
    before = stub.GetJobSummary(pb.GetJobSummaryRequest(job="victim", run_id=RUN),
                                metadata=node, timeout=5)

    attacks = {
        "decide_only": lambda: stub.ReportFailures(pb.ReportFailuresRequest(
            job="victim", run_id=RUN, task=TASK, records=_records("x", 5), decide_only=True),
            metadata=node, timeout=5),
        "progress_only": lambda: stub.FlushTask(pb.FlushTaskRequest(
            job="victim", run_id=RUN, task=TASK, progress_only=True,
            processed=[pb.StageCount(stage=pb.STAGE_TRANSFORMATION, records=10**6)]),
            metadata=node, timeout=5),
        "peer": lambda: stub.RegisterJob(pb.RegisterJobRequest(
            job="victim", run_id=RUN, properties=props, peer="127.0.0.1:1"), metadata=node,
            timeout=5),
        "local_only": lambda: stub.EndJob(pb.EndJobRequest(job="victim", run_id=RUN,
                                                           local_only=True),
                                          metadata=node, timeout=5),
    }
    for field, attack in attacks.items():
        code, details = rpc.error(attack)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (field, code, details)
        assert field in details and "peer sidecar" in details

    after = stub.GetJobSummary(pb.GetJobSummaryRequest(job="victim", run_id=RUN), metadata=node,
                               timeout=5)
    assert after == before  # no failure counted, no progress recorded, not failed
    assert not after.failed and after.total_record_failures == 0
    assert after.records_processed == before.records_processed
    # the same fields from a peer (peer token, forwarding the run's job token) are honoured
    peer = [("spillway-peer-token", PEER)] + job_token
    out = stub.ReportFailures(pb.ReportFailuresRequest(
        job="victim", run_id=RUN, task=TASK, records=_records("p", 1), decide_only=True),
        metadata=peer, timeout=5)
    assert len(out.verdicts) == 1
    assert rpc.health(ch) == health_pb2.HealthCheckResponse.SERVING


def test_home_address_not_allowed_is_refused_without_dialling(guarded):
    stub = pb_grpc.ErrorSidecarStub(grpc.insecure_channel(guarded))
    node = [("spillway-node-token", NODE)]
    for home in ("169.254.169.254:80", "metadata.attacker.invalid:50051", "10.0.0.1:50051"):
        code, details = rpc.error(lambda: stub.RegisterJob(pb.RegisterJobRequest(
            job="ssrf", run_id=RUN, home=home),
            metadata=node + [("spillway-job-token", "an-executors-token")], timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED, (home, code, details)
        assert home in details and "home.allowed.addresses" in details
    code, _ = rpc.error(lambda: stub.GetJobSummary(pb.GetJobSummaryRequest(job="ssrf", run_id=RUN),
                                               metadata=node, timeout=5))
    assert code == grpc.StatusCode.NOT_FOUND  # nothing was registered


def test_unix_socket_path_that_is_a_regular_file_is_refused_and_kept(tmp_path):
    victim = tmp_path / "important.db"
    victim.write_bytes(b"precious")
    proc = subprocess.run(
        [sys.executable, "-m", "spillway.sidecar.cli", "serve", "--listen", "",
         "--unix-socket", str(victim)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "listen.unix.socket" in proc.stderr and "regular file" in proc.stderr
    assert victim.read_bytes() == b"precious"


def test_unix_socket_mode_and_spool_permissions(tmp_path):
    sock = tmp_path / "run" / "sidecar.sock"
    sock.parent.mkdir()
    spool = tmp_path / "spool"
    old = os.umask(0o000)  # the most permissive umask: the sidecar must not rely on it
    try:
        proc, address = _spawn(["--listen", "", "--unix-socket", str(sock),
                                "--bootstrap-servers", "127.0.0.1:1",
                                "--set", f"spool.dir={spool}",
                                "--set", "listen.unix.socket.mode=0600"])
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(spool).st_mode) == 0o700
        files = os.listdir(spool)
        assert any(f.endswith("-wal") for f in files)
        for f in files:
            assert stat.S_IMODE(os.stat(spool / f).st_mode) == 0o600, f
        with grpc.insecure_channel(address) as ch:
            assert rpc.health(ch) == health_pb2.HealthCheckResponse.SERVING
    finally:
        _stop(proc)


def test_plaintext_on_a_routable_address_is_refused_at_start_up():
    proc = subprocess.run(
        [sys.executable, "-m", "spillway.sidecar.cli", "serve", "--listen", "0.0.0.0:0"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "refusing to serve plaintext" in proc.stderr and "tls.cert.file" in proc.stderr


# --- TLS -----------------------------------------------------------------------------------


@pytest.fixture
def pki(tmp_path):
    ca = Ca.create(tmp_path / "ca")
    return {
        "ca": ca,
        "server": ca.issue(tmp_path / "server", "sidecar-a"),
        "client": ca.issue(tmp_path / "client", "executor-1", dns=("executor-1",), ips=()),
        "other_ca": Ca.create(tmp_path / "other", "other-ca"),
    }


def _tls_client(address, pki, *, ca=None, cert=None, token_file="", timeout_s=10.0):
    leaf = pki["client"] if cert is None else cert
    return SidecarClient(address, timeout_s=timeout_s, tls_ca_file=str(ca or pki["ca"].path),
                         tls_cert_file=str(leaf.cert) if leaf else "",
                         tls_key_file=str(leaf.key) if leaf else "", token_file=token_file)


def test_tls_wrong_ca_expired_and_missing_client_certificate_are_refused(pki, tmp_path):
    s = pki["server"]
    proc, address = _spawn(["--listen", "127.0.0.1:0", "--tls-cert", str(s.cert),
                            "--tls-key", str(s.key), "--tls-ca", str(pki["ca"].path)])
    try:
        assert _tls_client(address, pki).status().sidecar_id  # mutual TLS works
        with pytest.raises(SidecarTlsError, match="CERTIFICATE_VERIFY_FAILED.*"
                                                  "SPILLWAY_TLS_CA_FILE"):
            _tls_client(address, pki, ca=pki["other_ca"].path).status()
        expired = pki["ca"].issue(tmp_path / "old", "executor-old", expired=True)
        with pytest.raises(SidecarUnavailableError, match="certificate"):
            _tls_client(address, pki, cert=expired).status()
        with pytest.raises(SidecarUnavailableError, match="certificate"):
            _tls_client(address, pki, cert=False).status()  # no client certificate
        with pytest.raises(SidecarUnavailableError, match="SPILLWAY_TLS_CA_FILE"):
            SidecarClient(address, timeout_s=10, tls_ca_file="").status()  # plaintext
    finally:
        _stop(proc)


def test_expired_server_certificate_is_named_on_the_client_side(pki, tmp_path):
    old = pki["ca"].issue(tmp_path / "expired", "sidecar-old", expired=True)
    proc, address = _spawn(["--listen", "127.0.0.1:0", "--tls-cert", str(old.cert),
                            "--tls-key", str(old.key)])
    try:
        with pytest.raises(SidecarTlsError, match="certificate has expired"):
            _tls_client(address, pki, cert=False).status()
    finally:
        _stop(proc)


def test_certificate_rotation_without_restart(pki, tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    s = pki["server"]
    shutil.copy(s.cert, live / "tls.crt")
    shutil.copy(s.key, live / "tls.key")
    proc, address = _spawn(["--listen", "127.0.0.1:0", "--tls-cert", str(live / "tls.crt"),
                            "--tls-key", str(live / "tls.key")])
    try:
        assert _tls_client(address, pki, cert=False).status().sidecar_id
        # a new CA and certificate replace the files while the sidecar runs
        new_ca = Ca.create(tmp_path / "new-ca", "new-ca")
        fresh = new_ca.issue(tmp_path / "fresh", "sidecar-a2")
        shutil.copy(fresh.key, live / "tls.key.tmp")
        shutil.copy(fresh.cert, live / "tls.crt.tmp")
        os.replace(live / "tls.key.tmp", live / "tls.key")
        os.replace(live / "tls.crt.tmp", live / "tls.crt")
        # new connections get the new certificate: trusted by the new CA only
        assert SidecarClient(address, timeout_s=10, tls_ca_file=str(new_ca.path),
                             tls_cert_file="", tls_key_file="").status().sidecar_id
        with pytest.raises(SidecarTlsError):
            SidecarClient(address, timeout_s=10, tls_ca_file=str(pki["ca"].path),
                          tls_cert_file="", tls_key_file="", tls_server_name="localhost"
                          ).status()
    finally:
        _stop(proc)


def test_node_sidecar_forwards_to_its_home_over_mtls(pki, tmp_path):
    """Executors reach their node sidecar over TLS with the node token; the node sidecar
    forwards to the job's home over mutual TLS, recognised as a peer by its certificate."""
    ca = pki["ca"]
    token = write_token(tmp_path / "node", NODE)
    certs = {n: ca.issue(tmp_path / n, f"sidecar-{n}", dns=("localhost", f"sidecar-{n}"))
             for n in "ab"}
    procs = {}
    try:
        for n in "ab":
            procs[n] = _spawn(["--listen", "127.0.0.1:0", "--tls-cert", str(certs[n].cert),
                               "--tls-key", str(certs[n].key), "--tls-ca", str(ca.path),
                               "--token-file", str(token),
                               "--set", "auth.peer.identities=sidecar-a,sidecar-b",
                               "--set", "home.allowed.addresses=127.0.0.0/8",
                               "--set", f"sidecar.id=node-{n}"])
        a, b = procs["a"][1], procs["b"][1]
        ca_, cb = (_tls_client(x, pki, token_file=str(token)) for x in (a, b))
        props = {"errors.tolerance": "all", "errors.tolerance.max.errors": "2"}
        stub_a = pb_grpc.ErrorSidecarStub(ca_._channel())
        stub_b = pb_grpc.ErrorSidecarStub(cb._channel())
        reg = stub_a.RegisterJob(pb.RegisterJobRequest(job="wide", run_id=RUN, properties=props),
                                 timeout=10)
        jt = [("spillway-job-token", reg.job_token)]
        assert reg.home == a and reg.home_instance_id
        assert stub_a.GetStatus(pb.GetStatusRequest(), timeout=5).advertised_address == a
        stub_b.RegisterJob(pb.RegisterJobRequest(job="wide", run_id=RUN, properties=props,
                                                 home=reg.home,
                                                 home_instance_id=reg.home_instance_id),
                           metadata=jt, timeout=15)
        task_b = pb.TaskIdentity(stage_id=1, partition_id=1, task_attempt_id=2)
        va = stub_a.ReportFailures(pb.ReportFailuresRequest(
            job="wide", run_id=RUN, task=TASK, records=_records("a", 2)), metadata=jt,
            timeout=10)
        vb = stub_b.ReportFailures(pb.ReportFailuresRequest(
            job="wide", run_id=RUN, task=task_b, records=_records("b", 1)), metadata=jt,
            timeout=10)
        assert [v.action for v in va.verdicts] == [pb.ACTION_SKIP] * 2
        # the third error, on the other node, is decided by the home: the job-wide limit holds
        assert vb.verdicts[0].action == pb.ACTION_FAIL and vb.verdicts[0].job_failed
        # the executor's certificate is not a peer's: the home refuses its decide_only
        code, details = rpc.error(lambda: stub_a.ReportFailures(pb.ReportFailuresRequest(
            job="wide", run_id=RUN, task=TASK, records=_records("x", 1), decide_only=True),
            metadata=jt, timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "executor-1" in details
    finally:
        for proc, _ in procs.values():
            _stop(proc)


def test_node_token_rotation_without_restart(tmp_path):
    token = write_token(tmp_path / "node.token", "old-token")
    proc, address = _spawn(["--listen", "127.0.0.1:0", "--token-file", str(token)])
    try:
        def status(value):
            return SidecarClient(address, timeout_s=10,
                                 token_file=str(write_token(tmp_path / f"c-{value}", value))
                                 ).status()

        assert status("old-token").sidecar_id
        write_token(token, "new-token", "old-token")  # step 1: both accepted
        assert status("new-token").sidecar_id and status("old-token").sidecar_id
        write_token(token, "new-token")  # step 2: the old one retired
        os.utime(token, ns=(10**18, 10**18))  # a distinct mtime even on coarse clocks
        with pytest.raises(SidecarAuthError, match="does not match"):
            status("old-token")
        assert status("new-token").sidecar_id
    finally:
        _stop(proc)
