"""The home protocol in columns (TallyFailures): a node sidecar sends its run's home ids,
payload digests and each way of failing once, never payloads; the home decides exactly what it
decides for the whole report, and refuses what a peer may not send."""

from __future__ import annotations

import json
import logging

import grpc
import pytest
from spillway.v1 import sidecar_pb2 as pb
from support import rpc
from support.creds import peer_md
from support.records import json_error

pytestmark = pytest.mark.integration


HANDLER = """
from spillway.sidecar.core.handlers import HandlerResponse

SEEN = []


class Seeing:
    def handle(self, context):
        SEEN.append(context.record.value)
        return HandlerResponse.CONTINUE
"""


@pytest.fixture(scope="module")
def cluster(broker, tmp_path_factory):
    """A home (a) and a node (b), each its own sidecar with its own spool; they allow one user
    handler, which remembers the payloads it was given."""
    import sys

    from spillway.sidecar.server import start_server

    handlers = tmp_path_factory.mktemp("tally-handlers")
    (handlers / "tally_handlers.py").write_text(HANDLER)
    sys.path.insert(0, str(handlers))
    nodes = [start_server({
        "errors.handler.allowed.classes": "tally_handlers:Seeing",
        "listen.address": "127.0.0.1:0", "bootstrap.servers": broker.bootstrap_servers,
        "spool.dir": str(tmp_path_factory.mktemp(f"tally-spool-{n}")),
        "producer.linger.ms": "5", "sidecar.id": f"tally-{n}",
        "home.allowed.addresses": "127.0.0.0/8"}) for n in "ab"]
    yield nodes
    for n in nodes:
        n.stop(1.0)
    sys.path.remove(str(handlers))


_exc = json_error


def _record(rid, value, exc, offset=0):
    return pb.FailedRecord(record_id=rid, stage=pb.STAGE_TRANSFORMATION,
                           function_name="app.parse", key=rid.encode(), value=value,
                           source=pb.SourceCoordinates(topic="orders", partition=0,
                                                       offset=offset),
                           exception=exc)


def _reports():
    """Reports that take every path of the decision: a run of records failing alike, distinct
    messages, a retriable record, a re-report (same ids and payloads), ids reused with another
    payload, and enough errors to pass the limit partway."""
    same = _exc()
    first = [_record(f"r{i}", b"{bad", same, i) for i in range(120)]
    first += [_record(f"m{i}", b"{x", _exc(msg=f"Expecting value: column {i}"), 200 + i)
              for i in range(15)]
    first.append(_record("net", b"{}", _exc("grpc.RpcError", "unavailable",
                                               grpc_status_code=14)))
    again = first[:10]                                   # a task re-run: same records
    reused = [_record(f"r{i}", b"{other", same, 500 + i) for i in range(5)]   # collisions
    tail = [_record(f"t{i}", b"{bad", same, 600 + i) for i in range(30)]
    return [first, again + reused, tail]


PROPS = {"errors.tolerance": "all", "errors.tolerance.max.errors": "150",
         "errors.log.enable": "true", "errors.log.include.messages": "true",
         "errors.retry.timeout": "60000",
         "errors.deadletterqueue.topic.name": "dlq.tally-test",
         "errors.deadletterqueue.auto.create.topics.enable": "true",
         "errors.deadletterqueue.topic.replication.factor": "1"}


def _run_through(entry, job, run_id, home_reg=None, home_stub=None):
    """Report every report at `entry`; the run is homed at `home_stub` (registered there
    first) when given. Answers (verdict tuples per report, the home's summary)."""
    if home_stub is not None:
        reg = home_stub.RegisterJob(pb.RegisterJobRequest(job=job, run_id=run_id,
                                                          properties=PROPS), timeout=20)
        entry.RegisterJob(pb.RegisterJobRequest(job=job, run_id=run_id, properties=PROPS,
                                                home=reg.home,
                                                home_instance_id=reg.home_instance_id),
                          timeout=20, metadata=rpc.md(reg.job_token))
    else:
        reg = entry.RegisterJob(pb.RegisterJobRequest(job=job, run_id=run_id,
                                                      properties=PROPS), timeout=20)
    md = rpc.md(reg.job_token)
    out = []
    for n, records in enumerate(_reports()):
        task = pb.TaskIdentity(stage_id=1, partition_id=n, task_attempt_id=10 + n)
        resp = entry.ReportFailures(pb.ReportFailuresRequest(
            job=job, run_id=run_id, task=task, records=records), timeout=20, metadata=md)
        out.append([(v.record_id, v.action, v.category, v.reason, v.attempt, v.dead_lettered,
                     v.job_failed, v.retry_delay_ms > 0) for v in resp.verdicts])
    summary = (home_stub or entry).GetJobSummary(
        pb.GetJobSummaryRequest(job=job, run_id=run_id), timeout=5, metadata=md)
    return out, summary, reg


def _counts(s: pb.JobSummary):
    return (s.failed, s.failure_reason, s.total_record_failures, s.total_record_errors,
            s.total_records_skipped, s.total_retries, s.total_errors_logged,
            s.record_id_collisions, sorted((e.key, e.count) for e in s.by_stage),
            sorted((e.key, e.count) for e in s.by_category),
            sorted((e.key, e.count) for e in s.by_exception_class))


def test_a_node_tally_decides_exactly_what_the_home_decides_for_the_whole_report(
        cluster, caplog):
    a, b = cluster
    sa, sb = rpc.stub(a), rpc.stub(b)
    with caplog.at_level(logging.ERROR, logger="spillway.errors"):
        direct, at_home, _ = _run_through(sa, "tally-direct", "run-1")
        caplog.clear()
        via, through_node, _ = _run_through(sb, "tally-direct", "run-2", home_stub=sa)
        lines = [json.loads(r.getMessage()) for r in caplog.records
                 if r.name == "spillway.errors"]
    assert via == direct
    assert _counts(through_node) == _counts(at_home)
    # every path was taken: skips, a retry, re-reports already in the DLQ, collisions, and the
    # limit passed partway (150 errors)
    actions = [v[1] for report in via for v in report]
    assert {pb.ACTION_SKIP, pb.ACTION_RETRY, pb.ACTION_FAIL} <= set(actions)
    assert all("not written again" in v[3] for v in via[1][:10])
    assert through_node.record_id_collisions == 5
    assert through_node.failed and "errors.tolerance.max.errors=150" in \
        through_node.failure_reason
    # the node wrote the error log lines, with what only it holds (source, payload, stack)
    assert len(lines) == through_node.total_errors_logged
    assert all(line["topic"] == "orders" and line["stack_trace"] and "value" in line
               for line in lines)


def test_a_home_that_predates_the_tally_gets_the_whole_report(cluster, broker, monkeypatch,
                                                                tmp_path):
    from spillway.sidecar.server import start_server
    from spillway.sidecar.transport.servicer import ErrorSidecarServicer

    def unknown(self, request, context):   # what grpc answers for a method it does not serve
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    monkeypatch.setattr(ErrorSidecarServicer, "TallyFailures", unknown)
    old = start_server({"listen.address": "127.0.0.1:0", "spool.dir": str(tmp_path),
                        "bootstrap.servers": broker.bootstrap_servers,
                        "producer.linger.ms": "5", "home.allowed.addresses": "127.0.0.0/8"})
    try:
        so, sb = rpc.stub(old), rpc.stub(cluster[1])
        direct, at_home, _ = _run_through(so, "tally-old", "run-1")
        via, through_node, _ = _run_through(sb, "tally-old", "run-2", home_stub=so)
        assert via == direct and _counts(through_node) == _counts(at_home)
        run = cluster[1].sidecar.registry.get("tally-old", "run-2")
        assert run.home is not None and not run.home.tally_supported
    finally:
        old.stop(1.0)


_GUARDED = iter(range(1_000_000))


def _guard_run(stub, props=None):
    job = f"tally-guard-{next(_GUARDED)}"
    return stub.RegisterJob(pb.RegisterJobRequest(
        job=job, run_id="run-1", properties=props or {"errors.tolerance": "all"}), timeout=20)


def _tally(reg, n=2, **over):
    req = pb.TallyRequest(job=reg.job, run_id="run-1")
    report = req.reports.add(task=pb.TaskIdentity(stage_id=1, partition_id=0),
                             record_ids=[f"g{i}" for i in range(n)],
                             payload_digests=bytes(8 * n))
    report.groups.add(count=n, stage=pb.STAGE_TRANSFORMATION,
                      exception=pb.ExceptionInfo(class_name="builtins.ValueError"))
    for name, value in over.items():
        if name == "groups":
            del report.groups[:]
            for g in value:
                report.groups.add(**g)
        else:
            setattr(report, name, value)
    return req


@pytest.mark.parametrize(("over", "expected"), [
    ({"payload_digests": b"\0" * 7}, "reports[0].payload_digests: 8 bytes per record id"),
    ({"groups": [{"count": 1, "stage": pb.STAGE_TRANSFORMATION,
                  "exception": pb.ExceptionInfo(class_name="builtins.ValueError")}]},
     "reports[0].groups: their counts add up to 1, not to the 2 record ids"),
    ({"groups": [{"count": 2, "stage": pb.STAGE_TRANSFORMATION, "exception": pb.ExceptionInfo(
        class_name="builtins.ValueError", stack_trace="x")}]},
     "reports[0].groups[0].exception.stack_trace: not sent to a home"),
    ({"groups": [{"count": 2, "stage": 99,
                  "exception": pb.ExceptionInfo(class_name="builtins.ValueError")}]},
     "reports[0].groups[0].stage: must be one of"),
    ({"groups": [{"count": 2, "stage": pb.STAGE_TRANSFORMATION}]},
     "reports[0].groups[0].exception: required"),
])
def test_a_malformed_tally_is_refused_and_changes_nothing(cluster, over, expected):
    a, _ = cluster
    sa = rpc.stub(a)
    reg = _guard_run(sa)
    before = sa.GetJobSummary(pb.GetJobSummaryRequest(job=reg.job, run_id="run-1"),
                              timeout=5, metadata=rpc.md(reg.job_token))
    with pytest.raises(grpc.RpcError) as refused:
        sa.TallyFailures(_tally(reg, **over), timeout=5,
                         metadata=[*peer_md(), *rpc.md(reg.job_token)])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in refused.value.details()
    after = sa.GetJobSummary(pb.GetJobSummaryRequest(job=reg.job, run_id="run-1"),
                             timeout=5, metadata=rpc.md(reg.job_token))
    assert _counts(after) == _counts(before)


def test_only_a_peer_with_the_run_token_may_tally(cluster):
    a, _ = cluster
    sa = rpc.stub(a)
    reg = _guard_run(sa)
    with pytest.raises(grpc.RpcError) as not_peer:   # an executor holding the run's token
        sa.TallyFailures(_tally(reg), timeout=5, metadata=rpc.md(reg.job_token))
    assert not_peer.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "sidecar-to-sidecar" in not_peer.value.details()
    with pytest.raises(grpc.RpcError) as no_token:   # a peer without the run's token
        sa.TallyFailures(_tally(reg), timeout=5, metadata=peer_md())
    assert no_token.value.code() == grpc.StatusCode.PERMISSION_DENIED
    ok = sa.TallyFailures(_tally(reg), timeout=5, metadata=[*peer_md(), *rpc.md(reg.job_token)])
    assert ok.reports[0].actions == bytes([pb.ACTION_SKIP]) * 2
    assert len(ok.reports[0].reasons) == 1


def test_a_run_with_a_user_handler_is_forwarded_whole(cluster, broker):
    """A user handler is given each record's whole context: the home needs the report."""
    a, b = cluster
    sa, sb = rpc.stub(a), rpc.stub(b)
    import tally_handlers

    props = {"errors.tolerance": "all", "errors.handler.class": "tally_handlers:Seeing"}
    reg = sa.RegisterJob(pb.RegisterJobRequest(job="tally-user", run_id="run-1",
                                               properties=props), timeout=20)
    sb.RegisterJob(pb.RegisterJobRequest(job="tally-user", run_id="run-1", properties=props,
                                         home=reg.home, home_instance_id=reg.home_instance_id),
                   timeout=20, metadata=rpc.md(reg.job_token))
    resp = sb.ReportFailures(pb.ReportFailuresRequest(
        job="tally-user", run_id="run-1", task=pb.TaskIdentity(stage_id=1),
        records=[_record("u1", b"{", _exc())]), timeout=20, metadata=rpc.md(reg.job_token))
    assert resp.verdicts[0].action == pb.ACTION_SKIP
    assert tally_handlers.SEEN == [b"{"]   # the home's handler saw the record's payload
    with pytest.raises(grpc.RpcError) as refused:   # and the home refuses a tally of it
        sa.TallyFailures(_tally(reg), timeout=5,
                         metadata=[*peer_md(), *rpc.md(reg.job_token)])
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "ReportFailures.decide_only" in refused.value.details()


def test_reports_of_one_run_in_one_tally_are_decided_in_order(cluster):
    a, _ = cluster
    sa = rpc.stub(a)
    reg = _guard_run(sa)
    req = _tally(reg, n=3)
    again = req.reports.add()
    again.CopyFrom(req.reports[0])
    again.task.partition_id = 7   # a re-run of the task: the same records again
    resp = sa.TallyFailures(req, timeout=5, metadata=[*peer_md(), *rpc.md(reg.job_token)])
    first, second = resp.reports
    assert first.actions == second.actions == bytes([pb.ACTION_SKIP]) * 3
    assert first.reasons[0].startswith("skipped, dropped (no errors.deadletterqueue")
    assert all("already skipped by an earlier task attempt" in second.reasons[i]
               for i in range(len(second.reasons)))
    summary = sa.GetJobSummary(pb.GetJobSummaryRequest(job=reg.job, run_id="run-1"), timeout=5,
                               metadata=rpc.md(reg.job_token))
    assert summary.total_record_errors == 3 and summary.total_record_failures == 6


def test_a_tally_of_too_many_records_together_is_refused(cluster):
    a, _ = cluster
    sa = rpc.stub(a)
    reg = _guard_run(sa)
    req = _tally(reg, n=40_000)
    req.reports.add().CopyFrom(req.reports[0])
    with pytest.raises(grpc.RpcError) as refused:
        sa.TallyFailures(req, timeout=20, metadata=[*peer_md(), *rpc.md(reg.job_token)])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 65536 record ids together (got 80000 by reports[1])" in \
        refused.value.details()


@pytest.mark.parametrize("provisional", [False, True], ids=["waits-for-home", "provisional"])
def test_concurrent_reports_through_a_node_share_calls_and_lose_nothing(cluster, broker,
                                                                       provisional,
                                                                       monkeypatch):
    """Executors report at once through one node; reports that arrive while a tally is in
    flight go together in the next call (or, answered provisionally, are confirmed together
    in the background). Every record is decided once, dead-lettered once."""
    from concurrent.futures import ThreadPoolExecutor

    from support.kafka import read_all

    a, b = cluster
    sa, sb = rpc.stub(a), rpc.stub(b)
    job = f"tally-many-{provisional}"
    topic = f"dlq.tally-concurrent-{provisional}"
    monkeypatch.setitem(b.sidecar.props, "home.confirm.async", provisional)
    calls_before = b.sidecar.confirmations.calls
    props = {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
             "errors.deadletterqueue.auto.create.topics.enable": "true",
             "errors.deadletterqueue.topic.replication.factor": "1"}
    reg = sa.RegisterJob(pb.RegisterJobRequest(job=job, run_id="run-1",
                                               properties=props), timeout=20)
    md = rpc.md(reg.job_token)
    sb.RegisterJob(pb.RegisterJobRequest(job=job, run_id="run-1", properties=props,
                                         home=reg.home, home_instance_id=reg.home_instance_id),
                   timeout=20, metadata=md)
    exc = _exc()

    def executor(e):
        task = pb.TaskIdentity(stage_id=1, partition_id=e, task_attempt_id=100 + e)
        for n in range(10):
            # executors 0 and 1 report the same records (a speculative attempt)
            part = e if e > 1 else 0
            records = [_record(f"p{part}-{n}-{i}", b"{bad", exc, i) for i in range(50)]
            resp = sb.ReportFailures(pb.ReportFailuresRequest(
                job=job, run_id="run-1", task=task, records=records), timeout=30,
                metadata=md)
            assert all(v.action == pb.ACTION_SKIP and v.dead_lettered for v in resp.verdicts)
        return sb.FlushTask(pb.FlushTaskRequest(job=job, run_id="run-1", task=task),
                            timeout=30, metadata=md).dlq_records_acknowledged

    with ThreadPoolExecutor(8) as pool:
        acked = list(pool.map(executor, range(8)))
    assert sum(acked) == 7 * 500   # executors 0 and 1 shared their records: 7 x 500 distinct
    summary = sa.GetJobSummary(pb.GetJobSummaryRequest(job=job, run_id="run-1"),
                               timeout=5, metadata=md)
    assert summary.total_record_errors == 7 * 500 and summary.total_record_failures == 8 * 500
    run = b.sidecar.registry.get(job, "run-1")
    if provisional:
        assert (job, "run-1") not in run.home._tallies   # no report waited for the home
        assert b.sidecar.confirmations.calls - calls_before < 80
    else:
        group = run.home._tallies[(job, "run-1")]
        assert group.items == 80 and group.calls < group.items
    ids = [m.key() for m in read_all(broker.bootstrap_servers, topic)]
    assert len(ids) == len(set(ids)) == 7 * 500
