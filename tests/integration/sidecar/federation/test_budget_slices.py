"""Budget slices against real sidecars (docs/POLICY.md, "Budget slices"): with an error limit
(errors.tolerance.max.errors), a node answers a run's reports on its own while it holds room
in a slice of the budget its home granted, and the limit stays exact: the run fails on the
limit + 1st distinct error wherever it was reported, exactly `limit` records are dead-lettered,
and a task that was answered SKIP for a record past the limit fails at its flush."""

from __future__ import annotations

import threading

import grpc
import pytest

from spillway.sidecar.core.jobstate import run_key
from spillway.v1 import sidecar_pb2 as pb
from support.engines import run_state
from support.homes import flush, record, register, report, start, stub, summary, task
from support.kafka import read_all

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def home(broker, tmp_path_factory):
    h = start(broker, tmp_path_factory.mktemp("slice-home"), "slice-home")
    yield h
    h.stop(1.0)


@pytest.fixture
def nodes(broker, tmp_path):
    ns = [start(broker, tmp_path / f"n{i}", f"slice-n{i}") for i in range(2)]
    yield ns
    for n in ns:
        n.stop(1.0)


def _limit(n):
    return {"errors.tolerance.max.errors": str(n)}


def _waited(node, job):
    """Reports of the run that went to its home and waited there."""
    group = node.sidecar.registry.get(job, "r").home._tallies.get((job, "r"))
    return group.items if group is not None else 0


def test_within_the_limit_most_reports_do_not_wait_and_every_record_is_dead_lettered(
        home, nodes, broker):
    job, token, topic, _ = register(home, nodes, _limit(10_000))
    n = 0
    for node in nodes:
        for k in range(20):
            resp = report(node, job, token, task(n), [record(f"{n}-{i}") for i in range(25)])
            assert all(v.action == pb.ACTION_SKIP and v.dead_lettered for v in resp.verdicts)
            n += 1
    for node in nodes:
        # the first report asked for a slice and waited; the rest were answered under it
        assert _waited(node, job) == 1
        assert node.sidecar.confirmations.slices.granted == 1
    assert sum(flush(node, job, token, task(k)) for k, node in
               enumerate(x for x in nodes for _ in range(20))) == 1000
    s = summary(home, job, token)
    assert s.total_record_errors == 1000 and not s.failed
    assert len(read_all(broker.bootstrap_servers, topic)) == 1000


def test_the_limit_stays_exact_across_nodes(home, nodes, broker):
    """Two nodes each report 60 distinct errors, 10 a report, against a limit of 100: the run
    fails, 100 records are dead-lettered once each and the tasks answered SKIP for records the
    home counted past the limit fail at their flush (or were answered FAIL outright)."""
    limit = 100
    job, token, topic, _ = register(home, nodes, _limit(limit))
    answers: dict[tuple[int, int], list] = {}

    def run(i, node):
        for k in range(6):
            t = task(10 * i + k)
            try:
                resp = report(node, job, token, t, [record(f"{i}-{k}-{r}") for r in range(10)])
                answers[(i, k)] = [v.action for v in resp.verdicts]
            except grpc.RpcError as exc:   # a limit run may refuse a report with the run failed
                answers[(i, k)] = [exc.code()]
    threads = [threading.Thread(target=run, args=(i, n)) for i, n in enumerate(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flushed = failed = 0
    for i, node in enumerate(nodes):
        for k in range(6):
            try:
                flushed += flush(node, job, token, task(10 * i + k))
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.details()
                failed += 1
    s = summary(home, job, token)
    assert s.failed and "errors.tolerance.max.errors=100" in s.failure_reason
    dlq = [m.key() for m in read_all(broker.bootstrap_servers, topic)]
    assert len(dlq) == len(set(dlq)) == limit
    assert flushed <= limit
    # every task either flushed its records or learned that the run failed
    fails = sum(1 for a in answers.values() if pb.ACTION_FAIL in a)
    assert failed + fails >= 1
    assert any(n.sidecar.confirmations.slices.answered for n in nodes)


def test_near_the_limit_slices_shrink_and_then_reports_wait(home, nodes):
    limit = 40
    job, token, _, _ = register(home, nodes[:1], _limit(limit))
    node = nodes[0]
    sizes = []
    real = node.sidecar.confirmations.slices.grant

    def grant(key, g):
        sizes.append(g.size)
        real(key, g)
    node.sidecar.confirmations.slices.grant = grant
    for k in range(limit):
        resp = report(node, job, token, task(k), [record(f"x{k}")])
        assert resp.verdicts[0].action == pb.ACTION_SKIP
    for k in range(limit):
        flush(node, job, token, task(k))
    # a slice never outgrows half the free budget, and they shrink with it to one error (in
    # an order that depends on how soon the home confirmed what was answered under them)
    assert sizes and max(sizes) == sizes[0] <= limit // 2 and min(sizes) == 1
    assert sum(sizes) <= limit
    # the budget is spent: the next error waits for the home and fails the run at once
    resp = report(node, job, token, task(99), [record("one-too-many")])
    assert resp.verdicts[0].action == pb.ACTION_FAIL and resp.verdicts[0].job_failed


def test_slices_are_durable_at_the_home_across_its_restart(broker, tmp_path):
    """A home restarted with a slice granted keeps reserving it (it is in the run's journal),
    so what it grants after the restart still adds up to no more than the budget."""
    spool = tmp_path / "home"
    h = start(broker, spool, "slice-durable")
    n = start(broker, tmp_path / "node", "slice-durable-n")
    try:
        job, token, _, props = register(h, [n], _limit(1000))
        report(n, job, token, task(0), [record("a")])
        book = run_state(h.sidecar.engine, run_key(job, "r")).slices
        before = book.state()
        assert len(before["slices"]) == 1
        h.stop(1.0)
        h = start(broker, spool, "slice-durable")
        stub(h).RegisterJob(pb.RegisterJobRequest(job=job, run_id="r", properties=props),
                            timeout=10, metadata=[("spillway-job-token", token)])
        assert run_state(h.sidecar.engine, run_key(job, "r")).slices.state() == before
    finally:
        h.stop(1.0)
        n.stop(1.0)


def test_a_peer_asking_for_too_much_or_closing_too_many_is_refused_and_changes_nothing(home):
    """A peer's slice fields are bounded (INVALID_ARGUMENT naming the field) and a refused
    tally grants nothing."""
    from support.creds import peer_md

    job, token, _, _ = register(home, [], _limit(1000))
    book = run_state(home.sidecar.engine, run_key(job, "r")).slices

    def tally(**fields):
        req = pb.TallyRequest(job=job, run_id="r")
        rep = req.reports.add(task=task(0), record_ids=["x"], payload_digests=bytes(8),
                              **fields)
        rep.groups.add(count=1, stage=pb.STAGE_TRANSFORMATION, function_name="f",
                       exception=pb.ExceptionInfo(class_name="builtins.ValueError"))
        return stub(home).TallyFailures(req, timeout=10,
                                        metadata=[*peer_md(), ("spillway-job-token", token)])

    with pytest.raises(grpc.RpcError) as refused:
        tally(want_slice=65_537)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "reports[0].want_slice" in refused.value.details()
    with pytest.raises(grpc.RpcError) as refused:
        tally(closed_slices=[pb.SliceUse(id=i + 1, used=1) for i in range(1025)])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "reports[0].closed_slices" in refused.value.details()
    assert book.slices == {} and summary(home, job, token).total_record_errors == 0
    # asked within bounds, a peer gets a slice of the free budget, never more than half of it
    granted = tally(want_slice=65_536).reports[0].grant
    assert 0 < granted.size <= (1000 - 1) // 2 and granted.lease_ms > 0
    # unknown slices closed or spent are ignored
    tally(slice=12345, closed_slices=[pb.SliceUse(id=999, used=10**9)])
    assert list(book.slices) == [granted.id]
