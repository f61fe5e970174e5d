"""Hostile input against `spillway serve` as its own process (issue 11, "Bounds everywhere" and
"Operator-owned code and topics").

Each attack is refused with the stated status code and a short message naming what is wrong,
and leaves the victim job (its summary, a normal report), the sidecar and its health untouched.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

TASK = pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=7)
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def sidecar(broker, tmp_path_factory):
    d = tmp_path_factory.mktemp("hardening")
    (d / "slow_handlers.py").write_text(textwrap.dedent("""
        import threading
        from spillway.sidecar.core.handlers import HandlerResponse

        class Blocking:
            def handle(self, context):
                threading.Event().wait()          # never returns (like signal.pause)
                return HandlerResponse.CONTINUE
    """))
    env = {**os.environ, "GRPC_VERBOSITY": "NONE",
           "PYTHONPATH": os.pathsep.join([str(d), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "spillway.sidecar.cli", "--log-level", "WARNING", "serve",
         "--listen", "127.0.0.1:0", "--bootstrap-servers", broker.bootstrap_servers,
         "--set", f"spool.dir={d / 'spool'}", "--set", "telemetry.enable=false",
         "--set", "errors.handler.allowed.classes=slow_handlers:Blocking",
         "--set", "errors.handler.timeout.ms=300", "--set", "errors.handler.pool.size=2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    m = re.search(r"listening on (\S+)", proc.stdout.readline())
    if not m:
        proc.kill()
        raise AssertionError(proc.communicate()[1][-2000:])
    channel = grpc.insecure_channel(m.group(1))
    yield proc, channel
    channel.close()
    proc.send_signal(signal.SIGTERM)
    try:
        # a handler stuck forever must not keep the sidecar from stopping
        proc.wait(20)  # TimeoutExpired fails the test
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def stub(sidecar):
    return pb_grpc.ErrorSidecarStub(sidecar[1])


RUN = "app-attacks-0001"  # every job-scoped call names its run


def _md(resp):
    token = getattr(resp, "job_token", "")
    return (("spillway-job-token", token),) if token else ()


@pytest.fixture(scope="module")
def victim(stub):
    resp = stub.RegisterJob(pb.RegisterJobRequest(run_id=RUN,
        job="victim", properties={"errors.tolerance": "all"}), timeout=20)
    return _md(resp)


def _records(prefix, n):
    return [pb.FailedRecord(
        record_id=f"{prefix}-{i}", stage=pb.STAGE_TRANSFORMATION, function_name="app.f",
        exception=pb.ExceptionInfo(class_name="builtins.ValueError",
                                   class_chain=["builtins.ValueError"]))
        for i in range(n)]


def _refused(call, code=grpc.StatusCode.INVALID_ARGUMENT):
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, (err.value.code(), err.value.details())
    details = err.value.details()
    assert len(details) <= 1024, "error details are cut"
    return details


def _untouched(sidecar, stub, victim, n=[0]):
    """The sidecar answers health, status and the victim's summary, and a normal report."""
    proc, channel = sidecar
    assert proc.poll() is None, "the sidecar died"
    assert health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
    n[0] += 1
    before = stub.GetJobSummary(pb.GetJobSummaryRequest(run_id=RUN, job="victim"), metadata=victim,
                                timeout=5)
    out = stub.ReportFailures(pb.ReportFailuresRequest(run_id=RUN,
        job="victim", task=TASK, records=_records(f"v{n[0]}", 2)), metadata=victim, timeout=10)
    assert [v.action for v in out.verdicts] == [pb.ACTION_SKIP] * 2
    after = stub.GetJobSummary(pb.GetJobSummaryRequest(run_id=RUN, job="victim"), metadata=victim,
                               timeout=5)
    assert not after.failed
    assert after.total_record_errors == before.total_record_errors + 2
    stub.GetStatus(pb.GetStatusRequest(), timeout=5)


@pytest.mark.parametrize("spec", ["os:abort", "signal:pause", "os.abort",
                                  "processing.exception.handler"])
def test_arbitrary_handler_code_is_refused_at_registration(sidecar, stub, victim, spec):
    prop = "errors.handler.class"
    if spec == "processing.exception.handler":  # KIP-1033's name, an alias
        prop, spec = spec, "signal:pause"
    details = _refused(lambda: stub.RegisterJob(pb.RegisterJobRequest(run_id=RUN,
        job="evil-handler", properties={"errors.tolerance": "all", prop: spec}), timeout=10))
    assert details.startswith("errors.handler.class:")
    assert "errors.handler.allowed.classes" in details and "slow_handlers.Blocking" in details
    _untouched(sidecar, stub, victim)
    _refused(lambda: stub.GetJobSummary(pb.GetJobSummaryRequest(run_id=RUN, job="evil-handler"),
                                        timeout=5), grpc.StatusCode.NOT_FOUND)


def test_allowed_handlers_that_block_fail_their_jobs_not_the_sidecar(sidecar, stub, victim):
    # more blocking jobs than handler threads (2): the first ones time out and fail their
    # jobs (handler failures); once both threads are held, loading or calling a user handler
    # is refused at once with the reason, never a hang
    saturated = 'all 2 handler threads (errors.handler.pool.size) are still held'
    failed = 0
    for i in range(4):
        req = pb.RegisterJobRequest(run_id=RUN, job=f"blocking-{i}", properties={
            "errors.tolerance": "all", "errors.handler.class": "slow_handlers:Blocking"})
        try:
            resp = stub.RegisterJob(req, timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and saturated in exc.details()
            assert i >= 2
            continue
        out = stub.ReportFailures(pb.ReportFailuresRequest(run_id=RUN,
            job=f"blocking-{i}", task=TASK, records=_records("b", 1)), metadata=_md(resp),
            timeout=10)
        v = out.verdicts[0]
        assert v.action == pb.ACTION_FAIL and v.job_failed
        assert "did not return within errors.handler.timeout.ms=300" in v.reason \
            or saturated in v.reason
        failed += 1
    assert failed >= 2
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
    assert status.counters["handler-failures"] >= failed
    _untouched(sidecar, stub, victim)


def test_huge_processed_counts_are_refused_and_status_keeps_working(sidecar, stub, victim):
    for _ in range(2):
        details = _refused(lambda: stub.FlushTask(pb.FlushTaskRequest(run_id=RUN,
            job="victim", task=TASK, processed=[pb.StageCount(
                stage=pb.STAGE_TRANSFORMATION, records=2**64 - 1)]), metadata=victim,
            timeout=10))
        assert details.startswith("processed[0].records: must be in [0, 1099511627776]")
    _untouched(sidecar, stub, victim)


@pytest.mark.parametrize("prop, value", [
    ("errors.retry.max.backoff.ms", str(2**64 + 1)),
    ("errors.retry.initial.backoff.ms", str(2**64)),
    ("status.storage.retry.max.backoff.ms", str(2**70)),
    ("errors.retry.delay.max.ms", str(2**64)),
    ("errors.deadletterqueue.topic.partitions", str(2**31)),
    ("errors.retry.timeout", "9" * 5000),
])
def test_absurd_numbers_are_refused_naming_the_property(sidecar, stub, victim, prop, value):
    details = _refused(lambda: stub.RegisterJob(pb.RegisterJobRequest(run_id=RUN,
        job="absurd", properties={"errors.tolerance": "all", prop: value}), timeout=10))
    canonical = prop.replace("status.storage.retry", "errors.retry")
    assert details.startswith(f"{canonical}:") and "must be" in details
    _untouched(sidecar, stub, victim)


def test_a_100kb_property_value_gets_a_short_invalid_argument(sidecar, stub, victim):
    for props in ({"errors.tolerance": "x" * 100_000},
                  {"errors.classification.rules": "a.B=data," * 12_500},
                  {"k" * 100_000: "v"}):
        details = _refused(lambda: stub.RegisterJob(pb.RegisterJobRequest(run_id=RUN,
            job="long", properties=props), timeout=10))
        assert details.startswith("properties")
        assert len(details) < 300
    _untouched(sidecar, stub, victim)


@pytest.mark.parametrize("method", ["RegisterJob", "ReportFailures", "FlushTask",
                                    "GetJobSummary", "GetStatus", "EndJob"])
def test_an_undecodable_request_is_invalid_argument(sidecar, stub, victim, method):
    call = sidecar[1].unary_unary(f"/spillway.v1.ErrorSidecar/{method}")  # raw bytes both ways
    # a truncated tag, a length past the end, a job name that is not UTF-8
    for garbage in (b"\xff\xff\xff\xff", b"\x0a\xff\x01", b"\x0a\x02\xc3\x28"):
        details = _refused(lambda: call(garbage, timeout=5))
        assert details.startswith("request is not a valid spillway.v1.")
    _untouched(sidecar, stub, victim)


def test_a_job_name_with_surrounding_spaces_is_refused_everywhere(sidecar, stub, victim):
    details = _refused(lambda: stub.RegisterJob(pb.RegisterJobRequest(run_id=RUN,
        job=" spaced ", properties={"errors.tolerance": "all"}), timeout=10))
    assert details.startswith("job:") and "leading or trailing whitespace" in details
    for call in (
        lambda: stub.ReportFailures(pb.ReportFailuresRequest(run_id=RUN,
            job="victim ", task=TASK, records=_records("s", 1)), metadata=victim, timeout=5),
        lambda: stub.FlushTask(pb.FlushTaskRequest(run_id=RUN, job=" victim", task=TASK),
                               metadata=victim, timeout=5),
        lambda: stub.GetJobSummary(pb.GetJobSummaryRequest(run_id=RUN, job=" victim"),
                                   metadata=victim, timeout=5),
        lambda: stub.GetStatus(pb.GetStatusRequest(job="victim\n"), timeout=5),
        lambda: stub.EndJob(pb.EndJobRequest(run_id=RUN, job=" victim"), metadata=victim,
                            timeout=5),
    ):
        assert _refused(call).startswith("job:")
    _untouched(sidecar, stub, victim)


@pytest.mark.parametrize("props, field", [
    ({"errors.deadletterqueue.topic.name.prefix": "",
      "errors.deadletterqueue.topic.name": "orders"}, "errors.deadletterqueue.topic.name:"),
    ({"errors.deadletterqueue.topic.name.prefix": "ord",
      "errors.deadletterqueue.topic.name": "orders"},
     "errors.deadletterqueue.topic.name.prefix:"),
    ({"errors.deadletterqueue.topic.name.prefix": "bad prefix!",
      "errors.deadletterqueue.topic.name": "dlq.x"},
     "errors.deadletterqueue.topic.name.prefix:"),
    ({"errors.deadletterqueue.topic.name": "__consumer_offsets"},
     "errors.deadletterqueue.topic.name:"),
])
def test_a_job_cannot_loosen_the_dlq_prefix(sidecar, stub, victim, props, field):
    details = _refused(lambda: stub.RegisterJob(pb.RegisterJobRequest(run_id=RUN,
        job="loose-dlq", properties={"errors.tolerance": "all", **props}), timeout=20))
    assert details.startswith(field)
    _untouched(sidecar, stub, victim)
    _refused(lambda: stub.GetJobSummary(pb.GetJobSummaryRequest(run_id=RUN, job="loose-dlq"),
                                        timeout=5),
             grpc.StatusCode.NOT_FOUND)
