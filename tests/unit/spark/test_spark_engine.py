"""The verdict loop (`spillway.spark._engine`) with a fake session and a fake clock."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
from spillway.client import (
    JobFailedError,
    RecordFailedError,
    RefreshRetriableError,
    RetriableError,
    ToleranceExceededError,
)
from spillway.client.errors import SidecarProtocolError
from spillway.spark._adapters import (
    BatchAdapter,
    RowAdapter,
    SinkAdapter,
    batch_units,
    chunk_units,
    row_units,
)
from spillway.spark._engine import Engine, StageFailure, StageRef, Unit, follow, reported
from spillway.spark._records import RecordContext, positional_record_id
from spillway.v1 import sidecar_pb2 as pb

TRANSFORMATION = StageRef.of("TRANSFORMATION")


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += s


class FakeSession:
    """Answers by policy(record) -> (action, delay_ms, category, job_failed)."""

    job = "j"
    trace_context = None

    def __init__(self, policy):
        self.policy = policy
        self.reports: list[list[pb.FailedRecord]] = []
        self.counts: dict = {}
        self.recovered_ids: list[str] = []
        self.skipped_ids: list[str] = []
        self.failures: list[tuple[str, str]] = []

    def report(self, records):
        self.reports.append(list(records))
        out = []
        for r in records:
            action, delay, category, job_failed = self.policy(r)
            out.append(pb.Verdict(record_id=r.record_id, action=action, retry_delay_ms=delay,
                                  category=category, reason=f"policy says {action}",
                                  job_failed=job_failed))
        return out

    def processed(self, stages, n):
        for s in stages:
            self.counts[s.name] = self.counts.get(s.name, 0) + n

    def recovered(self, rid):
        self.recovered_ids.append(rid)

    def failed(self, exc, record):
        self.failures.append((record.record_id, type(exc).__name__))

    def skipped(self, records, verdicts):
        self.skipped_ids += [r.record_id for r in records]


def ids(i):
    return positional_record_id("TRANSFORMATION", "j", "w", 0, i)


def skip_data(r):
    return pb.ACTION_SKIP, 0, pb.CATEGORY_DATA, False


MODE = {"rows": "fast"}


@pytest.fixture(autouse=True, params=["fast", "general"])
def row_mode(request):
    """Row tests run through both loops: run_rows (fast path) and run over row units."""
    MODE["rows"] = request.param


class RowsEngine(Engine):
    def rows(self, data):
        if MODE["rows"] == "fast":
            return self.run_rows(data)
        return self.run(row_units(data))


def _engine(session, adapter, clock, **kw):
    return RowsEngine(session, adapter, stage=TRANSFORMATION, function_name="app.fn",
                      clock=clock, sleep=clock.sleep, **kw)


def test_retry_then_success_emits_once_and_reports_recovery():
    calls = {}

    def fn(x):
        calls[x] = calls.get(x, 0) + 1
        if x == 2 and calls[x] == 1:
            raise RetriableError("flaky")
        if x == 4:
            raise ValueError("poison")
        return x * 10

    def policy(r):
        if r.exception.class_name.endswith("RetriableError"):
            return pb.ACTION_RETRY, 250, pb.CATEGORY_RETRIABLE, False
        return skip_data(r)

    session, clock = FakeSession(policy), FakeClock()
    out = list(_engine(session, RowAdapter(fn, ids=ids), clock).rows(range(6)))
    assert sorted(out) == [0, 10, 20, 30, 50]
    assert out.count(20) == 1
    assert out[-1] == 20  # the retried record comes out after the ones that kept flowing
    assert session.recovered_ids == [ids(2)]
    assert session.skipped_ids == [ids(4)]
    assert calls[2] == 2 and calls[4] == 1
    assert clock.sleeps == [0.25]  # waited only for the retry's remaining delay
    first = session.reports[0]
    assert [r.record_id for r in first] == [ids(2), ids(4)]
    assert [r.attempt for r in first] == [1, 1]
    assert session.counts == {"TRANSFORMATION": 6}  # each input record counted once


def test_a_record_that_keeps_failing_carries_its_attempt_number():
    attempts = []

    def policy(r):
        attempts.append(r.attempt)
        return ((pb.ACTION_RETRY, 10, pb.CATEGORY_RETRIABLE, False) if r.attempt < 3
                else skip_data(r))

    def fn(x):
        raise RetriableError("down")

    session, clock = FakeSession(policy), FakeClock()
    assert list(_engine(session, RowAdapter(fn, ids=ids), clock).rows([1])) == []
    assert attempts == [1, 2, 3]
    assert session.skipped_ids == [ids(0)] and session.recovered_ids == []


def test_failures_are_reported_in_batches():
    session, clock = FakeSession(skip_data), FakeClock()

    def fn(x):
        if x % 2:
            raise ValueError(x)
        return x

    out = list(_engine(session, RowAdapter(fn, ids=ids), clock, batch_size=3,
                       linger_s=100).rows(range(14)))
    assert sorted(out) == list(range(0, 14, 2))
    assert [len(b) for b in session.reports] == [3, 3, 1]  # 7 failures: two full batches + rest


def test_linger_reports_a_lonely_failure_before_the_partition_ends():
    session, clock = FakeSession(skip_data), FakeClock()
    seen_reports_at = []

    def fn(x):
        clock.now += 0.3
        seen_reports_at.append(len(session.reports))
        if x == 0:
            raise ValueError("first")
        return x

    list(_engine(session, RowAdapter(fn, ids=ids), clock, batch_size=100,
                 linger_s=0.5).rows(range(5)))
    # failed at t=0.3; after the run ending at t=0.9 it had waited >= 0.5 s: reported
    assert seen_reports_at == [0, 0, 0, 1, 1]


def test_fail_raises_readable_error_from_the_user_exception():
    session, clock = FakeSession(lambda r: (pb.ACTION_FAIL, 0, pb.CATEGORY_DATA, True)), FakeClock()

    def fn(x):
        raise ValueError("bad row")

    eng = _engine(session, RowAdapter(fn, ids=ids), clock)
    with pytest.raises(JobFailedError) as info:
        list(eng.rows([1]))
    assert "TRANSFORMATION" in str(info.value) and "builtins.ValueError: bad row" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    if sys.version_info >= (3, 11):  # the trace the queued failure dropped, as a note
        note = "\n".join(info.value.__cause__.__notes__)
        assert "Traceback (most recent call last)" in note and "in fn" in note


def test_a_queued_failure_frees_its_frames_without_the_cyclic_gc():
    """A failure waiting for its report holds no traceback: its frames' locals go at once, not
    at the GC's next full collection (which a burst of failures ran every ~50 records)."""
    session, clock = FakeSession(skip_data), FakeClock()
    held = []

    class Local:
        pass

    def fn(x):
        if any(ref() is not None for ref in held):
            raise AssertionError("a queued failure still holds its frame's locals")
        local = Local()
        held.append(weakref.ref(local))
        raise ValueError(f"bad {x}")

    gc.disable()
    try:
        list(_engine(session, RowAdapter(fn, ids=ids), clock, batch_size=100).rows(range(5)))
    finally:
        gc.enable()
    assert [len(r) for r in session.reports] == [5]     # queued together, reported at the end
    assert all("ValueError: bad" in r.exception.stack_trace for r in session.reports[0])


def test_job_failed_verdict_wins_over_task_fail_and_tolerance_is_typed():
    def policy(r):
        if r.record_id == ids(0):
            return pb.ACTION_FAIL, 0, pb.CATEGORY_ABORTABLE, False
        return pb.ACTION_FAIL, 0, pb.CATEGORY_DATA, True

    session, clock = FakeSession(policy), FakeClock()

    def fn(x):
        raise ValueError(x)

    original = session.report

    def report(records):
        out = original(records)
        for v in out:
            if v.job_failed:
                v.reason = ("job 'j' exceeded errors.tolerance.max.errors=1: 2 errors; "
                            "last error: ...")
        return out

    session.report = report
    with pytest.raises(ToleranceExceededError) as info:
        list(_engine(session, RowAdapter(fn, ids=ids), clock).rows([0, 1]))
    assert info.value.record_id == ids(1)
    assert info.value.limit == "errors.tolerance.max.errors=1" and info.value.count == 2


def test_abortable_fail_is_a_task_failure_only():
    session, clock = FakeSession(lambda r: (pb.ACTION_FAIL, 0, pb.CATEGORY_ABORTABLE, False)),\
        FakeClock()

    def fn(x):
        raise ValueError(x)

    with pytest.raises(RecordFailedError) as info:
        list(_engine(session, RowAdapter(fn, ids=ids), clock).rows([0]))
    assert not isinstance(info.value, JobFailedError)


def test_verdict_without_action_is_a_protocol_error():
    session, clock = FakeSession(lambda r: (pb.ACTION_UNSPECIFIED, 0, 0, False)), FakeClock()

    def fn(x):
        raise ValueError(x)

    with pytest.raises(SidecarProtocolError):
        list(_engine(session, RowAdapter(fn, ids=ids), clock).rows([0]))


def _failed_units(session, n):
    """``n`` units that failed, each described by `reported` as every wrapper does."""
    out = []
    for i in range(n):
        try:
            raise ValueError(f"row {i}")
        except ValueError as exc:
            unit = Unit(i, 1, i, exc=exc)
            unit.record = reported(session, RecordContext(ids(i)), exc, TRANSFORMATION,
                                   "app.fn", unit.attempt)
            out.append(unit)
    return out


def test_the_verdict_path_of_every_wrapper_skips_retries_and_fails_as_its_verdicts_say():
    """`follow` is what the loop and a UDF's row do with verdicts: SKIP told to the session,
    RETRY handed back with the next attempt, and a FAIL raised before anything is applied."""
    by_row = {ids(0): pb.ACTION_SKIP, ids(1): pb.ACTION_RETRY, ids(2): pb.ACTION_SKIP}
    session = FakeSession(lambda r: (by_row[r.record_id], 5, pb.CATEGORY_RETRIABLE, False))
    units = _failed_units(session, 3)
    assert session.failures == [(ids(i), "ValueError") for i in range(3)]
    retries = follow(session, units, session.report([u.record for u in units]))
    assert session.skipped_ids == [ids(0), ids(2)]
    assert [(u.record.record_id, u.attempt, v.retry_delay_ms) for u, v in retries] == [
        (ids(1), 2, 5)]

    by_row[ids(1)] = pb.ACTION_FAIL
    session = FakeSession(lambda r: (by_row[r.record_id], 0, pb.CATEGORY_DATA, False))
    units = _failed_units(session, 3)
    with pytest.raises(RecordFailedError) as info:
        follow(session, units, session.report([u.record for u in units]))
    assert session.skipped_ids == [] and info.value.__cause__ is units[1].exc

    session = FakeSession(lambda r: (pb.ACTION_UNSPECIFIED, 0, 0, False))
    units = _failed_units(session, 1)
    with pytest.raises(SidecarProtocolError, match=ids(0)):
        follow(session, units, session.report([u.record for u in units]))
    with pytest.raises(ValueError):   # one verdict per record reported
        follow(session, units, [])


def test_refresh_hook_runs_before_a_refresh_retriable_record_is_rerun():
    events = []

    def fn(x):
        events.append(("run", x))
        if len([e for e in events if e == ("run", 0)]) == 1 and x == 0:
            raise RefreshRetriableError("stale metadata")
        return x

    def policy(r):
        return pb.ACTION_RETRY, 5, pb.CATEGORY_REFRESH_RETRIABLE, False

    session, clock = FakeSession(policy), FakeClock()
    out = list(_engine(session, RowAdapter(fn, ids=ids), clock,
                       refresh=lambda: events.append(("refresh",))).rows([0]))
    assert out == [0]
    assert events == [("run", 0), ("refresh",), ("run", 0)]


def test_stage_failure_reports_the_step_stage_and_function():
    def fn(x):
        try:
            raise KeyError("k")
        except KeyError as exc:
            raise StageFailure(StageRef.of("KEY_CONVERTER"), "app.decode_key", exc) from exc

    session, clock = FakeSession(skip_data), FakeClock()
    list(_engine(session, RowAdapter(fn, ids=ids), clock).rows([0]))
    rec = session.reports[0][0]
    assert rec.stage == pb.STAGE_KEY_CONVERTER and rec.function_name == "app.decode_key"
    assert rec.exception.class_name == "builtins.KeyError"


def test_flat_outputs_are_all_or_nothing_per_record():
    def fn(x):
        yield x
        if x == 1:
            raise ValueError("half-way")
        yield x + 100

    session, clock = FakeSession(skip_data), FakeClock()
    out = list(_engine(session, RowAdapter(fn, ids=ids, flat=True), clock).run(
        row_units([0, 1, 2])))
    assert sorted(out) == [0, 2, 100, 102]


def test_bisection_isolates_failing_rows_and_good_rows_flow():
    pa = pytest.importorskip("pyarrow")
    calls = []
    bad = {7, 20}

    def fn(batch):
        calls.append(batch.num_rows)
        ids_ = batch.column("id").to_pylist()
        if bad & set(ids_):
            raise ValueError(f"bad id in {sorted(bad & set(ids_))}")
        return batch

    batches = [pa.RecordBatch.from_pydict({"id": list(range(s, s + 16))}) for s in (0, 16)]
    session, clock = FakeSession(skip_data), FakeClock()
    out = list(_engine(session, BatchAdapter(fn, "arrow", ids=ids), clock).run(
        batch_units(batches)))
    got = sorted(i for b in out for i in b.column("id").to_pylist())
    assert got == [i for i in range(32) if i not in bad]
    assert {r.record_id for rep in session.reports for r in rep} == {ids(7), ids(20)}
    assert session.counts == {"TRANSFORMATION": 32}
    assert calls[0] == 16  # the happy path is the whole batch
    assert len(calls) <= 2 * (1 + 2 * 4)  # O(k log n) calls, not one per row


def test_bisection_with_pandas_and_a_retry():
    pd = pytest.importorskip("pandas")
    flaky = {"left": 1}

    def fn(df):
        if 3 in set(df["id"]) and flaky["left"]:
            if len(df) == 1:
                flaky["left"] -= 1
            raise RetriableError("flaky 3")
        return df.assign(twice=df["id"] * 2)

    def policy(r):
        return pb.ACTION_RETRY, 1, pb.CATEGORY_RETRIABLE, False

    session, clock = FakeSession(policy), FakeClock()
    out = list(_engine(session, BatchAdapter(fn, "pandas", ids=ids), clock).run(
        batch_units([pd.DataFrame({"id": range(8)})])))
    rows = sorted(int(i) for df in out for i in df["id"])
    assert rows == list(range(8))
    assert session.recovered_ids == [ids(3)]


def test_sink_chunks_are_bisected_and_only_unwritable_rows_reported():
    written = []

    def write(rows):
        if any(r == 5 for r in rows):
            raise IOError("row 5 rejected")
        written.extend(rows)

    session, clock = FakeSession(skip_data), FakeClock()
    sink_stage = StageRef.of("SINK")
    eng = Engine(session, SinkAdapter(write, ids=ids), stage=sink_stage,
                 function_name="app.write", clock=clock, sleep=clock.sleep)
    assert list(eng.run(chunk_units(range(12), 4))) == []
    assert sorted(written) == [i for i in range(12) if i != 5]
    [[rec]] = session.reports
    assert rec.record_id == ids(5) and rec.stage == pb.STAGE_SINK
    assert sink_stage.name == "TASK_PUT"


def test_unit_defaults():
    u = Unit("x")
    assert (u.size, u.offset, u.attempt, u.record) == (1, 0, 1, None)


def test_reported_stack_traces_start_at_user_code():
    def user_parse(x):
        raise ValueError("deep in user code")

    session, clock = FakeSession(skip_data), FakeClock()
    list(_engine(session, RowAdapter(user_parse, ids=ids), clock).rows([0]))
    trace = session.reports[0][0].exception.stack_trace
    frames = [ln for ln in trace.splitlines() if ln.strip().startswith("File ")]
    assert "user_parse" in frames[0] and "spillway/spark" not in frames[0]


# --- reports in the background ---------------------------------------------------------------


class ManualSubmit:
    """A ``submit`` whose reports land only when the test says so."""

    def __init__(self):
        self.calls = []  # (fn, args, future)

    def __call__(self, fn, *args):
        from concurrent.futures import Future

        future = Future()
        self.calls.append((fn, args, future))
        return future

    def land(self, i=-1, error=None):
        fn, args, future = self.calls[i]
        if not future.done():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(fn(*args))

    @property
    def in_flight(self):
        return sum(not f.done() for _, _, f in self.calls)


def test_reports_go_in_the_background_and_rows_keep_flowing():
    session, clock, submit = FakeSession(skip_data), FakeClock(), ManualSubmit()
    seen = []

    def fn(x):
        seen.append((x, len(submit.calls), len(session.skipped_ids)))
        if x == 1:
            raise ValueError(x)
        if x == 5:
            submit.land(0)  # the report lands while row 5 runs
        return x

    out = list(_engine(session, RowAdapter(fn, ids=ids), clock, batch_size=1,
                       submit=submit).rows(range(10)))
    assert sorted(out) == [0, 2, 3, 4, 5, 6, 7, 8, 9]
    # row 1's report went out at once and rows kept flowing while it was in flight...
    assert seen[2:6] == [(2, 1, 0), (3, 1, 0), (4, 1, 0), (5, 1, 0)]
    # ...its verdict was applied as soon as it landed
    assert seen[6] == (6, 1, 1) and session.skipped_ids == [ids(1)]
    assert submit.in_flight == 0 and session.counts == {"TRANSFORMATION": 10}


class ImmediateSubmit(ManualSubmit):
    def __call__(self, fn, *args):
        future = super().__call__(fn, *args)
        self.land()
        return future


def test_failures_while_a_report_waits_join_it_with_their_own_positions():
    """While a report is pending or in flight the fast loop queues a failure where it happens
    (it does not leave the run for each one): each failed row still gets its own positional id,
    a report never exceeds the batch size, and every row is counted once."""
    session, clock, submit = FakeSession(skip_data), FakeClock(), ManualSubmit()
    runs = []
    processed = session.processed
    session.processed = lambda stages, n: (runs.append(n), processed(stages, n))

    def fn(x):
        if x == 42:                 # amid five failures in a row, the first report lands
            submit.land(0)
        if x == 60:                 # the rest land, and from now on at once
            for i in range(len(submit.calls)):
                submit.land(i)
            submit.__class__ = ImmediateSubmit
        if x % 3 == 0 or 40 <= x <= 44:
            raise ValueError(x)
        return x

    failing = [x for x in range(90) if x % 3 == 0 or 40 <= x <= 44]
    out = list(_engine(session, RowAdapter(fn, ids=ids), clock, batch_size=4, linger_s=100,
                       submit=submit, max_inflight=8).rows(range(90)))
    assert sorted(out) == sorted(set(range(90)) - set(failing))
    reported = [r.record_id for batch in session.reports for r in batch]
    assert sorted(reported) == sorted(ids(x) for x in failing)      # each exactly once
    assert all(len(batch) <= 4 for batch in session.reports)
    assert session.counts == {"TRANSFORMATION": 90}
    if MODE["rows"] == "fast":
        assert len(runs) < len(failing) // 2    # not one run per failure


def test_a_full_batch_waits_for_the_report_in_flight():
    session, clock = FakeSession(skip_data), FakeClock()
    from concurrent.futures import ThreadPoolExecutor

    inflight, most = [0], [0]
    original = session.report

    def report(records):
        inflight[0] += 1
        most[0] = max(most[0], inflight[0])
        try:
            return original(records)
        finally:
            inflight[0] -= 1

    session.report = report

    def fn(x):
        if x % 3 == 0:
            raise ValueError(x)
        return x

    with ThreadPoolExecutor(2) as pool:
        out = list(_engine(session, RowAdapter(fn, ids=ids), clock, batch_size=4,
                           submit=pool.submit).rows(range(300)))
    assert len(out) == 200 and most[0] == 1
    reported = [r.record_id for batch in session.reports for r in batch]
    assert sorted(reported) == sorted(ids(i) for i in range(0, 300, 3))  # each exactly once
    assert len(session.skipped_ids) == 100


def test_a_fail_verdict_of_a_background_report_fails_the_loop():
    session = FakeSession(lambda r: (pb.ACTION_FAIL, 0, pb.CATEGORY_DATA, True))
    clock, submit = FakeClock(), ManualSubmit()

    def fn(x):
        if x == 0:
            raise ValueError("bad row")
        if x == 3:
            submit.land(0)
        return x

    with pytest.raises(JobFailedError) as info:
        list(_engine(session, RowAdapter(fn, ids=ids), clock, batch_size=1,
                     submit=submit).rows(range(100)))
    assert isinstance(info.value.__cause__, ValueError)
    assert len(session.reports) == 1


def test_an_error_of_a_background_report_is_raised_by_the_loop():
    from spillway.client.errors import SidecarUnavailableError

    session, clock, submit = FakeSession(skip_data), FakeClock(), ManualSubmit()

    def fn(x):
        if x == 0:
            raise ValueError("bad row")
        if x == 2:
            submit.land(0, error=SidecarUnavailableError("down"))
        return x

    with pytest.raises(SidecarUnavailableError):
        list(_engine(session, RowAdapter(fn, ids=ids), clock, batch_size=1,
                     submit=submit).rows(range(5)))


def test_retry_verdicts_of_background_reports_are_followed():
    calls = {}

    def fn(x):
        calls[x] = calls.get(x, 0) + 1
        if x == 2 and calls[x] == 1:
            raise RetriableError("flaky")
        return x

    def policy(r):
        return pb.ACTION_RETRY, 100, pb.CATEGORY_RETRIABLE, False

    from concurrent.futures import ThreadPoolExecutor

    session, clock = FakeSession(policy), FakeClock()
    with ThreadPoolExecutor(1) as pool:
        out = list(_engine(session, RowAdapter(fn, ids=ids), clock,
                           submit=pool.submit).rows(range(5)))
    assert sorted(out) == [0, 1, 2, 3, 4] and calls[2] == 2
    assert session.recovered_ids == [ids(2)]


def test_closing_the_loop_early_lets_the_report_in_flight_finish():
    session, clock, submit = FakeSession(skip_data), FakeClock(), ManualSubmit()

    def fn(x):
        if x == 0:
            raise ValueError("bad")
        return x

    gen = _engine(session, RowAdapter(fn, ids=ids), clock, batch_size=1,
                  submit=submit).rows(range(100))
    assert next(gen) == 1
    submit.calls[0][2].set_result([])  # lands with no verdicts applied
    gen.close()
    assert submit.in_flight == 0


# --- several reports in flight (max_inflight) --------------------------------------------------


def test_reports_are_pipelined_up_to_max_inflight_and_no_further():
    session, clock, submit = FakeSession(skip_data), FakeClock(), ManualSubmit()
    at_submit = []  # reports in flight when each report was sent (itself included)
    send = submit.__call__

    def counting(fn, *args):
        future = send(fn, *args)
        at_submit.append(submit.in_flight)
        return future

    seen = []

    def fn(x):
        seen.append((x, len(submit.calls), submit.in_flight))
        if x in (1, 2, 3):
            if x == 3:  # a third full batch must wait for the oldest report: let it land
                submit.land(0)
            raise ValueError(x)
        if x == 9:
            submit.land(1)
            submit.land(2)
        return x

    out = list(_engine(session, RowAdapter(fn, ids=ids), clock, batch_size=1, submit=counting,
                       max_inflight=2).rows(range(10)))
    assert sorted(out) == [0, 4, 5, 6, 7, 8, 9]
    # rows 1 and 2 were both reported without waiting: two reports in flight while row 3 ran
    assert seen[3] == (3, 2, 2)
    assert at_submit == [1, 2, 2] and max(at_submit) <= 2
    assert session.skipped_ids == [ids(1), ids(2), ids(3)]  # each once, in report order
    assert submit.in_flight == 0


def test_verdicts_are_applied_in_report_order_even_when_a_later_report_lands_first():
    session, clock, submit = FakeSession(skip_data), FakeClock(), ManualSubmit()
    seen = []

    def fn(x):
        seen.append((x, list(session.skipped_ids)))
        if x in (1, 2):
            raise ValueError(x)
        if x == 4:
            submit.land(1)  # the second report lands first: not applied before the first
        if x == 6:
            submit.land(0)
        return x

    list(_engine(session, RowAdapter(fn, ids=ids), clock, batch_size=1, submit=submit,
                 max_inflight=2).rows(range(9)))
    assert seen[5] == (5, [])  # report 1 landed, report 0 had not: nothing applied yet
    assert seen[7] == (7, [ids(1), ids(2)])  # both applied, oldest first, once 0 landed
    assert session.skipped_ids == [ids(1), ids(2)]


def test_a_fail_in_the_oldest_report_wins_over_later_reports_and_they_still_finish():
    def policy(r):
        if r.record_id == ids(1):
            return pb.ACTION_FAIL, 0, pb.CATEGORY_DATA, False
        return skip_data(r)

    session, clock, submit = FakeSession(policy), FakeClock(), ManualSubmit()

    def fn(x):
        if x in (1, 2):
            raise ValueError(f"bad {x}")
        if x == 4:
            submit.land(1)
            submit.land(0)
        return x

    with pytest.raises(RecordFailedError) as info:
        list(_engine(session, RowAdapter(fn, ids=ids), clock, batch_size=1, submit=submit,
                     max_inflight=3).rows(range(100)))
    assert str(info.value.__cause__) == "bad 1"
    assert session.skipped_ids == []  # the later report's verdicts are not followed
    assert submit.in_flight == 0


def test_max_inflight_must_be_positive():
    with pytest.raises(ValueError, match="report_max_inflight"):
        _engine(FakeSession(skip_data), RowAdapter(lambda x: x, ids=ids), FakeClock(),
                max_inflight=0)


def test_a_report_goes_once_its_records_bytes_reach_the_bound_whatever_their_number():
    """report_max_bytes: records of 1 KiB with a 3 KiB bound go three a report (the fourth
    starts the next), though the batch size would take 1,000."""
    def fn(x):
        raise ValueError("poison")

    session, clock = FakeSession(skip_data), FakeClock()
    engine = _engine(session, RowAdapter(fn, ids=ids), clock, batch_size=1000, max_bytes=3000)
    assert list(engine.rows([b"v" * 1024] * 7)) == []
    assert [len(r) for r in session.reports] == [3, 3, 1]
    assert len(session.skipped_ids) == 7


def test_report_bounds_below_one_are_refused_naming_them():
    with pytest.raises(ValueError, match="report_max_bytes: must be >= 1, got 0"):
        _engine(FakeSession(skip_data), RowAdapter(lambda x: x, ids=ids), FakeClock(),
                max_bytes=0)


def test_a_mixed_answer_tells_the_session_its_skipped_records_once_in_report_order():
    """Only an all-SKIP answer is followed per report without looking at each verdict; a mixed
    one still retries its RETRY records and tells the session the rest, in order."""
    tries: dict = {}

    def fn(x):
        tries[x] = tries.get(x, 0) + 1
        if tries[x] == 1:
            raise (RetriableError if x % 2 else ValueError)(f"bad {x}")
        return x

    def policy(r):
        if r.exception.class_name.endswith("RetriableError"):
            return pb.ACTION_RETRY, 0, pb.CATEGORY_RETRIABLE, False
        return skip_data(r)

    session, clock = FakeSession(policy), FakeClock()
    out = list(_engine(session, RowAdapter(fn, ids=ids), clock, batch_size=4).rows(range(4)))
    assert sorted(out) == [1, 3]
    assert session.skipped_ids == [ids(0), ids(2)]


def test_with_a_waker_the_row_loop_ends_a_linger_when_the_wake_up_lands():
    """The fast loop asks for one wake-up per pending report and reads no clock per row: the
    lonely failure is reported once the wake-up lands in the loop's inbox (`_waker`)."""
    from spillway.spark._waker import WAKE

    session, clock = FakeSession(skip_data), FakeClock()
    asked: list = []
    seen_reports_at = []

    def fn(x):
        clock.now += 0.3
        if x == 4:  # the waker's thread: the deadline (0.3 + 0.5) passed at t=0.9
            for when, inbox in asked:
                inbox.append(WAKE)
        seen_reports_at.append(len(session.reports))
        if x == 0:
            raise ValueError("first")
        return x

    eng = _engine(session, RowAdapter(fn, ids=ids), clock, batch_size=100, linger_s=0.5,
                  wake=lambda when, inbox: asked.append((when, inbox)))
    list(eng.run_rows(range(8)))   # the general loop checks the linger at every step
    assert [when for when, _ in asked] == [pytest.approx(0.8)]   # once, at the deadline
    # past the deadline at t=0.9 (row 2) but reported only after the wake-up (row 4)
    assert seen_reports_at == [0, 0, 0, 0, 0, 1, 1, 1]


def test_the_waker_wakes_each_inbox_at_its_time_an_earlier_one_first():
    import time
    from collections import deque

    from spillway.spark._waker import WAKE, Waker

    waker, late, soon = Waker(), deque(), deque()
    now = time.monotonic()
    waker.at(now + 3600, late)
    waker.at(now + 0.05, soon)          # earlier than what the thread already waits for
    deadline = time.monotonic() + 30
    while not soon and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(soon) == [WAKE] and time.monotonic() >= now + 0.05
    assert not late
