"""The retry budget of a job: retries may be at most a fraction of recent failure reports.

Finagle-style, per job, over the sliding window ``errors.retry.budget.window.ms``::

    allowed  ⇔  retries_in_window < errors.retry.budget.min.retries
                                    + errors.retry.budget.ratio × reports_in_window

``reports`` counts every failed record reported for the job (the current one included);
``retries`` counts the RETRY verdicts the budget granted. The minimum is always available, so a
quiet job is never starved; past the budget a retriable failure is treated as exhausted and the
verdict's reason says so. ``errors.retry.budget.ratio=-1`` disables the budget.

Retries granted by an open circuit breaker (holds) are not charged: the breaker already turned
N storms into one wait, and charging the budget too would turn a managed outage into errors.
Memory is O(1): two bucketed window counters.
"""

from __future__ import annotations

from dataclasses import dataclass

from .counters import WindowedCounter


@dataclass(frozen=True, slots=True)
class BudgetVerdict:
    allowed: bool
    reason: str = ""


class RetryBudget:
    def __init__(self, ratio: float, min_retries: int, window_ms: int) -> None:
        self.ratio = ratio
        self.min_retries = min_retries
        self.window_ms = window_ms
        self._reports = WindowedCounter(window_ms)
        self._retries = WindowedCounter(window_ms)
        self.exhausted_total = 0

    @property
    def enabled(self) -> bool:
        return self.ratio >= 0

    def on_report(self, now_ms: float, n: int = 1) -> None:
        self._reports.add(now_ms, n)

    def try_acquire(self, now_ms: float) -> BudgetVerdict:
        """Charge one retry if the budget allows it."""
        if not self.enabled:
            return BudgetVerdict(True)
        retries = self._retries.total(now_ms)
        reports = self._reports.total(now_ms)
        allowance = self.min_retries + self.ratio * reports
        if retries < allowance:
            self._retries.add(now_ms)
            return BudgetVerdict(True)
        self.exhausted_total += 1
        return BudgetVerdict(False, (
            f"retry budget exhausted: {int(retries)} retries for {int(reports)} failure reports "
            f"in the last {self.window_ms} ms (errors.retry.budget.ratio={self.ratio:g}, "
            f"errors.retry.budget.min.retries={self.min_retries})"))
