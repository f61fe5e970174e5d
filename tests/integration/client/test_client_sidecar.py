"""spillway.client against the real sidecar servicer, with a real Tansu broker behind its DLQ."""

from __future__ import annotations

import uuid

import grpc
import pytest
from spillway.client import (
    JobRun,
    InvalidPolicyError,
    JobConflictError,
    JobNotRegisteredError,
    SidecarClient,
    ToleranceExceededError,
    error_for_verdict,
    report,
)
from spillway.v1 import sidecar_pb2 as pb
from support.kafka import read_all

pytestmark = pytest.mark.integration


@pytest.fixture
def client(sidecar):
    return SidecarClient(sidecar.address, timeout_s=20)


def _job():
    return f"client-{uuid.uuid4().hex[:8]}"


TASK = pb.TaskIdentity(stage_id=1, partition_id=0, attempt_number=0, task_attempt_id=11,
                       executor_id="1", host="node-a")


def _poison(i: int) -> pb.FailedRecord:
    try:
        raise ValueError(f"bad record {i}")
    except ValueError as exc:
        return report.failed_record(f"orders/0/{i}", "TRANSFORMATION", exc,
                                    function_name="app.parse", source=("orders", 0, i),
                                    key=b"k%d" % i, value=b"{bad", headers=[("h", b"v")])


def test_register_is_idempotent_and_refusals_are_typed(client):
    job = _job()
    props = {"errors.tolerance": "all"}
    run = client.register_job(job, props)
    assert run["errors.tolerance"] == "all" and run.run_id and run.job_token
    again = client.register_job(run, props)  # the same run, with its token
    assert again["errors.tolerance"] == "all" and again.job_token == run.job_token
    with pytest.raises(JobConflictError) as conflict:
        client.register_job(run, {"errors.tolerance": "none"})
    assert conflict.value.code is grpc.StatusCode.FAILED_PRECONDITION
    # another run of the same name may have another policy
    assert client.register_job(job, {"errors.tolerance": "none"})["errors.tolerance"] == "none"
    with pytest.raises(InvalidPolicyError, match="errors.tolerance"):
        client.register_job(_job(), {"errors.tolerance": "some"})
    with pytest.raises(JobNotRegisteredError):
        client.report_failures(JobRun(_job(), "run-1"), TASK, [_poison(0)])
    assert client.health() == "SERVING"
    assert client.status().sidecar_id


def test_poison_is_dead_lettered_and_the_flush_barrier_counts_the_acks(client, broker,
                                                                       topic_name):
    job = _job()
    run = client.register_job(job, {
        "errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic_name,
        "errors.deadletterqueue.auto.create.topics.enable": "true",
        "errors.deadletterqueue.topic.replication.factor": "1"})
    verdicts = client.report_failures(run, TASK, [_poison(i) for i in range(3)])
    assert [(v.action, v.dead_lettered) for v in verdicts] == [(pb.ACTION_SKIP, True)] * 3
    assert client.flush_task(run, TASK, {"TRANSFORMATION": 10}) == 3
    summary = client.job_summary(run)
    assert (summary.records_processed, summary.dlq_records_written) == (10, 3)
    assert sorted(m.key() for m in read_all(broker.bootstrap_servers, topic_name)) == [
        b"k0", b"k1", b"k2"]


def test_tolerance_exceeded_names_job_stage_limit_and_count(client):
    job = _job()
    run = client.register_job(job, {"errors.tolerance": "all", "errors.tolerance.max.errors": "1"})
    records = [_poison(i) for i in range(2)]
    v1, v2 = client.report_failures(run, TASK, records)
    assert v1.action == pb.ACTION_SKIP and v2.action == pb.ACTION_FAIL and v2.job_failed
    err = error_for_verdict(job, records[1], v2)
    assert isinstance(err, ToleranceExceededError)
    assert (err.limit, err.count) == ("errors.tolerance.max.errors=1", 2)
    for part in (job, "stage TRANSFORMATION", "builtins.ValueError", "orders/0/1"):
        assert part in str(err)


def test_retry_budget_deferral_is_flagged_on_the_verdict_and_counted_in_the_summary(client):
    job = _job()
    run = client.register_job(job, {"errors.tolerance": "all", "errors.retry.timeout": "-1",
                              "errors.retry.budget.ratio": "0",
                              "errors.retry.budget.min.retries": "2",
                              "errors.circuit.enable": "false"})

    def failure(i):
        try:
            raise ConnectionError("dependency down")
        except ConnectionError as exc:
            return report.failed_record(f"r{i}", "TRANSFORMATION", exc)

    verdicts = client.report_failures(run, TASK, [failure(i) for i in range(4)])
    assert [v.action for v in verdicts] == [pb.ACTION_RETRY] * 4          # deferred, not dropped
    assert [v.retry_budget_exhausted for v in verdicts] == [False, False, True, True]
    assert "retry budget exhausted" in verdicts[2].reason
    assert verdicts[3].retry_delay_ms > verdicts[2].retry_delay_ms >= 300
    assert client.job_summary(run).retry_budget_exhausted == 2


def test_status_store_kip_names_through_a_real_sidecar(client):
    """A shape knob alone, under the status-store KIP's own name, retries as that KIP says:
    max.retries 5 (then the handler), delays from initial.backoff.ms doubling, jitter <= 25 %."""
    job = _job()
    effective = client.register_job(job, {"errors.tolerance": "all",
                                          "status.storage.retry.initial.backoff.ms": "100",
                                          "errors.circuit.enable": "false"})
    assert effective["errors.retry.initial.backoff.ms"] == "100"

    def failure():
        try:
            raise TimeoutError("dependency timed out")
        except TimeoutError as exc:
            return report.failed_record("r1", "TRANSFORMATION", exc)

    verdicts = [client.report_failures(effective, TASK, [failure()])[0] for _ in range(6)]
    assert [v.action for v in verdicts] == [pb.ACTION_RETRY] * 5 + [pb.ACTION_SKIP]
    for n, v in enumerate(verdicts[:5]):
        assert 100 * 2 ** n <= v.retry_delay_ms <= 100 * 2 ** n * 1.25 + 1
    assert "errors.retry.max.retries=5 reached" in verdicts[5].reason

    with pytest.raises(InvalidPolicyError) as refused:
        client.register_job(_job(), {"status.storage.retry.max.retries": "4",
                                     "errors.retry.max.retries": "3"})
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "status.storage.retry.max.retries" in str(refused.value)
    assert "errors.retry.max.retries" in str(refused.value)


@pytest.mark.parametrize("fmt", ["connect", "dlq"])
def test_context_headers_on_a_real_dlq_record_keep_or_overwrite_originals_per_kip(
        client, broker, topic_name, fmt):
    """KIP-298 adds a __connect.errors.* header only if the record has none of that name (a
    record dead-lettered before keeps the topic it first failed in); KIP-1191's __dlq.errors.*
    headers overwrite same-named originals."""
    job = _job()
    run = client.register_job(job, {
        "errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic_name,
        "errors.deadletterqueue.auto.create.topics.enable": "true",
        "errors.deadletterqueue.topic.replication.factor": "1",
        "errors.deadletterqueue.context.headers.enable": "true",
        "errors.deadletterqueue.headers.format": fmt})
    p = f"__{'connect' if fmt == 'connect' else 'dlq'}.errors."
    try:
        raise ValueError("bad amount")
    except ValueError as exc:
        rec = report.failed_record("orders.retry/2/77", "TRANSFORMATION", exc,
                                   function_name="app.parse", source=("orders.retry", 2, 77),
                                   key=b"k", value=b"v",
                                   headers=[(p + "topic", b"orders"), (p + "offset", b"5"),
                                            ("h", b"x")])
    [v] = client.report_failures(run, TASK, [rec])
    assert v.dead_lettered
    assert client.flush_task(run, TASK, {"TRANSFORMATION": 1}) == 1
    [msg] = read_all(broker.bootstrap_servers, topic_name)
    headers = msg.headers()
    names = [n for n, _ in headers]
    assert len(names) == len(set(names)), names            # never two headers of one name
    h = dict(headers)
    assert h["h"] == b"x"
    assert h[p + "partition"] == b"2" and h[p + "stage"] == b"TRANSFORMATION"
    assert h[p + "task.id"] == b"1.0"                      # the Spark task: stage.partition
    if fmt == "connect":      # the originals are kept: where the record first failed
        assert (h[p + "topic"], h[p + "offset"]) == (b"orders", b"5")
    else:                     # overwritten with this failure's coordinates
        assert (h[p + "topic"], h[p + "offset"]) == (b"orders.retry", b"77")
