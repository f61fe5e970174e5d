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

def test_budget_always_allows_the_minimum():
    b = RetryBudget(ratio=0.0, min_retries=3, window_ms=1000)
    assert [b.try_acquire(0).allowed for _ in range(4)] == [True, True, True, False]


def test_budget_grows_with_reports():
    b = RetryBudget(ratio=0.5, min_retries=0, window_ms=1000)
    assert not b.try_acquire(0).allowed
    b.on_report(0, 10)
    assert [b.try_acquire(0).allowed for _ in range(6)] == [True] * 5 + [False]


def test_budget_window_slides():
    b = RetryBudget(ratio=0.0, min_retries=1, window_ms=1000)
    assert b.try_acquire(0).allowed
    assert not b.try_acquire(500).allowed
    assert b.try_acquire(1100).allowed


def test_budget_disabled_with_minus_one():
    b = RetryBudget(ratio=-1, min_retries=0, window_ms=1000)
    assert all(b.try_acquire(0).allowed for _ in range(1000))


def test_budget_refusal_reason_names_the_properties():
    b = RetryBudget(ratio=0.25, min_retries=1, window_ms=2000)
    b.on_report(0, 2)                       # allowance: 1 + 0.25 × 2 = 1.5 retries
    assert b.try_acquire(0).allowed and b.try_acquire(0).allowed
    v = b.try_acquire(0)
    assert not v.allowed
    assert v.reason == ("retry budget exhausted: 2 retries for 2 failure reports in the last "
                        "2000 ms (errors.retry.budget.ratio=0.25, "
                        "errors.retry.budget.min.retries=1)")


def test_engine_budget_exhaustion_is_an_exhausted_retry_with_its_reason():
    clock = Clock()
    e = PolicyEngine(clock=clock, rng=Rng())
    e.register_job("j", {"errors.tolerance": "all", "errors.retry.max.retries": "5",
                         "errors.retry.budget.ratio": "0", "errors.retry.budget.min.retries": "2",
                         "errors.circuit.enable": "false"})
    # the budget is the job's: spread over tasks and task attempts, it is still spent
    v1 = e.decide("j", task(0), [FailedRecord("a", T, CONN)])[0].verdict
    v2 = e.decide("j", task(1, attempt=1), [FailedRecord("b", T, CONN)])[0].verdict
    v3 = e.decide("j", task(2), [FailedRecord("c", T, CONN)])[0].verdict
    assert (v1.action, v2.action) == (Action.RETRY, Action.RETRY)
    assert v3.action is Action.SKIP
    assert "retries exhausted: retry budget exhausted: 2 retries for 3 failure reports" in v3.reason
    assert e.counters()["retry-budget-exhausted"] == 1
    clock.ms += 11_000                                      # the window moved on
    assert e.decide("j", task(2), [FailedRecord("d", T, CONN)])[0].verdict.action is Action.RETRY


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
    return e.decide("j", task(p), [FailedRecord(rid, T, exc)])[0].verdict


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
