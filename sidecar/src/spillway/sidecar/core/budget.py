"""The retry budget of a job: a bound on the job's retry *rate* that defers retries, never drops
them.

Shape (Finagle's ``RetryBudget`` and Envoy's retry budget, adapted to a sidecar that answers
with a delay instead of holding a request)::

    allowance = errors.retry.budget.min.retries + errors.retry.budget.ratio × deposits
    refill    = allowance / errors.retry.budget.window.ms      (tokens per ms)

``deposits`` are the job's work in the last window (Finagle deposits one credit per request):
records it processed (FlushTask progress) and records that failed for the first time. A
record's later failures deposit nothing, so an outage cannot grow its own budget. The
minimum is Finagle's ``minRetriesPerSec`` (over the window): a quiet job is never starved.

The budget is a token bucket of capacity ``allowance``, full at the start. Every charged retry
takes one token. When the bucket is empty the retry is *deferred*, not refused: its delay is
stretched to the time the bucket will have refilled a token for it, and that token is reserved
(the balance goes negative), so deferred retries are spread at the refill rate, in the order
they were asked for, like Envoy's cap on concurrent retries turns a burst into a queue. Hence:

- the job's retries start at no more than ``allowance`` per window on average, with bursts of at
  most ``allowance``: a dependency that is down sees a bounded retry rate, however many records
  fail;
- only a record's own ``errors.retry.timeout`` / ``errors.retry.max.retries`` end its retries:
  a retry the bucket can fit before the record's deadline is granted (deferred if need be); a
  retry whose token would come after the deadline is not granted (its record goes to the
  handler, tolerance and DLQ as usual) and takes no token. With no deadline
  (``errors.retry.timeout=-1``) a retry is always granted, however long the wait.

Every deferral and refusal is counted (``exhausted_total``), flagged on the verdict
(``retry_budget_exhausted``) and explained in its reason. Retries granted by an open circuit
breaker (holds) are not charged: the breaker already turned N storms into one wait.
``errors.retry.budget.ratio=-1`` disables the budget. Memory is O(1): one bucketed window
counter and the bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .counters import WindowedCounter


@dataclass(frozen=True, slots=True)
class BudgetGrant:
    """The budget's answer for one retry whose schedule asked for ``delay_ms``.

    ``delay_ms`` None: not granted (its token would come after the record's deadline).
    ``limited``: the budget deferred or refused the retry (``reason`` says how)."""

    delay_ms: int | None
    limited: bool = False
    reason: str = ""


class RetryBudget:
    def __init__(self, ratio: float, min_retries: int, window_ms: int) -> None:
        self.ratio = ratio
        self.min_retries = min_retries
        self.window_ms = window_ms
        self._deposits = WindowedCounter(window_ms)
        self._balance = float(min_retries)   # full bucket: the minimum is there at once
        self._last_ms: float | None = None
        self._next_slot_ms = -math.inf       # deferred retries start in order, 1/refill apart
        self.exhausted_total = 0             # retries deferred or refused by the budget

    @property
    def enabled(self) -> bool:
        return self.ratio >= 0

    def deposit(self, now_ms: float, n: int = 1) -> None:
        """Work of the job: processed records, records failing for the first time."""
        if n > 0 and self.enabled:
            self._deposits.add(now_ms, n)

    def allowance(self, now_ms: float) -> float:
        return self.min_retries + self.ratio * self._deposits.total(now_ms)

    def _refill(self, now_ms: float) -> tuple[float, float]:
        """(allowance, refill per ms), with the balance brought up to now."""
        allowance = self.allowance(now_ms)
        rate = allowance / self.window_ms
        if self._last_ms is None:
            self._balance = allowance
        elif now_ms > self._last_ms:
            self._balance = min(allowance, self._balance + rate * (now_ms - self._last_ms))
        self._last_ms = now_ms if self._last_ms is None else max(self._last_ms, now_ms)
        return allowance, rate

    def acquire(self, now_ms: float, delay_ms: int, latest_ms: float | None) -> BudgetGrant:
        """Charge one retry that the record's schedule wants to start in ``delay_ms``.

        ``latest_ms``: the most the retry may be delayed (the time left before the record's
        ``errors.retry.timeout``), None for no bound."""
        if not self.enabled:
            return BudgetGrant(delay_ms)
        allowance, rate = self._refill(now_ms)
        if self._balance >= 1.0:
            self._balance -= 1.0
            return BudgetGrant(delay_ms)
        # the token this retry needs comes once the debt ahead of it is paid at `rate`, and
        # never before the slot after the last deferred retry's (the rate may have grown since)
        slot = max(now_ms + (1.0 - self._balance) / rate, self._next_slot_ms)
        wait = math.ceil(slot - now_ms)
        if wait <= delay_ms:          # the backoff is longer anyway: nothing deferred
            self._balance -= 1.0
            return BudgetGrant(delay_ms)
        self.exhausted_total += 1
        what = (f"retry budget exhausted: at most {allowance:g} retries per "
                f"{self.window_ms} ms for this job (errors.retry.budget.min.retries="
                f"{self.min_retries} + errors.retry.budget.ratio={self.ratio:g} × "
                f"{int(self._deposits.total(now_ms))} records processed or failed in the window)")
        if latest_ms is not None and wait > latest_ms:
            return BudgetGrant(None, True, (
                f"{what}; the next retry slot is in {wait} ms, after errors.retry.timeout "
                f"({math.floor(latest_ms)} ms left)"))
        self._balance -= 1.0
        self._next_slot_ms = slot + 1.0 / rate
        return BudgetGrant(wait, True, f"{what}; retry deferred from {delay_ms} ms to {wait} ms")
