"""Redrive's pure rules: why a stage's input is left out, the one line that sums up refusals,
when a run sent nothing it was asked to send, progress with a total and an ETA."""

from __future__ import annotations

import pytest
from spillway.sidecar.dlq.redrive_rules import (
    SOURCE_TOPIC,
    UNKNOWN_SOURCE,
    RedriveSummary,
    eta_s,
    progress_line,
    stage_input_conflict,
    stage_input_skip,
)
from spillway.sidecar.dlq.tools import DlqMessage


def msg(*headers: tuple[str, bytes]) -> DlqMessage:
    return DlqMessage("dlq.t", 0, 5, 1_000, b"k", b"v", tuple(headers))


ROW = ("spillway.payload", b"stage-input")
SOURCE = ("spillway.payload", b"source")
FROM_ORDERS = ("__connect.errors.topic", b"orders")
CONTEXT = ("__connect.errors.stage", b"TRANSFORMATION")


@pytest.mark.parametrize("headers,target,expected", [
    ((SOURCE,), "orders", None),                          # the record as read: it may go home
    ((ROW, CONTEXT, FROM_ORDERS), "orders", SOURCE_TOPIC),
    ((ROW, CONTEXT, FROM_ORDERS), "orders.retry", None),  # not its source
    ((ROW, CONTEXT), "orders", None),                     # context says: not from Kafka
    ((ROW,), "orders.retry", UNKNOWN_SOURCE),             # no context headers: cannot tell
    ((), "orders", UNKNOWN_SOURCE),                       # an older record, nothing said
])
def test_a_stage_input_is_held_back_only_where_the_target_is_or_may_be_its_source(
        headers, target, expected):
    assert stage_input_conflict(msg(*headers), target) == expected


def test_the_per_record_line_says_what_the_payload_is_and_why_the_target_is_refused():
    assert stage_input_skip(msg(ROW), "t", UNKNOWN_SOURCE) == (
        "its key/value are a stage's input (spillway.payload=stage-input, e.g. a transformed "
        "row), not a record as read, and it was dead-lettered without context headers: its "
        "source topic is unknown, so spillway cannot tell that 't' is not it "
        "(--allow-stage-input sends it)")
    assert stage_input_skip(msg(), "orders", SOURCE_TOPIC) == (
        "its key/value may be a stage's input (no spillway.payload: written by an older "
        "spillway), and 'orders' is its source topic (--allow-stage-input sends it)")


def test_refusals_are_one_line_with_counts_by_reason_and_the_option_for_each():
    s = RedriveSummary(matched=10, redriven=2, skipped_stage_input=4,
                       stage_input_unknown_source=3, skipped_loop=2, skipped_context_only=1,
                       skipped_resolved=1)
    line = s.refusals("orders", 3, dry_run=False)
    assert "\n" not in line
    assert line == (
        "refused 7 of 10 matching record(s): 1 stage input whose source topic is 'orders'; "
        "3 stage input of unknown source (dead-lettered without context headers: spillway "
        "cannot tell that 'orders' is not their source topic): their key/value are a stage's "
        "input (e.g. a transformed row), not records as read; --allow-stage-input sends them; "
        "2 at the loop protection's limit (redriven 3 or more times already; --max-redrives "
        "raises it); 1 context-only (dead-lettered with "
        "errors.deadletterqueue.copy.record.enable=false: no record to send)")
    assert not s.sent_nothing()
    assert RedriveSummary(matched=3, skipped_resolved=3).refusals("t", 3, False) is None


@pytest.mark.parametrize("summary,nothing", [
    (RedriveSummary(matched=2, skipped_loop=2), True),
    (RedriveSummary(matched=2, skipped_loop=1, redriven=1), False),
    (RedriveSummary(matched=2, skipped_resolved=2), False),  # done before: nothing to do
    (RedriveSummary(matched=0), False),                      # nothing matched the filters
    (RedriveSummary(matched=2, skipped_loop=1, failed=1), False),  # failed: exit 1 anyway
])
def test_sent_nothing_only_when_refusals_left_nothing_sent(summary, nothing):
    assert summary.sent_nothing() is nothing
    if nothing:
        assert summary.refusals("t", 3, dry_run=False).startswith("sent nothing: refused 2 of 2")
        assert summary.refusals("t", 3, dry_run=True).startswith(
            "would send nothing: would refuse 2 of 2")


@pytest.mark.parametrize("done,total,elapsed,expected", [
    (25, 100, 5.0, 15.0),
    (0, 100, 5.0, None),      # no rate yet
    (100, 100, 5.0, None),    # finished
    (120, 100, 5.0, None),    # past a lagging watermark: no honest estimate
    (25, None, 5.0, None),    # total unknown
])
def test_eta_at_the_rate_so_far(done, total, elapsed, expected):
    assert eta_s(done, total, elapsed) == expected


def test_progress_shows_the_total_while_it_holds():
    s = RedriveSummary(scanned=250, matched=200, redriven=150, skipped_loop=1)
    assert progress_line(s, 1000, 10.0, dry_run=False) == (
        "redrive progress: scanned 250/1000 (25%), matched=200 redriven=150 refused=1 "
        "failed=0, 10s elapsed, ETA 30s")
    assert progress_line(s, 100, 10.0, dry_run=True) == (
        "redrive progress: scanned 250, matched=200 would redrive=150 refused=1 failed=0, "
        "10s elapsed")
