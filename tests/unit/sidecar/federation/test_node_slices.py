"""The edges of a node's budget slices (federation/node_slices.py; docs/POLICY.md, "Budget
slices"). Exact limits are a promise: a node answers under a slice at most the errors it was
granted, never one more, and stops at half the lease. Every boundary is asked about on both
sides: a report exactly the rest of a slice and one error bigger, a lease ending at the very
moment a report arrives and just before, a slice closed (spent, out of room, expired, pushed
out) never answering again. Time is the module's `time.monotonic`, replaced by a clock the
test sets."""

from __future__ import annotations

import random
import types

import pytest
from spillway.sidecar.federation import node_slices
from spillway.sidecar.federation.node_slices import MAX_CLOSED, MAX_HELD, SLICE_WANT, NodeSlices
from spillway.v1 import sidecar_pb2 as pb

KEY = "job@run"


@pytest.fixture
def clock(monkeypatch):
    """The node's monotonic clock, in seconds, set by the test (``clock.now``)."""
    c = types.SimpleNamespace(now=1_000.0)
    monkeypatch.setattr(node_slices, "time", types.SimpleNamespace(monotonic=lambda: c.now))
    return c


def _grant(n: NodeSlices, sid: int, size: int, lease_ms: int = 60_000) -> None:
    n.grant(KEY, pb.BudgetSlice(id=sid, size=size, lease_ms=lease_ms))


def _held(n: NodeSlices) -> dict[int, tuple[int, int]]:
    """The run's held slices: id -> (left, used)."""
    return {s.id: (s.left, s.used) for s in n._held.get(KEY, [])}


# --- a report against the rest of a slice ---------------------------------------------------

def test_a_report_one_error_bigger_than_the_rest_is_not_answered_under_the_slice(clock):
    n = NodeSlices()
    _grant(n, 7, 10)
    assert n.take(KEY, 7) == 7
    assert n.take(KEY, 4) == 0                      # 3 left: one short, it waits for the home
    assert _held(n) == {7: (3, 7)} and n.answered == 7   # nothing spent on it
    assert n.closes(KEY) == []                      # and the slice is still open


def test_a_report_exactly_the_rest_spends_the_slice_and_closes_it(clock):
    n = NodeSlices()
    _grant(n, 7, 10)
    assert n.take(KEY, 7) == 7
    assert n.take(KEY, 3) == 7                      # exactly the rest
    assert _held(n) == {} and not n.holds(KEY)
    assert n.closes(KEY) == [(7, 10)] and n.answered == 10
    assert n.take(KEY, 1) == 0                      # closed: nothing more under it


@pytest.mark.parametrize(("size", "report", "answered"), [
    (1, 1, True), (1, 2, False),
    (10, 10, True), (10, 11, False),
    (4_096, 4_096, True), (4_096, 4_097, False),
])
def test_a_fresh_slice_answers_a_report_of_its_size_not_one_more(clock, size, report, answered):
    n = NodeSlices()
    _grant(n, 3, size)
    assert n.take(KEY, report) == (3 if answered else 0)
    assert n.answered == (report if answered else 0)


def test_a_report_too_big_for_one_slice_is_not_split_over_two(clock):
    n = NodeSlices()
    _grant(n, 1, 5)
    _grant(n, 2, 5)
    assert n.take(KEY, 6) == 0                      # 10 left in all, 5 in each
    assert _held(n) == {1: (5, 0), 2: (5, 0)}
    assert n.take(KEY, 5) == 1 and n.take(KEY, 5) == 2


def test_left_is_never_negative_and_spent_errors_add_up(clock):
    """Drawn reports of sizes around what is left, spent and given back: a slice never answers
    more than its size, its left is never below 0, and the node's count is what was taken."""
    rng = random.Random(298)
    for _ in range(200):
        n = NodeSlices()
        sizes = {}
        taken = 0
        spent: list[tuple[int, int]] = []
        for step in range(40):
            if rng.random() < 0.15 and len(sizes) < MAX_HELD:
                sid = len(sizes) + 1
                sizes[sid] = rng.randrange(1, 12)
                _grant(n, sid, sizes[sid])
            held = _held(n)
            rest = max((left for left, _ in held.values()), default=0)
            want = max(1, rest + rng.choice((-1, 0, 0, 1, 1, 2)))
            sid = n.take(KEY, want)
            if sid:
                taken += want
                spent.append((sid, want))
                assert held[sid][0] >= want     # it had room for all of them
            elif rng.random() < 0.2 and spent:
                back_sid, back_n = spent.pop(rng.randrange(len(spent)))
                n.give_back(KEY, back_sid, back_n)
                taken -= back_n
            for s, (left, used) in _held(n).items():
                assert left >= 0 and left + used == sizes[s]
            for s, used in n._closed.get(KEY, []):
                assert 0 <= used <= sizes[s]
        assert n.answered == taken


# --- the lease ------------------------------------------------------------------------------

def test_a_slice_is_used_until_half_its_lease_and_not_at_that_moment(clock):
    n = NodeSlices()
    _grant(n, 9, 100, lease_ms=2_000)               # used for 1 s from now
    clock.now += 0.999
    assert n.take(KEY, 1) == 9
    clock.now += 0.001                              # exactly half the lease
    assert n.take(KEY, 1) == 0
    assert not n.holds(KEY) and n.closes(KEY) == [(9, 1)]


def test_a_lease_ending_between_two_reports_closes_the_slice_with_what_it_answered(clock):
    n = NodeSlices()
    _grant(n, 4, 50, lease_ms=10_000)
    assert n.take(KEY, 20) == 4                     # the first part of a task's reports
    clock.now += 5.0                                # the lease half gone mid-way
    assert n.take(KEY, 20) == 0                     # the rest waits for the home
    assert n.closes(KEY) == [(4, 20)] and n.answered == 20


def test_asking_closes_an_expired_slice_even_with_room(clock):
    n = NodeSlices()
    _grant(n, 4, 50, lease_ms=10_000)
    n.take(KEY, 5)
    clock.now += 5.0
    assert n.ask(KEY, 1) == (SLICE_WANT, [(4, 5)])


def test_an_expired_slice_is_skipped_for_a_later_one(clock):
    n = NodeSlices()
    _grant(n, 1, 10, lease_ms=2_000)
    clock.now += 0.5
    _grant(n, 2, 10, lease_ms=2_000)
    clock.now += 0.5                                # the first at half its lease
    assert n.take(KEY, 1) == 2
    assert n.closes(KEY) == [(1, 0)]


# --- asking the home ------------------------------------------------------------------------

def test_asking_keeps_a_slice_with_exactly_the_room_and_closes_one_a_record_short(clock):
    n = NodeSlices()
    _grant(n, 1, 10)
    n.take(KEY, 6)                                  # 4 left
    assert n.ask(KEY, 4) == (0, [])                 # room for 4: nothing to ask for
    assert n.ask(KEY, 5) == (SLICE_WANT, [(1, 6)])  # one short: closed, a new one asked for
    assert not n.holds(KEY)


def test_a_big_report_asks_for_at_least_its_size(clock):
    n = NodeSlices()
    assert n.ask(KEY, SLICE_WANT + 1) == (SLICE_WANT + 1, [])
    assert n.ask(KEY, SLICE_WANT) == (SLICE_WANT, [])


# --- closed slices --------------------------------------------------------------------------

def test_a_closed_slice_never_answers_again_and_its_close_is_sent_once(clock):
    n = NodeSlices()
    _grant(n, 5, 10)
    n.take(KEY, 2)
    n.ask(KEY, 9)                                   # 8 left, short of 9: closed (and taken)
    assert n.take(KEY, 1) == 0 and n.closes(KEY) == []


def test_giving_back_to_a_closed_slice_lowers_its_close_not_below_zero(clock):
    n = NodeSlices()
    _grant(n, 5, 3)
    assert n.take(KEY, 3) == 5                      # spent: closed with 3
    n.give_back(KEY, 5, 2)
    assert n.closes(KEY) == [(5, 1)]
    _grant(n, 6, 3)
    n.take(KEY, 3)
    n.give_back(KEY, 6, 5)                          # more than it answered
    assert n.closes(KEY) == [(6, 0)]
    assert n.take(KEY, 1) == 0                      # given back, still closed


def test_a_node_holds_max_held_slices_and_closes_the_oldest_past_it(clock):
    n = NodeSlices()
    for sid in range(1, MAX_HELD + 1):
        _grant(n, sid, 10)
    assert len(_held(n)) == MAX_HELD and n.closes(KEY) == []
    _grant(n, MAX_HELD + 1, 10)
    assert n.closes(KEY) == [(1, 0)] and 1 not in _held(n)


def test_closes_waiting_to_be_sent_are_bounded_oldest_forgotten(clock):
    n = NodeSlices()
    for sid in range(1, MAX_CLOSED + 2):
        _grant(n, sid, 1)
        assert n.take(KEY, 1) == sid                # spent at once: closed
    closes = n.closes(KEY)
    assert len(closes) == MAX_CLOSED and closes[0] == (2, 1) and closes[-1][0] == MAX_CLOSED + 1


def test_no_slice_for_an_empty_grant_and_none_after_the_run_is_forgotten(clock):
    n = NodeSlices()
    _grant(n, 0, 10)
    _grant(n, 3, 0)
    assert not n.holds(KEY) and n.granted == 0
    _grant(n, 3, 10)
    n.take(KEY, 4)
    n.forget(KEY)
    assert n.take(KEY, 1) == 0 and n.closes(KEY) == [] and n.granted == 1
