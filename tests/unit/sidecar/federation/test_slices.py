"""Budget slices (core/slices.py at the home, node_slices.py on a node): which runs have them,
how big a grant is, how reservations are spent, closed and expire, and that the home's table is
journaled with the run. The limit's exactness is the confirmation's (test_budget_slices.py);
what is checked here is that grants never add up to more than the free budget."""

from __future__ import annotations

import pickle

import pytest
from spillway.sidecar.core.model import ExceptionInfo, FailedRecord, TaskIdentity
from spillway.sidecar.core.slices import MAX_OPEN, MAX_SLICE, SliceAsk, SliceBook
from spillway.sidecar.federation.node_slices import MAX_HELD, SLICE_WANT, NodeSlices
from spillway.v1 import sidecar_pb2 as pb
from support.deciding import Tally, decisions, tally
from support.engines import journaled, run_state
from support.fakes import FakeClock

DATA = ExceptionInfo("json.decoder.JSONDecodeError",
                     ("json.decoder.JSONDecodeError", "builtins.ValueError",
                      "builtins.Exception"), "Expecting value")
LIMITED = {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": "dlq.t",
           "errors.tolerance.max.errors": "100"}
TASK = TaskIdentity(stage_id=1, partition_id=0, attempt_number=0, task_attempt_id=7)


def _stage():
    from spillway.sidecar.transport import convert
    return convert.stage_ref(pb.STAGE_TRANSFORMATION, "", "t")


def _tally(e, key, ids, ask):
    stage = _stage()
    return tally(e, key, Tally(TASK, list(ids), [7] * len(ids),
                               [(stage, DATA, "parse", len(ids))], 0, ask), [])


@pytest.mark.parametrize(("extra", "sliced"), [
    ({}, True),
    ({"errors.tolerance.max.errors": "0"}, True),             # sliced, never granted
    ({"errors.tolerance.max.errors": "-1"}, False),           # no limit: provisional anyway
    ({"errors.tolerance.window.ms": "60000"}, False),         # when an error counts matters
    ({"errors.tolerance.max.ratio": "0.1"}, False),
    ({"errors.tolerance.per.stage": "true"}, False),
    ({"errors.tolerance": "none", "errors.tolerance.max.errors": "-1"}, False),
    ({"errors.deadletterqueue.topic.name": ""}, False),
    ({"errors.handler.class": "LogAndFail"}, False),
])
def test_which_runs_have_slices(extra, sliced):
    e, key = journaled({**LIMITED, **extra})
    assert e.sliceable(key) is sliced


def test_a_limited_run_is_answered_provisionally_only_under_a_slice():
    e, key = journaled(LIMITED)
    records = [FailedRecord(f"r{i}", _stage(), DATA, "parse", tag=7) for i in range(3)]
    assert e.provisional(key, records) is None
    verdicts = [v for v, n in e.provisional(key, records, sliced=True) for _ in range(n)]
    home = [d.verdict for d in decisions(e, key, TASK, records)]
    assert [(v.action, v.reason) for v in verdicts] == [(v.action, v.reason) for v in home]


def test_grants_share_the_free_budget_shrink_near_the_limit_and_never_exceed_it():
    book = SliceBook(1000)
    sizes = [book.grant(i + 1, 10_000, 0, 0) for i in range(MAX_OPEN)]
    assert sizes[:3] == [500, 125, 62]            # half the free budget, split among holders
    assert sum(sizes) == 1000 and book.reserved(0) == 1000
    assert 1 in sizes and sizes[-1] == 0          # down to one error, then none
    assert book.grant(99, 5, 900, 0) == 0         # nothing free: counted errors count too
    assert SliceBook(10).grant(1, 10, 0, 0, least=6) == 0   # a share under the report's size
    assert SliceBook(10 ** 9).grant(1, 10 ** 9, 0, 0) == MAX_SLICE


def test_a_reservation_is_spent_by_confirmations_and_ends_with_its_close_or_lease():
    book = SliceBook(100, lease_ms=1000)
    assert book.grant(1, 40, 0, 0) == 40
    book.confirmed(1, 10)
    assert book.reserved(0) == 30
    book.close(1, 25)                   # answered 25 under it: 15 still to be confirmed
    assert book.reserved(0) == 15
    book.confirmed(1, 15)
    assert book.reserved(0) == 0 and not book.slices
    assert book.grant(2, 40, 0, 0) == 40
    assert book.reserved(999) > 0 and book.reserved(1000) == 0   # the lease ran out
    book.confirmed(404, 5)              # unknown or ended slices: nothing happens
    book.close(404, 5)
    assert len({book.grant(i, 1, 0, 0) for i in range(10, 10 + MAX_OPEN + 5)}) == 2  # 1s, 0s


def test_the_homes_table_is_journaled_and_replayed_with_the_run():
    clock = FakeClock()
    e, key = journaled(LIMITED, clock=clock)
    ask = SliceAsk(want=SLICE_WANT, new_id=42)
    _tally(e, key, ["a", "b"], ask)
    assert ask.granted == (100 - 2) // 2
    held = SliceAsk(slice=42)
    _tally(e, key, ["c"], held)
    j = run_state(e, key)
    state = j.slices.state()
    assert state["slices"] == {42: [49, 1, -1, clock.wall_ms() + 30_000]}
    _, entries = j.snapshot()
    e2, key2 = journaled(LIMITED)
    run_state(e2, key2).replay(entries)
    assert run_state(e2, key2).slices.state() == state
    journal: list = []
    tally(e, key, Tally(TASK, [], [], [], 0, SliceAsk(closed=[(42, 1)])), journal)
    assert not j.slices.slices
    # one slice's change, not the table; replayed over the snapshot it ends the slice
    entries = pickle.loads(journal[0][1])
    assert ("b", 42, None, 1) in entries
    run_state(e2, key2).replay(entries)
    assert not run_state(e2, key2).slices.slices


def test_no_grant_once_the_run_failed():
    e, key = journaled({**LIMITED, "errors.tolerance.max.errors": "2"})
    _tally(e, key, ["a", "b", "c"], None)
    ask = SliceAsk(want=10, new_id=7)
    _tally(e, key, ["d"], ask)
    assert ask.granted == 0


def _slice(sid, size, lease_ms=60_000):
    return pb.BudgetSlice(id=sid, size=size, lease_ms=lease_ms)


def test_a_node_spends_its_slices_and_closes_them_when_out_of_room():
    n = NodeSlices()
    assert n.take("k", 1) == 0 and n.ask("k", 10) == (SLICE_WANT, [])
    n.grant("k", _slice(5, 25))
    assert n.ask("k", 10) == (0, [])             # room enough: it asks for nothing
    assert [n.take("k", 10) for _ in range(3)] == [5, 5, 0]
    want, closed = n.ask("k", 10)                # 5 left, too few for 10: closed
    assert want == SLICE_WANT and closed == [(5, 20)]
    n.grant("k", _slice(6, 4))
    assert n.take("k", 4) == 6 and n.closes("k") == [(6, 4)]   # spent: closed at once
    assert n.answered == 24 and n.granted == 2


def test_a_node_stops_using_a_slice_at_half_its_lease_and_holds_a_bounded_number():
    n = NodeSlices()
    n.grant("k", _slice(1, 100, lease_ms=0))
    assert n.take("k", 1) == 0 and n.closes("k") == [(1, 0)]
    for i in range(MAX_HELD + 3):
        n.grant("k", _slice(10 + i, 100))
    assert len(n.closes("k")) == 3
    n.forget("k")
    assert not n.holds("k") and n.closes("k") == []
    n.grant("k", _slice(0, 100))                  # not a grant
    assert not n.holds("k")


def test_a_tally_closing_more_slices_than_a_run_can_hold_is_refused():
    from spillway.sidecar.transport import validate
    req = pb.TallyRequest(job="j", run_id="r")
    report = req.reports.add()
    report.task.CopyFrom(pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=1))
    for i in range(validate.MAX_CLOSED_SLICES + 1):
        report.closed_slices.add(id=i + 1, used=1)
    with pytest.raises(ValueError, match=r"reports\[0\].closed_slices: at most 1024"):
        validate.tally_failures(req)
    del report.closed_slices[:]
    report.want_slice = MAX_SLICE + 1
    with pytest.raises(ValueError, match=r"reports\[0\].want_slice: must be in \[0, 65536\]"):
        validate.tally_failures(req)


def test_errors_spent_on_a_report_the_spool_refused_go_back_to_their_slice():
    n = NodeSlices()
    n.grant("k", _slice(5, 20))
    assert n.take("k", 15) == 5
    n.give_back("k", 5, 15)
    assert n.take("k", 20) == 5 and n.answered == 20    # the whole slice again, now spent
    n.give_back("k", 5, 5)                               # its close counts 5 fewer
    assert n.closes("k") == [(5, 15)] and n.answered == 15
