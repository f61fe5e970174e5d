"""Counts that outlive a run: the last runs that ended on this sidecar, and totals that never go
down while the process lives.

A run's counters leave with it (the engine drops its state, its per-job series end). Before
they do, `EndedRuns.record` keeps the run's final summary among the last
``status.ended.runs.max`` (a bounded deque: the oldest goes first) and adds its counts to the
ended runs' totals, which nothing ever takes back. A total shown (GetStatus, the Prometheus
``spillway_sidecar_*_total`` series) is the live runs' counts plus the ended runs' totals, read
under the same lock the ending holds while a run leaves the engine: a reader sees a run's counts
in one place or the other, never in neither (so the totals never go down) nor in both.

Memory: the totals are a handful of integers; each kept run is its summary with the
breakdowns cut to `BREAKDOWN_KEYS` keys each and the failure reason to `REASON_CHARS`
characters, about 1.5 KB (docs/OBSERVABILITY.md gives the figures).

Outcomes: ``failed`` (past its errors.tolerance, whether then ended or expired), ``expired``
(ended by job.idle.timeout.ms), ``completed`` (ended by EndJob). A node sidecar's copy of a run
homed elsewhere is kept (with its home) and its counts are in the totals, but it is not counted
as a run that ended: its home counts the run, so a fleet's sum counts each run once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace

from spillway.sidecar.core.counters import KIP_NAMES, add_counts, copy_counts
from spillway.sidecar.core.model import Counts, JobSummary

#: Outcomes of a run, in the order they are shown.
OUTCOMES = ("completed", "failed", "expired")
#: Per breakdown (by stage, category, exception class) of a kept summary, the rest summed as
#: "(other)"; the failure reason is cut to this many characters.
BREAKDOWN_KEYS = 10
REASON_CHARS = 1024


@dataclass(frozen=True, slots=True)
class EndedRun:
    """A run that ended here: its final summary (breakdowns and reason cut), how it ended, when
    it started and ended (seconds since the Unix epoch), and, for a node's copy of a run homed
    elsewhere, its home's address. ``digest``: of its job token, so that only who could see
    the run live sees it here (`registry.visible`); never shown."""

    summary: JobSummary
    outcome: str
    started: float
    ended: float
    home: str = ""
    key: str = ""
    digest: bytes = field(default=b"", repr=False)


@dataclass(frozen=True, slots=True)
class Totals:
    """Counts of this sidecar process's runs, live ones and ended ones; ``runs_ended``: the runs
    homed here that ended, by outcome (every outcome present, at zero too); ``since``: when
    the process started counting, seconds since the Unix epoch."""

    records_processed: int
    counts: Counts
    dlq_records_written: int
    runs_ended: Mapping[str, int]
    since: float


def outcome_of(summary: JobSummary, *, expired: bool) -> str:
    if summary.failed:
        return "failed"
    return "expired" if expired else "completed"


def _cut(counts: Mapping[str, int]) -> dict[str, int]:
    if len(counts) <= BREAKDOWN_KEYS:
        return dict(counts)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    out = dict(ranked[:BREAKDOWN_KEYS])
    out["(other)"] = out.get("(other)", 0) + sum(n for _, n in ranked[BREAKDOWN_KEYS:])
    return out


def kept_summary(s: JobSummary) -> JobSummary:
    """``s`` as it is kept: bounded whatever the run reported."""
    reason = s.failure_reason
    if len(reason) > REASON_CHARS:
        reason = reason[:REASON_CHARS] + "…"
    return replace(s, failure_reason=reason, by_stage=_cut(s.by_stage),
                   by_category=_cut(s.by_category),
                   by_exception_class=_cut(s.by_exception_class))


class EndedRuns:
    """The last ``max_runs`` runs that ended here, and the totals of every run that did.
    Thread-safe."""

    def __init__(self, *, max_runs: int, clock: Callable[[], float] = time.time) -> None:
        if max_runs < 0:
            raise ValueError(f"max_runs must be >= 0, got {max_runs}")
        self.max_runs = max_runs
        self._clock = clock
        self._since = clock()
        # held while a run leaves the engine and is recorded, and while totals are read
        self._lock = threading.RLock()
        self._kept: deque[EndedRun] = deque(maxlen=max_runs or None)
        self._by_key: dict[str, EndedRun] = {}
        self._counts = Counts()
        self._processed = 0
        self._dlq = 0
        self._outcomes = dict.fromkeys(OUTCOMES, 0)

    def record(self, leave: Callable[[], JobSummary | None], *, key: str, expired: bool,
               started: float, home: str = "", digest: bytes = b"") -> JobSummary | None:
        """Call ``leave()`` (which takes the run out of the engine and returns its final summary,
        None when it was not there) and record what it returns, as one step for any reader of
        the totals. ``started``: seconds since the Unix epoch."""
        with self._lock:
            final = leave()
            if final is None:
                return None
            add_counts(self._counts, final.counts)
            self._processed += final.records_processed
            self._dlq += final.dlq_records_written
            outcome = outcome_of(final, expired=expired)
            if not home:
                self._outcomes[outcome] += 1
            if self.max_runs:
                run = EndedRun(kept_summary(final), outcome, started, self._clock(), home,
                               key, digest)
                if len(self._kept) == self.max_runs:
                    oldest = self._kept[0]
                    if self._by_key.get(oldest.key) is oldest:
                        del self._by_key[oldest.key]
                self._kept.append(run)
                self._by_key[key] = run
            return final

    def note_acked(self, key: str, n: int) -> None:
        """DLQ records of a run that had ended (or was never live in this process) acknowledged
        by Kafka: into the totals, and into the run's kept summary while it is kept."""
        with self._lock:
            self._dlq += int(n)
            run = self._by_key.get(key)
            if run is None:
                return
            s = replace(run.summary, dlq_records_written=run.summary.dlq_records_written + n)
            updated = replace(run, summary=s)
            for i in range(len(self._kept) - 1, -1, -1):   # the newest first: it just ended
                if self._kept[i] is run:
                    self._kept[i] = updated
                    break
            self._by_key[key] = updated

    def reading(self) -> AbstractContextManager:
        """Hold while the live runs' counts are read for `totals`: no run leaves meanwhile."""
        return self._lock

    def totals(self, live: Mapping[str, float]) -> Totals:
        """The totals given the live runs' sidecar-wide counters (`PolicyEngine.counters`, read
        within `reading()`)."""
        with self._lock:
            counts = copy_counts(self._counts)
            add_counts(counts, Counts(**{name: int(live.get(kip, 0))
                                         for name, kip in KIP_NAMES.items()}))
            return Totals(
                records_processed=self._processed + int(live.get("records-processed", 0)),
                counts=counts,
                dlq_records_written=self._dlq + int(live.get("dlq-records-written", 0)),
                runs_ended=dict(self._outcomes), since=self._since)

    def runs(self) -> list[EndedRun]:
        """The kept runs, newest first."""
        with self._lock:
            return list(reversed(self._kept))

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)


def totals_rows(totals: Totals) -> Iterable[tuple[str, dict[str, str], float]]:
    """The totals as metric rows (observability/telemetry.py names them). Not the records
    processed: a task attempt's count replaces its earlier one, so that sum may go down, which
    a Prometheus counter may not."""
    c = totals.counts
    yield "sidecar-record-failures", {}, float(c.total_record_failures)
    yield "sidecar-record-errors", {}, float(c.total_record_errors)
    yield "sidecar-records-skipped", {}, float(c.total_records_skipped)
    yield "sidecar-retries", {}, float(c.total_retries)
    yield "sidecar-errors-logged", {}, float(c.total_errors_logged)
    yield "sidecar-records-dropped", {}, float(c.dropped_records)
    yield "sidecar-dlq-records", {}, float(totals.dlq_records_written)
    for outcome, n in totals.runs_ended.items():
        yield "runs-ended", {"outcome": outcome}, float(n)


__all__ = ["BREAKDOWN_KEYS", "OUTCOMES", "REASON_CHARS", "EndedRun", "EndedRuns", "Totals",
           "kept_summary", "outcome_of", "totals_rows"]
