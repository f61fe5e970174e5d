"""The retry budget and the circuit breaker, alone and through the engine."""

from __future__ import annotations

import pytest
from spillway.sidecar.core.breaker import Breakers, CircuitBreaker, CircuitState
from spillway.sidecar.core.budget import RetryBudget
from spillway.sidecar.core.model import (
    Action,
    ExceptionInfo,
    FailedRecord,
    Stage,
    StageRef,
    TaskIdentity,
)
from spillway.sidecar.core.policy import PolicyEngine
from spillway.sidecar.core.settings import CircuitSettings
from support.deciding import decisions
from support.fakes import FakeClock
from support.fakes import FakeRng as Rng


def Clock() -> FakeClock:
    return FakeClock(start_ms=50_000.0, wall_start_ms=50_000)


CONN = ExceptionInfo("builtins.ConnectionError", message="refused")
TIMEOUT = ExceptionInfo("builtins.TimeoutError", message="timed out")
T = StageRef(Stage.SINK)


def circuit(threshold=4, min_tasks=2, window_ms=10_000, open_ms=5_000, successes=2, holds=10):
    return CircuitSettings(True, threshold, min_tasks, window_ms, open_ms, successes, holds)


def task(p: int, attempt: int = 0) -> TaskIdentity:
    return TaskIdentity(stage_id=3, partition_id=p, attempt_number=attempt,
                        task_attempt_id=100 * p + attempt)


# --- budget ------------------------------------------------------------------------------------

def test_budget_grants_the_minimum_at_once_then_defers_at_the_refill_rate():
    b = RetryBudget(ratio=0.0, min_retries=3, window_ms=1000)      # 3 per s: a token per 334 ms
    grants = [b.acquire(0, 10, None) for _ in range(6)]
    assert [g.delay_ms for g in grants] == [10, 10, 10, 334, 667, 1000]
    assert [g.limited for g in grants] == [False] * 3 + [True] * 3
    assert b.exhausted_total == 3
    assert "retry deferred from 10 ms to 334 ms" in grants[3].reason


def test_budget_a_long_backoff_is_not_deferred():
    b = RetryBudget(ratio=0.0, min_retries=1, window_ms=1000)
    assert b.acquire(0, 0, None).delay_ms == 0
    g = b.acquire(0, 5_000, None)                 # the token comes before the backoff ends
    assert (g.delay_ms, g.limited) == (5_000, False) and b.exhausted_total == 0


def test_budget_grows_with_deposits():
    b = RetryBudget(ratio=0.5, min_retries=1, window_ms=1000)
    b.deposit(0, 10)                              # allowance 1 + 0.5 × 10 = 6
    assert [b.acquire(0, 0, None).limited for _ in range(7)] == [False] * 6 + [True]


def test_budget_refills_with_time():
    b = RetryBudget(ratio=0.0, min_retries=2, window_ms=1000)
    assert not b.acquire(0, 0, None).limited and not b.acquire(0, 0, None).limited
    assert b.acquire(100, 0, None).limited        # 0.2 tokens back: deferred
    assert not b.acquire(2_000, 0, None).limited  # the debt was paid and the bucket refilled


def test_budget_refuses_only_past_the_records_deadline_and_then_takes_no_token():
    b = RetryBudget(ratio=0.0, min_retries=1, window_ms=1000)
    b.acquire(0, 0, None)
    g = b.acquire(0, 0, 500)                      # next token in 1000 ms, 500 ms left
    assert (g.delay_ms, g.limited) == (None, True)
    assert "after errors.retry.timeout (500 ms left)" in g.reason
    assert b.acquire(0, 0, 1_000).delay_ms == 1_000   # the refused one reserved nothing


def test_budget_disabled_with_minus_one():
    b = RetryBudget(ratio=-1, min_retries=1, window_ms=1000)
    assert all(b.acquire(0, 7, 1).delay_ms == 7 for _ in range(1000))
    assert b.exhausted_total == 0


def test_budget_reason_names_the_properties():
    b = RetryBudget(ratio=0.25, min_retries=1, window_ms=2000)
    b.deposit(0, 4)                               # allowance: 1 + 0.25 × 4 = 2 per 2000 ms
    b.acquire(0, 0, None), b.acquire(0, 0, None)
    g = b.acquire(0, 300, None)
    assert g.reason == ("retry budget exhausted: at most 2 retries per 2000 ms for this job "
                        "(errors.retry.budget.min.retries=1 + errors.retry.budget.ratio=0.25 × "
                        "4 records processed or failed in the window); retry deferred from "
                        "300 ms to 1000 ms")


def test_engine_budget_defers_then_refuses_past_the_timeout_and_says_so():
    clock = Clock()
    e = PolicyEngine(clock=clock, rng=Rng())
    e.register_job("j", {"errors.tolerance": "all", "errors.retry.timeout": "8000",
                         "errors.retry.budget.ratio": "0", "errors.retry.budget.min.retries": "2",
                         "errors.circuit.enable": "false"})
    # the budget is the job's: spread over tasks and task attempts, it is still spent
    v1 = decisions(e, "j", task(0), [FailedRecord("a", T, CONN)])[0].verdict
    v2 = decisions(e, "j", task(1, attempt=1), [FailedRecord("b", T, CONN)])[0].verdict
    v3 = decisions(e, "j", task(2), [FailedRecord("c", T, CONN)])[0].verdict
    assert [v.action for v in (v1, v2, v3)] == [Action.RETRY] * 3
    assert (v1.retry_delay_ms, v1.retry_budget_exhausted) == (300, False)
    # 2 per 10 s: the third retry's token comes in 5 s, later than its backoff
    assert (v3.retry_delay_ms, v3.retry_budget_exhausted) == (5_000, True)
    assert "retry deferred from 300 ms to 5000 ms" in v3.reason
    # "d" has 8 s left and the next token is 10 s away: refused, handled as exhausted
    v4 = decisions(e, "j", task(2), [FailedRecord("d", T, CONN)])[0].verdict
    assert v4.action is Action.SKIP and v4.retry_budget_exhausted
    assert "retries exhausted: retry budget exhausted" in v4.reason
    assert "after errors.retry.timeout" in v4.reason
    assert e.counters()["retry-budget-exhausted"] == 2
    assert e.summary("j").retry_budget_exhausted == 2


def _outage(e: PolicyEngine, clock: FakeClock, n: int, outage_ms: float, *, partitions: int = 1,
            job: str = "j") -> dict[str, int]:
    """Drive `n` records the way the executors do: each fails while the dependency is down
    (the first `outage_ms`), is retried after its verdict's delay, and recovers once it is up.
    Returns the outcome counts and the retries started per 10 s window."""
    import heapq

    start = clock.ms
    due = [(start, i) for i in range(n)]
    heapq.heapify(due)
    out = {"recovered": 0, "skipped": 0, "failed": 0, "retries": 0, "deferred": 0,
           "last_ms": 0, "max_per_window": 0}
    started: dict[int, int] = {}
    while due:
        t, i = heapq.heappop(due)
        clock.ms = t
        rid, p = f"r{i}", i % partitions
        if t - start >= outage_ms:
            e.record_recovered(job, task(p), [rid])
            out["recovered"] += 1
            out["last_ms"] = max(out["last_ms"], t - start)
            continue
        v = decisions(e, job, task(p), [FailedRecord(rid, T, CONN)])[0].verdict
        if v.action is Action.RETRY:
            out["retries"] += 1
            out["deferred"] += v.retry_budget_exhausted
            w = int((t + v.retry_delay_ms - start) // 10_000)
            started[w] = started.get(w, 0) + 1
            heapq.heappush(due, (t + v.retry_delay_ms, i))
        else:
            out["skipped" if v.action is Action.SKIP else "failed"] += 1
    out["max_per_window"] = max(started.values(), default=0)
    return out


@pytest.mark.parametrize("partitions", [1, 2])
def test_a_3_second_outage_of_60_records_recovers_all_60_with_the_default_budget(partitions):
    """KIP-298's promise: errors.retry.timeout=60000 retries through a short outage. (With
    the old default budget, ratio 0.5 of failure reports + 10, 55 of 60 were skipped.)"""
    clock = Clock()
    e = PolicyEngine(clock=clock, rng=Rng())
    e.register_job("j", {"errors.tolerance": "all", "errors.retry.timeout": "60000"})
    out = _outage(e, clock, 60, 3_000, partitions=partitions)
    assert (out["recovered"], out["skipped"], out["failed"]) == (60, 0, 0)
    assert e.summary("j").counts.total_records_skipped == 0


def test_infinite_timeout_keeps_retrying_one_record_through_40_failures():
    clock = Clock()
    for props in ({}, {"errors.retry.budget.min.retries": "1"}):   # default, and a tiny budget
        e = PolicyEngine(clock=clock, rng=Rng())
        e.register_job("j", {"errors.tolerance": "all", "errors.retry.timeout": "-1", **props})
        verdicts = []
        for _ in range(40):
            v = decisions(e, "j", task(0), [FailedRecord("x", T, CONN)])[0].verdict
            verdicts.append(v)
            clock.ms += v.retry_delay_ms
        assert [v.action for v in verdicts] == [Action.RETRY] * 40, props
        assert verdicts[-1].attempt == 40


def test_a_retry_storm_is_rate_limited_by_deferral_and_nothing_is_dropped():
    """2,000 records, a dependency down for 5 minutes, no retry timeout: every record is
    retried until it recovers, and the retries started per 10 s stay near the budget."""
    clock = Clock()
    e = PolicyEngine(clock=clock, rng=Rng())
    e.register_job("j", {"errors.tolerance": "all", "errors.retry.timeout": "-1",
                         "errors.circuit.enable": "false"})
    out = _outage(e, clock, 2_000, 300_000)
    assert (out["recovered"], out["skipped"], out["failed"]) == (2_000, 0, 0)
    assert out["deferred"] > 0 and e.summary("j").retry_budget_exhausted == out["deferred"]
    # allowance: 100 + 0.2 × 2,000 first failures = 500 per window; a full bucket's burst on top
    assert out["max_per_window"] <= 2 * 500
    # without a budget, the same storm starts far more retries per window
    clock2 = Clock()
    e2 = PolicyEngine(clock=clock2, rng=Rng())
    e2.register_job("j", {"errors.tolerance": "all", "errors.retry.timeout": "-1",
                          "errors.circuit.enable": "false", "errors.retry.budget.ratio": "-1"})
    assert _outage(e2, clock2, 2_000, 300_000)["max_per_window"] > 2 * 500


# --- breaker alone -----------------------------------------------------------------------------

def test_one_task_alone_never_opens_the_circuit():
    cb = CircuitBreaker("C", circuit(threshold=3, min_tasks=2))
    assert all(cb.on_failure(t, "3.0", Rng()) is None for t in range(100))
    assert cb.state(100) is CircuitState.CLOSED


def test_failures_outside_the_window_do_not_open_it():
    cb = CircuitBreaker("C", circuit(threshold=3, window_ms=1000))
    assert cb.on_failure(0, "a", Rng()) is None
    assert cb.on_failure(600, "b", Rng()) is None
    assert cb.on_failure(1200, "c", Rng()) is None        # the first one left the window
    assert cb.on_failure(1300, "d", Rng()) is not None


def test_open_half_open_closed_cycle():
    cb = CircuitBreaker("C", circuit(threshold=2, open_ms=1000, successes=2))
    cb.on_failure(0, "a", Rng())
    hold = cb.on_failure(10, "b", Rng(0.0))
    assert hold is not None and hold.wait_ms == 1000
    assert cb.state(500) is CircuitState.OPEN
    assert cb.on_failure(500, "c", Rng(0.0)).wait_ms == 510       # same end for everyone
    assert cb.state(1010) is CircuitState.HALF_OPEN
    cb.on_success(1010)
    assert cb.state(1011) is CircuitState.HALF_OPEN
    cb.on_success(1012)
    assert cb.state(1013) is CircuitState.CLOSED
    assert cb.on_failure(1014, "a", Rng()) is None               # counting starts afresh


def test_a_failing_probe_reopens():
    cb = CircuitBreaker("C", circuit(threshold=1, min_tasks=1, open_ms=1000))
    cb.on_failure(0, "a", Rng())
    assert cb.state(1000) is CircuitState.HALF_OPEN
    hold = cb.on_failure(1000, "a", Rng(0.0))
    assert hold is not None and hold.wait_ms == 1000
    assert "probe failed" in hold.reason and cb.times_opened == 2


def test_breakers_are_bounded_and_evict_closed_circuits_first():
    b = Breakers(circuit(threshold=1, min_tasks=1), max_circuits=3)
    b.get("open", 0).on_failure(0, "t", Rng())
    for name in ("a", "b", "c", "d"):
        b.get(name, 0)
    assert len(b._by_class) == 3 and b.find("open") is not None and b.open_count(0) == 1


# --- breaker through the engine ------------------------------------------------------------------

@pytest.fixture
def setup():
    clock = Clock()
    e = PolicyEngine(clock=clock, rng=Rng(0.5))
    e.register_job("j", {"errors.tolerance": "all", "errors.retry.max.retries": "1",
                         "errors.retry.budget.ratio": "-1",
                         "errors.circuit.failure.threshold": "4", "errors.circuit.min.tasks": "2",
                         "errors.circuit.open.ms": "5000", "errors.circuit.success.threshold": "2",
                         "errors.circuit.max.holds": "2"})
    return e, clock


def report(e, p, rid, exc=CONN):
    return decisions(e, "j", task(p), [FailedRecord(rid, T, exc)])[0].verdict


def test_breaker_opens_across_tasks_with_one_shared_wait_and_closes_after_recoveries(setup):
    e, clock = setup
    # three failures: ordinary backoff (finer family, jitter 0.25, rng 0.5 -> 337 ms)
    for p, rid in ((0, "a"), (0, "b"), (1, "c")):
        v = report(e, p, rid)
        assert v.action is Action.RETRY and v.retry_delay_ms == 338
        clock.ms += 10
    # the fourth opens the circuit: everyone gets the same target time (+ the shared jitter)
    ends = []
    for p, rid in ((2, "d"), (3, "e"), (0, "a"), (1, "c")):
        v = report(e, p, rid)
        assert v.action is Action.RETRY and "circuit open for builtins.ConnectionError" in v.reason
        ends.append(clock.ms + v.retry_delay_ms)
        clock.ms += 100
    assert len(set(ends)) == 1
    assert ends[0] == pytest.approx(clock.ms - 400 + 5000 + 250, abs=1)   # open.ms + spread × r
    flat = e.counters()
    assert flat["circuits-open"] == 1 and flat["circuit-breaker-opened"] == 1
    # "a" had used its one retry before the circuit opened: the hold did not burn anything
    assert "not charged" in report(e, 0, "a").reason

    # another class is not held by this circuit
    other = report(e, 1, "t1", TIMEOUT)
    assert other.action is Action.RETRY and "circuit" not in other.reason

    clock.ms = ends[0]                                    # half-open: held records come back
    e.record_recovered("j", task(2), ["d"])
    assert e.counters()["circuits-open"] == 1             # one success of two
    e.record_recovered("j", task(3), ["e"])
    assert e.counters()["circuits-open"] == 0             # closed
    v = report(e, 2, "f")
    assert v.action is Action.RETRY and "circuit" not in v.reason


def test_holds_are_bounded_then_charged_as_retries(setup):
    e, _ = setup
    for p, rid in ((0, "a"), (1, "b"), (2, "c"), (3, "d")):      # opens on the fourth
        report(e, p, rid)
    # "a": 1 charged retry (its max) then holds 1 and 2 are free, the third hold is charged
    # against max.retries=1, which is spent: exhausted -> tolerance
    h1 = report(e, 0, "a")
    h2 = report(e, 0, "a")
    assert "hold 1" in h1.reason and "hold 2" in h2.reason
    v = report(e, 0, "a")
    assert v.action is Action.SKIP
    assert "errors.retry.max.retries=1 reached" in v.reason
    assert v.attempt == 4


def test_a_failing_probe_gives_everyone_a_new_shared_wait(setup):
    e, clock = setup
    for p, rid in ((0, "a"), (1, "b"), (2, "c"), (3, "d")):
        report(e, p, rid)
    clock.ms += 5_000                                      # half-open
    v = report(e, 0, "b")
    assert v.action is Action.RETRY and "probe failed" in v.reason
    assert v.retry_delay_ms == 5_250
    assert e.counters()["circuit-breaker-opened"] == 2


def test_breaker_respects_the_retry_timeout():
    clock = Clock()
    e = PolicyEngine(clock=clock, rng=Rng(0.0))
    e.register_job("j", {"errors.tolerance": "all", "errors.retry.timeout": "3000",
                         "errors.circuit.failure.threshold": "2", "errors.circuit.min.tasks": "2",
                         "errors.circuit.open.ms": "10000"})
    report(e, 0, "a")
    v = report(e, 1, "b")                                  # opens: a 10 s wait
    assert v.action is Action.RETRY
    assert v.retry_delay_ms == 3000                        # shortened to b's retry timeout
    clock.ms += 3000
    assert report(e, 1, "b").action is Action.SKIP


def test_breaker_never_holds_when_retries_are_disabled():
    e = PolicyEngine(clock=Clock(), rng=Rng())
    e.register_job("j", {"errors.tolerance": "all", "errors.circuit.failure.threshold": "1",
                         "errors.circuit.min.tasks": "1"})
    assert report(e, 0, "a").action is Action.SKIP
