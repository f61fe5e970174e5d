"""Circuit breaker per job and error class: one shared wait instead of N retry storms.

States of one (job, exception class) circuit:

CLOSED
    Retriable failures are counted. When ``errors.circuit.failure.threshold`` of them fall within
    ``errors.circuit.window.ms`` and come from at least ``errors.circuit.min.tasks`` distinct
    Spark tasks (``stage.partition``: one task retrying alone never opens it), the circuit opens.
OPEN (for ``errors.circuit.open.ms``)
    Every failure of that class is answered RETRY with the same target time, the end of the open
    period, plus a small per-report jitter (at most ``open.ms / 10``, capped at 1 s) so the
    held records come back spread over a short interval rather than in one burst.
HALF_OPEN
    Held records come back and act as probes. A failure re-opens the circuit (a new open
    period, a new shared wait); ``errors.circuit.success.threshold`` recoveries
    (``record_recovered`` of records whose last failure was of this class) close it.

Holds and the record's own retries (the engine applies this; docs/POLICY.md states it too):
a hold is not charged to the record's ``errors.retry.max.retries`` nor to the job's retry
budget, because the sidecar, not the record, chose to wait. ``errors.retry.timeout`` still
bounds it (wall-clock time is the user's bound), and after ``errors.circuit.max.holds`` holds
of one record, further holds are charged as ordinary retries, so every record's retries end.

Memory: the failure window keeps at most ``failure.threshold`` timestamps and
``min.tasks`` task ids; ``Breakers`` keeps at most ``MAX_CIRCUITS`` classes per job, evicting
closed ones first.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass

from .ports import RandomSource
from .settings import CircuitSettings

MAX_CIRCUITS = 1_000
MAX_SPREAD_MS = 1_000.0


class CircuitState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass(frozen=True, slots=True)
class Hold:
    """The wait an open circuit imposes on one reporter."""

    wait_ms: float
    reason: str


class CircuitBreaker:
    def __init__(self, error_class: str, settings: CircuitSettings) -> None:
        self.error_class = error_class
        self.s = settings
        self._failures: deque[float] = deque(maxlen=settings.failure_threshold)
        self._tasks: OrderedDict[str, float] = OrderedDict()
        self._state = CircuitState.CLOSED
        self._open_until = 0.0
        self._successes = 0
        self._opened_why = ""
        self.times_opened = 0

    @property
    def spread_ms(self) -> float:
        return min(self.s.open_ms / 10.0, MAX_SPREAD_MS)

    def state(self, now_ms: float) -> CircuitState:
        if self._state is CircuitState.OPEN and now_ms >= self._open_until:
            self._state = CircuitState.HALF_OPEN
            self._successes = 0
        return self._state

    def _open(self, now_ms: float, why: str) -> None:
        self._state = CircuitState.OPEN
        self._open_until = now_ms + self.s.open_ms
        self._opened_why = why
        self._successes = 0
        self.times_opened += 1

    def _hold(self, now_ms: float, rng: RandomSource) -> Hold:
        remaining = max(0.0, self._open_until - now_ms)
        wait = remaining + self.spread_ms * rng.random()
        return Hold(wait, (
            f"circuit open for {self.error_class} ({self._opened_why}): shared wait until "
            f"half-open in {int(remaining)} ms"))

    def on_failure(self, now_ms: float, task_id: str, rng: RandomSource) -> Hold | None:
        """Count a retriable failure; a Hold when the circuit is (or just became) open."""
        state = self.state(now_ms)
        if state is CircuitState.OPEN:
            return self._hold(now_ms, rng)
        if state is CircuitState.HALF_OPEN:
            self._open(now_ms, f"a probe failed in half-open state after {self.times_opened} "
                               f"opening(s)")
            return self._hold(now_ms, rng)
        cutoff = now_ms - self.s.window_ms
        self._failures.append(now_ms)
        self._tasks[task_id] = now_ms
        self._tasks.move_to_end(task_id)
        while self._tasks and (len(self._tasks) > self.s.min_tasks
                               or next(iter(self._tasks.values())) < cutoff):
            self._tasks.popitem(last=False)
        if (len(self._failures) >= self.s.failure_threshold and self._failures[0] >= cutoff
                and len(self._tasks) >= self.s.min_tasks):
            self._open(now_ms, f"{self.s.failure_threshold} failures across "
                               f">= {self.s.min_tasks} tasks within {self.s.window_ms} ms")
            self._failures.clear()
            self._tasks.clear()
            return self._hold(now_ms, rng)
        return None

    def on_success(self, now_ms: float) -> None:
        if self.state(now_ms) is CircuitState.HALF_OPEN:
            self._successes += 1
            if self._successes >= self.s.success_threshold:
                self._state = CircuitState.CLOSED
                self._failures.clear()
                self._tasks.clear()


class Breakers:
    """The circuits of one job, by exception class (bounded)."""

    def __init__(self, settings: CircuitSettings, max_circuits: int = MAX_CIRCUITS) -> None:
        self.s = settings
        self.max_circuits = max_circuits
        self._by_class: OrderedDict[str, CircuitBreaker] = OrderedDict()

    def get(self, error_class: str, now_ms: float) -> CircuitBreaker:
        cb = self._by_class.get(error_class)
        if cb is None:
            cb = self._by_class[error_class] = CircuitBreaker(error_class, self.s)
            if len(self._by_class) > self.max_circuits:
                self._evict(now_ms, keep=error_class)
        else:
            self._by_class.move_to_end(error_class)
        return cb

    def find(self, error_class: str) -> CircuitBreaker | None:
        return self._by_class.get(error_class)

    def _evict(self, now_ms: float, keep: str) -> None:
        for name, cb in self._by_class.items():
            if name != keep and cb.state(now_ms) is CircuitState.CLOSED:
                del self._by_class[name]
                return
        oldest = next(iter(self._by_class))
        if oldest != keep:
            del self._by_class[oldest]

    def open_count(self, now_ms: float) -> int:
        return sum(1 for cb in self._by_class.values()
                   if cb.state(now_ms) is not CircuitState.CLOSED)

    def times_opened(self) -> int:
        return sum(cb.times_opened for cb in self._by_class.values())
