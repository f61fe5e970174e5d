"""Provisional verdicts against real sidecars (docs/POLICY.md, "Provisional verdicts"): a node
answers a report of a run homed elsewhere at once when nothing but identity decides, holds its
DLQ records and confirms them with the home in the background. The answers, counts and DLQ
records are those of the synchronous path; a record is dead-lettered once across nodes, task
re-runs and a node restarted mid-confirmation; a task learns at its flush that the run failed
meanwhile."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from spillway.v1 import sidecar_pb2 as pb
from support.creds import peer_md
from support.homes import (
    Gate,
    flush,
    md,
    record,
    register,
    register_again,
    report,
    start,
    stub,
    summary,
    task,
    until_nothing_held,
)
from support.kafka import read_all
from support.records import json_error

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def home(broker, tmp_path_factory):
    h = start(broker, tmp_path_factory.mktemp("prov-home"), "prov-home")
    yield h
    h.stop(1.0)


@pytest.fixture
def node(broker, tmp_path):
    n = start(broker, tmp_path / "node-spool", "prov-node")
    yield n
    n.stop(1.0)


_exc = json_error


def _verdicts(resp):
    return [(v.record_id, v.action, v.category, v.reason, v.attempt, v.dead_lettered)
            for v in resp.verdicts]


def test_answers_counts_and_dead_letters_are_those_of_waiting_for_the_home(home, node, broker,
                                                                          monkeypatch):
    """The same reports (a run failing alike, distinct messages, a re-report of a task re-run)
    through a node that answers provisionally and one that waits for the home."""
    reports = [[record(f"r{i}") for i in range(60)]
               + [record(f"m{i}", exc=_exc(msg=f"Expecting value: column {i}"))
                  for i in range(5)],
               [record(f"r{i}") for i in range(10)] + [record(f"t{i}") for i in range(20)]]
    out = {}
    for provisional in (False, True):
        monkeypatch.setitem(node.sidecar.props, "home.confirm.async", provisional)
        job, token, topic, _ = register(home, [node], {})
        calls = node.sidecar.confirmations.calls
        answers = [[(*v[:3], v[3].replace(topic, "<topic>"), *v[4:])
                    for v in _verdicts(report(node, job, token, task(n), recs))]
                   for n, recs in enumerate(reports)]
        acked = [flush(node, job, token, task(n)) for n in range(len(reports))]
        totals = summary(home, job, token)
        run = node.sidecar.registry.get(job, "r")
        if provisional:
            assert (job, "r") not in run.home._tallies   # no report waited for the home
            assert node.sidecar.confirmations.calls > calls
        else:
            assert run.home._tallies[(job, "r")].items == 2
        dlq = sorted((m.key(), m.value()) for m in read_all(broker.bootstrap_servers, topic))
        counts = (totals.total_record_failures, totals.total_record_errors,
                  totals.total_records_skipped, totals.total_errors_logged,
                  totals.dlq_records_written, list(totals.by_stage))
        out[provisional] = (answers, acked, counts, dlq)
    sync, prov = out[False], out[True]
    # the re-reported records: "already in the DLQ" when waiting, the first answer when not
    # (the executor skips them either way; the held copy is dropped)
    for (sa, pa) in zip(sync[0], prov[0], strict=True):
        for s, p in zip(sa, pa, strict=True):
            assert p[:2] == s[:2] and p[5] is True
            if "already" not in s[3]:
                assert p == s
    assert prov[1] == sync[1] == [65, 20]
    assert prov[2] == sync[2]
    assert prov[3] == sync[3] and len(prov[3]) == 85


def test_a_record_reported_on_two_nodes_is_dead_lettered_once(home, broker, tmp_path):
    n1 = start(broker, tmp_path / "n1", "prov-n1")
    n2 = start(broker, tmp_path / "n2", "prov-n2")
    try:
        job, token, topic, _ = register(home, [n1, n2], {})
        records = [record(f"s{i}") for i in range(40)]
        # a task and its speculative copy on another node, at the same time
        with_threads = [threading.Thread(target=report, args=(n, job, token, task(k),
                                                                records))
                        for k, n in enumerate((n1, n2))]
        for t in with_threads:
            t.start()
        for t in with_threads:
            t.join()
        assert flush(n1, job, token, task(0)) + flush(n2, job, token, task(1)) == 40
        keys = [m.key() for m in read_all(broker.bootstrap_servers, topic)]
        assert sorted(keys) == sorted(r.record_id.encode() for r in records)
        s = summary(home, job, token)
        assert s.total_record_errors == 40 and s.total_record_failures == 80
    finally:
        n1.stop(1.0)
        n2.stop(1.0)


def test_a_task_learns_at_its_flush_that_the_run_failed_before_its_records_were_confirmed(
        home, node, broker):
    job, token, topic, _ = register(home, [node], {})
    gate = Gate(node, job)
    held = report(node, job, token, task(0), [record(f"h{i}") for i in range(5)])
    assert all(v.action == pb.ACTION_SKIP and v.dead_lettered for v in held.verdicts)
    # meanwhile the run fails at its home (an invalid-configuration error elsewhere)
    failing = report(home, job, token, task(9), [record(
        "cfg", exc=_exc("org.apache.kafka.common.errors.InvalidConfigurationException",
                        "bad setting"))])
    assert failing.verdicts[0].action == pb.ACTION_FAIL
    gate.open.set()
    with pytest.raises(grpc.RpcError) as failed:
        flush(node, job, token, task(0))
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "answered record" in failed.value.details() and "FAIL" in failed.value.details()
    assert node.sidecar.pipeline.store.held_count() == 0
    assert read_all(broker.bootstrap_servers, topic, timeout_s=5) == []   # nothing written
    # and a report after that waits for the home: the run is known to have failed
    again = report(node, job, token, task(1), [record("late")])
    assert again.verdicts[0].action == pb.ACTION_FAIL


def test_a_node_restarted_mid_confirmation_writes_each_record_once(home, broker, tmp_path):
    """The node is stopped after its home committed a held report but before the node
    released it (the home answered nobody): restarted on the same spool, the run registered
    again, it asks again under the same claim and writes the records, once. A second held
    report whose records another task had dead-lettered meanwhile is dropped."""
    spool = tmp_path / "node"
    node = start(broker, spool, "prov-restart")
    job, token, topic, props = register(home, [node], {})
    gate = Gate(node, job)
    report(node, job, token, task(0), [record(f"a{i}") for i in range(30)])
    report(node, job, token, task(1), [record(f"b{i}") for i in range(10)])
    store = node.sidecar.pipeline.store
    rows = store.held_rows()
    assert len(rows) == 2 and store.held_count() == 40
    # the home commits the first report under its claim (the node never hears the answer) ...
    first = pb.TallyReport.FromString(rows[0][2])
    stub(home).TallyFailures(pb.TallyRequest(job=job, run_id="r", reports=[first]),
                              timeout=10, metadata=[*peer_md(), *md(token)])
    # ... and another task dead-letters the second report's records through the home
    report(home, job, token, task(5), [record(f"b{i}") for i in range(10)])
    node.sidecar.confirmations.close()   # a crash: nothing more is confirmed or released
    node.stop(0.5)
    gate.open.set()

    node = start(broker, spool, "prov-restart")
    try:
        assert node.sidecar.pipeline.store.held_count() == 40
        register_again(home, node, job, token, props)
        assert node.sidecar.pipeline.store.held_count() == 0
        node.sidecar.pipeline.force_flush(20)
        keys = sorted(m.key() for m in read_all(broker.bootstrap_servers, topic))
        assert keys == sorted([f"a{i}".encode() for i in range(30)]
                              + [f"b{i}".encode() for i in range(10)])   # each once
        assert summary(home, job, token).total_record_errors == 40
    finally:
        node.stop(1.0)


def test_ending_the_run_at_its_home_confirms_what_its_nodes_hold_first(home, node, broker):
    """EndJob right after a report, without a flush: the home ends the run on its nodes
    first, which confirm what they hold while it still has the run, so its final summary
    counts those records and each reaches the topic once."""
    job, token, topic, _ = register(home, [node], {})
    gate = Gate(node, job)
    report(node, job, token, task(0), [record(f"e{i}") for i in range(25)])
    threading.Timer(0.5, gate.open.set).start()
    ended = stub(home).EndJob(pb.EndJobRequest(job=job, run_id="r"), timeout=30,
                               metadata=md(token))
    final = {s.sidecar_id: s for s in ended.summaries}
    assert final["prov-home"].total_record_errors == 25 and not ended.unreachable
    keys = sorted(m.key() for m in read_all(broker.bootstrap_servers, topic))
    assert keys == sorted(f"e{i}".encode() for i in range(25))


def test_past_its_memory_bound_a_report_waits_for_its_home(home, node, monkeypatch):
    from spillway.sidecar.federation import confirm

    monkeypatch.setattr(confirm, "MAX_HELD_IN_MEMORY", 30)
    job, token, _topic, _ = register(home, [node], {})
    gate = Gate(node, job)
    report(node, job, token, task(0), [record(f"x{i}") for i in range(20)])   # held
    run = node.sidecar.registry.get(job, "r")
    assert (job, "r") not in run.home._tallies
    # 20 held + 20 more would pass 30: this one is decided by the home before it is answered
    report(node, job, token, task(1), [record(f"y{i}") for i in range(20)])
    assert run.home._tallies[(job, "r")].items == 1
    gate.open.set()
    assert flush(node, job, token, task(0)) == 20 and flush(node, job, token, task(1)) == 20


def test_a_run_expiring_on_a_node_writes_what_it_still_holds(home, node, broker):
    """Idle expiry on the node (no EndJob): what is held and not yet sent is written as it is
    (never lost; a copy the home also has elsewhere would be a duplicate), and the report in
    flight is applied when its answer comes."""
    job, token, topic, _ = register(home, [node], {})
    gate = Gate(node, job)
    report(node, job, token, task(0), [record(f"i{i}") for i in range(10)])
    deadline = time.monotonic() + 10
    while gate.calls == 0 and time.monotonic() < deadline:   # the first report is in flight
        time.sleep(0.01)
    report(node, job, token, task(1), [record(f"q{i}") for i in range(10)])   # queued
    run = node.sidecar.registry.get(job, "r")
    node.sidecar.ending.release(run, time.monotonic(), expired=True)
    gate.open.set()
    node.sidecar.pipeline.force_flush(20)
    until_nothing_held(node)
    assert node.sidecar.pipeline.store.held_count() == 0
    keys = sorted(m.key() for m in read_all(broker.bootstrap_servers, topic))
    assert keys == sorted([f"i{i}".encode() for i in range(10)]
                          + [f"q{i}".encode() for i in range(10)])


def test_held_rows_of_a_run_that_never_registers_again_are_written_after_the_idle_timeout(
        home, broker, tmp_path):
    from spillway.sidecar.server import start_server

    spool = tmp_path / "orphans"
    node = start(broker, spool, "prov-orphan")
    job, token, topic, _ = register(home, [node], {})
    gate = Gate(node, job)
    report(node, job, token, task(0), [record(f"o{i}") for i in range(12)])
    node.sidecar.confirmations.close()
    node.stop(0.5)
    gate.open.set()
    node = start_server({
        "listen.address": "127.0.0.1:0", "bootstrap.servers": broker.bootstrap_servers,
        "spool.dir": str(spool), "producer.linger.ms": "5", "sidecar.id": "prov-orphan",
        "home.allowed.addresses": "127.0.0.0/8", "job.idle.timeout.ms": "1000"})
    try:
        assert node.sidecar.pipeline.store.held_count() == 12
        until_nothing_held(node)   # nobody registers the run here again
        assert node.sidecar.pipeline.store.held_count() == 0
        node.sidecar.pipeline.force_flush(20)
        keys = sorted(m.key() for m in read_all(broker.bootstrap_servers, topic))
        assert keys == sorted(f"o{i}".encode() for i in range(12))
    finally:
        node.stop(1.0)


def test_a_home_that_cannot_confirm_gets_the_held_records_written_as_they_are(home, node,
                                                                             broker):
    """A home older than TallyFailures answers UNIMPLEMENTED: the held records are written
    as they are (never lost), the task's flush succeeds, and later reports wait for it."""
    from spillway.sidecar.federation.peers import HomeError

    job, token, topic, _ = register(home, [node], {})
    run = node.sidecar.registry.get(job, "r")

    def older(*_a, **_kw):
        run.home.tally_supported = False   # what peers.Home learns from UNIMPLEMENTED
        raise HomeError(grpc.StatusCode.UNIMPLEMENTED, "unknown method TallyFailures")
    run.home.confirm = older
    report(node, job, token, task(0), [record(f"u{i}") for i in range(8)])
    assert flush(node, job, token, task(0)) == 8
    keys = sorted(m.key() for m in read_all(broker.bootstrap_servers, topic))
    assert keys == sorted(f"u{i}".encode() for i in range(8))
    assert node.sidecar.confirmations.answer(run, None, [], token, "") is None


def test_a_waiting_report_whose_node_dies_before_spooling_is_not_lost(home, broker, tmp_path,
                                                                     monkeypatch):
    """A report that waits for its home (a tolerance limit): the node holds copies of its data
    errors' DLQ records under a claim before asking. Killed after the home answered but before
    it spooled (simulated: the spool write fails and the process does nothing more), the node
    confirms the held copies after its restart and writes them; the task's retry is answered
    "already in the DLQ". Without the held copies that record would be counted and never
    dead-lettered."""
    spool = tmp_path / "guarded"
    node = start(broker, spool, "prov-guard")
    job, token, topic, props = register(home, [node], {"errors.tolerance.max.errors": "100"})
    s = node.sidecar
    real_submit = s.pipeline.submit

    def dies(records, *, release=0, segments=None):
        if records:
            raise RuntimeError("killed before the spool's commit")
        return real_submit(records, release=release, segments=segments)
    monkeypatch.setattr(s.pipeline, "submit", dies)
    monkeypatch.setattr(s.reporting, "_undo_dead_letters", lambda *a, **kw: None)   # no time left
    monkeypatch.setattr(s.confirmations, "drop", lambda *a, **kw: None)
    with pytest.raises(grpc.RpcError):
        report(node, job, token, task(0), [record(f"g{i}") for i in range(6)])
    assert s.pipeline.store.held_count() == 6
    s.confirmations.close()
    node.stop(0.5)
    monkeypatch.undo()

    node = start(broker, spool, "prov-guard")
    try:
        register_again(home, node, job, token, props)
        assert node.sidecar.pipeline.store.held_count() == 0
        # Spark's retry of the task: already in the DLQ, not written again
        again = report(node, job, token, task(1), [record(f"g{i}") for i in range(6)])
        assert all("already in the DLQ" in v.reason for v in again.verdicts)
        flush(node, job, token, task(1))
        node.sidecar.pipeline.force_flush(20)
        keys = sorted(m.key() for m in read_all(broker.bootstrap_servers, topic))
        assert keys == sorted(f"g{i}".encode() for i in range(6))   # each once
        assert summary(home, job, token).total_record_errors == 6
    finally:
        node.stop(1.0)


def test_an_unreachable_home_is_asked_again_with_backoff_and_the_flush_says_why(home, broker,
                                                                              tmp_path):
    """The home does not answer: the held reports stay held, calls back off (even with a full
    call's worth queued), and the task's flush times out naming the home's last error."""
    from spillway.sidecar.server import start_server

    node = start_server({   # flush.timeout.ms: the sidecar's own deadline, not the caller's
        "listen.address": "127.0.0.1:0", "bootstrap.servers": broker.bootstrap_servers,
        "spool.dir": str(tmp_path / "down"), "sidecar.id": "prov-down",
        "home.allowed.addresses": "127.0.0.0/8", "flush.timeout.ms": "1500"})
    try:
        _home_down(home, node)
    finally:
        node.stop(1.0)


def _home_down(home, node):
    from spillway.sidecar.federation.peers import HomeError

    job, token, _topic, _ = register(home, [node], {})
    run = node.sidecar.registry.get(job, "r")
    calls = []

    def down(*_a, **_kw):
        calls.append(time.monotonic())
        raise HomeError(grpc.StatusCode.UNAVAILABLE, "home 10.0.0.9:50051 unreachable")
    run.home.confirm = down
    for n in range(2):   # 20,000 records: more than one call carries
        report(node, job, token, task(n), [record(f"d{n}-{i}") for i in range(10_000)])
    # the confirmations run in the background: on a busy machine the first may come late, so
    # the 1.5 s in which they may not loop are counted from it, not from the reports
    first = time.monotonic() + 30
    while not calls and time.monotonic() < first:
        time.sleep(0.01)
    assert calls, "the node never tried to confirm with its home"
    time.sleep(max(0.0, calls[0] + 1.5 - time.monotonic()))
    assert 1 <= len(calls) <= 8, len(calls)    # 0.1, 0.2, 0.4, 0.8 s apart, not a busy loop
    with pytest.raises(grpc.RpcError) as late:   # no deadline of the caller's: the sidecar's
        stub(node).FlushTask(pb.FlushTaskRequest(job=job, run_id="r", task=task(0)),
                              metadata=md(token))
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "not confirmed by the run's home" in late.value.details()
    assert "home 10.0.0.9:50051 unreachable" in late.value.details()
    assert node.sidecar.pipeline.store.held_count() == 20_000
