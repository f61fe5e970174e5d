"""One sidecar per node, one home per job: job-wide limits hold across sidecars, while each node
dead-letters its own records locally."""

from __future__ import annotations

import grpc
import pytest

from spillway.v1 import sidecar_pb2 as pb
from support.creds import admin_md, peer_md
from support import rpc
from support.kafka import read_all

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two_nodes(broker, tmp_path_factory):
    from spillway.sidecar.server import start_server

    nodes = [start_server({
        "listen.address": "127.0.0.1:0", "bootstrap.servers": broker.bootstrap_servers,
        "spool.dir": str(tmp_path_factory.mktemp(f"spool-{n}")), "producer.linger.ms": "5",
        "sidecar.id": f"node-{n}",
        # several sidecars on one host: the default dials no address but a sidecar's own
        "home.allowed.addresses": "127.0.0.0/8"}) for n in "ab"]
    yield nodes
    for n in nodes:
        n.stop(1.0)


RUN = "app-20261123000000-0042"


def _records(prefix, n):
    return [pb.FailedRecord(
        record_id=f"{prefix}-{i}", stage=pb.STAGE_TRANSFORMATION, function_name="app.f",
        key=f"{prefix}-{i}".encode(), value=b"bad",
        exception=pb.ExceptionInfo(class_name="builtins.ValueError",
                                   class_chain=["builtins.ValueError", "builtins.Exception"]))
        for i in range(n)]


def test_job_wide_error_limit_holds_across_two_sidecars(two_nodes, broker, topic_name):
    a, b = two_nodes
    props = {"errors.tolerance": "all", "errors.tolerance.max.errors": "3",
             "errors.deadletterqueue.topic.name": topic_name,
             "errors.deadletterqueue.auto.create.topics.enable": "true",
             "errors.deadletterqueue.topic.replication.factor": "1"}
    sa, sb = rpc.stub(a), rpc.stub(b)
    reg = sa.RegisterJob(pb.RegisterJobRequest(job="wide", run_id=RUN, properties=props),
                         timeout=20)
    assert reg.home == a.address and reg.home_instance_id == a.sidecar.instance_id
    # the executor on node b registers with its own sidecar, naming the job's home
    on_b = sb.RegisterJob(pb.RegisterJobRequest(job="wide", run_id=RUN, properties=props,
                                                home=reg.home,
                                                home_instance_id=reg.home_instance_id),
                          timeout=20, metadata=rpc.md(reg.job_token))
    assert on_b.job_token == reg.job_token and on_b.home_instance_id == reg.home_instance_id
    task_a = pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=1)
    task_b = pb.TaskIdentity(stage_id=1, partition_id=1, task_attempt_id=2)

    va = sa.ReportFailures(pb.ReportFailuresRequest(job="wide", run_id=RUN, task=task_a,
                                                    records=_records("a", 2)), timeout=10,
                           metadata=rpc.md(reg.job_token))
    vb = sb.ReportFailures(pb.ReportFailuresRequest(job="wide", run_id=RUN, task=task_b,
                                                    records=_records("b", 2)), timeout=10,
                           metadata=rpc.md(reg.job_token))
    assert [v.action for v in va.verdicts] == [pb.ACTION_SKIP] * 2
    # 3 errors are tolerated job-wide; the 4th, reported on the other node, fails the job
    assert [v.action for v in vb.verdicts] == [pb.ACTION_SKIP, pb.ACTION_FAIL]
    assert vb.verdicts[0].dead_lettered and not vb.verdicts[0].dead_letter
    failed = vb.verdicts[1]
    assert failed.job_failed and "errors.tolerance.max.errors=3" in failed.reason
    # afterwards every node answers FAIL
    later = sa.ReportFailures(pb.ReportFailuresRequest(job="wide", run_id=RUN, task=task_a,
                                                       records=_records("c", 1)), timeout=10,
                              metadata=rpc.md(reg.job_token))
    assert later.verdicts[0].action == pb.ACTION_FAIL and later.verdicts[0].job_failed

    # each node dead-lettered its own records; both flush barriers see them acknowledged
    assert sa.FlushTask(pb.FlushTaskRequest(job="wide", run_id=RUN, task=task_a), timeout=20,
                        metadata=rpc.md(reg.job_token)).dlq_records_acknowledged == 2
    assert sb.FlushTask(pb.FlushTaskRequest(job="wide", run_id=RUN, task=task_b), timeout=20,
                        metadata=rpc.md(reg.job_token)).dlq_records_acknowledged == 1
    keys = sorted(m.key() for m in read_all(broker.bootstrap_servers, topic_name))
    assert keys == [b"a-0", b"a-1", b"b-0"]

    home = sa.GetJobSummary(pb.GetJobSummaryRequest(job="wide", run_id=RUN), timeout=5,
                            metadata=rpc.md(reg.job_token))
    remote = sb.GetJobSummary(pb.GetJobSummaryRequest(job="wide", run_id=RUN), timeout=5,
                              metadata=rpc.md(reg.job_token))
    assert home.failed and home.total_record_errors == 4 and remote.total_record_errors == 0
    assert home.dlq_records_written + remote.dlq_records_written == 3

    # ending the run at its home releases it on node b too, with b's final summary
    ended = sa.EndJob(pb.EndJobRequest(job="wide", run_id=RUN), timeout=30,
                      metadata=rpc.md(reg.job_token))
    assert [s.sidecar_id for s in ended.summaries] == ["node-a", "node-b"]
    assert not ended.unreachable
    assert ended.summaries[0].total_record_errors == 4
    for stub in (sa, sb):
        with pytest.raises(grpc.RpcError) as gone:
            stub.GetJobSummary(pb.GetJobSummaryRequest(job="wide", run_id=RUN), timeout=5,
                               metadata=rpc.md(reg.job_token))
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND


def test_processed_counts_reach_the_home_for_ratio_limits(two_nodes, topic_name):
    a, b = two_nodes
    props = {"errors.tolerance": "all", "errors.tolerance.max.ratio": "0.5",
             "errors.tolerance.min.records": "1"}
    sa, sb = rpc.stub(a), rpc.stub(b)
    reg = sa.RegisterJob(pb.RegisterJobRequest(job="ratio", run_id=RUN, properties=props),
                         timeout=20)
    sb.RegisterJob(pb.RegisterJobRequest(job="ratio", run_id=RUN, properties=props,
                                         home=reg.home, home_instance_id=reg.home_instance_id),
                   timeout=20, metadata=rpc.md(reg.job_token))
    task = pb.TaskIdentity(stage_id=1, partition_id=3, task_attempt_id=7)
    sb.FlushTask(pb.FlushTaskRequest(job="ratio", run_id=RUN, task=task, processed=[
        pb.StageCount(stage=pb.STAGE_TRANSFORMATION, records=40)]), timeout=20,
        metadata=rpc.md(reg.job_token))
    assert sa.GetJobSummary(pb.GetJobSummaryRequest(job="ratio", run_id=RUN), timeout=5,
                            metadata=rpc.md(reg.job_token)).records_processed == 40


def test_unreachable_home_is_a_clear_error(two_nodes):
    _, b = two_nodes
    with pytest.raises(grpc.RpcError) as err:
        rpc.stub(b).RegisterJob(pb.RegisterJobRequest(job="lost", run_id=RUN, home="127.0.0.1:1"),
                             timeout=5, metadata=[("spillway-job-token", "t")])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "127.0.0.1:1" in err.value.details() and "home" in err.value.details()


def test_naming_itself_as_home_is_local(two_nodes):
    a, _ = two_nodes
    sa = rpc.stub(a)
    sa.RegisterJob(pb.RegisterJobRequest(job="self", run_id=RUN, home=a.address), timeout=10,
                   metadata=[("spillway-job-token", "executor-held-token")])
    status = sa.GetStatus(pb.GetStatusRequest(job="self"), timeout=5, metadata=admin_md())
    assert status.instance_id and [j.job for j in status.jobs] == ["self"]


def _dlq_props(topic_name):
    return {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic_name,
            "errors.deadletterqueue.auto.create.topics.enable": "true",
            "errors.deadletterqueue.topic.replication.factor": "1"}


def test_a_record_reported_on_two_nodes_is_dead_lettered_once(two_nodes, broker, topic_name):
    a, b = two_nodes
    props = _dlq_props(topic_name)
    sa, sb = rpc.stub(a), rpc.stub(b)
    reg = sa.RegisterJob(pb.RegisterJobRequest(job="once", run_id=RUN, properties=props),
                         timeout=20)
    sb.RegisterJob(pb.RegisterJobRequest(job="once", run_id=RUN, properties=props,
                                         home=reg.home, home_instance_id=reg.home_instance_id),
                   timeout=20, metadata=rpc.md(reg.job_token))
    # attempt 0 on node a, then a speculative copy (attempt 1) on node b, then a retry on a
    tasks = [(sa, pb.TaskIdentity(stage_id=1, partition_id=0, attempt_number=0,
                                  task_attempt_id=10)),
             (sb, pb.TaskIdentity(stage_id=1, partition_id=0, attempt_number=1,
                                  task_attempt_id=11)),
             (sa, pb.TaskIdentity(stage_id=1, partition_id=0, attempt_number=2,
                                  task_attempt_id=12))]
    answers = [stub.ReportFailures(pb.ReportFailuresRequest(
        job="once", run_id=RUN, task=t, records=_records("p", 3)), timeout=10,
        metadata=rpc.md(reg.job_token)) for stub, t in tasks]
    for resp in answers:
        assert [(v.action, v.dead_lettered) for v in resp.verdicts] == [
            (pb.ACTION_SKIP, True)] * 3
    # node b answered its copy provisionally (the first-seen answer) and dropped its held copy
    # once the home said it was already in the DLQ (docs/POLICY.md, "Provisional verdicts")
    assert all("not written again" in v.reason for v in answers[2].verdicts)
    for stub, t in tasks:
        stub.FlushTask(pb.FlushTaskRequest(job="once", run_id=RUN, task=t), timeout=20,
                       metadata=rpc.md(reg.job_token))
    keys = sorted(m.key() for m in read_all(broker.bootstrap_servers, topic_name))
    assert keys == [b"p-0", b"p-1", b"p-2"]
    home = sa.GetJobSummary(pb.GetJobSummaryRequest(job="once", run_id=RUN), timeout=5,
                            metadata=rpc.md(reg.job_token))
    assert home.total_record_errors == 3 and home.total_records_skipped == 3


def test_records_a_full_spool_refused_are_dead_lettered_on_their_next_report(
        two_nodes, broker, topic_name, tmp_path):
    from spillway.sidecar.server import start_server

    a, _ = two_nodes
    full = start_server({
        "listen.address": "127.0.0.1:0", "bootstrap.servers": broker.bootstrap_servers,
        "spool.dir": str(tmp_path / "spool"), "spool.max.records": "1",
        "sidecar.id": "node-full", "home.allowed.addresses": "127.0.0.0/8"})
    try:
        props = _dlq_props(topic_name)
        sa, sf = rpc.stub(a), rpc.stub(full)
        reg = sa.RegisterJob(pb.RegisterJobRequest(job="undo", run_id=RUN, properties=props),
                             timeout=20)
        sf.RegisterJob(pb.RegisterJobRequest(job="undo", run_id=RUN, properties=props,
                                             home=reg.home,
                                             home_instance_id=reg.home_instance_id),
                       timeout=20, metadata=rpc.md(reg.job_token))
        t0 = pb.TaskIdentity(stage_id=1, partition_id=0, attempt_number=0, task_attempt_id=20)
        with pytest.raises(grpc.RpcError) as err:   # 2 records, room for 1: none stored
            sf.ReportFailures(pb.ReportFailuresRequest(
                job="undo", run_id=RUN, task=t0, records=_records("u", 2)), timeout=10,
                metadata=rpc.md(reg.job_token))
        # it could not fit even the empty spool: refused before anything was decided (a client
        # splits it; here the task is retried on another node instead)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # the task is retried on node a: its records were never written, so they are now
        t1 = pb.TaskIdentity(stage_id=1, partition_id=0, attempt_number=1, task_attempt_id=21)
        resp = sa.ReportFailures(pb.ReportFailuresRequest(
            job="undo", run_id=RUN, task=t1, records=_records("u", 2)), timeout=10,
            metadata=rpc.md(reg.job_token))
        assert all(v.dead_lettered and "not written again" not in v.reason
                   for v in resp.verdicts)
        assert sa.FlushTask(pb.FlushTaskRequest(job="undo", run_id=RUN, task=t1), timeout=20,
                            metadata=rpc.md(reg.job_token)).dlq_records_acknowledged == 2
        keys = sorted(m.key() for m in read_all(broker.bootstrap_servers, topic_name))
        assert keys == [b"u-0", b"u-1"]
    finally:
        full.stop(1.0)


def test_a_home_that_lost_the_run_hears_of_it_again_when_the_executor_registers_again(
        two_nodes):
    """The home restarted or expired the run while a node still has it: the node relays
    NOT_FOUND, the executor registers again (as the client does on NOT_FOUND), the node forwards
    that to the home, which takes the run back with the executor's token."""
    a, b = two_nodes
    sa, sb = rpc.stub(a), rpc.stub(b)
    props = {"errors.tolerance": "all"}
    reg = sa.RegisterJob(pb.RegisterJobRequest(job="lost-home", run_id=RUN, properties=props),
                         timeout=20)
    register_on_b = pb.RegisterJobRequest(job="lost-home", run_id=RUN, properties=props,
                                          home=reg.home, home_instance_id=reg.home_instance_id)
    sb.RegisterJob(register_on_b, timeout=20, metadata=rpc.md(reg.job_token))
    sa.EndJob(pb.EndJobRequest(job="lost-home", run_id=RUN, local_only=True), timeout=20,
              metadata=rpc.md(reg.job_token) + peer_md())  # only the home forgets it
    report = pb.ReportFailuresRequest(job="lost-home", run_id=RUN, records=_records("l", 1),
                                      task=pb.TaskIdentity(stage_id=1, task_attempt_id=3))
    with pytest.raises(grpc.RpcError) as lost:
        sb.ReportFailures(report, timeout=10, metadata=rpc.md(reg.job_token))
    assert lost.value.code() == grpc.StatusCode.NOT_FOUND
    sb.RegisterJob(register_on_b, timeout=20, metadata=rpc.md(reg.job_token))
    out = sb.ReportFailures(report, timeout=10, metadata=rpc.md(reg.job_token))
    assert out.verdicts[0].action == pb.ACTION_SKIP
    assert sa.GetJobSummary(pb.GetJobSummaryRequest(job="lost-home", run_id=RUN), timeout=5,
                            metadata=rpc.md(reg.job_token)).total_record_errors == 1


def test_a_columnar_report_the_node_passes_on_whole_is_decided_at_the_home(
        two_nodes, broker, topic_name):
    """A report with recovered ids goes to the home whole (decide_only): a columnar one is
    passed on as messages, decided there once per record, dead-lettered on the node, and
    answered to the executor as columns."""
    from spillway.client import columns

    a, b = two_nodes
    props = _dlq_props(topic_name)
    sa, sb = rpc.stub(a), rpc.stub(b)
    run = "app-20261123000000-0043"
    reg = sa.RegisterJob(pb.RegisterJobRequest(job="cols", run_id=run, properties=props),
                         timeout=20)
    assert sb.RegisterJob(pb.RegisterJobRequest(
        job="cols", run_id=run, properties=props, home=reg.home,
        home_instance_id=reg.home_instance_id), timeout=20,
        metadata=rpc.md(reg.job_token)).report_columns
    task = pb.TaskIdentity(stage_id=1, partition_id=0, attempt_number=0, task_attempt_id=20)
    try:
        raise ValueError("bad")
    except ValueError as exc:
        fs = [columns.failure(f"c-{i}", "TRANSFORMATION", exc, key=f"c-{i}".encode(),
                              value=b"bad", function_name="app.f") for i in range(4)]
    resp = sb.ReportFailures(pb.ReportFailuresRequest(
        job="cols", run_id=run, task=task, columns=columns.encode(fs),
        recovered_record_ids=["c-earlier"], verdict_columns=True), timeout=10,
        metadata=rpc.md(reg.job_token))
    verdicts = columns.verdicts(resp.columns, [f.record_id for f in fs], "node b")
    assert [(v.action, v.dead_lettered) for v in verdicts] == [(pb.ACTION_SKIP, True)] * 4
    sb.FlushTask(pb.FlushTaskRequest(job="cols", run_id=run, task=task), timeout=20,
                 metadata=rpc.md(reg.job_token))
    keys = sorted(m.key() for m in read_all(broker.bootstrap_servers, topic_name))
    assert keys == [b"c-0", b"c-1", b"c-2", b"c-3"]
    home = sa.GetJobSummary(pb.GetJobSummaryRequest(job="cols", run_id=run), timeout=5,
                            metadata=rpc.md(reg.job_token))
    assert home.total_record_errors == 4 and home.total_records_skipped == 4
