"""Spool full: backpressure reaches the executor's client as a clear error, health turns
NOT_SERVING, and nothing the sidecar accepted is lost once Kafka is back."""

from __future__ import annotations

import time

import pytest
from grpc_health.v1 import health_pb2

from spillway.client import SidecarClient
from spillway.client.errors import SidecarBackpressureError
from spillway.v1 import sidecar_pb2 as pb
from support import rpc
from support.kafka import read_all

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _records(prefix, n):
    return [pb.FailedRecord(
        record_id=f"{prefix}-{i}", stage=pb.STAGE_TRANSFORMATION, function_name="app.f",
        key=f"{prefix}-{i}".encode(), value=b"bad",
        exception=pb.ExceptionInfo(class_name="builtins.ValueError",
                                   class_chain=["builtins.ValueError"])) for i in range(n)]


def _wait_health(address, status, timeout_s=15):
    deadline = time.monotonic() + timeout_s
    while rpc.health_at(address) != status:
        assert time.monotonic() < deadline, f"health never became {status}"
        time.sleep(0.1)


def test_full_spool_pushes_back_and_loses_nothing(broker, tmp_path, topic_name):
    from spillway.sidecar.server import start_server

    running = start_server({"listen.address": "127.0.0.1:0",
                            "bootstrap.servers": broker.bootstrap_servers,
                            "spool.dir": str(tmp_path / "spool"), "spool.max.records": "5",
                            "producer.linger.ms": "5"})
    client = SidecarClient(running.address, timeout_s=10)
    try:
        run = client.register_job("bp", {
            "errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic_name,
            "errors.deadletterqueue.auto.create.topics.enable": "true",
            "errors.deadletterqueue.topic.replication.factor": "1"})
        task = pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=1)
        broker.pause()  # an outage: nothing drains
        try:
            accepted = client.report_failures(run, task, _records("a", 5))
            assert all(v.dead_lettered for v in accepted)
            with pytest.raises(SidecarBackpressureError) as err:
                client.report_failures(run, task, _records("b", 3))
            assert "spool" in str(err.value)
            # refused before anything was decided: the policy's counts are those of the 5
            summary = client.job_summary(run)
            assert summary.total_records_skipped == 5
            assert summary.total_record_failures == 5
            assert summary.records_refused == 3
            _wait_health(running.address, health_pb2.HealthCheckResponse.NOT_SERVING)
            # refusing until the spool is below its low-water mark: even one record is refused
            with pytest.raises(SidecarBackpressureError):
                client.report_failures(run, task, _records("c", 1))
            assert client.job_summary(run).total_records_skipped == 5
            counters = client.status().counters
            assert counters["records-refused"] == 4 and counters["backpressure"] == 1
        finally:
            broker.resume()
        _wait_health(running.address, health_pb2.HealthCheckResponse.SERVING, timeout_s=60)
        assert client.flush_task(run, task, {}, timeout_s=60) == 5
        keys = sorted(m.key() for m in read_all(broker.bootstrap_servers, topic_name))
        assert keys == [f"a-{i}".encode() for i in range(5)]  # accepted = delivered, no more
        # the refused report can simply be sent again now
        again = client.report_failures(run, task, _records("b", 3))
        assert all(v.dead_lettered for v in again)
        summary = client.job_summary(run)
        assert (summary.total_records_skipped, summary.records_refused) == (8, 4)
    finally:
        client.close()
        running.stop(1.0)
