"""KIP-298 task-error-metrics (plus KIP-1033 dropped-records), kept per job, stage and task.

Names, as KIP-298 defines them:

- ``total-record-failures``  every failed attempt reported (retried or not);
- ``total-record-errors``    failures that are errors: not retriable, or retries exhausted;
- ``total-records-skipped``  records answered SKIP;
- ``total-retries``          RETRY verdicts (circuit-breaker holds included: they are retries);
- ``total-errors-logged``    errors written to the error log or handed to the DLQ (once each);
- ``last-error-timestamp``   wall-clock ms of the last failure;
- ``dropped-records``        KIP-1033: skipped without a DLQ, i.e. gone from the output.

Also the sliding-window counter the tolerance limits and the retry budget share. Every map here
is bounded: per-task scopes are kept for the ``MAX_TASK_SCOPES`` most recently active tasks.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field, fields

from .model import Counts

MAX_TASK_SCOPES = 10_000
EVICTED_TASK = "_evicted"  # the task label that older, evicted (stage, task) pairs fold into
WINDOW_BUCKETS = 20

KIP_NAMES: dict[str, str] = {
    "total_record_failures": "total-record-failures",
    "total_record_errors": "total-record-errors",
    "total_records_skipped": "total-records-skipped",
    "total_retries": "total-retries",
    "total_errors_logged": "total-errors-logged",
    "dropped_records": "dropped-records",
    "last_error_timestamp_ms": "last-error-timestamp",
}


def as_kip_dict(c: Counts) -> dict[str, float]:
    return {KIP_NAMES[f.name]: float(getattr(c, f.name)) for f in fields(c)}


def copy_counts(c: Counts) -> Counts:
    return Counts(**{f.name: getattr(c, f.name) for f in fields(c)})


_SUMMED = tuple(f.name for f in fields(Counts) if f.name != "last_error_timestamp_ms")


def add_counts(into: Counts, c: Counts) -> None:
    # field names computed once: a scrape sums every live job's counts (10,000 jobs)
    for name in _SUMMED:
        setattr(into, name, getattr(into, name) + getattr(c, name))
    if c.last_error_timestamp_ms > into.last_error_timestamp_ms:
        into.last_error_timestamp_ms = c.last_error_timestamp_ms


@dataclass(slots=True)
class ScopedCounts:
    """One job's counts, by job, by stage name and by task id (Spark ``stage.partition``)."""

    job: Counts = field(default_factory=Counts)
    stages: dict[str, Counts] = field(default_factory=dict)
    tasks: OrderedDict[str, Counts] = field(default_factory=OrderedDict)
    # (stage, task) pairs, for metrics labelled job/stage/task. Evicted pairs fold into the
    # stage's EVICTED_TASK pair so sums over the labels stay exact.
    pairs: OrderedDict[tuple[str, str], Counts] = field(default_factory=OrderedDict)
    max_tasks: int = MAX_TASK_SCOPES
    tasks_evicted: int = 0

    def scopes(self, stage: str, task: str) -> tuple[Counts, Counts, Counts, Counts]:
        s = self.stages.get(stage)
        if s is None:
            s = self.stages[stage] = Counts()
        key = (stage, task)
        p = self.pairs.get(key)
        if p is None:
            p = self.pairs[key] = Counts()
            if len(self.pairs) > self.max_tasks:
                (old_stage, _), old = self.pairs.popitem(last=False)
                rest = self.pairs.setdefault((old_stage, EVICTED_TASK), Counts())
                add_counts(rest, old)
        else:
            self.pairs.move_to_end(key)
        t = self.tasks.get(task)
        if t is None:
            t = self.tasks[task] = Counts()
            if len(self.tasks) > self.max_tasks:
                self.tasks.popitem(last=False)
                self.tasks_evicted += 1
        else:
            self.tasks.move_to_end(task)
        return self.job, s, t, p

    def add_batch(self, stage: str, task: str, amounts: list[int], wall_ms: int) -> None:
        """One report's failures of one stage at once: ``amounts`` in ``BATCH_FIELDS`` order,
        and the errors' wall-clock time (the latest wins)."""
        failures, errors, skipped, retries, logged, dropped = amounts
        for c in self.scopes(stage, task):
            c.total_record_failures += failures
            c.total_record_errors += errors
            c.total_records_skipped += skipped
            c.total_retries += retries
            c.total_errors_logged += logged
            c.dropped_records += dropped
            if wall_ms > c.last_error_timestamp_ms:
                c.last_error_timestamp_ms = wall_ms


# The order of the amounts `ScopedCounts.add_batch` takes.
BATCH_FIELDS = ("total_record_failures", "total_record_errors", "total_records_skipped",
                "total_retries", "total_errors_logged", "dropped_records")


class WindowedCounter:
    """A sum over a sliding time window, in ``WINDOW_BUCKETS`` buckets: O(1) memory.

    ``window_ms`` 0 means no window (a plain running total). Amounts may be negative (a
    correction: a re-attempted task replacing its earlier count); ``add`` at an explicit
    ``at_ms`` corrects the bucket the earlier amount went into, if it is still in the window.
    Precision: an amount leaves the window up to one bucket (window/20) late.
    """

    __slots__ = ("_buckets", "_total", "_width", "window_ms")

    def __init__(self, window_ms: float, buckets: int = WINDOW_BUCKETS) -> None:
        self.window_ms = float(window_ms)
        self._width = self.window_ms / buckets if window_ms > 0 else 0.0
        self._buckets: deque[list[float]] = deque()   # [bucket index, amount]
        self._total = 0.0

    def _index(self, t_ms: float) -> int:
        return int(t_ms // self._width) if self._width else 0

    def _expire(self, now_ms: float) -> None:
        if not self._width:
            return
        # a bucket leaves once all of it is older than the window: amounts leave late, never early
        oldest_live = self._index(now_ms - self.window_ms)
        while self._buckets and self._buckets[0][0] < oldest_live:
            self._total -= self._buckets.popleft()[1]

    def add(self, now_ms: float, amount: float = 1.0, at_ms: float | None = None) -> None:
        width = self._width
        if not width:  # no window: a running total
            self._total += amount
            return
        buckets = self._buckets
        if at_ms is None and buckets:
            # the common case, in O(1): now's bucket is the newest one
            last = buckets[-1]
            if last[0] == int(now_ms // width):
                if buckets[0][0] < int((now_ms - self.window_ms) // width):
                    self._expire(now_ms)  # never the newest bucket: it is now's
                last[1] += amount
                self._total += amount
                return
        self._expire(now_ms)
        idx = self._index(now_ms if at_ms is None else at_ms)
        if buckets and idx < buckets[0][0]:
            return  # the bucket it belonged to has already left the window
        for b in reversed(buckets):
            if b[0] == idx:
                b[1] += amount
                self._total += amount
                return
            if b[0] < idx:
                break
        buckets.append([idx, amount])
        if len(buckets) > 1 and buckets[-2][0] > idx:
            self._buckets = deque(sorted(buckets, key=lambda b: b[0]))
        self._total += amount

    def total(self, now_ms: float) -> float:
        self._expire(now_ms)
        return self._total
