"""Counts that outlive a run, over a real gRPC server (log-only): GetStatus's totals and ended
runs after EndJob and idle expiry, who sees which ended run, the bound, the first page only.
The CLI and Prometheus against `spillway serve` and Kafka: tests/e2e/test_status_totals.py."""

from __future__ import annotations

import time

import grpc
import pytest

from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support.creds import admin_md

pytestmark = pytest.mark.integration

TASK = pb.TaskIdentity(stage_id=1, partition_id=0, attempt_number=0, task_attempt_id=1)


@pytest.fixture
def stub():
    from spillway.sidecar.server import start_server

    running = start_server({"listen.address": "127.0.0.1:0", "telemetry.enable": "false",
                            "status.ended.runs.max": "2", "job.idle.timeout.ms": "1000"})
    channel = grpc.insecure_channel(running.address)
    yield pb_grpc.ErrorSidecarStub(channel)
    channel.close()
    running.stop(1.0)


def _run(stub, job: str, errors: int, *, tolerance: str = "all") -> list[tuple[str, str]]:
    """A run with ``errors`` failed records; returns its job token's metadata."""
    reg = stub.RegisterJob(pb.RegisterJobRequest(
        job=job, run_id="run-1", properties={"errors.tolerance": tolerance}), timeout=10)
    md = [("spillway-job-token", reg.job_token)]
    records = [pb.FailedRecord(record_id=f"r{i}", stage=pb.STAGE_TRANSFORMATION, value=b"x",
                               exception=pb.ExceptionInfo(class_name="builtins.ValueError",
                                                          class_chain=["builtins.ValueError"]))
               for i in range(errors)]
    stub.ReportFailures(pb.ReportFailuresRequest(job=job, run_id="run-1", task=TASK,
                                                 records=records), timeout=10, metadata=md)
    return md


def _end(stub, job: str, md) -> None:
    stub.EndJob(pb.EndJobRequest(job=job, run_id="run-1"), timeout=10, metadata=md)


def test_ended_runs_keep_their_counts_and_only_who_could_see_them_sees_them(stub):
    a = _run(stub, "a", 3)
    _end(stub, "a", a)
    b = _run(stub, "b", 1, tolerance="none")     # fails on its first error
    _end(stub, "b", b)
    _run(stub, "live", 2)

    status = stub.GetStatus(pb.GetStatusRequest(), timeout=5, metadata=admin_md())
    assert status.counters["total-record-errors"] == 2            # the live run only
    t = status.totals
    assert t.total_record_errors == 3 + 1 + 2                     # every run
    assert t.total_records_skipped == 3 + 2
    assert dict(t.runs_ended) == {"completed": 1, "failed": 1, "expired": 0}
    assert t.since_ms > 0
    assert [(r.summary.job, r.outcome) for r in status.ended_runs] == [("b", "failed"),
                                                                        ("a", "completed")]
    a_run = status.ended_runs[1]
    assert a_run.summary.total_record_errors == 3 and a_run.summary.run_id == "run-1"
    assert 0 < a_run.started_ms <= a_run.ended_ms
    assert "errors.tolerance" in status.ended_runs[0].summary.failure_reason
    assert status.jobs_hidden == 0

    # anonymous (another local user): the totals, no run, and how many it does not see
    anon = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
    assert anon.totals.total_record_errors == 6
    assert list(anon.ended_runs) == [] and list(anon.jobs) == []
    assert anon.jobs_hidden == 1
    # the run's own job token: its own ended run, no other
    own = stub.GetStatus(pb.GetStatusRequest(), timeout=5, metadata=a)
    assert [r.summary.job for r in own.ended_runs] == ["a"]
    # a job filter applies to the ended runs too
    only_b = stub.GetStatus(pb.GetStatusRequest(job="b"), timeout=5, metadata=admin_md())
    assert [r.summary.job for r in only_b.ended_runs] == ["b"]
    assert only_b.jobs_hidden == 0 and list(only_b.jobs) == []


def test_the_kept_runs_are_bounded_and_the_totals_are_not(stub):
    for i in range(4):
        _end(stub, f"j{i}", _run(stub, f"j{i}", 1))
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=5, metadata=admin_md())
    assert [r.summary.job for r in status.ended_runs] == ["j3", "j2"]   # status.ended.runs.max=2
    assert status.totals.runs_ended["completed"] == 4
    assert status.totals.total_record_errors == 4


def test_ended_runs_come_on_the_first_page_only(stub):
    _end(stub, "gone", _run(stub, "gone", 1))
    for job in ("x", "y"):
        _run(stub, job, 1)
    first = stub.GetStatus(pb.GetStatusRequest(page_size=1), timeout=5, metadata=admin_md())
    assert [r.summary.job for r in first.ended_runs] == ["gone"] and first.next_page_token
    second = stub.GetStatus(pb.GetStatusRequest(page_size=1, page_token=first.next_page_token),
                            timeout=5, metadata=admin_md())
    assert list(second.ended_runs) == [] and [j.job for j in second.jobs] == ["y"]


def test_an_idle_run_that_expired_is_kept_as_expired(stub):
    _run(stub, "idle", 2)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=5, metadata=admin_md())
        if status.ended_runs:
            break
        time.sleep(0.2)
    assert [(r.summary.job, r.outcome) for r in status.ended_runs] == [("idle", "expired")]
    assert dict(status.totals.runs_ended)["expired"] == 1
    assert status.totals.total_record_errors == 2 and status.counters["jobs-expired"] == 1
