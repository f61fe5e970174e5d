"""TaskSession (executor side) against a real in-process grpc.server with a scripted servicer:
when gRPC calls happen, what they carry, and what happens when the sidecar is away."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from spillway.client import (
    SidecarBackpressureError,
    SidecarClient,
    SidecarUnavailableError,
    _channel,
)
from spillway.spark import _runtime, _taskinfo, _tracing
from spillway.spark._engine import StageRef
from spillway.spark._runtime import JobSpec, TaskSession, WrapperSpec
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support.net import reserved_port
from support.rpc import serve_servicer

T = StageRef.of("TRANSFORMATION")


class Scripted(pb_grpc.ErrorSidecarServicer):
    def __init__(self, effective=None):
        self.calls: list[tuple[str, object]] = []
        self.fail: dict[str, list[grpc.StatusCode]] = {}
        self.effective = effective or {"errors.tolerance": "all"}
        self.lock = threading.Lock()

    def _enter(self, method, request, context):
        with self.lock:
            self.calls.append((method, request))
            script = self.fail.get(method)
            code = script.pop(0) if script else None
        if code is not None:
            context.abort(code, f"scripted {code.name}")

    def RegisterJob(self, request, context):
        self._enter("RegisterJob", request, context)
        return pb.RegisterJobResponse(job=request.job, effective_properties=self.effective)

    def ReportFailures(self, request, context):
        self._enter("ReportFailures", request, context)
        return pb.ReportFailuresResponse(verdicts=[
            pb.Verdict(record_id=r.record_id, action=pb.ACTION_SKIP, reason="ok",
                       dead_lettered=True) for r in request.records])

    def FlushTask(self, request, context):
        self._enter("FlushTask", request, context)
        return pb.FlushTaskResponse(dlq_records_acknowledged=1)

    def methods(self):
        return [m for m, _ in self.calls]

    def flushed(self, i=-1) -> dict:
        flushes = [r for m, r in self.calls if m == "FlushTask"]
        return {(c.stage, c.custom_stage): c.records for c in flushes[i].processed}


@pytest.fixture(autouse=True)
def fresh_worker(monkeypatch):
    monkeypatch.setattr(_runtime, "_worker", None)
    # this process is not an executor: leave its global TracerProvider alone
    monkeypatch.setattr(_tracing, "ensure_provider", lambda: None)
    monkeypatch.delenv("SPILLWAY_SIDECAR_ADDRESS", raising=False)
    yield


@pytest.fixture
def scripted():
    servicer = Scripted()
    server, target = serve_servicer(servicer)
    servicer.target = target
    yield servicer
    server.stop(0)
    _channel.close_channel(target)


def _task(partition=0, tid=1):
    return pb.TaskIdentity(stage_id=2, partition_id=partition, task_attempt_id=tid,
                           executor_id="1", host="h")


def _session(spec, target, partition=0, tid=1, **kw):
    return TaskSession(spec, WrapperSpec("w", T, "app.fn"), task=_task(partition, tid),
                       client=SidecarClient(target, timeout_s=5), **kw)


def _record(rid="r1"):
    return pb.FailedRecord(record_id=rid, stage=pb.STAGE_TRANSFORMATION,
                           exception=pb.ExceptionInfo(class_name="builtins.ValueError"))


def test_failure_free_partitions_send_their_counts_before_the_task_ends(scripted):
    """Exact summaries: each clean partition's counts reach the sidecar before its task ends,
    whatever counts_interval_s says (that interval is for UDFs, which see no partition end)."""
    spec = JobSpec("j", (("errors.tolerance", "all"),), counts_interval_s=3600)
    for p in range(3):
        s = _session(spec, scripted.target, partition=p)
        s.processed([T], 10)
        s.close(True)
        assert scripted.flushed() == {(pb.STAGE_TRANSFORMATION, ""): 10}
    assert scripted.methods() == ["RegisterJob", "FlushTask", "FlushTask", "FlushTask"]
    s = _session(spec, scripted.target, partition=3)
    s.processed([T], 5)
    s.report([_record()])
    s.close(True)
    assert scripted.methods()[-2:] == ["ReportFailures", "FlushTask"]
    assert scripted.flushed() == {(pb.STAGE_TRANSFORMATION, ""): 5}
    assert _runtime.worker().counts == {}


def test_counts_only_flush_once_due_and_kept_when_it_fails(scripted, unreachable):
    spec = JobSpec("j", counts_interval_s=0)
    s = _session(spec, scripted.target)
    s.processed([T], 7)
    s.close(True)
    assert scripted.methods() == ["RegisterJob", "FlushTask"]
    assert scripted.flushed() == {(pb.STAGE_TRANSFORMATION, ""): 7}

    dead = unreachable
    s = _session(spec, dead)
    s.processed([T], 4)
    s.close(True)  # no exception: counts are statistics, kept for a later call
    assert _runtime.worker().counts[(dead, "j", "")] == {T.key: 4}


def test_registers_once_per_process_and_again_when_the_sidecar_forgot_the_job(scripted):
    spec = JobSpec("j")
    for p in range(2):
        s = _session(spec, scripted.target, partition=p)
        s.report([_record(f"r{p}")])
    assert scripted.methods().count("RegisterJob") == 1
    scripted.fail["ReportFailures"] = [grpc.StatusCode.NOT_FOUND]
    verdicts = _session(spec, scripted.target, partition=5).report([_record("r5")])
    assert [v.record_id for v in verdicts] == ["r5"]
    assert scripted.methods()[-3:] == ["ReportFailures", "RegisterJob", "ReportFailures"]


def test_counts_are_refreshed_before_reports_only_for_ratio_tolerance(scripted):
    spec = JobSpec("j")
    s = _session(spec, scripted.target)
    s.processed([T], 100)
    s.report([_record()])
    assert "FlushTask" not in scripted.methods()

    scripted.effective = {"errors.tolerance": "all", "errors.tolerance.max.ratio": "0.1"}
    _runtime._worker = None
    scripted.calls.clear()
    s = _session(spec, scripted.target)
    s.processed([T], 100)
    s.report([_record("a")])
    s.processed([T], 5)       # +5%: no refresh
    s.report([_record("b")])
    s.processed([T], 50)      # +>10%: refresh
    s.report([_record("c")])
    assert scripted.methods() == ["RegisterJob", "FlushTask", "ReportFailures",
                                  "ReportFailures", "FlushTask", "ReportFailures"]
    assert scripted.flushed(0) == {(pb.STAGE_TRANSFORMATION, ""): 100}
    assert scripted.flushed(1) == {(pb.STAGE_TRANSFORMATION, ""): 155}


def test_recovered_ids_travel_with_the_next_call(scripted):
    s = _session(JobSpec("j"), scripted.target)
    s.recovered("r0")
    s.report([_record("r1")])
    s.recovered("r1")
    s.close(True)
    report = [r for m, r in scripted.calls if m == "ReportFailures"][0]
    flush = [r for m, r in scripted.calls if m == "FlushTask"][0]
    assert list(report.recovered_record_ids) == ["r0"]
    assert list(flush.recovered_record_ids) == ["r1"]


def test_a_failed_partition_does_not_flush(scripted):
    s = _session(JobSpec("j"), scripted.target)
    s.report([_record()])
    s.close(False, ValueError("task failed"))
    assert scripted.methods() == ["RegisterJob", "ReportFailures"]


def test_unreachable_sidecar_fails_by_default(unreachable):
    dead = unreachable
    s = _session(JobSpec("j"), dead)
    with pytest.raises(SidecarUnavailableError, match=dead):
        s.report([_record()])


def test_wait_mode_rides_out_a_sidecar_restart():
    servicer = Scripted()
    started = {}
    with reserved_port() as port:   # no other process of a parallel run is given it meanwhile

        def start_later():
            time.sleep(1.0)
            started["server"] = serve_servicer(servicer, port=port)[0]

        threading.Thread(target=start_later, daemon=True).start()
        s = _session(JobSpec("j", on_sidecar_unavailable="wait", sidecar_wait_s=30),
                     f"127.0.0.1:{port}")
        try:
            assert [v.action for v in s.report([_record()])] == [pb.ACTION_SKIP]
        finally:
            started["server"].stop(0)
    assert servicer.methods() == ["RegisterJob", "ReportFailures"]


def test_backpressure_is_waited_out_then_bounded(scripted):
    sleeps = []
    scripted.fail["ReportFailures"] = [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    s = _session(JobSpec("j"), scripted.target, sleep=sleeps.append)
    assert len(s.report([_record()])) == 1
    assert sleeps == [0.1, 0.2]
    scripted.fail["ReportFailures"] = [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    s = _session(JobSpec("j", sidecar_wait_s=0), scripted.target, sleep=sleeps.append)
    with pytest.raises(SidecarBackpressureError):
        s.report([_record()])


def test_sidecar_address_precedence(monkeypatch):
    spec = JobSpec("j", sidecar="10.0.0.1:7000")
    assert spec.executor_target() == "10.0.0.1:7000"
    assert spec.driver_target() == "10.0.0.1:7000"
    monkeypatch.setenv("SPILLWAY_SIDECAR_ADDRESS", "unix:///run/spillway.sock")
    assert spec.executor_target() == "unix:///run/spillway.sock"  # the node's own sidecar
    assert spec.driver_target() == "10.0.0.1:7000"                # explicit on the driver
    assert JobSpec("j").driver_target() == "unix:///run/spillway.sock"
    monkeypatch.setenv("MY_SIDECAR", "10.9.9.9:1")
    assert JobSpec("j", address_env="MY_SIDECAR").executor_target() == "10.9.9.9:1"
    monkeypatch.delenv("SPILLWAY_SIDECAR_ADDRESS")
    assert JobSpec("j").executor_target() == "127.0.0.1:50051"


@pytest.mark.parametrize("kwargs, field", [
    ({"name": " "}, "name"),
    ({"on_sidecar_unavailable": "drop"}, "on_sidecar_unavailable"),
    ({"flush_timeout_s": 0}, "flush_timeout_s"),
    ({"report_batch_size": 0}, "report_batch_size"),
    ({"report_max_bytes": 0}, "report_max_bytes"),
    ({"sidecar": "nohost"}, "sidecar: expected host:port"),
])
def test_bad_job_settings_are_refused_naming_the_setting(kwargs, field):
    with pytest.raises(ValueError, match=field):
        JobSpec(**{"name": "j", **kwargs})


def test_task_identity_off_spark():
    task = _taskinfo.current_task(partition_fallback=3)
    assert (task.partition_id, task.executor_id) == (3, "driver") and task.host


def test_parked_counts_of_a_reporting_session_keep_what_its_slot_held(scripted):
    """A UDF's session ends without a final flush: its slot must keep the counts it already
    sent plus the unsent ones (the sidecar replaces a task's counts with the latest)."""
    spec = JobSpec("j", counts_interval_s=0)
    s = _session(spec, scripted.target)
    s.processed([T], 50)
    s.report([_record()])
    s.flush()
    s.processed([T], 10)
    s.park_counts()
    assert scripted.flushed(-2) == {(pb.STAGE_TRANSFORMATION, ""): 50}
    assert scripted.flushed(-1) == {(pb.STAGE_TRANSFORMATION, ""): 60}


def test_only_parked_counts_of_the_sessions_own_stages_are_adopted(scripted):
    """Wrappers pipelined in one Spark task flush under the same task identity: each flush
    carries only its own stages, so none overwrites the other's counts."""
    spec = JobSpec("j", counts_interval_s=3600)
    clean = _session(spec, scripted.target, partition=0)
    clean.processed([T], 30)
    clean.park_counts()  # parked, as a UDF's counts are (not due for an hour)
    sink = StageRef.of("SINK")
    s = TaskSession(spec, WrapperSpec("sink", sink, "app.write"), task=_task(1),
                    client=SidecarClient(scripted.target, timeout_s=5))
    s.processed([sink], 8)
    s.report([_record()])
    s.close(True)
    assert scripted.flushed() == {(pb.STAGE_SINK, ""): 8}
    assert _runtime.worker().counts[(scripted.target, "j", "")] == {T.key: 30}


def test_report_max_inflight_is_checked_on_the_driver():
    assert JobSpec("j").report_max_inflight == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="report_max_inflight"):
            JobSpec("j", report_max_inflight=bad)
