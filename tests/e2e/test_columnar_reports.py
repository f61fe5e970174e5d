"""Columnar reports against `spillway serve` as its own process and a real Tansu broker: the same
failures reported as columns and as FailedRecord messages give the same verdicts and the same
DLQ records; malformed columns are refused with INVALID_ARGUMENT naming the field and change
nothing; the exception of records failing alike crosses the wire once."""

from __future__ import annotations

import uuid

import grpc
import pytest
from spillway.client import SidecarClient, columns, report
from spillway.client.runs import JobRun
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support import serve
from support.kafka import read_all

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TASK = pb.TaskIdentity(stage_id=2, partition_id=1, attempt_number=0, task_attempt_id=11,
                       executor_id="3", host="worker-1")
# what differs between two runs' DLQ records of the same failures (a record reported without a
# trace context gets its decision's)
PER_RUN = {"spillway.run.id", "spillway.timestamp", "traceparent"}


@pytest.fixture(scope="module")
def sidecar_address(broker, tmp_path_factory):
    spool = tmp_path_factory.mktemp("columns")
    err = open(spool / "stderr.log", "w")
    proc, address = serve.spawn(
        ["--listen", "127.0.0.1:0", "--bootstrap-servers", broker.bootstrap_servers,
         "--set", f"spool.dir={spool}", "--set", "producer.linger.ms=5",
         "--set", "sidecar.id=columns"], stderr=err)
    yield address
    serve.stop(proc, 30)
    err.close()


def _props(topic: str) -> dict[str, str]:
    return {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
            "errors.deadletterqueue.context.headers.enable": "true",
            "errors.deadletterqueue.auto.create.topics.enable": "true",
            "errors.deadletterqueue.topic.replication.factor": "1",
            "errors.retry.timeout": "0"}


def _arguments() -> list[tuple[tuple, dict]]:
    out = []
    for i in range(40):
        try:
            if i % 5 == 4:
                raise KeyError(f"missing {i % 2}")
            raise ValueError("bad amount")
        except Exception as exc:  # noqa: BLE001 - the test's own failures
            kw = {"function_name": "etl.parse", "value": f"row {i}".encode(),
                  "timestamp_ms": 1_700_000_000_000 + i}
            if i % 3:
                kw.update(source=("orders", i % 4, 1000 + i), key=f"k{i}".encode(),
                          payload="source")
            if i % 7 == 0:
                kw["headers"] = [("origin", b"web"), ("empty", None)]
            out.append(((f"orders/{i}", "TRANSFORMATION", exc), kw))
    return out


def _dlq(bootstrap: str, topic: str, n: int) -> dict[str, tuple]:
    recs = read_all(bootstrap, topic)
    assert len(recs) == n
    out = {}
    for r in recs:   # the reason names the run's DLQ topic
        headers = tuple((k, v.replace(topic.encode(), b"TOPIC") if v else v)
                        for k, v in (r.headers() or []) if k not in PER_RUN)
        out[dict(headers)["spillway.record.id"].decode()] = (r.key(), r.value(), headers)
    return out


def test_columns_and_messages_give_the_same_verdicts_and_dlq_records(sidecar_address, broker):
    client = SidecarClient(sidecar_address, timeout_s=30)
    args = _arguments()
    results = {}
    for how in ("columns", "messages"):
        topic = f"dlq.columns-{how}-{uuid.uuid4().hex[:6]}"
        reg = client.register_job("orders-etl", _props(topic))
        assert columns.takes(client.target, reg.job, reg.run_id)
        make = columns.failure if how == "columns" else report.failed_record
        verdicts = client.report_failures(reg.run(), TASK, [make(*a, **kw) for a, kw in args])
        assert {type(v).__name__ for v in verdicts} == (
            {"ColumnVerdict"} if how == "columns" else {"Verdict"})
        assert client.flush_task(reg.run(), TASK, timeout_s=60) == len(args)
        summary = client.job_summary(reg.run())
        results[how] = ([(v.record_id, v.action, v.category, v.reason.replace(topic, "TOPIC"),
                          v.dead_lettered, v.attempt) for v in verdicts],
                        _dlq(broker.bootstrap_servers, topic, len(args)),
                        (summary.total_record_errors, summary.total_records_skipped,
                         dict((e.key, e.count) for e in summary.by_exception_class)))
        client.end_job(reg.run())
    assert results["columns"] == results["messages"]
    verdicts, dlq, (errors, skipped, by_class) = results["columns"]
    assert errors == skipped == 40 and by_class == {"builtins.ValueError": 32,
                                                    "builtins.KeyError": 8}
    assert all(v[4] for v in verdicts)   # every record dead-lettered, once
    key, value, headers = dlq["orders/7"]
    assert key == b"k7" and value == b"row 7"
    assert ("origin", b"web") in headers and ("empty", None) in headers


def _raw(address: str):
    ch = grpc.insecure_channel(address)
    return ch, pb_grpc.ErrorSidecarStub(ch)


@pytest.mark.parametrize("mutate, field", [
    (lambda c: setattr(c, "kind_index", b"\x05\x00\x00\x00" * 3), "columns.kind_index"),
    (lambda c: c.values.append(b"extra"), "columns.values"),
    (lambda c: setattr(c, "header_counts", b"\x01\x00\x00\x00" * 3), "columns.header_counts"),
    (lambda c: setattr(c.kinds[0], "stage", 42), "columns.kinds[0].stage"),
])
def test_malformed_columns_are_refused_and_change_nothing(sidecar_address, mutate, field):
    client = SidecarClient(sidecar_address, timeout_s=30)
    reg = client.register_job("orders-etl", _props(f"dlq.columns-bad-{uuid.uuid4().hex[:6]}"))
    try:
        raise ValueError("bad")
    except ValueError as exc:
        cols = columns.encode([columns.failure(f"b/{i}", "SINK", exc, value=b"v")
                               for i in range(3)])
    cols.kinds.add().CopyFrom(cols.kinds[0])
    cols.kind_index = b"\x00\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00"
    mutate(cols)
    ch, stub = _raw(sidecar_address)
    token = [("spillway-job-token", reg.job_token.reveal())]
    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportFailures(pb.ReportFailuresRequest(
                job=reg.job, run_id=reg.run_id, task=TASK, columns=cols, verdict_columns=True),
                metadata=token, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
        summary = client.job_summary(reg.run())
        assert summary.total_record_failures == 0 and summary.dlq_records_written == 0
    finally:
        ch.close()
        client.end_job(JobRun(reg.job, reg.run_id, reg.job_token))


def test_records_failing_alike_send_their_exception_once(sidecar_address):
    """256 records failing alike: the columnar request is a fraction of the messages' (the stack
    trace crosses once), and the sidecar answers them all."""
    client = SidecarClient(sidecar_address, timeout_s=30)
    reg = client.register_job("orders-etl", _props(f"dlq.columns-one-{uuid.uuid4().hex[:6]}"))
    try:
        raise ValueError("bad amount")
    except ValueError as exc:
        fs = [columns.failure(f"o/{i}", "TRANSFORMATION", exc, value=b"v" * 64,
                              function_name="etl.parse") for i in range(256)]
    as_columns = pb.ReportFailuresRequest(columns=columns.encode(fs)).ByteSize()
    as_messages = pb.ReportFailuresRequest(records=[f.to_pb() for f in fs]).ByteSize()
    assert as_columns * 2 < as_messages
    verdicts = client.report_failures(reg.run(), TASK, fs)
    assert [v.record_id for v in verdicts] == [f"o/{i}" for i in range(256)]
    assert client.flush_task(reg.run(), TASK, timeout_s=60) == 256
    client.end_job(reg.run())
