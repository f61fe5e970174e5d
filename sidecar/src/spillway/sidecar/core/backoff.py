"""Retry scheduling: small wait and stop values over an immutable retry state (tenacity style).

A failed record's schedule is a pure function of its `RetryState` (how many retries it was
already given, how long ago it first failed, the last delay) and one random draw. Two property
families feed it:

KIP-298 family (the default)
    ``errors.retry.timeout`` (0: no retry, -1: no time limit) and ``errors.retry.delay.max.ms``.
    Delays start at 300 ms and double; once a delay reaches the cap it is jittered *below* the
    cap, uniformly in ``[cap × 0.75, cap]``, so ``errors.retry.delay.max.ms`` stays a true
    maximum (the KIP calls it "the maximum delay between two consecutive retries"). Connect's
    code draws in ``[0, cap)``, which can follow a 60 s wait with a 1 ms one; we keep the
    spread but not the collapse.

Status-store KIP family (finer knobs)
    ``errors.retry.max.retries``, ``errors.retry.initial.backoff.ms``,
    ``errors.retry.max.backoff.ms``, ``errors.retry.backoff.multiplier``,
    ``errors.retry.jitter.factor`` (or the KIP's own names, ``status.storage.retry.*``), with
    the KIP's exact formula::

        base   = initial × multiplier ** n          (n = retries already scheduled, from 0)
        capped = min(base, max)
        final  = capped + capped × jitter × random(0, 1)

How they combine (the rule, stated once; docs/POLICY.md repeats it)
    1. Shape. If any finer knob is set, the family is in use: the finer formula is used and each
       unset knob takes the status-store KIP's default (settings.py): max.retries 5, initial
       300 ms, max 10000 ms (or ``errors.retry.delay.max.ms`` when lower), multiplier 2.0,
       jitter 0.25. Otherwise the KIP-298 shape above is used.
    2. Count bound. ``errors.retry.max.retries`` (set, or 5 once the family is in use) bounds
       the number of retries; so a shape knob alone retries 5 times, as the KIP says.
    3. Time bound. ``errors.retry.timeout`` > 0 bounds the time from the record's first failure:
       a wait that would end past it is shortened to end exactly at it (as Connect does), and
       once it has passed no retry is scheduled. -1 means no time bound.
    4. ``errors.retry.timeout=0`` means "no retry" only when ``errors.retry.max.retries`` is
       unset. When max.retries is set, timeout 0 means "no time bound": max.retries alone
       decides. Both bounds apply when both are set; whichever is reached first stops retries.
    5. Neither bound (timeout -1, max.retries unset): retries never stop (KIP-298's -1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from .ports import RandomSource
from .settings import RetrySettings

KIP298_START_MS = 300
KIP298_MULTIPLIER = 2.0
KIP298_JITTER = 0.25          # spread below the cap once it is reached
FINE_DEFAULT_JITTER = 0.25    # the status-store KIP's default jitter.factor


@dataclass(frozen=True, slots=True)
class RetryState:
    """What a record's schedule depends on. Build one in a test and assert the number."""

    retries: int = 0             # retries already scheduled for the record (n in the formula)
    elapsed_ms: float = 0.0      # since the record's first failure
    last_delay_ms: float = 0.0   # the delay of the previous retry (0 before the first)


class Wait(Protocol):
    def __call__(self, state: RetryState, rng: RandomSource) -> float:
        """The next delay in ms (not yet bounded by any deadline)."""


class Stop(Protocol):
    def __call__(self, state: RetryState) -> str | None:
        """None to allow another retry, else the reason retries stop."""


# --- waits --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Kip298Wait:
    """300 ms × 2^n up to ``cap_ms``; at the cap, jittered in ``[cap × (1 - jitter), cap]``."""

    cap_ms: float
    start_ms: float = KIP298_START_MS
    multiplier: float = KIP298_MULTIPLIER
    jitter: float = KIP298_JITTER

    def __call__(self, state: RetryState, rng: RandomSource) -> float:
        base = _exp(self.start_ms, self.multiplier, state.retries)
        if base < self.cap_ms:
            return base
        return self.cap_ms - self.cap_ms * self.jitter * rng.random()


@dataclass(frozen=True, slots=True)
class ExponentialJitterWait:
    """The status-store KIP formula: ``capped + capped × jitter × random(0, 1)``."""

    initial_ms: float
    max_ms: float
    multiplier: float
    jitter: float

    def capped(self, retries: int) -> float:
        return min(_exp(self.initial_ms, self.multiplier, retries), self.max_ms)

    def __call__(self, state: RetryState, rng: RandomSource) -> float:
        capped = self.capped(state.retries)
        return capped + capped * self.jitter * rng.random()


def _exp(start: float, multiplier: float, n: int) -> float:
    # multiplier ** n overflows for large n; the cap takes over long before that matters.
    if start <= 0:
        return 0.0
    try:
        return start * multiplier ** n
    except OverflowError:
        return math.inf


# --- stops --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StopAfterRetries:
    max_retries: int

    def __call__(self, state: RetryState) -> str | None:
        if state.retries >= self.max_retries:
            return f"errors.retry.max.retries={self.max_retries} reached"
        return None


@dataclass(frozen=True, slots=True)
class StopNever:
    def __call__(self, state: RetryState) -> str | None:
        return None


@dataclass(frozen=True, slots=True)
class StopAlways:
    reason: str = "retries are disabled (errors.retry.timeout=0)"

    def __call__(self, state: RetryState) -> str | None:
        return self.reason


@dataclass(frozen=True, slots=True)
class StopAny:
    stops: tuple[Stop, ...]

    def __call__(self, state: RetryState) -> str | None:
        for stop in self.stops:
            reason = stop(state)
            if reason is not None:
                return reason
        return None


@dataclass(frozen=True, slots=True)
class Deadline:
    """``errors.retry.timeout`` > 0: no wait ends past ``timeout_ms`` after the first failure.

    A wait that would end past it is shortened to end at it; with under 1 ms left, none.
    ``timeout_ms`` None means no time bound.
    """

    timeout_ms: float | None

    def bound(self, state: RetryState, delay_ms: float) -> tuple[int | None, str]:
        """(delay to use in whole ms, or None when the deadline leaves no room; why)."""
        delay = math.ceil(delay_ms)
        if self.timeout_ms is None:
            return delay, ""
        remaining = self.timeout_ms - state.elapsed_ms
        if remaining < 1:
            return None, (f"errors.retry.timeout={int(self.timeout_ms)} ms passed "
                          f"({int(state.elapsed_ms)} ms since the first failure)")
        if delay > remaining:
            return math.floor(remaining), "shortened to end at errors.retry.timeout"
        return delay, ""


# --- the schedule -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RetryDecision:
    delay_ms: int | None     # None: no more retries
    reason: str              # why not, or a note on the delay ("" when plain)

    @property
    def retry(self) -> bool:
        return self.delay_ms is not None


@dataclass(frozen=True, slots=True)
class RetrySchedule:
    """A record's whole schedule: wait shape, count/flag stop and the time deadline."""

    wait: Wait
    stop: Stop
    deadline: Deadline
    enabled: bool = True       # False: this policy never retries (no breaker holds either)

    def next(self, state: RetryState, rng: RandomSource) -> RetryDecision:
        reason = self.stop(state)
        if reason is not None:
            return RetryDecision(None, reason)
        delay, note = self.deadline.bound(state, self.wait(state, rng))
        return RetryDecision(delay, note)

    def hold(self, state: RetryState, wait_ms: float) -> RetryDecision:
        """A wait imposed from outside (an open circuit): only the deadline applies."""
        if not self.enabled:
            return RetryDecision(None, self.stop(state) or "retries are disabled")
        delay, note = self.deadline.bound(state, wait_ms)
        return RetryDecision(delay, note)


def schedule_from_settings(r: RetrySettings) -> RetrySchedule:
    """Apply the combination rule of the module docstring to validated settings."""
    wait: Wait
    if r.fine_grained:   # settings.py filled the family's unset knobs with the KIP's defaults
        wait = ExponentialJitterWait(
            initial_ms=float(r.initial_backoff_ms if r.initial_backoff_ms is not None
                             else KIP298_START_MS),
            max_ms=float(r.max_backoff_ms if r.max_backoff_ms is not None else r.delay_max_ms),
            multiplier=r.multiplier if r.multiplier is not None else KIP298_MULTIPLIER,
            jitter=r.jitter_factor if r.jitter_factor is not None else FINE_DEFAULT_JITTER,
        )
    else:
        wait = Kip298Wait(cap_ms=float(r.delay_max_ms))

    if r.max_retries is None and r.timeout_ms == 0:
        return RetrySchedule(wait, StopAlways(), Deadline(None), enabled=False)
    stops: list[Stop] = []
    if r.max_retries is not None:
        stops.append(StopAfterRetries(r.max_retries))
    stop: Stop = StopAny(tuple(stops)) if stops else StopNever()
    deadline = Deadline(float(r.timeout_ms) if r.timeout_ms > 0 else None)
    return RetrySchedule(wait, stop, deadline, enabled=r.max_retries != 0)
