"""The edges of a run's slice table at its home (core/slices.py, `SliceBook`): a grant never
reserves more than the free budget (the limit, less the errors counted, less what open slices
still reserve), down to the last error; a reservation ends exactly when its lease does, when its
records are confirmed, or when the node closes it, and is never negative; a closed slice
reserves only what the node said it answered under it."""

from __future__ import annotations

import random

import pytest
from spillway.sidecar.core.slices import MAX_OPEN, MAX_SLICE, SliceAsk, SliceBook

NOW = 1_000_000


# --- grants against the free budget ---------------------------------------------------------

@pytest.mark.parametrize(("limit", "errors", "granted"), [
    (10, 9, 1),     # one error free: a slice of one
    (10, 10, 0),    # none free
    (10, 11, 0),    # past it (the home counted more than the limit: the run fails)
    (1, 0, 1),
    (0, 0, 0),
])
def test_a_grant_is_at_least_one_error_while_one_is_free_and_none_when_none_is(
        limit, errors, granted):
    book = SliceBook(limit)
    assert book.grant(1, 100, errors, NOW) == granted
    assert book.reserved(NOW) == granted


def test_the_last_free_error_is_granted_once():
    book = SliceBook(10)
    assert book.grant(1, 100, 8, NOW) == 1          # 2 free: half of them
    assert book.grant(2, 100, 8, NOW) == 1          # 1 free: the last one
    assert book.grant(3, 100, 8, NOW) == 0          # none free
    assert book.reserved(NOW) == 2


def test_grants_never_add_up_to_more_than_the_free_budget():
    rng = random.Random(1191)
    for _ in range(300):
        limit = rng.randrange(0, 200)
        errors = rng.randrange(0, limit + 2)
        book = SliceBook(limit)
        total = 0
        for sid in range(1, 40):
            total += book.grant(sid, rng.randrange(1, 300), errors, NOW,
                                rng.choice((1, 1, 2, 5)))
        assert total == book.reserved(NOW) <= max(limit - errors, 0)


@pytest.mark.parametrize(("least", "granted"), [(5, 5), (6, 0)])
def test_a_share_exactly_the_asking_reports_size_is_granted_one_less_is_not(least, granted):
    book = SliceBook(10)                            # a first share: half of 10
    assert book.grant(1, 100, 0, NOW, least=least) == granted


def test_a_grant_is_at_most_what_is_wanted_and_max_slice():
    assert SliceBook(1000).grant(1, 7, 0, NOW) == 7
    assert SliceBook(1000).grant(1, 0, 0, NOW) == 0
    assert SliceBook(10 ** 9).grant(1, MAX_SLICE + 1, 0, NOW) == MAX_SLICE


def test_at_most_max_open_slices_reserve_at_once():
    book = SliceBook(10 ** 9)
    for sid in range(1, MAX_OPEN):
        assert book.grant(sid, 1, 0, NOW) == 1
    assert book.grant(MAX_OPEN, 1, 0, NOW) == 1     # the last one there is room for
    assert book.grant(MAX_OPEN + 1, 1, 0, NOW) == 0
    assert book.grant(1, 1, 0, NOW) == 0            # and never an id already open


# --- reservations: confirmed, closed, expired -----------------------------------------------

def test_a_reservation_ends_exactly_at_its_lease_end():
    book = SliceBook(100, lease_ms=1_000)
    size = book.grant(1, 10, 0, NOW)
    assert book.reserved(NOW + 999) == size
    assert book.reserved(NOW + 1_000) == 0 and not book.slices


def test_a_closed_slice_ends_when_exactly_its_answered_records_are_confirmed():
    book = SliceBook(100)
    book.grant(1, 10, 0, NOW)
    book.close(1, 6)                                # the node answered 6 under it
    assert book.reserved(NOW) == 6
    book.confirmed(1, 5)
    assert book.reserved(NOW) == 1 and 1 in book.slices
    book.confirmed(1, 1)
    assert book.reserved(NOW) == 0 and 1 not in book.slices


def test_a_close_confirmed_already_ends_the_slice_at_once():
    book = SliceBook(100)
    book.grant(1, 10, 0, NOW)
    book.confirmed(1, 4)
    book.close(1, 4)
    assert not book.slices


def test_a_reservation_is_never_negative_and_a_close_never_over_the_size():
    book = SliceBook(100)
    book.grant(1, 10, 0, NOW)
    book.confirmed(1, 25)                           # more than its size (a node's report
    assert book.reserved(NOW) == 0                  # confirmed in parts): nothing reserved
    book.grant(2, 10, 0, NOW)
    size = book.slices[2][0]
    book.close(2, size + 5)                         # said more than its size: its size
    assert book.slices[2][2] == size and book.reserved(NOW) == size
    book.close(2, -3)                               # said less than none: none
    assert 2 not in book.slices


def test_settling_a_report_spends_its_slice_then_closes_then_grants():
    book = SliceBook(20)
    first = SliceAsk(want=100, new_id=1)
    book.settle(first, 1, errors=1, may_grant=True, now_wall_ms=NOW)
    assert first.granted == 9 and first.lease_ms == book.lease_ms
    # 9 records answered under it confirmed, the slice closed with them: nothing reserved;
    # a new one for a report of 9 would be 4 (half of the 8 free), too small for it
    again = SliceAsk(slice=1, closed=[(1, 9)], want=100, new_id=2)
    book.settle(again, 9, errors=12, may_grant=True, now_wall_ms=NOW)
    assert 1 not in book.slices and book.reserved(NOW) == 0
    assert again.granted == 0 and 2 not in book.slices
    waiting = SliceAsk(want=100, new_id=3)          # a report of 2 that waited: 6 free
    book.settle(waiting, 2, errors=14, may_grant=True, now_wall_ms=NOW)
    assert waiting.granted == 3
    failed = SliceAsk(want=100, new_id=4)
    book.settle(failed, 1, errors=15, may_grant=False, now_wall_ms=NOW)
    assert failed.granted == 0 and 4 not in book.slices
