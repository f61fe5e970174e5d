"""Health that tells the truth, against `spillway serve` as its own process and a frozen broker
(SIGSTOP of the Tansu process):

- reports refused for backpressure turn ``""`` and ``spillway.v1.ErrorSidecar`` NOT_SERVING,
  also when the refused reports are large next to the spool (refused while it holds less than
  the low-water mark: health said SERVING before), and SERVING again once they fit;
- a report larger than the whole spool is FAILED_PRECONDITION naming ``spool.max.bytes`` (not
  RESOURCE_EXHAUSTED "retry later"), leaves health alone, and the client splits it;
- SIGTERM ends the process within ``shutdown.grace.ms`` whatever Kafka does (it took the grace
  twice over: 20.1 s for 10 s; a call stuck on Kafka held it 14.1 s for 3 s), leaving what
  Kafka did not acknowledge in the durable spool.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import grpc
import pytest
from spillway.client import SidecarClient
from spillway.client.errors import SidecarBackpressureError, SpillwayClientError
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support import serve
from support.kafka import read_all

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TASK = pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=1)
SERVICES = ("", "spillway.v1.ErrorSidecar")


def _records(prefix, n, size):
    return [pb.FailedRecord(
        record_id=f"{prefix}-{i}", stage=pb.STAGE_TRANSFORMATION, function_name="app.f",
        key=f"{prefix}-{i}".encode(), value=os.urandom(size),
        exception=pb.ExceptionInfo(class_name="builtins.ValueError",
                                   class_chain=["builtins.ValueError"])) for i in range(n)]


def _spawn(broker, tmp_path, *props, spool="spool"):
    args = ["--listen", "127.0.0.1:0", "--bootstrap-servers", broker.bootstrap_servers,
            "--set", f"spool.dir={tmp_path / spool}", "--set", "producer.linger.ms=5"]
    for p in props:
        args += ["--set", p]
    return serve.spawn(args, stderr=subprocess.PIPE)


def _register(client, topic):
    return client.register_job("health-truth", {
        "errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
        "errors.deadletterqueue.auto.create.topics.enable": "true",
        "errors.deadletterqueue.topic.replication.factor": "1"})


def _wait_health(client, status, timeout_s=20.0, probe=None):
    """Both services at `status` (the sidecar's health watch runs every 0.25 s), on the main
    port and on the plaintext probe port (`probe`: a client of health.listen.address)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = {s: client.health(s) for s in SERVICES}
        if probe is not None:
            now.update({f"probe:{s}": probe.health(s) for s in SERVICES})
        if set(now.values()) == {status}:
            return
        assert time.monotonic() < deadline, f"health {now}, expected {status}"
        time.sleep(0.1)


def _report_as_the_runtime_does(client, run, records, timeout_s=60.0):
    """spark/_runtime.py's loop: backpressure is waited out, the client splits what is too
    large for the spool."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.report_failures(run, TASK, records)
        except SidecarBackpressureError:
            assert time.monotonic() < deadline, "backpressure never ended"
            time.sleep(0.2)


def _keys(broker, topic):
    return sorted(m.key().decode() for m in read_all(broker.bootstrap_servers, topic))


def test_refused_reports_turn_health_not_serving_until_they_fit(broker, tmp_path, topic_name):
    # the setting: spool.max.bytes 300 KB, batches of 20 records of 5 KB (~120 KB each
    # with the DLQ context): the third is refused while the spool holds ~67 % (< 80 %)
    from support.ports import free_port

    probe_address = f"127.0.0.1:{free_port()}"
    proc, address = _spawn(broker, tmp_path, "spool.max.bytes=300000",
                           f"health.listen.address={probe_address}")
    client = SidecarClient(address, timeout_s=10)
    probe = SidecarClient(probe_address, timeout_s=10)  # what the kubelet's readiness probe asks
    try:
        run = _register(client, topic_name)
        _wait_health(client, "SERVING", probe=probe)
        broker.pause()
        try:
            for name in ("a", "b"):
                assert all(v.dead_lettered for v in client.report_failures(
                    run, TASK, _records(name, 20, 5000)))
            with pytest.raises(SidecarBackpressureError, match="spool.max.bytes=300000"):
                client.report_failures(run, TASK, _records("c", 20, 5000))
            _wait_health(client, "NOT_SERVING", probe=probe)
            assert probe.health("spillway.liveness") == "SERVING"  # not restarted for it
            # what health says holds: a small report is refused too, until the spool drains
            with pytest.raises(SidecarBackpressureError, match="spool.low.water.percent"):
                client.report_failures(run, TASK, _records("d", 1, 10))
            assert client.health() == "NOT_SERVING"
            assert client.status().counters["backpressure"] == 1
        finally:
            broker.resume()
        _wait_health(client, "SERVING", timeout_s=90, probe=probe)
        # SERVING again: the refused report is admitted now
        assert all(v.dead_lettered for v in client.report_failures(
            run, TASK, _records("c", 20, 5000)))
        assert client.flush_task(run, TASK, {}, timeout_s=60) == 60
        assert _keys(broker, topic_name) == sorted(
            f"{p}-{i}" for p in "abc" for i in range(20))
    finally:
        broker.resume()
        client.close()
        probe.close()
        serve.stop(proc)


def test_a_report_larger_than_the_spool_is_a_failed_precondition_and_is_split(
        broker, tmp_path, topic_name):
    proc, address = _spawn(broker, tmp_path, "spool.max.bytes=200000")
    client = SidecarClient(address, timeout_s=10)
    try:
        run = _register(client, topic_name)
        records = _records("big", 60, 5000)  # ~360 KB with the DLQ context: never fits
        with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as err:
            pb_grpc.ErrorSidecarStub(ch).ReportFailures(
                pb.ReportFailuresRequest(job=run.job, run_id=run.run_id, task=TASK,
                                         records=records),
                metadata=run.metadata(), timeout=10)
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "spool.max.bytes=200000" in err.value.details()
        assert "Split it into smaller reports" in err.value.details()
        # not backpressure: nothing refused, nothing decided, health untouched
        counters = client.status().counters
        assert (counters["backpressure"], counters["records-refused"]) == (0, 0)
        assert client.job_summary(run).total_record_failures == 0
        assert client.health() == client.health("spillway.v1.ErrorSidecar") == "SERVING"

        verdicts = _report_as_the_runtime_does(client, run, records)
        assert [v.record_id for v in verdicts] == [r.record_id for r in records]
        assert all(v.action == pb.ACTION_SKIP and v.dead_lettered for v in verdicts)
        client.flush_task(run, TASK, {}, timeout_s=60)
        assert _keys(broker, topic_name) == sorted(r.record_id for r in records)  # each once
        assert client.job_summary(run).total_records_skipped == 60

        # one record larger than the whole spool cannot be split: a clear error naming it
        with pytest.raises(SpillwayClientError, match=r"record 'huge-0' alone.*spool\.max\.bytes"):
            client.report_failures(run, TASK, _records("huge", 1, 250_000))
    finally:
        client.close()
        serve.stop(proc)


def test_sigterm_with_a_frozen_broker_stops_within_the_grace_and_keeps_the_spool(
        broker, tmp_path, topic_name):
    grace_s = 3.0
    proc, address = _spawn(broker, tmp_path, f"shutdown.grace.ms={int(grace_s * 1000)}")
    client = SidecarClient(address, timeout_s=10)
    flush_errors: list[Exception] = []

    def flush():  # in flight when SIGTERM comes: it holds the server for the whole grace
        try:
            client.flush_task(run, TASK, {}, timeout_s=120)
        except SpillwayClientError as exc:
            flush_errors.append(exc)

    try:
        run = _register(client, topic_name)
        broker.pause()
        try:
            assert all(v.dead_lettered for v in client.report_failures(
                run, TASK, _records("kept", 50, 100)))
            flusher = threading.Thread(target=flush, daemon=True)
            flusher.start()
            time.sleep(0.5)  # the FlushTask call reaches the sidecar and waits for Kafka
            proc.terminate()
            try:
                # the deadline Kubernetes enforces with SIGKILL: it took 2x the grace before
                proc.wait(timeout=grace_s + 1.0)
            except subprocess.TimeoutExpired:
                pytest.fail(f"spillway serve did not stop within shutdown.grace.ms "
                            f"({grace_s} s, +1 s of slack)")
            stderr = proc.stderr.read()
            assert proc.returncode == 0, stderr[-2000:]
            assert "50 records not yet acknowledged by Kafka" in stderr, stderr[-2000:]
            flusher.join(30)
            assert flush_errors  # the in-flight flush was not answered as if it succeeded
        finally:
            broker.resume()
        # the spool is durable: the next start delivers what the stopped sidecar held
        proc, address = _spawn(broker, tmp_path)
        keys = []
        deadline = time.monotonic() + 90
        while len(keys) < 50 and time.monotonic() < deadline:
            keys = _keys(broker, topic_name)
        assert keys == sorted(f"kept-{i}" for i in range(50))
    finally:
        broker.resume()
        client.close()
        serve.stop(proc)


def test_sigterm_leaves_a_call_stuck_on_a_frozen_kafka_behind(broker, tmp_path):
    """A RegisterJob whose DLQ topic check waits on the frozen broker (its own timeout is
    longer than the grace) must not hold the process past the grace: it was 14.1 s for 3 s."""
    grace_s = 3.0
    proc, address = _spawn(broker, tmp_path, f"shutdown.grace.ms={int(grace_s * 1000)}")
    client = SidecarClient(address, timeout_s=120)
    errors: list[Exception] = []

    def register():
        try:
            _register(client, "dlq.never-checked")
        except SpillwayClientError as exc:
            errors.append(exc)

    try:
        broker.pause()
        caller = threading.Thread(target=register, daemon=True)
        caller.start()
        time.sleep(1.0)  # the call is in the sidecar, waiting on Kafka
        proc.terminate()
        try:
            proc.wait(timeout=grace_s + 1.0)
        except subprocess.TimeoutExpired:
            pytest.fail(f"spillway serve outlived shutdown.grace.ms ({grace_s} s, +1 s of slack)")
        stderr = proc.stderr.read()
        assert proc.returncode == 0, stderr[-2000:]
        assert "exiting without waiting for threads still running" in stderr, stderr[-2000:]
        caller.join(30)
        assert errors  # the caller was told, not left hanging
    finally:
        broker.resume()
        client.close()
        serve.stop(proc)
