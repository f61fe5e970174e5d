"""Job runs and their lifecycle on real sidecars (and a real local Spark session): a run is a
run, a closed or abandoned run is gone everywhere, the live-run bound holds, and status pages
stay readable by a default gRPC client whatever the number of runs."""

from __future__ import annotations

import os
import sys
import time
import uuid

import grpc
import pytest
from pyspark import cloudpickle
from spillway.client import JobLimitError, SidecarClient
from spillway.spark import Job
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support.creds import admin_client, admin_md

pytestmark = pytest.mark.integration

cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROPS = {"errors.tolerance": "all", "errors.retry.timeout": "30000",
         "errors.retry.initial.backoff.ms": "20", "errors.circuit.enable": "false"}
TASK = pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=1)



@pytest.fixture(scope="module")
def sidecar_props():
    # the home (this module's `sidecar`) ends runs on node sidecars of this host: it may dial them
    return {"home.allowed.addresses": "127.0.0.0/8"}

def _start(tmp_path, **props):
    from spillway.sidecar.server import start_server

    return start_server({"listen.address": "127.0.0.1:0", "telemetry.enable": "false",
                         "home.allowed.addresses": "127.0.0.0/8",
                         "spool.dir": str(tmp_path / f"spool-{uuid.uuid4().hex[:6]}"),
                         **{k.replace("_", "."): v for k, v in props.items()}})


def _wait(predicate, what, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not seen within {timeout_s} s: {what}"
        time.sleep(0.05)


# --- a run is a run, through Spark ---------------------------------------------------------------


def day_one(x):
    if x == 3:
        raise ValueError(f"bad row {x}")  # a data error: skipped
    return x


def make_day_two(marker):
    def day_two(x):
        if x == 3 and not os.path.exists(marker):
            open(marker, "w").close()
            raise TimeoutError("dependency timed out")  # transient: must be retried
        return x
    return day_two


def test_the_same_job_name_twice_is_two_runs_and_yesterdays_ids_decide_nothing(
        spark, sidecar, tmp_path):
    """Yesterday's run skipped positional record p0:r3 as a data error. Today's run of the same
    job fails at the same position with a transient error: it is retried, not skipped."""
    name = f"daily-{uuid.uuid4().hex[:8]}"
    rdd = spark.sparkContext.parallelize(range(6), 1)
    with Job(name, {**PROPS, "errors.tolerance.max.errors": "1"}, sidecar=sidecar.address,
             run_id="day-1") as day1:
        assert sorted(day1.map_partitions(rdd, day_one).collect()) == [0, 1, 2, 4, 5]
    assert day1.report.total_records_skipped == 1 and day1.report.total_record_errors == 1

    # the same job, the same policy, the next day: fresh ids, fresh tolerance
    with Job(name, {**PROPS, "errors.tolerance.max.errors": "1"}, sidecar=sidecar.address,
             run_id="day-2") as day2:
        out = day2.map_partitions(rdd, make_day_two(str(tmp_path / "failed-once")))
        assert sorted(out.collect()) == list(range(6))  # retried, not skipped: nothing lost
        summary = day2.summary()
    assert (summary.total_retries, summary.total_records_skipped, summary.failed) == (1, 0, False)
    assert day2.report.run_id == "day-2" and day2.report.total_retries == 1
    # and a later run may change the policy
    with Job(name, {"errors.tolerance": "none"}, sidecar=sidecar.address, run_id="day-3") as day3:
        assert day3.effective_properties["errors.tolerance"] == "none"


def test_close_ends_the_run_at_its_home_and_on_the_node_sidecar(spark, sidecar, tmp_path):
    other = _start(tmp_path)  # the executors' node sidecar (another "node")
    env = spark.sparkContext.environment
    try:
        env["SPILLWAY_SIDECAR_ADDRESS"] = other.address
        job = Job(f"close-{uuid.uuid4().hex[:8]}", PROPS, sidecar=sidecar.address)
        with job:
            rdd = spark.sparkContext.parallelize(range(4), 1)
            assert sorted(job.map_partitions(rdd, lambda x: 1 // (x - 2)).collect()) == [
                -1, -1, 1]
            assert other.sidecar.registry.get(job.name, job.run_id) is not None
            assert sidecar.sidecar.registry.get(job.name, job.run_id) is not None
    finally:
        del env["SPILLWAY_SIDECAR_ADDRESS"]
        stop = other.stop
    try:
        report = job.report
        assert report is not None and not report.unreachable
        assert len(report.per_sidecar) == 2  # the home's summary, then the node's
        assert report.total_record_failures == 1 and report.records_processed == 4
        for s in (sidecar.sidecar, other.sidecar):
            assert s.registry.get(job.name, job.run_id) is None
            assert job.name not in {s.engine.summary(k).job for k in s.engine.jobs()}
        assert job.summary() is report  # a closed job keeps its final counts
    finally:
        stop(0.5)


# --- lifecycle bounds -------------------------------------------------------------------------


def test_an_abandoned_run_ends_on_its_idle_timeout(tmp_path, caplog):
    running = _start(tmp_path, job_idle_timeout_ms="1000")
    try:
        client = admin_client(running.address)   # status of every run: the operator
        run = client.register_job("abandoned", PROPS, run_id="gone-driver")
        client.report_failures(run, TASK, [pb.FailedRecord(
            record_id="r1", stage=pb.STAGE_TRANSFORMATION,
            exception=pb.ExceptionInfo(class_name="builtins.ValueError"))])
        with caplog.at_level("INFO", logger="spillway.sidecar"):
            _wait(lambda: client.status().counters["jobs-expired"] == 1, "the run expired")
            # the reaper logs once the run is released, a moment after the count moved
            _wait(lambda: any("expired" in r.getMessage() and "abandoned" in r.getMessage()
                              for r in caplog.records), "the expiry logged")
        status = client.status()
        assert status.jobs_total == 0 and status.counters["jobs"] == 0
        assert len(running.sidecar.engine.jobs()) == 0 and len(running.sidecar.registry) == 0
        # the executor of a run that expired registers it again (same token) and goes on
        again = client.register_job(run, PROPS)
        assert again.job_token == run.job_token
        assert client.job_summary(run).total_record_failures == 0
    finally:
        running.stop(0.5)


def test_the_live_run_bound_answers_resource_exhausted_naming_the_property(tmp_path):
    running = _start(tmp_path, jobs_max_live="2")
    try:
        client = SidecarClient(running.address)
        a = client.register_job("bounded", PROPS, run_id="r1")
        client.register_job("bounded", PROPS, run_id="r2")
        with pytest.raises(JobLimitError, match="jobs.max.live=2") as err:
            client.register_job("bounded", PROPS, run_id="r3")
        assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.register_job(a, PROPS).run_id == "r1"  # a live run re-registers
        client.end_job(a)
        assert client.register_job("bounded", PROPS, run_id="r3").run_id == "r3"
        assert client.health() == "SERVING"
    finally:
        running.stop(0.5)


def test_status_pages_through_every_run_and_each_page_fits_a_default_client(tmp_path):
    running = _start(tmp_path)
    try:
        client = admin_client(running.address)   # status of every run: the operator
        long_class = "x" * 900
        n = 640  # ~5.5 KB each in a status page even bounded: more than 3 MiB in all
        for i in range(n):
            run = client.register_job(f"{'long-name-' * 19}{i:04d}", PROPS, run_id=f"run-{i}")
            # many distinct, long exception classes: the summaries' breakdowns are large
            client.report_failures(run, TASK, [pb.FailedRecord(
                record_id=f"r{k}", stage=pb.STAGE_TRANSFORMATION,
                exception=pb.ExceptionInfo(class_name=f"{long_class}.E{k}", message="m" * 200))
                for k in range(30)])
        # a client with gRPC's default 4 MiB receive limit reads every page
        with grpc.insecure_channel(running.address) as ch:
            stub = pb_grpc.ErrorSidecarStub(ch)
            seen, token, pages = [], "", 0
            while True:
                page = stub.GetStatus(pb.GetStatusRequest(page_size=1000, page_token=token),
                                      timeout=30, metadata=admin_md())
                assert page.ByteSize() < 4 * 1024 * 1024 and page.jobs_total == n
                assert all(len(j.by_exception_class) <= 21 for j in page.jobs)
                seen += [(j.job, j.run_id) for j in page.jobs]
                pages += 1
                token = page.next_page_token
                if not token:
                    break
        assert pages > 1 and len(seen) == len(set(seen)) == n
        # the default page size, and the filter by job
        first = client.status()
        assert len(first.jobs) == 100 and first.next_page_token
        assert len(list(client.runs())) == n
        only = client.status(f"{'long-name-' * 19}0007")
        assert [j.run_id for j in only.jobs] == ["run-7"] and only.jobs_total == 1
        with pytest.raises(Exception, match="page_token"):
            client.status(page_token="not-a-token")
    finally:
        running.stop(0.5)


def test_ten_thousand_runs_registered_and_ended_leave_nothing_behind(tmp_path):
    """Through the sidecar's own flows (no network: 20,000 calls), counted, not timed."""
    from spillway.sidecar.service.values import Registration, Report
    from spillway.sidecar.transport.security import Caller

    running = _start(tmp_path)
    sc = running.sidecar
    app = Caller(authenticated=True, identity="app")
    try:
        for i in range(10_000):
            reg = sc.register_job(Registration(job="soak", run_id=f"run-{i}", properties=PROPS),
                                  token=None, caller=app, timeout_s=10)
            sc.report(Report(job="soak", run_id=f"run-{i}", task=None, records=[]),
                      timeout_s=10, token=reg.job_token, caller=app)
            ended = sc.end_job("soak", f"run-{i}", token=reg.job_token, caller=app,
                               timeout_s=10)
            assert (len(ended.summaries) == 1
                    and ended.summaries[0].summary.run_id == f"run-{i}")
        assert sc.engine.jobs() == [] and len(sc.registry) == 0
        counters = sc.sidewide_counters()
        assert (counters["jobs"], counters["jobs-ended"]) == (0, 10_000)
    finally:
        running.stop(0.5)
