"""Fuzz tier: random spillway.v1 requests (and raw random bytes) against a real in-process
sidecar with a real Tansu broker behind it.

Whatever arrives, the sidecar answers with a deliberate status (never UNKNOWN or INTERNAL, never
a hang), keeps its details short, stays SERVING, and a victim job registered before the storm
keeps its summary and still gets a normal verdict afterwards. The example budget is fixed and
derandomized so the tier is repeatable and stays well under a minute.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillway.sidecar.core import config
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support.creds import admin_md, peer_md
from support.kafka import create_topic

pytestmark = [pytest.mark.fuzz, pytest.mark.integration]

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])
# Codes that would mean a bug (UNKNOWN/INTERNAL: an exception escaped; UNAVAILABLE/DEADLINE:
# the server died or hung).
BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE,
       grpc.StatusCode.DEADLINE_EXCEEDED}
DLQ_TOPIC = "dlq.fuzz"
JOBS = ["fuzz-dlq", "fuzz-retry", "fuzz-none"]
RUN = "fuzz-run"
TOKENS: dict[str, tuple] = {}  # job -> its run's job token metadata
TASK = pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=1)

# --- strategies ------------------------------------------------------------------------------

_chars = st.characters(blacklist_categories=("Cs",))  # protobuf refuses lone surrogates
text = st.one_of(
    st.text(_chars, max_size=40),
    st.sampled_from(["", " ", " a ", "a\x00b", "\u202e", "dlq.", "__x", "é" * 200]),
    st.builds(lambda c, n: c * n, st.sampled_from(["x", "é", " ", "\n"]),
              st.sampled_from([255, 1025, 70_000, 300_000])),
)
name = st.one_of(st.sampled_from(JOBS), text)
i32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([-1, 0, 2**31 - 1]))
i64 = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([-(2**63), -1, 2**63 - 1]))
u32 = st.integers(0, 2**32 - 1)
u64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 2**40, 2**63, 2**64 - 1]))
number_text = st.one_of(
    st.integers(-(2**70), 2**70).map(str), st.floats(allow_nan=True).map(repr),
    st.sampled_from(["", "nan", "inf", "-1", "1e400", "9" * 5000, "0x10", "1_000", "true"]))
prop_key = st.one_of(st.sampled_from(sorted(config.PROPERTIES)), st.sampled_from(
    sorted(config.ALIASES)), text)
prop_value = st.one_of(number_text, text, st.sampled_from(
    ["all", "none", "os:abort", "signal:pause", "LogAndFail", "dlq.fuzz", "bad prefix!", "",
     "a.B=retriable", "connect", "dlq"]))
props = st.dictionaries(prop_key, prop_value, max_size=6)

stage = st.one_of(st.sampled_from(list(pb.Stage.values())), st.integers(-5, 2**31 - 1))
category = st.one_of(st.sampled_from(list(pb.Category.values())), st.integers(-5, 1000))
exception = st.builds(
    pb.ExceptionInfo, class_name=st.one_of(st.sampled_from(
        ["builtins.ValueError", "builtins.ConnectionError", "x.Y"]), text),
    class_chain=st.lists(text, max_size=3), message=text, stack_trace=text,
    grpc_status_code=st.one_of(st.none(), i32), http_status_code=st.one_of(st.none(), i32),
    kafka_retriable=st.one_of(st.none(), st.booleans()),
    marker_category=category, causes=st.lists(text, max_size=3),
    kafka_error_code=st.one_of(st.sampled_from(["", "NOT_LEADER_FOR_PARTITION", "_MSG_TIMED_OUT"]),
                               text))
header = st.builds(pb.Header, key=text, value=st.one_of(st.none(), st.binary(max_size=64)))
record = st.builds(
    pb.FailedRecord, record_id=st.one_of(st.sampled_from(["r1", "r2", "r3"]), text),
    stage=stage, custom_stage=text, function_name=text,
    source=st.one_of(st.none(), st.builds(pb.SourceCoordinates, topic=text, partition=i32,
                                          offset=i64)),
    key=st.one_of(st.none(), st.binary(max_size=64)),
    value=st.one_of(st.none(), st.binary(max_size=256)),
    headers=st.lists(header, max_size=3), timestamp_ms=st.one_of(st.none(), i64),
    exception=st.one_of(st.none(), exception), attempt=u32, traceparent=text, tracestate=text,
    payload=st.integers(-3, 10))
# plausible records and tasks too, so that many requests get past validation into the policy
# engine, the DLQ record builder, the spool and the producer
small = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), max_size=20)
plausible_record = st.builds(
    pb.FailedRecord, record_id=st.sampled_from(["r1", "r2", "r3", "r4"]),
    stage=st.sampled_from([1, 2, 3, 4, 5, 6, 7]), function_name=small,
    source=st.one_of(st.none(), st.builds(pb.SourceCoordinates, topic=st.just("in"),
                                          partition=st.integers(0, 2**31 - 1),
                                          offset=st.integers(0, 2**63 - 1))),
    key=st.one_of(st.none(), st.binary(max_size=32)), value=st.binary(max_size=2048),
    headers=st.lists(st.builds(pb.Header, key=small, value=st.binary(max_size=32)), max_size=3),
    timestamp_ms=st.integers(-1, 253_402_300_799_999), attempt=st.integers(0, 1000),
    exception=st.builds(pb.ExceptionInfo, class_name=st.sampled_from(
        ["builtins.ValueError", "builtins.ConnectionError", "builtins.TimeoutError"]),
        message=small, stack_trace=small, kafka_error_code=st.sampled_from(
            ["", "NOT_LEADER_FOR_PARTITION", "TOPIC_AUTHORIZATION_FAILED", "_MSG_TIMED_OUT"]),
        marker_category=st.integers(0, 6)))
record = st.one_of(plausible_record, record)
plausible_task = st.builds(pb.TaskIdentity, stage_id=st.integers(0, 2**31 - 1),
                          partition_id=st.integers(0, 2**31 - 1),
                          task_attempt_id=st.integers(0, 2**63 - 1))
task = st.one_of(
    plausible_task,
    st.builds(pb.TaskIdentity, stage_id=i32, partition_id=i32, attempt_number=i32,
              task_attempt_id=i64, executor_id=text, host=text))
ids = st.lists(st.one_of(st.sampled_from(["r1", "r2"]), text), max_size=4)

requests = st.one_of(
    st.tuples(st.just("RegisterJob"), st.builds(
        pb.RegisterJobRequest, job=name, properties=props, run_id=text)),
    st.tuples(st.just("ReportFailures"), st.builds(
        pb.ReportFailuresRequest, job=name, task=task, records=st.lists(record, max_size=4),
        recovered_record_ids=ids, run_id=st.one_of(st.just(""), text))),
    st.tuples(st.just("FlushTask"), st.builds(
        pb.FlushTaskRequest, job=name, task=task, recovered_record_ids=ids,
        processed=st.lists(st.builds(pb.StageCount, stage=stage, custom_stage=text,
                                     records=u64), max_size=4))),
    st.tuples(st.just("GetJobSummary"), st.builds(pb.GetJobSummaryRequest, job=name,
                                                  run_id=text)),
    st.tuples(st.just("GetStatus"), st.builds(pb.GetStatusRequest, job=name, page_size=u32,
                                              page_token=text)),
    # ending the fixed jobs would stop the storm from reaching the engine: random names only
    st.tuples(st.just("EndJob"), st.builds(pb.EndJobRequest, job=text, run_id=text)),
    st.tuples(st.just("ReportFailures"), st.builds(
        pb.ReportFailuresRequest, job=st.sampled_from(JOBS), run_id=st.just(RUN),
        task=plausible_task, records=st.lists(plausible_record, min_size=1, max_size=4),
        recovered_record_ids=st.lists(st.sampled_from(["r1", "r2"]), max_size=2))),
)
# TallyFailures, as a peer sidecar sends it (with the peer credential): random columns, and
# plausible ones that reach the fixed runs' engines
tally_group = st.builds(pb.TallyGroup, count=st.integers(0, 6), stage=stage,
                        custom_stage=text, function_name=text, exception=exception)
plausible_group = st.builds(pb.TallyGroup, count=st.just(2), stage=st.just(
    pb.STAGE_TRANSFORMATION), function_name=small, exception=st.builds(
    pb.ExceptionInfo, class_name=st.sampled_from(["builtins.ValueError", "json.JSONDecodeError"]),
    message=small))
requests = st.one_of(
    requests,
    st.tuples(st.just("TallyFailures"), st.builds(
        pb.TallyRequest, job=name, run_id=st.one_of(st.just(RUN), text),
        reports=st.lists(st.builds(pb.TallyReport, task=task, record_ids=ids,
                                   payload_digests=st.binary(max_size=40),
                                   groups=st.lists(tally_group, max_size=3)), max_size=3))),
    st.tuples(st.just("TallyFailures"), st.builds(
        pb.TallyRequest, job=st.sampled_from(JOBS), run_id=st.just(RUN),
        reports=st.lists(st.builds(pb.TallyReport, task=plausible_task,
                                   record_ids=st.lists(small.filter(bool), min_size=2,
                                                       max_size=2),
                                   payload_digests=st.binary(min_size=16, max_size=16),
                                   groups=st.lists(plausible_group, min_size=1, max_size=1)),
                         min_size=1, max_size=2))),
)
# columnar reports (RecordColumns): random columns of any shape, and plausible ones (the
# plausible records as an executor's client encodes them) that reach the fixed runs' engines
column = st.binary(max_size=48)
random_columns = st.builds(
    pb.RecordColumns, record_ids=ids, kinds=st.lists(st.builds(
        pb.FailureKind, stage=stage, custom_stage=text, function_name=text,
        exception=st.one_of(st.none(), exception), payload=st.integers(-3, 10)), max_size=3),
    kind_index=column, keys=st.lists(st.binary(max_size=16), max_size=4),
    values=st.lists(st.binary(max_size=16), max_size=4), absent=st.binary(max_size=6),
    topics=st.lists(text, max_size=2), topic_index=column, partitions=column, offsets=column,
    timestamps_ms=column, attempts=column, traceparents=st.lists(text, max_size=2),
    tracestates=st.lists(text, max_size=2), trace_index=column,
    headers=st.lists(header, max_size=3), header_counts=column)


def _as_columns(recs: list[pb.FailedRecord]) -> pb.RecordColumns:
    from spillway.client import columns

    return columns.encode([columns.Failure(
        r.record_id, stage=r.stage, custom_stage=r.custom_stage, function_name=r.function_name,
        payload=r.payload, exception=r.exception,
        kind=(r.stage, r.function_name, r.exception.SerializeToString()),
        source=((r.source.topic, r.source.partition, r.source.offset)
                if r.HasField("source") else None),
        key=r.key if r.HasField("key") else None, value=r.value if r.HasField("value") else None,
        headers=tuple((h.key, h.value if h.HasField("value") else None) for h in r.headers),
        timestamp_ms=r.timestamp_ms if r.HasField("timestamp_ms") else None,
        attempt=max(1, r.attempt), traceparent=r.traceparent, tracestate=r.tracestate)
        for r in recs])


requests = st.one_of(
    requests,
    st.tuples(st.just("ReportFailures"), st.builds(
        pb.ReportFailuresRequest, job=name, task=task, columns=random_columns,
        verdict_columns=st.booleans(), run_id=st.one_of(st.just(RUN), text))),
    st.tuples(st.just("ReportFailures"), st.builds(
        pb.ReportFailuresRequest, job=st.sampled_from(JOBS), run_id=st.just(RUN),
        task=plausible_task, verdict_columns=st.just(True),
        columns=st.lists(plausible_record, min_size=1, max_size=4).map(_as_columns))),
)
METHODS = ["RegisterJob", "ReportFailures", "FlushTask", "GetJobSummary", "GetStatus", "EndJob",
           "TallyFailures"]

# --- the server --------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def sidecar_props():
    return {"telemetry.enable": "false", "dlq.topic.auto.create.allow": "false",
            "errors.handler.timeout.ms": "200"}


@pytest.fixture(scope="module")
def world(sidecar, broker):
    create_topic(broker.bootstrap_servers, DLQ_TOPIC)
    channel = grpc.insecure_channel(sidecar.address)
    stub = pb_grpc.ErrorSidecarStub(channel)
    victim = stub.RegisterJob(pb.RegisterJobRequest(job="victim", run_id=RUN, properties={
        "errors.tolerance": "all", "errors.deadletterqueue.topic.name": DLQ_TOPIC}), timeout=20)
    md = (("spillway-job-token", victim.job_token),) if victim.job_token else ()
    stub.ReportFailures(pb.ReportFailuresRequest(job="victim", run_id=RUN, task=TASK, records=[
        pb.FailedRecord(record_id="v0", stage=pb.STAGE_TRANSFORMATION,
                        exception=pb.ExceptionInfo(class_name="builtins.ValueError"))]),
        metadata=md, timeout=20)
    for job, p in zip(JOBS, [
            {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": DLQ_TOPIC,
             "errors.deadletterqueue.context.headers.enable": "true"},
            {"errors.tolerance": "all", "errors.retry.timeout": "60000"},
            {}]):
        reg = stub.RegisterJob(pb.RegisterJobRequest(job=job, run_id=RUN, properties=p),
                               timeout=20)
        TOKENS[job] = (("spillway-job-token", reg.job_token),)
    before = stub.GetJobSummary(pb.GetJobSummaryRequest(job="victim", run_id=RUN), metadata=md,
                                timeout=5)
    yield channel, stub, md, before
    # the victim is untouched by everything the tier sent, and still served normally
    after = stub.GetJobSummary(pb.GetJobSummaryRequest(job="victim", run_id=RUN), metadata=md,
                               timeout=5)
    assert (after.failed, after.total_record_errors, after.records_processed) == \
        (before.failed, before.total_record_errors, before.records_processed)
    out = stub.ReportFailures(pb.ReportFailuresRequest(job="victim", run_id=RUN, task=TASK,
                                                       records=[
        pb.FailedRecord(record_id="v-last", stage=pb.STAGE_TRANSFORMATION,
                        exception=pb.ExceptionInfo(class_name="builtins.ValueError"))]),
        metadata=md, timeout=20)
    assert out.verdicts[0].action == pb.ACTION_SKIP and out.verdicts[0].dead_lettered
    channel.close()


def _answered(world, fn, request, metadata=None):
    channel, stub, md, before = world
    try:
        fn(request, timeout=15, metadata=metadata)
    except grpc.RpcError as exc:
        assert exc.code() not in BAD, (exc.code(), exc.details()[:500])
        assert len(exc.details() or "") <= 1024
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                       timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def _send(world, req) -> None:
    method, message = req
    # the fixed jobs' reports carry their run's token, as an executor's would
    token = TOKENS.get(message.job) if getattr(message, "run_id", "") == RUN else None
    if method == "TallyFailures":  # a peer sidecar's call
        token = (*peer_md(), *(token or ()))
    _answered(world, getattr(world[1], method), message, token)


@FUZZ
@given(req=requests)
def test_random_requests_get_deliberate_answers(world, req):
    _send(world, req)


@FUZZ
@given(method=st.sampled_from(METHODS), raw=st.one_of(
    st.binary(max_size=512), st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=8),
                                       st.integers(1, 4096))))
def test_raw_random_bytes_get_deliberate_answers(world, method, raw):
    call = world[0].unary_unary(f"/spillway.v1.ErrorSidecar/{method}")
    _answered(world, call, raw)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(counts=st.lists(u64, min_size=1, max_size=6))
def test_status_survives_any_processed_counts(world, counts):
    channel, stub, md, before = world
    for c in counts:
        _answered(world, stub.FlushTask, pb.FlushTaskRequest(
            job="fuzz-retry", run_id=RUN, task=TASK, processed=[pb.StageCount(
                stage=pb.STAGE_TRANSFORMATION, records=c)]), TOKENS["fuzz-retry"])
    # the run's own token shows it (an anonymous caller sees no run it holds no token for)
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=10, metadata=TOKENS["fuzz-retry"])
    assert any(j.job == "fuzz-retry" for j in status.jobs) or status.next_page_token


def test_the_tier_reaches_the_policy_engine(world):
    """Guards the strategies themselves: plausible reports are decided, not only refused. It
    sends its own examples, so it holds whichever tests ran before it on this worker."""
    channel, stub, md, before = world

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(req=requests)
    def send(req):
        _send(world, req)

    send()
    decided = stub.GetJobSummary(pb.GetJobSummaryRequest(job="fuzz-dlq", run_id=RUN),
                                 metadata=TOKENS["fuzz-dlq"], timeout=5)
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=5, metadata=admin_md())
    assert decided.total_record_failures > 0 or any(
        j.total_record_failures > 0 for j in status.jobs if j.job != "victim"), \
        "no fuzzed report ever reached a decision"
