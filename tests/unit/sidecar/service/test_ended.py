"""Counts that outlive a run (service/ended.py): the last N ended runs kept, bounded; totals that
never go down; the ending and a reader of the totals never see a run's counts in neither place."""

from __future__ import annotations

import threading

import pytest

from spillway.sidecar.core.model import Counts, JobSummary
from spillway.sidecar.service.ended import (
    BREAKDOWN_KEYS,
    REASON_CHARS,
    EndedRuns,
    totals_rows,
)


def _summary(job: str, *, errors: int = 1, failed: bool = False, dlq: int = 0,
             processed: int = 10, **kw) -> JobSummary:
    return JobSummary(job=job, run_id="run-1", failed=failed,
                      failure_reason="past errors.tolerance" if failed else "",
                      records_processed=processed,
                      counts=Counts(total_record_failures=errors + 1, total_record_errors=errors,
                                    total_records_skipped=errors, total_retries=1,
                                    total_errors_logged=errors, dropped_records=0),
                      dlq_records_written=dlq, **kw)


def _end(ended: EndedRuns, summary: JobSummary, *, expired: bool = False, home: str = "",
         digest: bytes = b"d") -> JobSummary | None:
    return ended.record(lambda: summary, key=f"{summary.job}\x00run-1", expired=expired,
                        started=1000.0, home=home, digest=digest)


def test_totals_add_the_ended_runs_to_the_live_ones_and_outcomes_are_counted():
    ended = EndedRuns(max_runs=10, clock=lambda: 2000.0)
    _end(ended, _summary("a", errors=3, dlq=3))
    _end(ended, _summary("b", errors=1, failed=True))
    _end(ended, _summary("c", errors=2), expired=True)
    _end(ended, _summary("d", errors=5, failed=True), expired=True)   # failed, then expired
    live = {"total-record-errors": 4.0, "total-record-failures": 5.0,
            "records-processed": 7.0, "dlq-records-written": 2.0}
    t = ended.totals(live)
    assert t.counts.total_record_errors == 3 + 1 + 2 + 5 + 4
    assert t.counts.total_record_failures == 4 + 2 + 3 + 6 + 5
    assert t.records_processed == 40 + 7
    assert t.dlq_records_written == 3 + 2
    assert t.runs_ended == {"completed": 1, "failed": 2, "expired": 1}
    assert t.since == 2000.0
    rows = {(n, tuple(a.items())): v for n, a, v in totals_rows(t)}
    assert rows[("sidecar-record-errors", ())] == 15
    assert rows[("runs-ended", (("outcome", "failed"),))] == 2
    assert rows[("runs-ended", (("outcome", "completed"),))] == 1


def test_every_outcome_is_there_at_zero_before_any_run_ended():
    t = EndedRuns(max_runs=5).totals({})
    assert t.runs_ended == {"completed": 0, "failed": 0, "expired": 0}
    assert t.counts.total_record_errors == 0


def test_the_kept_runs_are_bounded_newest_first_and_the_totals_keep_everything():
    ended = EndedRuns(max_runs=3)
    for i in range(7):
        _end(ended, _summary(f"j{i}", errors=1))
    assert [r.summary.job for r in ended.runs()] == ["j6", "j5", "j4"]
    assert len(ended) == 3
    assert ended.totals({}).counts.total_record_errors == 7
    assert ended.totals({}).runs_ended["completed"] == 7


def test_zero_keeps_no_run_but_the_totals():
    ended = EndedRuns(max_runs=0)
    _end(ended, _summary("a", errors=2))
    assert ended.runs() == [] and len(ended) == 0
    assert ended.totals({}).counts.total_record_errors == 2


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="max_runs"):
        EndedRuns(max_runs=-1)


def test_a_node_copy_is_kept_and_counted_in_the_totals_but_not_as_a_run():
    ended = EndedRuns(max_runs=5)
    _end(ended, _summary("a", errors=2, failed=True), home="10.0.0.1:50051")
    t = ended.totals({})
    assert t.counts.total_record_errors == 2
    assert t.runs_ended == {"completed": 0, "failed": 0, "expired": 0}   # its home counts it
    (run,) = ended.runs()
    assert run.home == "10.0.0.1:50051" and run.outcome == "failed"


def test_nothing_is_recorded_when_the_run_was_not_in_the_engine():
    ended = EndedRuns(max_runs=5)
    assert ended.record(lambda: None, key="k", expired=False, started=0.0) is None
    assert ended.runs() == [] and ended.totals({}).runs_ended["completed"] == 0


def test_a_kept_summary_is_bounded_whatever_the_run_reported():
    many = {f"stage-{i}": i + 1 for i in range(50)}
    ended = EndedRuns(max_runs=5)
    s = _summary("a", failed=True, by_stage=many, by_exception_class=many)
    s.failure_reason = "x" * (REASON_CHARS * 5)
    _end(ended, s)
    kept = ended.runs()[0].summary
    assert len(kept.failure_reason) == REASON_CHARS + 1
    for breakdown in (kept.by_stage, kept.by_exception_class):
        assert len(breakdown) == BREAKDOWN_KEYS + 1
        assert sum(breakdown.values()) == sum(many.values())   # the rest under "(other)"
        assert breakdown["stage-49"] == 50                      # the largest are kept


def test_acknowledgements_after_the_run_ended_count_in_the_totals_and_its_summary():
    ended = EndedRuns(max_runs=2)
    _end(ended, _summary("a", dlq=1))
    ended.note_acked("a\x00run-1", 4)
    assert ended.totals({}).dlq_records_written == 5
    assert ended.runs()[0].summary.dlq_records_written == 5
    ended.note_acked("never-seen", 2)          # a run of before a restart: the totals only
    assert ended.totals({}).dlq_records_written == 7
    _end(ended, _summary("b"))
    _end(ended, _summary("c"))                 # "a" is dropped from the kept runs
    ended.note_acked("a\x00run-1", 1)
    assert ended.totals({}).dlq_records_written == 8
    assert [r.summary.dlq_records_written for r in ended.runs()] == [0, 0]


def test_a_reader_holding_reading_never_sees_a_run_leave_halfway():
    """The ending takes the run out of the engine and records it under the lock a reader of the
    totals holds: while the reader reads the live counts, no run leaves them."""
    ended = EndedRuns(max_runs=5)
    left = threading.Event()
    engine = {"a": _summary("a", errors=3)}   # the live runs

    def leave():
        left.set()
        return engine.pop("a")

    with ended.reading():
        t = threading.Thread(target=lambda: _end_with(ended, leave))
        t.start()
        assert not left.wait(0.2)   # the ending waits for the reader
        live_errors = sum(s.counts.total_record_errors for s in engine.values())
        totals = ended.totals({"total-record-errors": live_errors})
    t.join(5)
    assert left.is_set() and not t.is_alive()
    assert totals.counts.total_record_errors == 3          # live, not yet ended
    assert ended.totals({}).counts.total_record_errors == 3   # ended, no longer live


def _end_with(ended: EndedRuns, leave) -> None:
    ended.record(leave, key="a", expired=False, started=0.0)
