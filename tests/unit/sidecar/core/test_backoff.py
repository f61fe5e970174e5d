"""Backoff: the KIP-298 shape, the status-store KIP formula, and how the two families combine."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from spillway.sidecar.core.backoff import (
    Deadline,
    ExponentialJitterWait,
    Kip298Wait,
    RetryState,
    schedule_from_settings,
)
from spillway.sidecar.core.settings import job_settings


class Fixed:
    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


class Floats:
    """A RandomSource fed by hypothesis."""

    def __init__(self, values: list[float]) -> None:
        self.values = values
        self.i = 0

    def random(self) -> float:
        v = self.values[self.i % len(self.values)]
        self.i += 1
        return v


def retry_settings(**props: str):
    return job_settings("j", {k.replace("_", "."): v for k, v in props.items()}).retry


def props(**kv: str) -> dict[str, str]:
    return {k: v for k, v in kv.items()}


# --- KIP-298 shape ---------------------------------------------------------------------------

@pytest.mark.parametrize(("retries", "expected"), [
    (0, 300), (1, 600), (2, 1200), (3, 2400), (4, 4800), (5, 9600), (6, 19200), (7, 38400),
])
def test_kip298_doubles_from_300ms_below_the_cap(retries, expected):
    wait = Kip298Wait(cap_ms=60_000)
    assert wait(RetryState(retries=retries), Fixed(0.99)) == expected


@pytest.mark.parametrize(("r", "expected"), [(0.0, 60_000), (0.5, 52_500), (1.0, 45_000)])
def test_kip298_jitters_below_the_cap_once_reached(r, expected):
    wait = Kip298Wait(cap_ms=60_000)
    assert wait(RetryState(retries=8), Fixed(r)) == pytest.approx(expected)
    assert wait(RetryState(retries=500), Fixed(r)) == pytest.approx(expected)


@given(n=st.integers(0, 2000), cap=st.integers(1, 10**7), r=st.floats(0, 1, exclude_max=True))
def test_kip298_never_exceeds_delay_max(n, cap, r):
    d = Kip298Wait(cap_ms=cap)(RetryState(retries=n), Fixed(r))
    assert 0 < d <= cap


# --- status-store KIP formula ------------------------------------------------------------------

@pytest.mark.parametrize(("initial", "mult", "cap", "jitter", "n", "r", "expected"), [
    (300, 2.0, 10_000, 0.25, 0, 0.0, 300),
    (300, 2.0, 10_000, 0.25, 0, 0.5, 337.5),
    (300, 2.0, 10_000, 0.25, 3, 0.0, 2400),
    (300, 2.0, 10_000, 0.25, 6, 0.0, 10_000),          # 19200 capped
    (300, 2.0, 10_000, 0.25, 6, 1.0, 12_500),          # capped + capped × 0.25 × 1
    (100, 3.0, 5_000, 0.0, 2, 0.7, 900),
    (100, 1.0, 5_000, 1.0, 40, 0.5, 150),              # multiplier 1: constant
    (0, 2.0, 5_000, 0.5, 10, 0.5, 0),                  # initial 0 is allowed by the KIP
])
def test_finer_formula_exact(initial, mult, cap, jitter, n, r, expected):
    wait = ExponentialJitterWait(initial_ms=initial, max_ms=cap, multiplier=mult, jitter=jitter)
    assert wait(RetryState(retries=n), Fixed(r)) == pytest.approx(expected)


@settings(max_examples=300)
@given(initial=st.integers(0, 100_000), extra=st.integers(0, 1_000_000),
       mult=st.floats(1.0, 10.0), jitter=st.floats(0.0, 1.0), n=st.integers(0, 5000),
       r=st.floats(0.0, 1.0, exclude_max=True))
def test_finer_backoff_lies_in_capped_to_capped_times_one_plus_jitter(initial, extra, mult,
                                                                       jitter, n, r):
    cap = initial + extra
    wait = ExponentialJitterWait(initial_ms=initial, max_ms=cap, multiplier=mult, jitter=jitter)
    if initial == 0:
        capped = 0.0
    elif math.log(initial) + n * math.log(mult) >= math.log(cap):
        capped = float(cap)
    else:
        capped = initial * mult ** n
    d = wait(RetryState(retries=n), Fixed(r))
    assert capped <= d <= capped * (1 + jitter) + 1e-6
    assert d <= cap * (1 + jitter) + 1e-6


# --- deadline --------------------------------------------------------------------------------

def test_deadline_shortens_a_wait_to_end_at_the_timeout():
    assert Deadline(10_000).bound(RetryState(elapsed_ms=9_900), 5_000)[0] == 100


def test_deadline_refuses_once_passed():
    delay, why = Deadline(10_000).bound(RetryState(elapsed_ms=9_999.5), 300)
    assert delay is None
    assert "errors.retry.timeout=10000" in why


def test_no_deadline_keeps_the_wait():
    assert Deadline(None).bound(RetryState(elapsed_ms=1e12), 300.2)[0] == 301


@settings(max_examples=200, deadline=None)
@given(timeout=st.integers(1, 600_000), max_retries=st.one_of(st.none(), st.integers(0, 50)),
       delay_max=st.integers(50, 60_000), fine=st.booleans(),
       randoms=st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=20),
       gaps=st.lists(st.integers(0, 5_000), min_size=1, max_size=20))
def test_schedule_never_retries_past_the_retry_timeout(timeout, max_retries, delay_max, fine,
                                                       randoms, gaps):
    p = {"errors.retry.timeout": str(timeout), "errors.retry.delay.max.ms": str(delay_max)}
    if max_retries is not None:
        p["errors.retry.max.retries"] = str(max_retries)
    if fine:
        p["errors.retry.jitter.factor"] = "1.0"
        p["errors.retry.initial.backoff.ms"] = str(min(500, delay_max))
    schedule = schedule_from_settings(job_settings("j", p).retry)
    rng = Floats(randoms)
    elapsed, retries, i = 0.0, 0, 0
    while True:
        decision = schedule.next(RetryState(retries=retries, elapsed_ms=elapsed), rng)
        if not decision.retry:
            break
        assert decision.delay_ms >= 0
        assert elapsed + decision.delay_ms <= timeout       # the wait ends by the deadline
        retries += 1
        # the record runs again after its wait, and takes some time to fail again
        elapsed += decision.delay_ms + gaps[i % len(gaps)]
        i += 1
        assert retries <= (max_retries if max_retries is not None else 10**6)
    if max_retries is not None:
        assert retries <= max_retries


# --- how the families combine ---------------------------------------------------------------

def _count_retries(p: dict[str, str], limit: int = 1000) -> int:
    schedule = schedule_from_settings(job_settings("j", p).retry)
    n = 0
    while n < limit and schedule.next(RetryState(retries=n), Fixed(0.0)).retry:
        n += 1
    return n


@pytest.mark.parametrize(("p", "retries"), [
    ({}, 0),                                                        # KIP-298 default: no retry
    ({"errors.retry.timeout": "0"}, 0),
    ({"errors.retry.max.retries": "3"}, 3),                         # timeout 0 does not disable
    ({"errors.retry.max.retries": "0", "errors.retry.timeout": "-1"}, 0),
    ({"errors.retry.timeout": "-1"}, 1000),                         # unlimited
    ({"errors.retry.timeout": "-1", "errors.retry.max.retries": "7"}, 7),
    ({"errors.retry.timeout": "600000", "errors.retry.max.retries": "4"}, 4),
    ({"errors.retry.initial.backoff.ms": "100"}, 5),                # a shape knob: KIP's 5
    ({"status.storage.retry.jitter.factor": "0.1"}, 5),             # under the KIP's name
    ({"status.storage.retry.max.retries": "2"}, 2),
    ({"errors.retry.timeout": "-1", "errors.retry.jitter.factor": "0"}, 5),
])
def test_combination_rule_retry_counts(p, retries):
    assert _count_retries(p) == retries


def test_time_bound_stops_before_max_retries_when_reached_first():
    p = {"errors.retry.timeout": "1000", "errors.retry.max.retries": "50"}
    schedule = schedule_from_settings(job_settings("j", p).retry)
    elapsed, n = 0.0, 0
    while (d := schedule.next(RetryState(retries=n, elapsed_ms=elapsed), Fixed(0.0))).retry:
        elapsed += d.delay_ms
        n += 1
    # 300 + 600 = 900, then 1200 is shortened to the 100 ms left, then the deadline has passed
    assert n == 3
    assert elapsed == 1000


def test_finer_knobs_override_shape_and_fall_back_to_kip298_values():
    r = job_settings("j", {"errors.retry.max.retries": "5",
                           "errors.retry.delay.max.ms": "4000"}).retry
    wait = schedule_from_settings(r).wait
    assert isinstance(wait, ExponentialJitterWait)
    assert (wait.initial_ms, wait.max_ms, wait.multiplier, wait.jitter) == (300, 4000, 2.0, 0.25)

    r = job_settings("j", {"errors.retry.max.retries": "5",
                           "errors.retry.initial.backoff.ms": "50",
                           "errors.retry.max.backoff.ms": "800",
                           "errors.retry.backoff.multiplier": "1.5",
                           "errors.retry.jitter.factor": "0"}).retry
    wait = schedule_from_settings(r).wait
    assert (wait.initial_ms, wait.max_ms, wait.multiplier, wait.jitter) == (50, 800, 1.5, 0.0)


def test_kip298_family_is_used_when_no_finer_knob_is_set():
    r = job_settings("j", {"errors.retry.timeout": "60000",
                           "errors.retry.delay.max.ms": "1000"}).retry
    wait = schedule_from_settings(r).wait
    assert isinstance(wait, Kip298Wait)
    assert wait.cap_ms == 1000
