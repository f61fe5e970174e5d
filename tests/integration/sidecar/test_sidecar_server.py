"""The sidecar's gRPC surface, served for real, writing to a real Tansu broker.

Driven through the generated stub (not spillway.client) so the contract itself is under test.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support import rpc
from support.kafka import read_all

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stub(sidecar):
    channel = grpc.insecure_channel(sidecar.address)
    yield pb_grpc.ErrorSidecarStub(channel)
    channel.close()


def _task(partition=0, attempt=0, tid=1):
    return pb.TaskIdentity(stage_id=3, partition_id=partition, attempt_number=attempt,
                           task_attempt_id=tid, executor_id="1", host="node-a")


def _record(i, cls="json.decoder.JSONDecodeError", chain=None, topic="orders"):
    chain = chain or [cls, "builtins.ValueError", "builtins.Exception", "builtins.BaseException"]
    return pb.FailedRecord(
        record_id=f"{topic}/0/{i}", stage=pb.STAGE_TRANSFORMATION, function_name="app.parse",
        source=pb.SourceCoordinates(topic=topic, partition=0, offset=i),
        key=b"k%d" % i, value=b"{bad", headers=[pb.Header(key="h", value=b"v")],
        exception=pb.ExceptionInfo(class_name=cls, class_chain=chain, message="boom",
                                   stack_trace="Traceback (most recent call last):\n  ..."),
        attempt=1,
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )


RUN = "app-20261123000000-0001"


def _register(stub, job, topic, token=None, **extra):
    props = {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
             "errors.deadletterqueue.context.headers.enable": "true",
             "errors.deadletterqueue.auto.create.topics.enable": "true",
             "errors.deadletterqueue.topic.replication.factor": "1", **extra}
    return stub.RegisterJob(pb.RegisterJobRequest(job=job, properties=props, run_id=RUN),
                            timeout=20,
                            metadata=[("spillway-job-token", token)] if token else None)


def test_health_is_serving(sidecar):
    with grpc.insecure_channel(sidecar.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="spillway.v1.ErrorSidecar"), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_poison_records_are_dead_lettered_and_flush_waits_for_kafka(stub, broker, topic_name):
    reg = _register(stub, "job-poison", topic_name)
    assert reg.run_id == RUN and reg.job_token and reg.home_instance_id
    resp = _register(stub, "job-poison", topic_name, token=reg.job_token)
    assert resp.effective_properties["errors.tolerance"] == "all"
    assert resp.job_token == reg.job_token
    task = _task()
    out = stub.ReportFailures(pb.ReportFailuresRequest(
        job="job-poison", run_id=RUN, task=task, records=[_record(i) for i in range(5)]),
        timeout=10, metadata=rpc.md(reg.job_token))
    assert [v.action for v in out.verdicts] == [pb.ACTION_SKIP] * 5
    assert all(v.dead_lettered and v.category == pb.CATEGORY_DATA and v.reason
               for v in out.verdicts)
    flushed = stub.FlushTask(pb.FlushTaskRequest(job="job-poison", run_id=RUN, task=task),
                             timeout=20, metadata=rpc.md(reg.job_token))
    assert flushed.dlq_records_acknowledged == 5

    records = read_all(broker.bootstrap_servers, topic_name)
    assert sorted(m.key() for m in records) == [b"k%d" % i for i in range(5)]
    h = dict(records[0].headers())
    assert h["h"] == b"v"
    assert h["__connect.errors.connector.name"] == b"job-poison"
    assert h["__connect.errors.stage"] == b"TRANSFORMATION"
    assert h["__connect.errors.task.id"] == b"3.0"
    assert h["traceparent"] == b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    summary = stub.GetJobSummary(pb.GetJobSummaryRequest(job="job-poison", run_id=RUN),
                                 timeout=5, metadata=rpc.md(reg.job_token))
    assert summary.dlq_records_written == 5 and summary.total_records_skipped == 5


def test_retriable_error_gets_retry_with_delay(stub, topic_name):
    reg = _register(stub, "job-retry", topic_name, **{"errors.retry.timeout": "10000"})
    rec = _record(1, cls="builtins.ConnectionError",
                  chain=["builtins.ConnectionError", "builtins.OSError", "builtins.Exception",
                         "builtins.BaseException"])
    out = stub.ReportFailures(pb.ReportFailuresRequest(job="job-retry", run_id=RUN, task=_task(),
                                                       records=[rec]), timeout=10,
                              metadata=rpc.md(reg.job_token))
    v = out.verdicts[0]
    assert v.action == pb.ACTION_RETRY and v.category == pb.CATEGORY_RETRIABLE
    assert 300 <= v.retry_delay_ms <= 10000


def test_tolerance_none_fails_the_job(stub, topic_name):
    reg = _register(stub, "job-none", topic_name, **{"errors.tolerance": "none"})
    out = stub.ReportFailures(pb.ReportFailuresRequest(job="job-none", run_id=RUN, task=_task(),
                                                       records=[_record(1)]), timeout=10,
                              metadata=rpc.md(reg.job_token))
    v = out.verdicts[0]
    assert v.action == pb.ACTION_FAIL and v.job_failed
    assert "TRANSFORMATION" in v.reason or "tolerance" in v.reason


def test_invalid_policy_is_refused_naming_the_property(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterJob(pb.RegisterJobRequest(
            job="bad", run_id=RUN, properties={"errors.retry.jitter.factor": "2"}), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "errors.retry.jitter.factor" in err.value.details()


def test_dlq_topic_guardrails_are_enforced_at_registration(stub):
    for topic in ("__consumer_offsets", "payments"):
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterJob(pb.RegisterJobRequest(
                job="guard", run_id=RUN,
                properties={"errors.deadletterqueue.topic.name": topic}), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "errors.deadletterqueue.topic.name" in err.value.details()


def test_unknown_job_and_malformed_records_are_clear_errors(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.ReportFailures(pb.ReportFailuresRequest(job="nope", run_id=RUN, task=_task(),
                                                     records=[_record(1)]), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.value.details()
    bad = _record(1)
    bad.record_id = ""
    with pytest.raises(grpc.RpcError) as err:
        stub.ReportFailures(pb.ReportFailuresRequest(job="nope", task=_task(), records=[bad]),
                            timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "records[0].record_id" in err.value.details()


def test_status_lists_jobs_and_counters(stub):
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
    assert status.sidecar_id and status.version
    assert "total-record-failures" in status.counters
