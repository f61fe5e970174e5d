"""Per-job isolation against `spillway serve` as its own process: another caller on the node
(it holds the node token, not the victim run's job token) cannot re-register, fail, reset, read,
end or redirect the victim's run. Each attempt is refused with its code (PERMISSION_DENIED for an
existing run) and changes nothing: the victim's summary and verdicts are as if it never happened,
and health stays SERVING. The operator (admin token) lists and ends runs with `spillway job`."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support import serve
from support import rpc
from support.tls import write_token

pytestmark = pytest.mark.e2e

NODE, ADMIN = "node-token-isolation-01", "admin-token-isolation-01"
RUN = "app-20261123120000-0007"
TASK = pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=7)
PROPS = {"errors.tolerance": "all", "errors.tolerance.max.errors": "5",
         "errors.retry.timeout": "-1", "errors.circuit.enable": "false"}


def _spawn(args):
    return serve.spawn(["--listen", "127.0.0.1:0", "--set", "telemetry.enable=false", *args],
                       extra_env={"GRPC_VERBOSITY": "NONE"})


_stop = serve.stop


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory):
    d = tmp_path_factory.mktemp("isolation")
    node, admin = write_token(d / "node", NODE), write_token(d / "admin", ADMIN)
    procs = [_spawn(["--token-file", str(node), "--admin-token-file", str(admin)])
             for _ in range(2)]  # the victim's sidecar, and one the attacker controls
    yield [address for _, address in procs], admin
    for proc, _ in procs:
        _stop(proc)


def _record(rid, category=pb.CATEGORY_UNSPECIFIED, cls="builtins.ValueError"):
    return pb.FailedRecord(record_id=rid, stage=pb.STAGE_TRANSFORMATION, value=b"payload",
                           exception=pb.ExceptionInfo(class_name=cls, class_chain=[cls],
                                                      marker_category=category))


def test_another_caller_cannot_touch_a_victims_run(sidecars):
    (victim_addr, attacker_addr), _ = sidecars
    ch = grpc.insecure_channel(victim_addr)
    stub = pb_grpc.ErrorSidecarStub(ch)
    node = [("spillway-node-token", NODE)]
    reg = stub.RegisterJob(pb.RegisterJobRequest(job="victim", run_id=RUN, properties=PROPS),
                           metadata=node, timeout=10)
    victim = node + [("spillway-job-token", reg.job_token)]
    # the victim's state: one data error skipped, one transient failure on its first retry
    first = stub.ReportFailures(pb.ReportFailuresRequest(
        job="victim", run_id=RUN, task=TASK, records=[
            _record("p0:r1"), _record("p0:r2", pb.CATEGORY_RETRIABLE, "builtins.TimeoutError")]),
        metadata=victim, timeout=10)
    assert [v.action for v in first.verdicts] == [pb.ACTION_SKIP, pb.ACTION_RETRY]
    before = stub.GetJobSummary(pb.GetJobSummaryRequest(job="victim", run_id=RUN),
                                metadata=victim, timeout=5)

    for who, md in (("no job token", node),
                    ("a wrong job token", node + [("spillway-job-token", "guess" * 8)])):
        attacks = {
            "re-register with another policy": lambda md=md: stub.RegisterJob(
                pb.RegisterJobRequest(job="victim", run_id=RUN,
                                      properties={"errors.tolerance": "none"}),
                metadata=md, timeout=10),
            "redirect its home": lambda md=md: stub.RegisterJob(
                pb.RegisterJobRequest(job="victim", run_id=RUN, properties=PROPS,
                                      home=attacker_addr),
                metadata=md, timeout=10),
            "fail it (invalid configuration)": lambda md=md: stub.ReportFailures(
                pb.ReportFailuresRequest(job="victim", run_id=RUN, task=TASK, records=[
                    _record("evil", pb.CATEGORY_INVALID_CONFIGURATION)]),
                metadata=md, timeout=10),
            "reset its retries (recovered ids)": lambda md=md: stub.ReportFailures(
                pb.ReportFailuresRequest(job="victim", run_id=RUN, task=TASK,
                                         recovered_record_ids=["p0:r2"]),
                metadata=md, timeout=10),
            "reset its retries (flush)": lambda md=md: stub.FlushTask(
                pb.FlushTaskRequest(job="victim", run_id=RUN, task=TASK,
                                    recovered_record_ids=["p0:r2"], processed=[
                                        pb.StageCount(stage=pb.STAGE_TRANSFORMATION,
                                                      records=10**6)]),
                metadata=md, timeout=10),
            "read its summary": lambda md=md: stub.GetJobSummary(
                pb.GetJobSummaryRequest(job="victim", run_id=RUN), metadata=md, timeout=5),
            "end it": lambda md=md: stub.EndJob(
                pb.EndJobRequest(job="victim", run_id=RUN), metadata=md, timeout=10),
        }
        for what, attack in attacks.items():
            code, details = rpc.error(attack)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (who, what, code, details)
            assert "job token" in details and reg.job_token not in details, (who, what)
        # status lists none of it to this caller
        listed = stub.GetStatus(pb.GetStatusRequest(), metadata=md, timeout=5)
        assert listed.jobs_total == 0 and not listed.jobs

    # nothing changed: same summary, not failed, no forwarding (the attacker's sidecar saw
    # nothing), and the victim's record continues its own retry schedule (attempt 2)
    after = stub.GetJobSummary(pb.GetJobSummaryRequest(job="victim", run_id=RUN),
                               metadata=victim, timeout=5)
    assert after == before and not after.failed and after.records_processed == 0
    again = stub.ReportFailures(pb.ReportFailuresRequest(
        job="victim", run_id=RUN, task=TASK, records=[
            _record("p0:r2", pb.CATEGORY_RETRIABLE, "builtins.TimeoutError")]),
        metadata=victim, timeout=10)
    assert again.verdicts[0].action == pb.ACTION_RETRY and again.verdicts[0].attempt == 2
    admin = [("spillway-admin-token", ADMIN)]
    elsewhere = pb_grpc.ErrorSidecarStub(grpc.insecure_channel(attacker_addr)).GetStatus(
        pb.GetStatusRequest(), metadata=admin, timeout=5)
    assert elsewhere.jobs_total == 0
    # the victim sees its own run; the operator sees every run
    own = stub.GetStatus(pb.GetStatusRequest(), metadata=victim, timeout=5)
    assert [(j.job, j.run_id) for j in own.jobs] == [("victim", RUN)]
    assert stub.GetStatus(pb.GetStatusRequest(job="victim"), metadata=admin,
                          timeout=5).jobs_total == 1
    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    ch.close()


def test_the_same_name_in_another_run_is_another_job(sidecars):
    """Another caller may register the same job name under its own run: it gets its own
    state and token, and the victim's run is untouched."""
    (addr, _), _ = sidecars
    stub = pb_grpc.ErrorSidecarStub(grpc.insecure_channel(addr))
    node = [("spillway-node-token", NODE)]
    mine = stub.RegisterJob(pb.RegisterJobRequest(job="shared", run_id="run-a",
                                                  properties=PROPS), metadata=node, timeout=10)
    theirs = stub.RegisterJob(pb.RegisterJobRequest(job="shared", run_id="run-b",
                                                    properties={"errors.tolerance": "none"}),
                              metadata=node, timeout=10)
    assert mine.job_token != theirs.job_token
    failed = stub.ReportFailures(pb.ReportFailuresRequest(
        job="shared", run_id="run-b", task=TASK, records=[_record("x")]),
        metadata=node + [("spillway-job-token", theirs.job_token)], timeout=10)
    assert failed.verdicts[0].job_failed  # tolerance none: run-b has failed
    code, _ = rpc.error(lambda: stub.ReportFailures(pb.ReportFailuresRequest(
        job="shared", run_id="run-a", task=TASK, records=[_record("x")]),
        metadata=node + [("spillway-job-token", theirs.job_token)], timeout=10))
    assert code == grpc.StatusCode.PERMISSION_DENIED  # run-b's token is not run-a's
    ok = stub.ReportFailures(pb.ReportFailuresRequest(
        job="shared", run_id="run-a", task=TASK, records=[_record("x")]),
        metadata=node + [("spillway-job-token", mine.job_token)], timeout=10)
    assert ok.verdicts[0].action == pb.ACTION_SKIP and not ok.verdicts[0].job_failed


def _cli(address, admin, *args):
    return subprocess.run(
        [sys.executable, "-m", "spillway.sidecar.cli", "job", *args, "--sidecar", address,
         "--admin-token-file", str(admin)], capture_output=True, text=True, timeout=60)


def test_the_operator_lists_and_ends_runs_with_spillway_job(sidecars):
    (addr, _), admin = sidecars
    stub = pb_grpc.ErrorSidecarStub(grpc.insecure_channel(addr))
    node = [("spillway-node-token", NODE)]
    for run in ("op-1", "op-2"):
        stub.RegisterJob(pb.RegisterJobRequest(job="nightly", run_id=run, properties=PROPS),
                         metadata=node, timeout=10)
    out = _cli(addr, admin, "list", "--job", "nightly")
    assert out.returncode == 0, out.stderr
    assert "2 live run(s)" in out.stdout and "nightly\top-1\trunning" in out.stdout
    out = _cli(addr, admin, "end", "nightly", "--run", "op-1")
    assert out.returncode == 0, out.stderr
    assert "ended job nightly run op-1" in out.stdout
    assert [j.run_id for j in stub.GetStatus(pb.GetStatusRequest(job="nightly"),
                                             metadata=[("spillway-admin-token", ADMIN)],
                                             timeout=5).jobs] == ["op-2"]
    # without the operator's token, the node token alone ends nothing
    code, _ = rpc.error(lambda: stub.EndJob(pb.EndJobRequest(job="nightly", run_id="op-2"),
                                        metadata=node, timeout=10))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    out = _cli(addr, admin, "end", "nightly")  # every live run of the name
    assert out.returncode == 0 and "ended job nightly run op-2" in out.stdout
    out = _cli(addr, admin, "end", "nightly")
    assert out.returncode == 1 and "no live run" in out.stdout
    # the name is free again: a new run registers with a fresh token
    again = stub.RegisterJob(pb.RegisterJobRequest(job="nightly", run_id="op-1",
                                                   properties={"errors.tolerance": "none"}),
                             metadata=node, timeout=10)
    assert again.job_token and again.effective_properties["errors.tolerance"] == "none"
