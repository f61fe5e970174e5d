"""The policy engine: the sidecar's decision for every failed record, behind one facade.
Pure: clock, randomness and the error log are injected; nothing here imports grpc,
confluent_kafka or pyspark.

`PolicyEngine` keeps the table of live runs (keyed by `run_key`), takes a run's lock, and hands
each report to the decision algorithm (`decide.Decider`, whose docstring lists the order of
decisions) over the run's state (`jobstate.JobState`: tables, counts, record identity) and the
report's bookkeeping (`batch.Batch`); it also takes recoveries, progress, refusals and DLQ
acknowledgements, and answers summaries and metrics.

Threads: the engine's own lock guards only the job table; each job has its lock, held while its
records are decided (the KIP-1033 handler is called under it, so handlers need not be
thread-safe) and released before error log lines are written.
"""

from __future__ import annotations

import pickle
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from itertools import repeat
from operator import attrgetter
from typing import NamedTuple

from ..errors import JobConflictError, UnknownJobError
from .batch import Batch
from .counters import KIP_NAMES, add_counts, as_kip_dict, copy_counts
from .decide import Decider, Outcome, Streak, per_record
from .errorlog import JsonErrorLogger, error_fields
from .handlers import UNRESTRICTED, HandlerRules, load_handler
from .jobstate import MAX_TRACKED_RECORDS, JobState, claim_of, run_key, warn_collisions
from .model import (
    Counts,
    FailedRecord,
    JobSummary,
    StageRef,
    TaskIdentity,
    Verdict,
)
from .ports import Clock, ErrorLogger, RandomSource
from .provisional import first_seen_skips, provisional_verdicts
from .streaks import Group, tally_streaks
from .settings import JobSettings, job_settings
from .slices import SliceAsk
from .tolerance import record_key

__all__ = ["MAX_TRACKED_RECORDS", "PolicyEngine", "Tally", "run_key"]


class Tally(NamedTuple):
    """One report of a TallyFailures call (`PolicyEngine.decide_tallies`)."""

    task: TaskIdentity
    ids: Sequence[str]          # record ids
    tags: Sequence[int]         # their payload digests
    groups: Sequence[Group]     # the records by way of failing, in order
    claim: int = 0              # the node's provisional claim (0: none)
    ask: SliceAsk | None = None  # what it says about budget slices (None: nothing)


def _take(j: JobState, out: list | None, counted: bool = False) -> None:
    """Move a durable run's journal slice into `out` as (generation, pickled entries); under
    the run's lock, so that the entries are pickled as they are. ``counted``: the summary's
    counts changed (a report was decided), so a slice is taken even when nothing else was
    journaled (the reports of a run that already failed)."""
    if out is None or j.journal is None:
        return
    gen, entries = j.take_journal(counted)
    if entries:
        out.append((gen, pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL)))


def _settle(j: JobState, ask: SliceAsk, n: int, now_wall_ms: int) -> None:
    """A decided report's slice business at its home (`SliceBook.settle`), after its `n`
    records were counted, so that a grant sees them; a run that failed grants nothing."""
    book = j.slices
    if book is not None:
        book.settle(ask, n, errors=j.tolerance.errors_total, may_grant=not j.failure_reason,
                    now_wall_ms=now_wall_ms)


# metric_rows reads a Counts' fields in one C call (a scrape reads every live job's counts)
_KIP_ORDER = tuple(KIP_NAMES.values())
_KIP_GETTER = attrgetter(*KIP_NAMES)


class PolicyEngine:
    def __init__(self, *, clock: Clock, rng: RandomSource, logger: ErrorLogger | None = None,
                 job_defaults: Mapping[str, str] | None = None,
                 handler_rules: HandlerRules = UNRESTRICTED) -> None:
        self._clock = clock
        self.handler_rules = handler_rules  # the operator's allow-list and time limit
        self._decider = Decider(rng)
        self._logger: ErrorLogger = logger if logger is not None else JsonErrorLogger()
        self._job_defaults = dict(job_defaults or {})
        self._lock = threading.Lock()
        self._jobs: dict[str, JobState] = {}

    # --- jobs -----------------------------------------------------------------------------
    # The table is keyed by the run (`run_key(job, run_id)`): every other method takes that key.
    # Two runs of one name share nothing (counts, remembered ids, schedules, policy).

    def register_job(self, job: str, properties: Mapping[str, str], *,
                     run_id: str = "", tag_secret: bytes = b"") -> JobSettings:
        """Validate and register one run of ``job``; idempotent for the same effective
        properties (a different policy for a live run raises JobConflictError). ``tag_secret``
        keys the run's payload digests (`tolerance.run_secret`)."""
        key = run_key(job, run_id)
        settings = job_settings(job, properties, self._job_defaults)
        with self._lock:
            existing = self._jobs.get(key)
        if existing is not None:
            return self._same_or_conflict(existing, settings)
        handler = load_handler(settings.handler_class, settings.tolerance.mode, settings.raw,
                               self.handler_rules)
        with self._lock:
            existing = self._jobs.get(key)
            if existing is None:
                self._jobs[key] = JobState(settings, handler, run_id, tag_secret)
                return settings
        return self._same_or_conflict(existing, settings)

    def end_job(self, key: str) -> JobSummary | None:
        """Release a run (by its key): its tables go with it. Returns its final summary (None:
        not registered here). Reports still in flight for it then answer UnknownJobError."""
        with self._lock:
            j = self._jobs.pop(key, None)
        if j is None:
            return None
        with j.lock:
            j.ended = True   # an acknowledgement after this goes to the ended run's totals
            return self._summary(j)

    @staticmethod
    def _same_or_conflict(existing: JobState, settings: JobSettings) -> JobSettings:
        old, new = existing.settings.raw, settings.raw
        if old == new:
            return existing.settings
        diffs = [f"{k}: {old.get(k, '')!r} -> {new.get(k, '')!r}"
                 for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]
        run = f" run {existing.run_id!r}" if existing.run_id else ""
        raise JobConflictError(
            f"job {settings.job!r}{run} is already registered with a different policy "
            f"({'; '.join(diffs)}); a live run's policy cannot change: end it (EndJob) or "
            f"start a new run")

    def settings(self, key: str) -> JobSettings:
        return self._job(key).settings

    def jobs(self) -> list[str]:
        """The live runs' keys, sorted."""
        with self._lock:
            return sorted(self._jobs)

    def _job(self, key: str) -> JobState:
        with self._lock:
            j = self._jobs.get(key)
        if j is None:
            raise UnknownJobError(key)
        return j

    # --- decisions ------------------------------------------------------------------------

    def decide(self, key: str, task: TaskIdentity, records: Sequence[FailedRecord],
               journal: list | None = None) -> list[Streak]:
        """The answers for a report's records, in order, as streaks (`Decider.decide`): an
        answer and how many consecutive records it is for, so that a sidecar deciding its own
        reports makes no Decision or Verdict per record of a streak (`decide.per_record` gives
        each record its own). The error log lines are written here, one per record.
        ``journal``: receives this call's slice of a durable run's journal
        (`JobState.take_journal`, pickled), for the caller to write once the report's dead
        letters are spooled."""
        decide = self._decider.decide
        j, batch, streaks = self._in_batch(key, task, journal,
                                           lambda j, b: decide(j, b, records))
        if j.settings.log_enable:
            self._write_logs(j, task, records, per_record(streaks, records), batch.wall)
        return streaks

    def decide_tallies(self, key: str, tallies: Sequence[Tally], journal: list | None = None,
                       around: Callable[[int], AbstractContextManager] | None = None
                       ) -> list[list[Streak]]:
        """A home's tallies, from their columns: each report (`Tally`) answered as streaks
        (`streaks.tally_streaks`); the error log lines are the node's to write. Each report is
        counted as a report of its own (its batch, its slices settled: `SliceBook.settle`), in
        order, under one hold of the run's lock, and the run's journal is taken once for them
        all (`_in_batches`: one slice for one TallyFailures call, where a slice each cost the
        home as much as deciding a report). ``around(i)``: a context to decide report ``i`` in
        (its OpenTelemetry span)."""
        decider = self._decider

        def deciding(t: Tally):
            def decide(j: JobState, b: Batch) -> list[Streak]:
                b.claim = t.claim
                return tally_streaks(decider, j, b, t.ids, t.tags, t.groups)
            return decide

        def settling(t: Tally):   # once the report's errors are counted
            ask, n = t.ask, len(t.ids)
            if ask is None:
                return None
            return lambda j, b: _settle(j, ask, n, b.wall)

        _, done = self._in_batches(
            key, [(t.task, deciding(t), settling(t)) for t in map(Tally._make, tallies)],
            journal, around)
        return [out for _, out in done]

    def _in_batch(self, key: str, task: TaskIdentity, journal: list | None, decide):
        """`_in_batches` of one report: (run state, batch, what `decide` answered)."""
        j, [(batch, out)] = self._in_batches(key, [(task, decide, None)], journal)
        return j, batch, out

    def _in_batches(self, key: str, reports: Sequence, journal: list | None,
                    around: Callable[[int], AbstractContextManager] | None = None):
        """For each (task, decide, after) of `reports`, in order, under one hold of the run's
        lock: `decide(j, batch)` in ``around(i)`` if given, then the report's counts applied
        and `after(j, batch)` called (if not None); the run's journal slice is taken once, after
        them all. Returns (run state, [(batch, what `decide` answered)])."""
        j = self._job(key)
        clock = self._clock
        done: list = []
        with j.lock:
            try:
                for task, decide, after in reports:
                    batch = Batch(task, clock.monotonic() * 1000.0, clock.wall_ms())
                    with around(len(done)) if around is not None else nullcontext():
                        try:
                            done.append((batch, decide(j, batch)))
                        finally:
                            batch.apply(j)
                            if after is not None:
                                after(j, batch)
            finally:
                _take(j, journal, counted=True)
        for batch, _ in done:
            if batch.collisions:
                warn_collisions(j, batch.collisions)
        return j, done

    def write_logs(self, key: str, task: TaskIdentity, records: Sequence[FailedRecord],
                   outcomes: Sequence[Outcome]) -> None:
        """The error log lines of outcomes decided elsewhere (the job's home), with the
        records' whole context."""
        j = self._job(key)
        if j.settings.log_enable:
            self._write_logs(j, task, records, outcomes, self._clock.wall_ms())

    def payload_digests(self, key: str, records: Sequence[FailedRecord]) -> bytes:
        """The records' payload digests (keyed by the run), 8 bytes each, little-endian: what a
        node sends the run's home instead of the payloads (`transport/tally.py`)."""
        digests = self._job(key).tags_of(records)
        if sys.byteorder != "little":
            digests.byteswap()
        return digests.tobytes()

    def provisional(self, key: str, records: Sequence[FailedRecord], *, sliced: bool = False
                    ) -> list[tuple[Verdict, int]] | None:
        """The verdicts a node may answer before its run's home confirms them, as streaks (a
        verdict and how many consecutive records it is for), or None
        (`provisional.provisional_verdicts`)."""
        return provisional_verdicts(self._job(key), records, sliced=sliced)

    def sliceable(self, key: str) -> bool:
        """Whether the run has an error limit its home slices among nodes (`slices.py`)."""
        return self._job(key).slices is not None

    def first_seen_skips(self, key: str, records: Sequence[FailedRecord]
                         ) -> list[Verdict | None] | None:
        """Per record, its home's answer if it is a data error met first within the limits
        (`provisional.first_seen_skips`)."""
        return first_seen_skips(self._job(key), records)

    def builtin_handler(self, key: str) -> bool:
        """Whether the run's KIP-1033 handler is a built-in one, whose answer needs no record:
        then its home can decide a report from columns (`tally`)."""
        return self._job(key).handler.fixed is not None

    def _write_logs(self, j: JobState, task: TaskIdentity, records: Sequence[FailedRecord],
                    outcomes: Sequence[Outcome], wall: int) -> None:
        failures = 0
        for record, (decision, log, rule) in zip(records, outcomes, strict=True):
            if not log:
                continue
            try:
                self._logger.log_error(error_fields(
                    job=j.settings.job, task=task, record=record,
                    verdict=decision.verdict,
                    include_messages=j.settings.log_include_messages, wall_ms=wall,
                    rule=rule))
            except Exception:  # a broken log sink must not change verdicts; it is counted
                failures += 1
        if failures:
            with j.lock:
                j.log_failures += failures
    # --- progress, recoveries, DLQ acks -----------------------------------------------------

    def record_recovered(self, key: str, task: TaskIdentity, record_ids: Sequence[str]) -> None:
        j = self._job(key)
        now = self._clock.monotonic() * 1000.0
        with j.lock:
            for rid in record_ids:
                st = j.records.pop(record_key(rid))
                if st is None:
                    continue
                j.recovered += 1
                cb = j.breakers.find(st.last_class) if st.last_class else None
                if cb is not None:
                    cb.on_success(now)

    def record_progress(self, key: str, task: TaskIdentity,
                        processed: Mapping[StageRef, int], journal: list | None = None) -> None:
        j = self._job(key)
        now = self._clock.monotonic() * 1000.0
        counts: dict[str, int] = {}
        for ref, n in processed.items():
            counts[ref.name] = counts.get(ref.name, 0) + int(n)
        with j.lock:
            before = j.tolerance.records_processed
            j.tolerance.record_progress((task.stage_id, task.partition_id), counts, now)
            # processed work is the budget's main deposit (a re-attempt's replaced count is not)
            j.budget.deposit(now, j.tolerance.records_processed - before)
            if not j.failure_reason:
                result = j.tolerance.check(now)
                if result.exceeded:
                    j.fail(result.reason)
            _take(j, journal)

    def note_refused(self, key: str, n: int) -> None:
        """``n`` records of a report refused for backpressure: counted, nothing decided."""
        with self._lock:
            j = self._jobs.get(key)
        if j is not None:
            with j.lock:
                j.refused += int(n)

    def undo_dead_letters(self, key: str, record_ids: Sequence[str],
                          journal: list | None = None) -> int:
        """The DLQ records of these skipped ids were not spooled after all (the spool refused
        the report): a re-report of them is dead-lettered again. Returns how many were marked."""
        j = self._job(key)
        undone = 0
        with j.lock:
            ids = j.ids
            for rid in record_ids:
                key = record_key(rid)
                # an id names every record reported under it: all of them are undone (one
                # that was spooled after all is then dead-lettered again if re-reported: a
                # duplicate, never a loss)
                for k in (key, *j.other_keys.get(key, ())):
                    info = ids.get(k)
                    if info is not None and info[3]:
                        ids.replace(k, j.skip_info(info[0], info[1], info[2], False,
                                                   claim_of(info)))
                        undone += 1
            _take(j, journal)
        return undone

    # --- durable state (runstate.py keeps it; JobState says what it is) ---------------------

    def enable_journal(self, key: str) -> None:
        j = self._job(key)
        with j.lock:
            if j.journal is None:
                j.enable_journal()

    def restore(self, key: str, slices: Sequence[bytes]) -> None:
        """Replay a run's journal slices (and snapshot), oldest first, into its fresh state."""
        j = self._job(key)
        with j.lock:
            for blob in slices:
                j.replay(pickle.loads(blob))  # noqa: S301 - the sidecar's own state file

    def snapshot(self, key: str) -> tuple[int, bytes]:
        """The run's whole durable state as one slice (compaction), numbered."""
        j = self._job(key)
        with j.lock:
            gen, entries = j.snapshot()
            return gen, pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL)

    def note_dead_letter_acked(self, key: str, n: int) -> bool:
        """Count ``n`` DLQ records of a live run acknowledged by Kafka; False when the run is
        not live here (it ended, or the sidecar restarted, while its records drained)."""
        with self._lock:
            j = self._jobs.get(key)
        if j is None:
            return False
        with j.lock:
            if j.ended:   # its final summary was taken meanwhile
                return False
            j.dlq_acked += int(n)
            return True

    # --- reporting --------------------------------------------------------------------------

    def summary(self, key: str) -> JobSummary:
        j = self._job(key)
        with j.lock:
            return self._summary(j)

    @staticmethod
    def _summary(j: JobState) -> JobSummary:
        return JobSummary(
            job=j.settings.job,
            run_id=j.run_id,
            failed=bool(j.failure_reason),
            failure_reason=j.failure_reason,
            records_processed=j.tolerance.records_processed,
            counts=copy_counts(j.counts.job),
            dlq_records_written=j.dlq_acked,
            by_stage=dict(j.by_stage),
            by_category=dict(j.by_category),
            by_exception_class=dict(j.by_class),
            retry_budget_exhausted=j.budget.exhausted_total,
            records_refused=j.refused,
            record_id_collisions=j.collisions,
        )

    def stage_counts(self, key: str, stage: str) -> Counts:
        """KIP-298 counts of one stage of a job (zeros if it never failed)."""
        j = self._job(key)
        with j.lock:
            c = j.counts.stages.get(stage)
            return copy_counts(c) if c is not None else Counts()

    def task_counts(self, key: str, task_id: str) -> Counts:
        """KIP-298 counts of one Spark task (``stage.partition``) of a job."""
        j = self._job(key)
        with j.lock:
            c = j.counts.tasks.get(task_id)
            return copy_counts(c) if c is not None else Counts()

    def metric_rows(self, *, task_label: bool = False) -> list[tuple[str, dict[str, str],
                                                                      float]]:
        """KIP-298 counts of the live jobs as (metric name, {job, stage}, value) rows for
        exporters. ``task_label`` adds the Spark task (``stage.partition``): one series per
        partition, for debugging only (bounded by ``MAX_TASK_SCOPES`` per job)."""
        rows: list[tuple[str, dict[str, str], float]] = []
        with self._lock:
            jobs = list(self._jobs.items())
        getter = _KIP_GETTER
        names = _KIP_ORDER
        for _key, j in jobs:
            name = j.settings.job
            # two live runs of one name (overlapping schedules) are two series
            run = {"run": j.run_id} if j.run_id else {}
            with j.lock:
                if task_label:
                    scoped = [({"stage": st, "task": tk}, getter(c))
                              for (st, tk), c in j.counts.pairs.items()]
                else:
                    scoped = [({"stage": st}, getter(c)) for st, c in j.counts.stages.items()]
                acked = j.dlq_acked
            for labels, values in scoped:
                attrs = {"job": name, **run, **labels}
                rows.extend(zip(names, repeat(attrs), values))
            rows.append(("dlq-records-written", {"job": name, **run}, float(acked)))
        return rows

    def counters(self) -> dict[str, float]:
        """Sidecar-wide counters by KIP metric name, plus spillway's own."""
        with self._lock:
            jobs = list(self._jobs.values())
        now = self._clock.monotonic() * 1000.0
        total = Counts()
        extra = dict.fromkeys((
            "jobs", "jobs-failed", "records-processed", "total-records-recovered",
            "dlq-records-written", "retry-budget-exhausted", "circuit-breaker-opened",
            "circuits-open", "records-tracked", "records-evicted", "handler-failures",
            "error-log-failures", "record-id-collisions"), 0.0)
        for j in jobs:
            with j.lock:
                add_counts(total, j.counts.job)
                extra["jobs"] += 1
                extra["jobs-failed"] += bool(j.failure_reason)
                extra["records-processed"] += j.tolerance.records_processed
                extra["total-records-recovered"] += j.recovered
                extra["dlq-records-written"] += j.dlq_acked
                extra["retry-budget-exhausted"] += j.budget.exhausted_total
                extra["circuit-breaker-opened"] += j.breakers.times_opened()
                extra["circuits-open"] += j.breakers.open_count(now)
                extra["records-tracked"] += len(j.records)
                extra["records-evicted"] += j.records_evicted
                extra["handler-failures"] += j.handler_failures
                extra["error-log-failures"] += j.log_failures
                extra["record-id-collisions"] += j.collisions
        out = as_kip_dict(total)
        out.update(extra)
        return out
