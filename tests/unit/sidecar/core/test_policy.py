"""The policy engine end to end over fakes: exact attempt counts, verdicts, counters, summaries."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from spillway.sidecar.core.model import (
    Action,
    Category,
    ExceptionInfo,
    FailedRecord,
    SourceCoordinates,
    Stage,
    StageRef,
    TaskIdentity,
)
from spillway.sidecar.core.policy import PolicyEngine
from spillway.sidecar.errors import ConfigError, JobConflictError, UnknownJobError
from support.deciding import decisions
from support.engines import run_state, runs
from support.fakes import FakeClock, FakeRng


class ListLogger:
    def __init__(self) -> None:
        self.lines: list[dict[str, object]] = []

    def log_error(self, fields: dict[str, object]) -> None:
        self.lines.append(fields)


CONN = ExceptionInfo("builtins.ConnectionError", ("builtins.ConnectionError", "builtins.OSError",
                                                  "builtins.Exception"), "connection refused")
VALUE = ExceptionInfo("builtins.ValueError", ("builtins.ValueError", "builtins.Exception"),
                      "invalid literal for int()")
PERM = ExceptionInfo("builtins.PermissionError", ("builtins.PermissionError", "builtins.OSError"),
                     "access denied")
T = StageRef(Stage.TRANSFORMATION)


def task(partition: int = 0, attempt: int = 0, stage_id: int = 1) -> TaskIdentity:
    return TaskIdentity(stage_id=stage_id, partition_id=partition, attempt_number=attempt,
                        task_attempt_id=stage_id * 1000 + partition * 10 + attempt)


def rec(rid: str, exc: ExceptionInfo = CONN, stage: StageRef = T, **kw) -> FailedRecord:
    return FailedRecord(record_id=rid, stage=stage, exception=exc, **kw)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def logger() -> ListLogger:
    return ListLogger()


@pytest.fixture
def engine(clock, logger) -> PolicyEngine:
    return PolicyEngine(clock=clock, rng=FakeRng(), logger=logger)


def run(engine: PolicyEngine, clock: FakeClock, job: str, rid: str,
        outcome: Callable[[int], ExceptionInfo | None], t: TaskIdentity | None = None):
    """Drive one record the way the executor's loop does; return (runs, last verdict)."""
    t = t or task()
    runs = 0
    while True:
        runs += 1
        exc = outcome(runs)
        if exc is None:
            engine.record_recovered(job, t, [rid])
            return runs, None
        verdict = decisions(engine, job, t, [rec(rid, exc)])[0].verdict
        if verdict.action is not Action.RETRY:
            return runs, verdict
        clock.advance(verdict.retry_delay_ms)


# --- exact attempt counts ----------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 5])
def test_record_failing_n_times_then_succeeding_is_attempted_n_plus_one_times(engine, clock, n):
    engine.register_job("j", {"errors.retry.max.retries": "10"})
    runs, verdict = run(engine, clock, "j", "r", lambda k: CONN if k <= n else None)
    assert (runs, verdict) == (n + 1, None)
    s = engine.summary("j")
    assert s.counts.total_record_failures == n
    assert s.counts.total_retries == n
    assert s.counts.total_record_errors == 0
    assert engine.counters()["total-records-recovered"] == 1


@pytest.mark.parametrize("max_retries", [0, 1, 4])
def test_always_failing_retriable_is_attempted_max_retries_plus_one_then_tolerated(
        engine, clock, max_retries):
    engine.register_job("j", {"errors.retry.max.retries": str(max_retries),
                              "errors.tolerance": "all"})
    runs, verdict = run(engine, clock, "j", "r", lambda k: CONN)
    assert runs == max_retries + 1
    assert verdict.action is Action.SKIP
    assert verdict.attempt == max_retries + 1
    assert f"errors.retry.max.retries={max_retries} reached" in verdict.reason or max_retries == 0
    c = engine.summary("j").counts
    assert (c.total_record_failures, c.total_retries, c.total_record_errors,
            c.total_records_skipped, c.dropped_records) == (max_retries + 1, max_retries, 1, 1, 1)


def test_data_error_is_attempted_exactly_once(engine, clock):
    engine.register_job("j", {"errors.retry.max.retries": "10", "errors.tolerance": "all"})
    runs, verdict = run(engine, clock, "j", "r", lambda k: VALUE)
    assert runs == 1
    assert verdict.action is Action.SKIP and verdict.category is Category.DATA
    assert "never retried" in verdict.reason


CRASH = ExceptionInfo("spillway.client.markers.WorkerCrashError",
                      ("spillway.client.markers.WorkerCrashError",
                       "spillway.client.markers.SpillwayMarker", "builtins.Exception"),
                      "the Python worker died on this record: killed by signal 11 (SIGSEGV)",
                      marker_category=Category.CRASH)
HANG = ExceptionInfo("spillway.client.markers.RecordTimeoutError",
                     ("spillway.client.markers.RecordTimeoutError",
                      "spillway.client.markers.SpillwayMarker", "builtins.Exception"),
                     "past errors.record.timeout.ms=500", marker_category=Category.TIMEOUT)


@pytest.mark.parametrize(("exc", "category", "words"), [
    (CRASH, Category.CRASH, "the worker died on this record: never retried"),
    (HANG, Category.TIMEOUT, "past errors.record.timeout.ms: never retried"),
])
def test_a_crash_or_a_timeout_is_never_retried_and_counts_against_the_limits(
        engine, clock, exc, category, words):
    engine.register_job("j", {"errors.retry.max.retries": "10", "errors.tolerance": "all",
                              "errors.tolerance.max.errors": "1"})
    runs, verdict = run(engine, clock, "j", "r", lambda k: exc)
    assert runs == 1
    assert (verdict.action, verdict.category) == (Action.SKIP, category)
    assert words in verdict.reason
    c = engine.summary("j").counts
    assert (c.total_record_errors, c.total_records_skipped, c.total_retries) == (1, 1, 0)
    # the second one is past errors.tolerance.max.errors=1: the job fails
    v = decisions(engine, "j", task(), [rec("r2", exc)])[0].verdict
    assert (v.action, v.category, v.job_failed) == (Action.FAIL, category, True)


def test_a_classification_rule_on_the_crash_class_makes_it_retriable(engine, clock):
    engine.register_job("j", {"errors.retry.max.retries": "2", "errors.tolerance": "all",
                              "errors.classification.rules":
                                  "spillway.client.markers.WorkerCrashError=retriable"})
    runs, verdict = run(engine, clock, "j", "r", lambda k: CRASH if k == 1 else None)
    assert (runs, verdict) == (2, None)


def test_a_crash_under_tolerance_none_fails_the_job_naming_the_record_and_how(engine):
    engine.register_job("j", {})
    v = decisions(engine, "j", task(), [rec("p0:r7", CRASH)])[0].verdict
    assert v.action is Action.FAIL and v.job_failed and v.category is Category.CRASH
    assert "'p0:r7'" in v.reason and "signal 11 (SIGSEGV)" in v.reason


def test_kip298_retry_timeout_bounds_the_schedule(engine, clock):
    engine.register_job("j", {"errors.retry.timeout": "2000", "errors.tolerance": "all"})
    delays = []
    t0 = clock.ms
    while True:
        v = decisions(engine, "j", task(), [rec("r")])[0].verdict
        if v.action is not Action.RETRY:
            break
        delays.append(v.retry_delay_ms)
        clock.advance(v.retry_delay_ms)
    assert delays == [300, 600, 1100]         # 1200 shortened to end at the 2000 ms timeout
    assert clock.ms - t0 == 2000
    assert "errors.retry.timeout=2000 ms passed" in v.reason


def test_reattempted_task_does_not_reset_a_records_retries(engine, clock):
    engine.register_job("j", {"errors.retry.max.retries": "3", "errors.tolerance": "all"})
    first = decisions(engine, "j", task(attempt=0), [rec("r")])[0].verdict
    clock.advance(first.retry_delay_ms)
    second = decisions(engine, "j", task(attempt=0), [rec("r")])[0].verdict
    assert (first.attempt, second.attempt) == (1, 2)
    # the task attempt dies; Spark re-runs it: same record id, new attempt
    clock.advance(second.retry_delay_ms)
    third = decisions(engine, "j", task(attempt=1), [rec("r")])[0].verdict
    assert third.action is Action.RETRY and third.attempt == 3
    assert third.retry_delay_ms == pytest.approx(1200 * 1.125, abs=1)   # n=2, not n=0
    clock.advance(third.retry_delay_ms)
    fourth = decisions(engine, "j", task(attempt=1), [rec("r")])[0].verdict
    assert fourth.action is Action.SKIP and fourth.attempt == 4


def test_reattempted_task_does_not_restart_the_retry_clock(engine, clock):
    engine.register_job("j", {"errors.retry.timeout": "1000", "errors.tolerance": "all"})
    decisions(engine, "j", task(attempt=0), [rec("r")])
    clock.advance(1500)                        # the task died; the re-run comes later
    v = decisions(engine, "j", task(attempt=1), [rec("r")])[0].verdict
    assert v.action is Action.SKIP
    assert "errors.retry.timeout=1000 ms passed" in v.reason


def test_skipped_record_reported_again_by_a_reattempt_is_not_counted_twice(engine, clock):
    engine.register_job("j", {"errors.tolerance": "all", "errors.tolerance.max.errors": "1",
                              "errors.deadletterqueue.topic.name": "dlq.j"})
    a = decisions(engine, "j", task(attempt=0), [rec("bad", VALUE)])[0]
    b = decisions(engine, "j", task(attempt=1), [rec("bad", VALUE)])[0]
    assert a.verdict.action is b.verdict.action is Action.SKIP
    # one dead letter per record id: the re-report is answered "already in the DLQ"
    assert a.dead_letter and not b.dead_letter and b.verdict.dead_lettered
    assert b.verdict.attempt == 2
    assert "already skipped" in b.verdict.reason and "already in the DLQ topic dlq.j" in (
        b.verdict.reason)
    c = engine.summary("j").counts
    assert (c.total_record_errors, c.total_records_skipped, c.total_record_failures) == (1, 1, 2)
    # one more distinct error is the second: over max.errors=1
    v = decisions(engine, "j", task(), [rec("bad2", VALUE)])[0].verdict
    assert v.action is Action.FAIL and v.job_failed


# --- categories --------------------------------------------------------------------------------

def test_invalid_configuration_fails_the_job_and_every_later_verdict(engine):
    engine.register_job("j", {"errors.tolerance": "all", "errors.retry.max.retries": "5"})
    v = decisions(engine, "j", task(), [rec("r1", PERM)])[0].verdict
    assert (v.action, v.category, v.job_failed) == (Action.FAIL, Category.INVALID_CONFIGURATION,
                                                    True)
    assert "invalid-configuration" in v.reason and "PermissionError" in v.reason
    later = decisions(engine, "j", task(3), [rec("r2", VALUE), rec("r3", CONN)])
    assert [d.verdict.action for d in later] == [Action.FAIL, Action.FAIL]
    assert all(d.verdict.job_failed for d in later)
    assert all("has failed" in d.verdict.reason for d in later)
    s = engine.summary("j")
    assert s.failed and "invalid-configuration" in s.failure_reason


@pytest.mark.parametrize(("exc", "category", "words"), [
    (ExceptionInfo("x.Txn", kafka_txn_requires_abort=True), Category.ABORTABLE,
     "Spark will re-run the task"),
    (ExceptionInfo("x.Fatal", kafka_fatal=True), Category.APPLICATION_RECOVERABLE,
     "Spark will restart the task"),
])
def test_abortable_and_application_recoverable_fail_the_task_only(engine, exc, category, words):
    engine.register_job("j", {"errors.tolerance": "all"})
    v = decisions(engine, "j", task(), [rec("r", exc)])[0].verdict
    assert (v.action, v.category, v.job_failed) == (Action.FAIL, category, False)
    assert words in v.reason
    assert not engine.summary("j").failed
    assert decisions(engine, "j", task(), [rec("r2", VALUE)])[0].verdict.action is Action.SKIP


def test_refresh_retriable_reason_asks_for_the_refresh_hook(engine):
    engine.register_job("j", {"errors.retry.max.retries": "2"})
    exc = ExceptionInfo("R", marker_category=Category.REFRESH_RETRIABLE)
    v = decisions(engine, "j", task(), [rec("r", exc)])[0].verdict
    assert v.action is Action.RETRY and v.category is Category.REFRESH_RETRIABLE
    assert "refresh hook" in v.reason


def test_tolerance_none_fails_the_job_on_the_first_error(engine):
    engine.register_job("j", {})
    v = decisions(engine, "j", task(), [rec("r", VALUE)])[0].verdict
    assert v.action is Action.FAIL and v.job_failed
    assert "errors.tolerance=none" in v.reason and "ValueError" in v.reason


def test_default_policy_does_not_retry_retriable_errors(engine):
    engine.register_job("j", {"errors.tolerance": "all"})
    v = decisions(engine, "j", task(), [rec("r", CONN)])[0].verdict
    assert v.action is Action.SKIP
    assert "retries are disabled (errors.retry.timeout=0)" in v.reason


# --- DLQ, batch order, logging -------------------------------------------------------------------

def test_one_decision_per_record_in_order_and_dead_letter_only_for_skip_with_dlq(engine):
    engine.register_job("j", {"errors.tolerance": "all", "errors.retry.max.retries": "1",
                              "errors.deadletterqueue.topic.name": "dlq.j"})
    ds = decisions(engine, "j", task(), [rec("a", VALUE), rec("b", CONN), rec("c", VALUE)])
    assert [d.verdict.record_id for d in ds] == ["a", "b", "c"]
    assert [d.verdict.action for d in ds] == [Action.SKIP, Action.RETRY, Action.SKIP]
    assert [d.dead_letter for d in ds] == [True, False, True]
    assert all(d.verdict.reason for d in ds)
    c = engine.summary("j").counts
    assert c.dropped_records == 0 and c.total_errors_logged == 2


def test_error_log_line_per_error_and_messages_only_when_asked(clock, logger):
    engine = PolicyEngine(clock=clock, rng=FakeRng(), logger=logger)
    engine.register_job("quiet", {"errors.tolerance": "all"})
    engine.register_job("loud", {"errors.tolerance": "all", "errors.log.enable": "true"})
    engine.register_job("full", {"errors.tolerance": "all", "errors.log.enable": "true",
                                 "errors.log.include.messages": "true"})
    r = rec("r", VALUE, key=b"k", value=b"\xff\x00", headers=(("h", b"v"),),
            source=SourceCoordinates("in", 3, 42), function_name="m.parse")
    decisions(engine, "quiet", task(), [r])
    assert logger.lines == []
    decisions(engine, "loud", task(), [r])
    (line,) = logger.lines
    assert line["job"] == "loud" and line["record_id"] == "r" and line["action"] == "SKIP"
    assert (line["topic"], line["partition"], line["offset"]) == ("in", 3, 42)
    assert line["exception_class"] == "builtins.ValueError" and line["function"] == "m.parse"
    assert "key" not in line and "value" not in line
    decisions(engine, "full", task(), [r])
    line = logger.lines[-1]
    assert line["key"] == "k" and line["value_encoding"] == "base64" and line["value"] == "/wA="
    assert line["headers"] == [{"key": "h", "value": "v", "encoding": "utf8"}]
    assert engine.summary("loud").counts.total_errors_logged == 1
    assert engine.summary("quiet").counts.total_errors_logged == 0


def test_a_broken_error_logger_does_not_change_verdicts(clock):
    class Broken:
        def log_error(self, fields):
            raise OSError("disk full")

    engine = PolicyEngine(clock=clock, rng=FakeRng(), logger=Broken())
    engine.register_job("j", {"errors.tolerance": "all", "errors.log.enable": "true"})
    assert decisions(engine, "j", task(), [rec("r", VALUE)])[0].verdict.action is Action.SKIP
    assert engine.counters()["error-log-failures"] == 1


def test_default_logger_writes_json_to_spillway_errors(clock, caplog):
    import json

    engine = PolicyEngine(clock=clock, rng=FakeRng())
    engine.register_job("j", {"errors.tolerance": "all", "errors.log.enable": "true"})
    with caplog.at_level("ERROR", logger="spillway.errors"):
        decisions(engine, "j", task(), [rec("r", VALUE)])
    (record,) = [r for r in caplog.records if r.name == "spillway.errors"]
    assert json.loads(record.getMessage())["record_id"] == "r"


# --- counters and summaries ----------------------------------------------------------------------

def test_counters_per_job_stage_and_task(engine, clock):
    engine.register_job("j", {"errors.tolerance": "all", "errors.retry.max.retries": "1"})
    sink = StageRef(Stage.SINK)
    decisions(engine, "j", task(0), [rec("a", VALUE), rec("b", CONN, stage=sink)])
    decisions(engine, "j", task(1), [rec("c", VALUE, stage=StageRef(Stage.CUSTOM, "enrich"))])
    s = engine.summary("j")
    assert s.by_stage == {"TRANSFORMATION": 1, "TASK_PUT": 1, "enrich": 1}
    assert s.by_category == {"data": 2, "retriable": 1}
    assert s.by_exception_class == {"builtins.ValueError": 2, "builtins.ConnectionError": 1}
    assert engine.stage_counts("j", "TASK_PUT").total_retries == 1
    assert engine.stage_counts("j", "TRANSFORMATION").total_records_skipped == 1
    assert engine.task_counts("j", "1.0").total_record_failures == 2
    assert engine.task_counts("j", "1.1").total_record_errors == 1
    assert s.counts.last_error_timestamp_ms == clock.wall_ms()
    flat = engine.counters()
    assert flat["total-record-failures"] == 3 and flat["total-retries"] == 1
    assert flat["total-records-skipped"] == 2 and flat["dropped-records"] == 2
    assert flat["jobs"] == 1


def test_summary_processed_and_dlq_acks(engine):
    engine.register_job("j", {"errors.tolerance": "all",
                              "errors.deadletterqueue.topic.name": "dlq.j"})
    engine.record_progress("j", task(0), {T: 90, StageRef(Stage.SINK): 10})
    engine.note_dead_letter_acked("j", 3)
    s = engine.summary("j")
    assert s.records_processed == 100 and s.dlq_records_written == 3
    assert engine.counters()["dlq-records-written"] == 3


def test_record_progress_is_idempotent_per_attempt_and_replaced_by_a_reattempt(engine):
    engine.register_job("j", {"errors.tolerance": "all"})
    engine.record_progress("j", task(0, attempt=0), {T: 50})
    engine.record_progress("j", task(0, attempt=0), {T: 50})     # same attempt reported twice
    assert engine.summary("j").records_processed == 50
    engine.record_progress("j", task(0, attempt=1), {T: 70})     # the re-run replaces it
    assert engine.summary("j").records_processed == 70
    engine.record_progress("j", task(1, attempt=0), {T: 30})     # another partition adds
    assert engine.summary("j").records_processed == 100


# --- registration ------------------------------------------------------------------------------

def test_register_is_idempotent_and_refuses_a_different_policy(engine):
    a = engine.register_job("j", {"errors.tolerance": "all"})
    b = engine.register_job("j", {"errors.tolerance": "all"})
    assert a is b
    with pytest.raises(JobConflictError, match=r"errors.tolerance: 'all' -> 'none'"):
        engine.register_job("j", {"errors.tolerance": "none"})
    assert engine.jobs() == ["j"]


def test_register_validates_naming_the_property(engine):
    with pytest.raises(ConfigError) as e:
        engine.register_job("j", {"errors.retry.jitter.factor": "1.5"})
    assert e.value.property == "errors.retry.jitter.factor"
    assert engine.jobs() == []


def test_job_defaults_apply_under_the_jobs_own_properties(clock):
    engine = PolicyEngine(clock=clock, rng=FakeRng(),
                          job_defaults={"errors.tolerance": "all", "errors.retry.timeout": "5000"})
    s = engine.register_job("j", {"errors.retry.timeout": "100"})
    assert s.tolerance.mode == "all" and s.retry.timeout_ms == 100
    assert s.raw["errors.tolerance"] == "all"


def test_unknown_job_is_refused_everywhere(engine):
    with pytest.raises(UnknownJobError):
        decisions(engine, "nope", task(), [rec("r")])
    with pytest.raises(UnknownJobError):
        engine.summary("nope")
    with pytest.raises(UnknownJobError):
        engine.record_progress("nope", task(), {T: 1})


# --- bounded state and threads -------------------------------------------------------------------

def test_recovered_records_leave_the_schedule(engine, clock):
    engine.register_job("j", {"errors.retry.max.retries": "3"})
    for i in range(50):
        decisions(engine, "j", task(), [rec(f"r{i}")])
    assert engine.counters()["records-tracked"] == 50
    engine.record_recovered("j", task(), [f"r{i}" for i in range(50)] + ["never-seen"])
    assert engine.counters()["records-tracked"] == 0
    assert engine.counters()["total-records-recovered"] == 50


def test_schedule_state_is_bounded(engine, monkeypatch):
    from spillway.sidecar.core import jobstate

    monkeypatch.setattr(jobstate, "MAX_TRACKED_RECORDS", 10)
    engine.register_job("j", {"errors.retry.max.retries": "3",
                              "errors.retry.budget.ratio": "-1", "errors.circuit.enable": "false"})
    for i in range(25):
        decisions(engine, "j", task(), [rec(f"r{i}")])
    flat = engine.counters()
    assert flat["records-tracked"] == 10 and flat["records-evicted"] == 15


def test_skipped_ids_are_compact_bounded_and_least_recently_seen_evicted(engine):
    engine.register_job("j", {"errors.tolerance": "all",
                              "errors.deadletterqueue.topic.name": "dlq.j"})
    j = run_state(engine, "j")
    j.ids.limit = 10
    decisions(engine, "j", task(), [rec(f"j/TRANSFORMATION/0/{i}", VALUE) for i in range(10)])
    # one shared answer for the batch, no record-id strings kept, no schedules left
    infos = {id(j.ids.get(k)) for k in j.ids.keys()}
    assert len(infos) == 1 and all(type(k) is int for k in j.ids.keys())
    assert len(j.records) == 0
    again = decisions(engine, "j", task(attempt=1), [rec("j/TRANSFORMATION/0/0", VALUE)])[0]
    assert again.verdict.action is Action.SKIP and not again.dead_letter
    assert again.verdict.dead_lettered
    assert "already skipped" in again.verdict.reason and again.verdict.attempt == 2
    # 9 new ids evict 1..9, not 0 (seen again most recently)
    decisions(engine, "j", task(), [rec(f"j/TRANSFORMATION/0/{i}", VALUE) for i in range(10, 19)])
    assert len(j.ids) == 10 and j.tolerance.ids_evicted == 9
    d0, d1 = decisions(engine, "j", task(attempt=2), [rec("j/TRANSFORMATION/0/0", VALUE),
                                                  rec("j/TRANSFORMATION/0/1", VALUE)])
    assert "already skipped" in d0.verdict.reason and d0.verdict.attempt == 3
    # an evicted id is decided afresh: still SKIP and dead-lettered, counted again
    assert d1.verdict.action is Action.SKIP and d1.dead_letter
    assert "already skipped" not in d1.verdict.reason
    assert engine.summary("j").counts.total_record_errors == 20


class _Colliding(str):
    """A record id whose digest collides with every other one's."""

    def __hash__(self) -> int:
        return 42


def test_a_digest_collision_answers_as_the_record_it_collides_with(engine):
    engine.register_job("j", {"errors.tolerance": "all",
                              "errors.deadletterqueue.topic.name": "dlq.j"})
    a, b = decisions(engine, "j", task(),
                     [rec(_Colliding("a"), VALUE), rec(_Colliding("b"), VALUE)])
    # b looks already skipped: answered SKIP under its own id, and taken for a's re-report it
    # is not written again (the documented ~n^2/2^61 risk of keeping digests, not ids)
    assert (a.verdict.action, b.verdict.action) == (Action.SKIP, Action.SKIP)
    assert a.dead_letter and b.verdict.record_id == "b" and b.verdict.dead_lettered
    assert "already skipped" in b.verdict.reason


def test_retry_schedules_are_keyed_by_digest_and_continue_across_attempts(engine):
    engine.register_job("j", {"errors.retry.max.retries": "2", "errors.tolerance": "all",
                              "errors.retry.budget.ratio": "-1", "errors.circuit.enable": "false"})
    j = run_state(engine, "j")
    for attempt in range(2):
        v = decisions(engine, "j", task(attempt=attempt), [rec("r")])[0].verdict
        assert v.action is Action.RETRY
    assert all(type(k) is int for k in j.records.keys()) and len(j.records) == 1
    v = decisions(engine, "j", task(attempt=2), [rec("r")])[0].verdict
    assert v.action is Action.SKIP and v.attempt == 3 and len(j.records) == 0


def test_concurrent_decisions_count_every_record_once(engine):
    engine.register_job("j", {"errors.tolerance": "all"})

    def worker(p: int) -> None:
        for i in range(200):
            decisions(engine, "j", task(p), [rec(f"{p}-{i}", VALUE)])

    threads = [threading.Thread(target=worker, args=(p,)) for p in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c = engine.summary("j").counts
    assert c.total_record_errors == c.total_records_skipped == 1600


# --- properties through the engine ---------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(timeout=st.sampled_from(["0", "-1", "500", "2000", "30000"]),
       max_retries=st.one_of(st.none(), st.integers(0, 6)),
       fine=st.booleans(), r=st.floats(0, 1, exclude_max=True),
       gaps=st.lists(st.integers(0, 3000), min_size=1, max_size=8),
       reattempt_every=st.integers(1, 4))
def test_engine_schedule_invariants(timeout, max_retries, fine, r, gaps, reattempt_every):
    clock = FakeClock()
    e = PolicyEngine(clock=clock, rng=FakeRng(r), logger=ListLogger())
    p = {"errors.tolerance": "all", "errors.retry.timeout": timeout,
         "errors.retry.budget.ratio": "-1"}
    if max_retries is not None:
        p["errors.retry.max.retries"] = str(max_retries)
    if fine:
        p["errors.retry.jitter.factor"] = "1"
    e.register_job("j", p)
    first = clock.ms
    retries = 0
    for i in range(200):
        t = task(attempt=i // reattempt_every)        # the task is re-attempted now and then
        v = decisions(e, "j", t, [rec("r")])[0].verdict
        assert v.attempt == i + 1                      # the sidecar's count survives re-attempts
        if v.action is not Action.RETRY:
            assert v.action is Action.SKIP and v.reason
            break
        retries += 1
        if int(timeout) > 0:
            assert clock.ms + v.retry_delay_ms <= first + int(timeout)
        clock.advance(v.retry_delay_ms + gaps[i % len(gaps)])
    else:
        # only an unbounded policy goes on (a jitter knob alone brings the KIP's 5 retries)
        assert timeout == "-1" and max_retries is None and not fine
    if max_retries is not None:
        assert retries <= max_retries
    elif fine:
        assert retries <= 5                            # the status-store KIP's default
    if timeout == "0" and max_retries is None:
        assert retries == (5 if fine else 0)


# --- one dead letter per record id --------------------------------------------------------------

def test_a_record_is_dead_lettered_once_whatever_reports_it_again(engine):
    engine.register_job("j", {"errors.tolerance": "all",
                              "errors.deadletterqueue.topic.name": "dlq.j"})
    first = decisions(engine, "j", task(attempt=0), [rec("bad", VALUE)])[0]
    assert first.dead_letter and first.verdict.action is Action.SKIP
    # a task retry, a speculative copy (another task attempt id) and a re-run action's task
    again = [decisions(engine, "j", task(attempt=a, stage_id=s), [rec("bad", VALUE)])[0]
             for a, s in ((1, 1), (2, 1), (0, 7))]
    for d in again:
        assert d.verdict.action is Action.SKIP and not d.dead_letter
        assert d.verdict.dead_lettered and "not written again" in d.verdict.reason
    assert [d.verdict.attempt for d in again] == [2, 3, 4]
    c = engine.summary("j").counts
    assert (c.total_record_errors, c.total_records_skipped) == (1, 1)


def test_an_undone_dead_letter_is_written_again_on_its_next_report(engine):
    engine.register_job("j", {"errors.tolerance": "all",
                              "errors.deadletterqueue.topic.name": "dlq.j"})
    a, b = decisions(engine, "j", task(), [rec("a", VALUE), rec("b", VALUE)])
    assert a.dead_letter and b.dead_letter
    # the spool refused the report (backpressure): nothing was written for a or b
    assert engine.undo_dead_letters("j", ["a", "b", "never-seen"]) == 2
    a2, b2 = decisions(engine, "j", task(attempt=1), [rec("a", VALUE), rec("b", VALUE)])
    assert a2.dead_letter and b2.dead_letter and not a2.verdict.dead_lettered
    assert engine.summary("j").counts.total_record_errors == 2   # still counted once
    a3 = decisions(engine, "j", task(attempt=2), [rec("a", VALUE)])[0]
    assert not a3.dead_letter and a3.verdict.dead_lettered


def test_without_a_dlq_a_reported_again_record_is_never_marked_dead_lettered(engine):
    engine.register_job("j", {"errors.tolerance": "all"})
    decisions(engine, "j", task(), [rec("a", VALUE)])
    d = decisions(engine, "j", task(attempt=1), [rec("a", VALUE)])[0]
    assert d.verdict.action is Action.SKIP and not d.dead_letter
    assert not d.verdict.dead_lettered


# --- runs: the state of one run never decides a record of another ------------------------------


def test_a_record_id_skipped_in_one_run_is_retried_in_the_next_run_of_the_same_job(engine):
    """The positional-id case: yesterday's run skipped p0:r3 as a data error; today's run fails
    at the same position with a transient error, which must be retried, not skipped."""
    from spillway.sidecar.core.policy import run_key

    props = {"errors.tolerance": "all", "errors.retry.timeout": "-1"}
    engine.register_job("daily", props, run_id="app-1")
    first = decisions(engine, run_key("daily", "app-1"), task(), [rec("p0:r3", VALUE)])[0].verdict
    assert first.action is Action.SKIP
    engine.register_job("daily", props, run_id="app-2")
    second = decisions(engine, run_key("daily", "app-2"), task(), [rec("p0:r3", CONN)])[0].verdict
    assert second.action is Action.RETRY and second.attempt == 1
    # and run 1 still answers for its own record as before
    again = decisions(engine, run_key("daily", "app-1"), task(), [rec("p0:r3", CONN)])[0].verdict
    assert again.action is Action.SKIP


def test_a_new_run_starts_with_fresh_tolerance_and_may_change_its_policy(engine):
    from spillway.sidecar.core.policy import run_key

    engine.register_job("daily", {"errors.tolerance": "all",
                                  "errors.tolerance.max.errors": "1"}, run_id="app-1")
    k1 = run_key("daily", "app-1")
    verdicts = [d.verdict
                for d in decisions(engine, k1, task(), [rec("a", VALUE), rec("b", VALUE)])]
    assert verdicts[1].job_failed and engine.summary(k1).failed
    with pytest.raises(JobConflictError, match="app-1"):
        engine.register_job("daily", {"errors.tolerance": "none"}, run_id="app-1")
    # the next run: another policy, nothing of the failed run
    engine.register_job("daily", {"errors.tolerance": "all"}, run_id="app-2")
    k2 = run_key("daily", "app-2")
    assert decisions(engine, k2, task(), [rec("a", VALUE)])[0].verdict.action is Action.SKIP
    s2 = engine.summary(k2)
    assert (s2.job, s2.run_id, s2.failed, s2.counts.total_record_errors) == (
        "daily", "app-2", False, 1)


def test_an_ended_run_is_gone_and_its_name_can_be_registered_again(engine):
    from spillway.sidecar.core.policy import run_key

    key = run_key("j", "app-1")
    engine.register_job("j", {"errors.tolerance": "all"}, run_id="app-1")
    decisions(engine, key, task(), [rec("a", VALUE)])
    final = engine.end_job(key)
    assert final is not None and final.counts.total_record_errors == 1
    assert engine.end_job(key) is None and engine.jobs() == []
    assert engine.counters()["jobs"] == 0
    with pytest.raises(UnknownJobError):
        decisions(engine, key, task(), [rec("a", VALUE)])
    engine.note_dead_letter_acked(key, 3)  # late acknowledgements of an ended run: ignored
    engine.register_job("j", {"errors.tolerance": "none"}, run_id="app-1")
    assert engine.summary(key).counts.total_record_errors == 0


def test_ten_thousand_runs_registered_and_ended_leave_the_engine_empty(engine):
    from spillway.sidecar.core.policy import run_key

    for i in range(10_000):
        key = run_key("many", f"app-{i}")
        engine.register_job("many", {"errors.tolerance": "all"}, run_id=f"app-{i}")
        decisions(engine, key, task(), [rec(f"r{i}", VALUE), rec(f"c{i}", CONN)])
        assert engine.end_job(key) is not None
    assert engine.jobs() == [] and runs(engine) == {}
    assert engine.counters()["records-tracked"] == 0


@pytest.mark.parametrize("props", [
    {"errors.tolerance": "all"},
    {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": "dlq.t",
     "errors.log.enable": "true"},
    {"errors.tolerance": "all", "errors.retry.max.retries": "1"},
    # a count limit the reports cannot cross (counted at their end), then ones they cross
    {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": "dlq.t",
     "errors.tolerance.max.errors": "100"},
    *({"errors.tolerance": "all", "errors.deadletterqueue.topic.name": "dlq.t",
       "errors.tolerance.max.errors": str(n)} for n in (3, 11, 14)),
    {"errors.tolerance": "all", "errors.tolerance.max.errors": "14",
     "errors.tolerance.window.ms": "60000", "errors.tolerance.per.stage": "true"},
])
def test_a_report_decided_at_once_answers_and_counts_as_record_by_record(clock, props):
    """Streaks of records failing the same way take a short path (`Decider.decide`): every answer,
    count and remembered id must be what deciding each record on its own gives."""
    S = StageRef(Stage.SINK)
    first = [rec(f"a{i}", VALUE) for i in range(5)] + [rec("c0", CONN)] + \
        [rec(f"b{i}", VALUE) for i in range(3)] + [rec(f"s{i}", VALUE, S) for i in range(3)]
    second = [rec("a1", VALUE), rec("a2", VALUE), rec("n0", VALUE), rec("n1", VALUE),
              rec("c0", CONN), rec("a1", VALUE), rec("n2", PERM), rec("n3", VALUE)]
    logs: dict[str, ListLogger] = {}

    def decided(per_record: bool):
        logs[per_record] = ListLogger()
        e = PolicyEngine(clock=clock, rng=FakeRng(), logger=logs[per_record])
        if per_record:  # the plain loop the short path must agree with
            d = e._decider
            d.decide = lambda j, b, rs: [(d.decide_one(j, b, r), 1) for r in rs]
        e.register_job("j", props)
        out = []
        for report in (first, second):
            out += [(d.verdict, d.dead_letter) for d in decisions(e, "j", task(), report)]
        j = e._jobs["j"]
        # the remembered ids and schedules, in use order (the order eviction follows)
        return out, e.summary("j"), e.task_counts("j", task().task_id), \
            [(k, j.ids.get(k)) for k in j.ids.keys()], \
            [(k, j.records.get(k).attempts, j.records.get(k).retries) for k in j.records.keys()]

    fast, plain = decided(False), decided(True)
    assert fast == plain
    assert [ln["record_id"] for ln in logs[False].lines] == \
        [ln["record_id"] for ln in logs[True].lines]
    if "errors.tolerance.max.errors" not in props:
        assert sum(v.action is Action.SKIP for v, _ in fast[0]) >= 12


def test_a_report_decided_in_streaks_logs_each_record_as_record_by_record(clock):
    """`decide` answers a streak as one answer, yet writes one error log line per record,
    with the record's own id, as deciding record by record does."""
    props = {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": "dlq.t",
             "errors.log.enable": "true"}
    report = [rec(f"a{i}", VALUE) for i in range(6)] + [rec("c0", CONN)] + \
        [rec(f"b{i}", VALUE) for i in range(3)]
    lines = {}
    for how in ("streaks", "decide"):
        lines[how] = ListLogger()
        e = PolicyEngine(clock=clock, rng=FakeRng(), logger=lines[how])
        e.register_job("j", props)
        if how == "streaks":
            streaks = e.decide("j", task(), report)
            assert len(streaks) < len(report)   # the streaks of VALUE errors are one answer each
        else:   # record by record
            d = e._decider
            d.decide = lambda j, b, rs: [(d.decide_one(j, b, r), 1) for r in rs]
            decisions(e, "j", task(), report)
    assert [ln["record_id"] for ln in lines["streaks"].lines] == \
        [ln["record_id"] for ln in lines["decide"].lines] == [r.record_id for r in report]
