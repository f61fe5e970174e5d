"""SidecarClient against a real in-process grpc.server running a small scripted servicer."""

from __future__ import annotations

import os
import threading
import time
from concurrent import futures

import grpc
import pytest
from spillway.client import (
    FlushTimeoutError,
    InvalidPolicyError,
    JobConflictError,
    JobNotRegisteredError,
    SidecarBackpressureError,
    SidecarClient,
    SidecarProtocolError,
    SidecarTimeoutError,
    SidecarUnavailableError,
    SpillwayClientError,
    _channel,
)
from spillway.client.client import DEFAULT_TARGET, resolve_target
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support.rpc import serve_servicer


class Scripted(pb_grpc.ErrorSidecarServicer):
    """Answers from a script: `fail[method]` is a list of status codes to abort with, in turn."""

    def __init__(self):
        self.calls: list[tuple[str, object, dict]] = []
        self.fail: dict[str, list[grpc.StatusCode]] = {}
        self.delay: dict[str, float] = {}
        self.verdicts = None  # callable(records) -> list[Verdict]
        self.lock = threading.Lock()

    def _enter(self, method, request, context):
        with self.lock:
            self.calls.append((method, request, dict(context.invocation_metadata())))
            script = self.fail.get(method)
            code = script.pop(0) if script else None
        if method in self.delay:
            time.sleep(self.delay[method])
        if code is not None:
            context.abort(code, f"scripted {code.name}")

    def RegisterJob(self, request, context):
        self._enter("RegisterJob", request, context)
        return pb.RegisterJobResponse(job=request.job, effective_properties={
            "errors.tolerance": "none", **request.properties})

    def ReportFailures(self, request, context):
        self._enter("ReportFailures", request, context)
        if self.verdicts:
            return pb.ReportFailuresResponse(verdicts=self.verdicts(list(request.records)))
        return pb.ReportFailuresResponse(verdicts=[
            pb.Verdict(record_id=r.record_id, action=pb.ACTION_SKIP, reason="tolerated",
                       category=pb.CATEGORY_DATA, dead_lettered=True, attempt=r.attempt)
            for r in request.records])

    def FlushTask(self, request, context):
        self._enter("FlushTask", request, context)
        return pb.FlushTaskResponse(dlq_records_acknowledged=7)

    def GetJobSummary(self, request, context):
        self._enter("GetJobSummary", request, context)
        return pb.JobSummary(job=request.job, records_processed=42)

    def GetStatus(self, request, context):
        self._enter("GetStatus", request, context)
        return pb.SidecarStatus(sidecar_id="node-a", version="test")

    def methods(self):
        return [m for m, _, _ in self.calls]


@pytest.fixture
def scripted():
    servicer = Scripted()
    server, servicer.target = serve_servicer(servicer, with_health=True)
    yield servicer
    server.stop(0)
    _channel.close_channel(servicer.target)


def _task():
    return pb.TaskIdentity(stage_id=1, partition_id=2, attempt_number=0, task_attempt_id=9,
                           executor_id="3", host="h")


def _rec(i):
    return pb.FailedRecord(record_id=f"t/0/{i}", stage=pb.STAGE_TRANSFORMATION,
                           exception=pb.ExceptionInfo(class_name="builtins.ValueError"), attempt=1)


def test_round_trip_of_every_call(scripted):
    c = SidecarClient(scripted.target)
    assert c.register_job("j", {"errors.tolerance": "all"})["errors.tolerance"] == "all"
    verdicts = c.report_failures("j", _task(), [_rec(1), _rec(2)], recovered=["t/0/0"])
    assert [(v.record_id, v.action) for v in verdicts] == [("t/0/1", pb.ACTION_SKIP),
                                                            ("t/0/2", pb.ACTION_SKIP)]
    assert c.flush_task("j", _task(), {("TRANSFORMATION", ""): 10, "SINK": 3, "VALUE_CONVERTER": 0},
                        recovered=["t/0/5"]) == 7
    assert c.job_summary("j").records_processed == 42
    assert c.status().sidecar_id == "node-a"
    assert c.health() == "SERVING"
    report = scripted.calls[1][1]
    assert report.job == "j" and report.task.partition_id == 2
    assert list(report.recovered_record_ids) == ["t/0/0"]
    flush = scripted.calls[2][1]
    assert {(s.stage, s.records) for s in flush.processed} == {(pb.STAGE_TRANSFORMATION, 10),
                                                               (pb.STAGE_SINK, 3)}
    assert list(flush.recovered_record_ids) == ["t/0/5"]


@pytest.mark.parametrize("code, method, call, err", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "ReportFailures",
     lambda c: c.report_failures("j", _task(), [_rec(1)]), SidecarBackpressureError),
    (grpc.StatusCode.NOT_FOUND, "ReportFailures",
     lambda c: c.report_failures("j", _task(), [_rec(1)]), JobNotRegisteredError),
    (grpc.StatusCode.INVALID_ARGUMENT, "RegisterJob",
     lambda c: c.register_job("j", {"errors.tolerance": "maybe"}), InvalidPolicyError),
    (grpc.StatusCode.FAILED_PRECONDITION, "RegisterJob",
     lambda c: c.register_job("j", {}), JobConflictError),
    (grpc.StatusCode.INTERNAL, "GetStatus", lambda c: c.status(), SidecarProtocolError),
])
def test_status_codes_map_to_typed_errors_keeping_the_code(scripted, code, method, call, err):
    scripted.fail[method] = [code]
    with pytest.raises(err) as info:
        call(SidecarClient(scripted.target))
    assert isinstance(info.value, SpillwayClientError)
    assert info.value.code is code
    assert isinstance(info.value.__cause__, grpc.RpcError)
    assert info.value.__cause__.code() is code
    assert "scripted" in str(info.value)


def test_transient_unavailable_is_retried_by_grpc_then_succeeds(scripted):
    scripted.fail["ReportFailures"] = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
    verdicts = SidecarClient(scripted.target).report_failures("j", _task(), [_rec(1)])
    assert [v.action for v in verdicts] == [pb.ACTION_SKIP]
    assert scripted.methods() == ["ReportFailures"] * 3


def test_persistent_unavailable_raises_after_bounded_retries(scripted):
    scripted.fail["ReportFailures"] = [grpc.StatusCode.UNAVAILABLE] * 10
    with pytest.raises(SidecarUnavailableError):
        SidecarClient(scripted.target).report_failures("j", _task(), [_rec(1)])
    assert scripted.methods() == ["ReportFailures"] * 5  # the retry policy's maxAttempts


def test_unreachable_sidecar_names_target_and_how_to_configure_it(unreachable):
    target = unreachable
    c = SidecarClient(target, timeout_s=5)
    start = time.monotonic()
    with pytest.raises(SidecarUnavailableError) as info:
        c.report_failures("j", _task(), [_rec(1)])
    assert time.monotonic() - start < 5  # bounded retries, not the deadline
    assert target in str(info.value)
    assert "SPILLWAY_SIDECAR_ADDRESS" in str(info.value)
    assert info.value.code is grpc.StatusCode.UNAVAILABLE
    c.close()


def test_deadlines_map_to_timeouts_flush_gets_its_own(scripted):
    scripted.delay = {"FlushTask": 1.0, "GetStatus": 1.0}
    c = SidecarClient(scripted.target, timeout_s=0.2)
    with pytest.raises(FlushTimeoutError) as info:
        c.flush_task("j", _task(), {"TRANSFORMATION": 1})
    assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(SidecarTimeoutError) as info:
        c.status()
    assert not isinstance(info.value, FlushTimeoutError)
    assert c.flush_task("j", _task(), {}, timeout_s=3.0) == 7


def test_verdicts_must_answer_every_record_in_order(scripted):
    scripted.verdicts = lambda recs: [pb.Verdict(record_id=r.record_id) for r in reversed(recs)]
    with pytest.raises(SidecarProtocolError, match="one verdict per record"):
        SidecarClient(scripted.target).report_failures("j", _task(), [_rec(1), _rec(2)])


def test_target_from_environment_then_default(monkeypatch):
    monkeypatch.setenv("SPILLWAY_SIDECAR_ADDRESS", "10.0.0.5:6000")
    assert SidecarClient().target == "10.0.0.5:6000"
    assert SidecarClient("127.0.0.1:1").target == "127.0.0.1:1"
    monkeypatch.delenv("SPILLWAY_SIDECAR_ADDRESS")
    assert SidecarClient().target == DEFAULT_TARGET
    assert resolve_target("unix:///tmp/s.sock") == "unix:///tmp/s.sock"
    monkeypatch.setenv("SPILLWAY_SIDECAR_ADDRESS", "nohostport")
    with pytest.raises(ValueError, match="SPILLWAY_SIDECAR_ADDRESS"):
        SidecarClient()


def test_unix_socket_target(tmp_path):
    path = tmp_path / "sidecar.sock"
    servicer = Scripted()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_ErrorSidecarServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    try:
        with SidecarClient(f"unix://{path}") as c:
            assert c.status().sidecar_id == "node-a"
    finally:
        server.stop(0)


def test_one_channel_per_target_per_process_recreated_after_fork(scripted, monkeypatch):
    a, b = SidecarClient(scripted.target), SidecarClient(scripted.target)
    a.status()
    b.status()
    first = _channel.get_channel(scripted.target)
    t = scripted.target
    assert a._bound[t][0] is first and b._bound[t][0] is first
    real_pid = os.getpid()
    monkeypatch.setattr(_channel.os, "getpid", lambda: real_pid + 100000)
    a.status()  # in the "child": a fresh channel, the parent's is left alone
    assert a._bound[t][0] is not first
    assert _channel.get_channel(scripted.target) is a._bound[t][0]


def test_interceptors_are_applied(scripted):
    class AddHeader(grpc.UnaryUnaryClientInterceptor):
        def intercept_unary_unary(self, continuation, details, request):
            md = list(details.metadata or []) + [("x-spillway-test", "yes")]
            return continuation(_Details(details, md), request)

    SidecarClient(scripted.target, interceptors=[AddHeader()]).status()
    assert scripted.calls[-1][2].get("x-spillway-test") == "yes"


class _Details(grpc.ClientCallDetails):
    def __init__(self, d, md):
        self.method, self.timeout, self.metadata = d.method, d.timeout, md
        self.credentials, self.wait_for_ready, self.compression = (
            d.credentials, d.wait_for_ready, d.compression)


def test_bad_timeout_is_refused():
    with pytest.raises(ValueError, match="timeout_s"):
        SidecarClient("127.0.0.1:1", timeout_s=0)


@pytest.mark.parametrize("call", [lambda c: c.status(),
                                  lambda c: c.flush_task("j", _task(), {"SINK": 1})])
def test_deadline_while_unreachable_is_unavailable_not_a_timeout(call, unreachable):
    target = unreachable
    c = SidecarClient(target, timeout_s=0.5)  # shorter than gRPC's own retries
    with pytest.raises(SidecarUnavailableError) as info:
        call(c)
    assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert target in str(info.value) and "SPILLWAY_SIDECAR_ADDRESS" in str(info.value)
    c.close()


def test_trace_context_travels_in_the_call_metadata(scripted):
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    ctx = SpanContext(trace_id=0x0AF7651916CD43DD8448EB211C80319C, span_id=0xB7AD6B7169203331,
                      is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    with trace.use_span(NonRecordingSpan(ctx)):
        SidecarClient(scripted.target).status()
    assert scripted.calls[-1][2]["traceparent"].startswith(
        "00-0af7651916cd43dd8448eb211c80319c-")
    SidecarClient(scripted.target).status()  # no current span: nothing is sent
    assert "traceparent" not in scripted.calls[-1][2]
    with trace.use_span(NonRecordingSpan(ctx)):
        SidecarClient(scripted.target, trace_calls=False).status()
    assert "traceparent" not in scripted.calls[-1][2]


def _failures(n):
    from spillway.client import columns

    try:
        raise ValueError("bad")
    except ValueError as exc:
        return [columns.failure(f"t/0/{i}", "TRANSFORMATION", exc, key=b"k") for i in range(n)]


def test_failures_go_as_messages_to_a_sidecar_that_takes_no_columns(scripted):
    """An older sidecar's RegisterJob says nothing of columns: the records go as messages."""
    from spillway.client import columns

    c = SidecarClient(scripted.target)
    reg = c.register_job("j", {})
    assert not columns.takes(c.target, reg.job, reg.run_id)
    verdicts = c.report_failures(reg.run(), _task(), _failures(3))
    (_, req, _), = [call for call in scripted.calls if call[0] == "ReportFailures"]
    assert not req.HasField("columns") and [r.record_id for r in req.records] == [
        "t/0/0", "t/0/1", "t/0/2"]
    assert req.records[0] == _failures(1)[0].to_pb()
    assert [type(v) for v in verdicts] == [pb.Verdict] * 3


def test_a_sidecar_replaced_by_one_that_takes_no_columns_gets_the_report_again(scripted):
    """Columns to a sidecar that ignores them come back with no verdicts: the client says the
    report again as messages (no recovered ids twice) and sends messages from then on."""
    from spillway.client import columns

    c = SidecarClient(scripted.target)
    reg = c.register_job("j", {})
    columns.note(c.target, reg.job, reg.run_id, True)   # what the earlier sidecar answered
    verdicts = c.report_failures(reg.run(), _task(), _failures(2), recovered=["t/0/9"])
    first, second = [req for m, req, _ in scripted.calls if m == "ReportFailures"]
    assert first.HasField("columns") and first.verdict_columns
    assert list(first.recovered_record_ids) == ["t/0/9"]
    assert len(second.records) == 2 and not second.recovered_record_ids
    assert [v.record_id for v in verdicts] == ["t/0/0", "t/0/1"]
    assert not columns.takes(c.target, reg.job, reg.run_id)
