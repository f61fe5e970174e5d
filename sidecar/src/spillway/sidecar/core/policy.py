"""The policy engine: the sidecar's decision for every failed record. Pure: clock, randomness
and the error log are injected; nothing here imports grpc, confluent_kafka or pyspark.

For each reported record, in order (docs/POLICY.md has the user-facing version):

1. The job has failed → FAIL (job_failed) with the job's failure reason.
2. The record was already skipped by an earlier report (a task retry, a speculative attempt, a
   re-run action, from any node) → SKIP again, counted once, and NOT dead-lettered again: the
   verdict says it is already in the DLQ (`dead_lettered`). Only if the earlier DLQ write was
   undone (`undo_dead_letters`: its spool refused it) is it dead-lettered now.
3. Classify (`classify.py`, KIP-1050) and act on the category:
   - invalid-configuration → the job fails at once;
   - abortable → FAIL this task attempt only; Spark re-runs the task;
   - application-recoverable → FAIL this task attempt only: Spark restarts the task with fresh
     clients and state, which is the recovery KIP-1050 asks the application for;
   - retriable / refresh-retriable → RETRY while the schedule allows (`backoff.py`), deferred
     if need be by the job's retry budget (`budget.py`, a bound on the retry rate) and, if its
     circuit is open, with the circuit's shared wait (`breaker.py`); otherwise the record's
     retries are exhausted;
   - data → never retried.
4. An exhausted or data record goes to the KIP-1033 handler (`handlers.py`): FAIL fails the
   job; CONTINUE is subject to the tolerance limits (`tolerance.py`): within them → SKIP
   (dead-lettered when the job has a DLQ topic), past them → the job fails.

The sidecar owns each record's schedule, keyed by (job, record id), so a re-attempted Spark task
(new attempt number, same record ids) continues the record's retry count, retry clock and
budget instead of restarting them. Memory is bounded: per job at most
``MAX_TRACKED_RECORDS`` schedules (least recently reported evicted; recovered and skipped
records leave at once) and ``tolerance.MAX_COUNTED_IDS`` counted error ids, which also hold the
skipped records' answers (one table: a skipped record is a counted one). Both tables are keyed
by a 60-bit digest of the record id (`tolerance.record_key`), not the id string, in flat arrays
(`idtable.IdTable`: no Python object per id); a skipped record's answer is a (category, reason,
attempts) tuple shared by every record skipped the same way (`_Job.skip_info`). A digest
collision (about n^2 / 2^61 for n remembered ids) can make a distinct record look already
skipped (still SKIP, not counted again, and not dead-lettered: its DLQ record is the one it
collided with; ~4e-8 at 300 000 ids) or share another record's retry schedule (it may run out
of retries sooner, then goes to the handler and tolerance as usual).

Threads: the engine's own lock guards only the job table; each job has its lock, held while its
records are decided (the KIP-1033 handler is called under it, so handlers need not be
thread-safe) and released before error log lines are written.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter

from ..errors import HandlerError, JobConflictError, UnknownJobError
from .backoff import RetryState, schedule_from_settings
from .breaker import Breakers
from .budget import RetryBudget
from .classify import Classification, Classifier
from .counters import KIP_NAMES, ScopedCounts, add_counts, as_kip_dict, copy_counts
from .errorlog import JsonErrorLogger, error_fields
from .handlers import (UNRESTRICTED, ErrorHandlerContext, HandlerResponse, HandlerRules,
                       LoadedHandler, invoke, load_handler)
from .model import (Action, Category, Counts, Decision, FailedRecord, JobSummary, StageRef,
                    TaskIdentity, Verdict)
from .ports import Clock, ErrorLogger, RandomSource
from .settings import JobSettings, job_settings
from .tolerance import _WITHIN, KEY_MASK, TAG_MASK, IdTable, ToleranceTracker

log = logging.getLogger("spillway.sidecar.policy")

MAX_TRACKED_RECORDS = 100_000
# metric_rows reads a Counts' fields in one C call (a scrape reads every live job's counts)
_KIP_ORDER = tuple(KIP_NAMES.values())
_KIP_GETTER = attrgetter(*KIP_NAMES)
MAX_SKIP_INFOS = 4_096    # distinct skip answers shared per job (cleared when full)
MAX_BREAKDOWN_KEYS = 1_000
OTHER_KEY = "(other)"
MAX_MESSAGE_CHARS = 300
# Known ids under which more than one distinct record was reported, with their other records'
# keys (so that `undo_dead_letters`, which names only ids, reaches them too); bounded: past it
# the oldest id's list is dropped (an undo then misses its other records, which only means a
# re-report of one of them is answered "already in the DLQ": the same as before this table).
MAX_COLLIDED_IDS = 10_000
MAX_KEYS_PER_ID = 1_024


def run_key(job: str, run_id: str) -> str:
    """The engine's key of one run of a job (just the name when there is no run id):
    ``job@run_id``, with '%' and '@' in the job name escaped so that no two (job, run id) pairs
    share a key (run ids have no '/', so ``key + "/"`` prefixes only that run's task keys)."""
    if not run_id:
        return job
    return job.replace("%", "%25").replace("@", "%40") + "@" + run_id


@dataclass(slots=True)
class _RecordState:
    first_ms: float
    attempts: int = 0          # failed attempts reported (Verdict.attempt)
    retries: int = 0           # retries charged to the record's schedule
    holds: int = 0             # free waits imposed by an open circuit
    last_delay_ms: float = 0.0
    last_class: str = ""


# A skipped record's answer, (category, reason, attempts, dead-lettered): immutable and shared by
# every record skipped the same way (`_Job.skip_info`), so remembering a skipped id costs no
# object of its own. dead-lettered: a DLQ record was handed to a spool for it (so a re-report
# is not written again), until `undo_dead_letters` says that spool refused it.
_SkipInfo = tuple[Category, str, int, bool]


class _Job:
    def __init__(self, settings: JobSettings, handler: LoadedHandler, run_id: str = "") -> None:
        self.settings = settings
        self.run_id = run_id
        self.handler = handler
        self.lock = threading.Lock()
        self.classifier = Classifier.build(settings.classification_rules,
                                           settings.default_category)
        self.schedule = schedule_from_settings(settings.retry)
        r = settings.retry
        self.budget = RetryBudget(r.budget_ratio, r.budget_min_retries, r.budget_window_ms)
        self.breakers = Breakers(settings.circuit)
        self.tolerance = ToleranceTracker(settings.job, settings.tolerance)
        self.records: IdTable[_RecordState] = IdTable(MAX_TRACKED_RECORDS)  # by record_key
        self.ids = self.tolerance.ids   # record_key -> _SkipInfo (None: counted, not skipped)
        self.skip_infos: dict[_SkipInfo, _SkipInfo] = {}
        self.counts = ScopedCounts()
        self.by_stage: dict[str, int] = {}
        self.by_category: dict[str, int] = {}
        self.by_class: dict[str, int] = {}
        self.failure_reason = ""
        self.dlq_acked = 0
        self.refused = 0        # records of reports refused for backpressure (never decided)
        self.recovered = 0
        self.handler_failures = 0
        self.log_failures = 0
        self.collisions = 0     # distinct records reported under an id known with another payload
        self.other_keys: dict[int, list[int]] = {}   # id key -> its other records' keys

    @property
    def records_evicted(self) -> int:
        return self.records.evicted

    def skip_info(self, category: Category, reason: str, attempts: int,
                  dead_lettered: bool) -> _SkipInfo:
        """The shared answer for records skipped this way (reasons are per report and per
        exception message: equal ones across reports are merged here)."""
        info = (category, reason, attempts, dead_lettered)
        shared = self.skip_infos.get(info)
        if shared is None:
            if len(self.skip_infos) >= MAX_SKIP_INFOS:
                self.skip_infos.clear()   # entries keep theirs; only sharing starts afresh
            shared = self.skip_infos[info] = info
        return shared

    def new_state(self, key: int, tag: int, now_ms: float,
                  record: FailedRecord) -> _RecordState:
        """The schedule of a data error first seen now (attempt 1), made when it is kept."""
        st = _RecordState(first_ms=now_ms, attempts=1, last_class=record.exception.class_name)
        self.records.add(key, st, tag)
        return st

    def identity(self, record: FailedRecord, b: _Batch) -> tuple[int, int]:
        """The key under which this record is remembered, and its payload tag.

        A record is its id *and* its payload: the key is the id's digest, unless the id is
        remembered (skipped, counted or retrying) with another payload. Then this is another
        record that happens to share the id (positions reused, a record_id function that is
        not unique, ...): it gets a key of its own, from id and payload, and is decided,
        counted and dead-lettered on its own; the first such report is counted as a collision
        and logged. The same id with the same payload is the same record (a re-report)."""
        rid = record.record_id
        key = hash(rid) & KEY_MASK
        tag = hash((record.key, record.value)) & TAG_MASK      # tolerance.payload_tag
        known = self.ids.tag(key)
        if known < 0:
            known = self.records.tag(key)
        if known < 0 or known == tag:
            return key, tag
        other = hash((rid, tag)) & KEY_MASK
        if self.ids.tag(other) == tag or self.records.tag(other) == tag:
            return other, tag                # a re-report of that other record
        self.collisions += 1
        b.collisions.append(record)
        keys = self.other_keys.get(key)
        if keys is None:
            if len(self.other_keys) >= MAX_COLLIDED_IDS:
                del self.other_keys[next(iter(self.other_keys))]
            keys = self.other_keys[key] = []
        if len(keys) < MAX_KEYS_PER_ID:
            keys.append(other)
        return other, tag


def _bump(table: dict[str, int], key: str, n: int = 1) -> None:
    if key not in table and len(table) >= MAX_BREAKDOWN_KEYS:
        key = OTHER_KEY
    table[key] = table.get(key, 0) + n


def _describe(record: FailedRecord) -> str:
    exc = record.exception
    msg = exc.message if len(exc.message) <= MAX_MESSAGE_CHARS else (
        exc.message[:MAX_MESSAGE_CHARS] + "…")
    return f"{exc.class_name or '<unknown exception>'}: {msg}" if msg else (
        exc.class_name or "<unknown exception>")


class _BudgetRefusal(str):
    """Why a record's retries ended: the retry budget had no slot before its deadline."""

    __slots__ = ()


# One record's answer, plus what to log after the lock is released: (decision, log, rule).
_Outcome = tuple[Decision, bool, str]

# Indexes into a batch's per-stage amounts (`counters.BATCH_FIELDS` order).
_FAILURES, _ERRORS, _SKIPPED, _RETRIES, _LOGGED, _DROPPED = range(6)
_RETRIABLE = frozenset(c for c in Category if c.retriable)
_DATA = Category.DATA
_DATA_WHY = "data error: never retried"
_CONTINUE = HandlerResponse.CONTINUE


class _Batch:
    """One report's bookkeeping, kept locally while its records are decided and applied to the
    job's tables once at the end (still under the job's lock, so nobody sees it half done):
    counters per stage, the breakdowns, and the retry budget's deposits (records failing for
    the first time), which are made before any retry is granted, so the budget sees exactly
    what it would per record.
    Also remembers the last record's description, which a batch failing the same way shares."""

    __slots__ = ("amounts", "last_stage", "last_amounts", "last_ref", "by_stage", "by_class",
                 "by_category", "reports", "last_exc", "last_cls", "last_what", "reasons",
                 "last_info", "cls_exc", "cls", "new_errors", "collisions")

    def __init__(self) -> None:
        self.amounts: dict[str, list[int]] = {}
        self.last_stage: str | None = None
        self.last_amounts: list[int] = []
        self.last_ref: StageRef | None = None
        self.by_stage: dict[str, int] = {}
        self.by_class: dict[str, int] = {}
        self.by_category: dict[Category, int] = {}
        self.reports = 0
        self.last_exc: object = None
        self.last_cls: object = None
        self.last_what = ""
        self.reasons: dict[tuple[str, str], str] = {}
        self.last_info: _SkipInfo | None = None
        self.cls_exc: object = None       # the last exception value classified, and its class
        self.cls: Classification | None = None
        self.new_errors: dict[str, int] = {}   # by stage: errors counted by tolerance at the end
        self.collisions: list[FailedRecord] = []   # records under an id known with another payload

    def stage_amounts(self, stage: str) -> list[int]:
        if stage == self.last_stage:
            return self.last_amounts
        # re-inserted so that stages are applied in the order of their last record, as the
        # per-record counters would have touched them (least recently used first)
        a = self.amounts.pop(stage, None)
        if a is None:
            a = [0, 0, 0, 0, 0, 0]
        self.amounts[stage] = a
        self.last_stage, self.last_amounts = stage, a
        return a

    def charge_reports(self, j: _Job, now: float) -> None:
        if self.reports:
            j.budget.deposit(now, self.reports)
            self.reports = 0

    def apply(self, j: _Job, task: TaskIdentity, tid: str, now: float, wall: int) -> None:
        self.charge_reports(j, now)
        if self.new_errors:
            tkey = (task.stage_id, task.partition_id)
            for stage, n in self.new_errors.items():
                j.tolerance.count_errors(stage, tkey, n, now)
        for stage, a in self.amounts.items():
            j.counts.add_batch(stage, tid, a, wall)
        for table, counted in ((j.by_stage, self.by_stage), (j.by_class, self.by_class)):
            for key, n in counted.items():
                _bump(table, key, n)
        for category, n in self.by_category.items():
            _bump(j.by_category, category.value, n)


def _warn_collisions(j: _Job, records: Sequence[FailedRecord]) -> None:
    """One warning per report (a reused position repeats across a whole partition), naming the
    wrapper function and an example id."""
    first = records[0]
    functions = sorted({r.function_name or "?" for r in records})
    run = f" run {j.run_id!r}" if j.run_id else ""
    log.warning(
        "job %r%s: %d record(s) reported under a record id already known with another payload "
        "(function %s, stage %s, e.g. record id %r); each is decided, counted and "
        "dead-lettered as a distinct record. Record ids should name one record: see "
        "docs/POLICY.md, Record identity", j.settings.job, run, len(records),
        ", ".join(functions[:5]), first.stage.name, first.record_id)


class PolicyEngine:
    def __init__(self, *, clock: Clock, rng: RandomSource, logger: ErrorLogger | None = None,
                 job_defaults: Mapping[str, str] | None = None,
                 handler_rules: HandlerRules = UNRESTRICTED) -> None:
        self._clock = clock
        self.handler_rules = handler_rules  # the operator's allow-list and time limit
        self._rng = rng
        self._logger: ErrorLogger = logger if logger is not None else JsonErrorLogger()
        self._job_defaults = dict(job_defaults or {})
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}

    # --- jobs -----------------------------------------------------------------------------
    # The table is keyed by the run (`run_key(job, run_id)`): every other method takes that key.
    # Two runs of one name share nothing (counts, remembered ids, schedules, policy).

    def register_job(self, job: str, properties: Mapping[str, str], *,
                     run_id: str = "") -> JobSettings:
        """Validate and register one run of ``job``; idempotent for the same effective
        properties (a different policy for a live run raises JobConflictError)."""
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
                self._jobs[key] = _Job(settings, handler, run_id)
                return settings
        return self._same_or_conflict(existing, settings)

    def end_job(self, job: str) -> JobSummary | None:
        """Release a run (by its key): its tables go with it. Returns its final summary (None:
        not registered here). Reports still in flight for it then answer UnknownJobError."""
        with self._lock:
            j = self._jobs.pop(job, None)
        if j is None:
            return None
        with j.lock:
            return self._summary(j)

    @staticmethod
    def _same_or_conflict(existing: _Job, settings: JobSettings) -> JobSettings:
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

    def settings(self, job: str) -> JobSettings:
        return self._job(job).settings

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._jobs)

    def _job(self, job: str) -> _Job:
        with self._lock:
            j = self._jobs.get(job)
        if j is None:
            raise UnknownJobError(job)
        return j

    # --- decisions ------------------------------------------------------------------------

    def decide(self, job: str, task: TaskIdentity,
               records: Sequence[FailedRecord]) -> list[Decision]:
        j = self._job(job)
        now = self._clock.monotonic() * 1000.0
        wall = self._clock.wall_ms()
        batch = _Batch()
        tid = task.task_id
        with j.lock:
            try:
                outcomes = self._decide_all(j, task, tid, records, now, wall, batch)
            finally:
                batch.apply(j, task, tid, now, wall)
        if batch.collisions:
            _warn_collisions(j, batch.collisions)
        if j.settings.log_enable:
            self._write_logs(j, task, records, outcomes, wall)
        return [o[0] for o in outcomes]

    def _decide_all(self, j: _Job, task: TaskIdentity, tid: str,
                    records: Sequence[FailedRecord], now: float, wall: int,
                    b: _Batch) -> list[_Outcome]:
        """`_decide_one` for each record, except along a run of records failing the same way
        for the first time: once a record (first seen, a data error, the built-in CONTINUE
        handler, tolerance without limits) was skipped, the records after it with the same
        exception value and stage get the same answer, so they take a short path (their id
        remembered, their verdict made) and are counted together when the run ends. Answers and
        counts are exactly `_decide_one`'s; any other record ends the run."""
        out: list[_Outcome] = []
        append = out.append
        if not (j.tolerance.unlimited and j.handler.fixed is _CONTINUE):
            for r in records:
                append(self._decide_one(j, task, tid, r, now, wall, b))
            return out
        ids, tracked = j.ids, j.records
        logged = j.settings.log_enable
        dead_letter = j.settings.dlq.enabled
        run_exc = run_ref = reason = info = rule = None
        category = _DATA
        pending = 0
        skip = Action.SKIP
        for r in records:
            if r.exception is run_exc and r.stage is run_ref:
                key = hash(r.record_id) & KEY_MASK
                if key not in ids and tracked.get(key) is None:
                    ids.add(key, info, hash((r.key, r.value)) & TAG_MASK)
                    append((Decision(Verdict(r.record_id, skip, category, reason, 1),
                                     dead_letter), logged, rule))
                    pending += 1
                    continue
            if pending:
                self._count_run(b, run_exc, pending, dead_letter, logged)
                pending = 0
            o = self._decide_one(j, task, tid, r, now, wall, b)
            append(o)
            v = o[0].verdict
            run_exc = None
            if (v.action is skip and v.category is _DATA and v.attempt == 1
                    and not v.dead_lettered and not j.failure_reason):
                reason = b.reasons.get((b.last_what, _DATA_WHY))
                info = b.last_info
                # the record went `_handle`'s first-seen data path: the run shares its answer
                if (reason is not None and v.reason is reason and info is not None
                        and info[0] is _DATA and info[1] == reason and info[2] == 1):
                    run_exc, run_ref, rule = r.exception, r.stage, o[2]
        if pending:
            self._count_run(b, run_exc, pending, dead_letter, logged)
        return out

    @staticmethod
    def _count_run(b: _Batch, exc, n: int, dead_letter: bool, logged: bool) -> None:
        """The counts `_decide_one` would have made for ``n`` records of a run (its stage is
        the batch's last one: no other record came between)."""
        a = b.last_amounts
        a[_FAILURES] += n
        a[_ERRORS] += n
        a[_SKIPPED] += n
        if not dead_letter:
            a[_DROPPED] += n
        if logged or dead_letter:
            a[_LOGGED] += n
        stage = b.last_stage
        b.by_stage[stage] += n
        cls_key = exc.class_name or "<unknown>"
        b.by_class[cls_key] += n
        b.by_category[_DATA] += n
        b.reports += n
        b.new_errors[stage] = b.new_errors.get(stage, 0) + n

    def _write_logs(self, j: _Job, task: TaskIdentity, records: Sequence[FailedRecord],
                    outcomes: Sequence[_Outcome], wall: int) -> None:
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

    def _decide_one(self, j: _Job, task: TaskIdentity, tid: str, record: FailedRecord,
                    now: float, wall: int, b: _Batch) -> _Outcome:
        s = j.settings
        rid, exc, ref = record.record_id, record.exception, record.stage
        if ref is b.last_ref:
            stage = b.last_stage        # StageRef.name, once per batch (refs are shared)
        else:
            stage = ref.name
            b.last_ref = ref
        amounts = b.stage_amounts(stage)
        amounts[_FAILURES] += 1           # and the batch's wall time as the last error's
        counted = b.by_stage
        counted[stage] = counted.get(stage, 0) + 1
        key = exc.class_name or "<unknown>"
        counted = b.by_class
        counted[key] = counted.get(key, 0) + 1
        if exc is b.cls_exc:
            cls = b.cls                   # records of a batch share their exception value
        else:
            cls = b.cls = j.classifier.classify(exc)
            b.cls_exc = exc
        category = cls.category
        counted = b.by_category       # by Category: its value is taken once, in apply()
        counted[category] = counted.get(category, 0) + 1
        key, tag = j.identity(record, b)
        skipped = j.ids.get(key)
        if skipped is not None and not j.failure_reason:
            # a re-attempted task met a record an earlier report already skipped: same answer,
            # counted once; its DLQ record was written then, so not again (one per record id)
            again = skipped[3]
            skipped = j.skip_info(skipped[0], skipped[1], skipped[2] + 1, s.dlq.enabled)
            j.ids.add(key, skipped)       # and now the most recently seen
            if again:
                return (Decision(Verdict(
                    rid, Action.SKIP, skipped[0],
                    f"already skipped by an earlier report and already in the DLQ topic "
                    f"{s.dlq.topic} (not written again): {skipped[1]}",
                    skipped[2], dead_lettered=True)), False, "")
            return (Decision(Verdict(
                rid, Action.SKIP, skipped[0],
                f"already skipped by an earlier task attempt: {skipped[1]}",
                skipped[2]), s.dlq.enabled), False, "")

        state = j.records.get(key)
        if state is None:
            b.reports += 1                # a first failure: a budget deposit, before any retry
        if state is None and category is _DATA and not j.failure_reason:
            # a data error never seen before: it is never retried, so it needs no schedule
            # (`_handle` makes one only if the record is not skipped, as it would be kept)
            if exc is b.last_exc and cls is b.last_cls:
                what = b.last_what
            else:
                what = f"{_describe(record)} [{cls.describe()}]"
                b.last_exc, b.last_cls, b.last_what = exc, cls, what
            return self._handle(j, task, tid, record, key, None, cls, _DATA_WHY, what, now,
                                wall, amounts, b, stage, tag)
        if state is None:
            state = _RecordState(first_ms=now)
            j.records.add(key, state, tag)
        else:
            j.records.touch(key)
        state.attempts += 1
        state.last_class = exc.class_name

        if j.failure_reason:
            return (Decision(Verdict(
                rid, Action.FAIL, category, f"job {s.job!r} has failed: {j.failure_reason}",
                state.attempts, job_failed=True)), False, "")

        if exc is b.last_exc and cls is b.last_cls:
            what = b.last_what            # a batch failing the same way: one description
        else:
            what = f"{_describe(record)} [{cls.describe()}]"
            b.last_exc, b.last_cls, b.last_what = exc, cls, what
        if category is Category.INVALID_CONFIGURATION:
            reason = self._fail_job(j, (
                f"job {s.job!r} failed on an invalid-configuration error in stage {stage} "
                f"(record {rid!r}): {what}; fix the configuration and re-run"))
            return self._error(j, amounts, Verdict(rid, Action.FAIL, category, reason,
                                                   state.attempts, job_failed=True), cls)
        if category is Category.ABORTABLE:
            return self._error(j, amounts, Verdict(rid, Action.FAIL, category, (
                f"abortable error in stage {stage}: {what}; failing this task attempt only, "
                f"Spark will re-run the task"), state.attempts), cls)
        if category is Category.APPLICATION_RECOVERABLE:
            return self._error(j, amounts, Verdict(rid, Action.FAIL, category, (
                f"application-recoverable error in stage {stage}: {what}; failing this task "
                f"attempt only, Spark will restart the task with fresh clients and state"),
                state.attempts), cls)

        if category in _RETRIABLE:
            b.charge_reports(j, now)
            retry = self._try_retry(j, task, record, state, cls, now)
            if isinstance(retry, Verdict):
                amounts[_RETRIES] += 1
                return (Decision(retry), False, "")
            if isinstance(retry, _BudgetRefusal):
                # the budget had no slot before the record's deadline: handled as exhausted,
                # and the final verdict says the budget was why
                out = self._handle(j, task, tid, record, key, state, cls,
                                   f"retries exhausted: {retry}", what, now, wall, amounts, b,
                                   stage, tag)
                out[0].verdict.retry_budget_exhausted = True
                return out
            why = f"retries exhausted: {retry}"
        else:
            why = _DATA_WHY
        return self._handle(j, task, tid, record, key, state, cls, why, what, now, wall,
                            amounts, b, stage, tag)

    def _try_retry(self, j: _Job, task: TaskIdentity, record: FailedRecord,
                   state: _RecordState, cls: Classification, now: float) -> Verdict | str:
        """A RETRY verdict (possibly deferred by the retry budget), or the reason the record's
        retries are exhausted (a `_BudgetRefusal` when the budget had no slot before the
        record's deadline)."""
        s = j.settings
        rs = RetryState(retries=state.retries, elapsed_ms=now - state.first_ms,
                        last_delay_ms=state.last_delay_ms)
        if not j.schedule.enabled:
            return j.schedule.stop(rs) or "retries are disabled"
        hold = None
        if s.circuit.enable and record.exception.class_name:
            cb = j.breakers.get(record.exception.class_name, now)
            hold = cb.on_failure(now, task.task_id, self._rng)
        charged = hold is None or state.holds >= s.circuit.max_holds
        if charged:
            stop = j.schedule.stop(rs)
            if stop is not None:
                return stop
        decision = (j.schedule.next(rs, self._rng) if hold is None
                    else j.schedule.hold(rs, hold.wait_ms))
        if decision.delay_ms is None:
            return decision.reason
        delay, budget_note = decision.delay_ms, ""
        if charged:
            timeout = j.schedule.deadline.timeout_ms
            grant = j.budget.acquire(now, delay, None if timeout is None
                                     else timeout - rs.elapsed_ms)
            if grant.delay_ms is None:
                return _BudgetRefusal(grant.reason)
            delay, budget_note = grant.delay_ms, grant.reason
            state.retries += 1
        else:
            state.holds += 1
        state.last_delay_ms = decision.delay_ms
        limit = s.retry.max_retries
        of = f" of {limit}" if limit is not None else ""
        refresh = ("run the stage's refresh hook, then " if cls.category
                   is Category.REFRESH_RETRIABLE else "")
        note = f" ({decision.reason})" if decision.reason else ""
        if budget_note:
            note += f" ({budget_note})"
        what = f"{cls.category.value} {_describe(record)} [{cls.rule}]"
        if hold is None:
            reason = f"{what}: {refresh}retry {state.retries}{of} in {delay} ms{note}"
        elif charged:
            reason = (f"{what}: {hold.reason}; {refresh}retry {state.retries}{of} in "
                      f"{delay} ms (charged: errors.circuit.max.holds="
                      f"{s.circuit.max_holds} reached){note}")
        else:
            reason = (f"{what}: {hold.reason}; {refresh}retry in {decision.delay_ms} ms "
                      f"(hold {state.holds}, not charged to the record's retries){note}")
        return Verdict(record_id=record.record_id, action=Action.RETRY, category=cls.category,
                       reason=reason, attempt=state.attempts, retry_delay_ms=delay,
                       retry_budget_exhausted=bool(budget_note))

    def _handle(self, j: _Job, task: TaskIdentity, tid: str, record: FailedRecord, key: int,
                state: _RecordState | None, cls: Classification, why: str, what: str,
                now: float, wall: int, amounts: list[int], b: _Batch, stage: str,
                tag: int) -> _Outcome:
        """KIP-1033 handler, then tolerance, for a record that will not be retried. `state`
        None: a data error seen for the first time (attempt 1), whose schedule is made only if
        the record is not skipped (a skipped record's schedule is dropped at once)."""
        s = j.settings
        rid, category = record.record_id, cls.category
        attempts = state.attempts if state is not None else 1

        response = j.handler.fixed  # a built-in's answer does not depend on the context
        if state is None and response is not _CONTINUE:
            state = j.new_state(key, tag, now, record)   # kept unless the record is skipped
        if response is None:
            src = record.source
            context = ErrorHandlerContext(
                job=s.job, record_id=rid, topic=src.topic if src else None,
                partition=src.partition if src else -1, offset=src.offset if src else -1,
                headers=record.headers, processor_node_id=record.function_name, task_id=tid,
                timestamp=record.timestamp_ms if record.timestamp_ms is not None else wall,
                stage=stage, exception=record.exception, category=category,
                attempt=attempts, reason=why, record=record)
            try:
                response = invoke(j.handler, context)
            except HandlerError as exc:
                j.handler_failures += 1
                reason = self._fail_job(j, f"job {s.job!r} failed: {exc} (stage {stage})")
                return self._error(j, amounts, Verdict(rid, Action.FAIL, category, reason,
                                                       attempts, job_failed=True), cls)

        if response is HandlerResponse.FAIL:
            if j.handler.derived:
                reason = (f"job {s.job!r} failed on its first error: errors.tolerance=none "
                          f"(stage {stage}, record {rid!r}): {what}; {why}")
            else:
                reason = (f"job {s.job!r} failed: errors.handler.class={j.handler.name} returned "
                          f"FAIL for record {rid!r} (stage {stage}): {what}; {why}")
            return self._error(j, amounts, Verdict(rid, Action.FAIL, category,
                                                   self._fail_job(j, reason), attempts,
                                                   job_failed=True), cls)

        tolerance = j.tolerance
        if tolerance.unlimited:           # no limit to check: counted per stage at the end
            ids = j.ids
            if key in ids:
                ids.touch(key)            # already counted by an earlier attempt
            else:
                ids.add(key, None, tag)
                new = b.new_errors
                new[stage] = new.get(stage, 0) + 1
            tol = _WITHIN
        else:
            tol = tolerance.admit(rid, stage, now, (task.stage_id, task.partition_id), key,
                                  tag)
        if tol.exceeded:
            if state is None:
                state = j.new_state(key, tag, now, record)
            reason = self._fail_job(j, f"{tol.reason}; last error: {what} (record {rid!r})")
            return self._error(j, amounts, Verdict(rid, Action.FAIL, category, reason,
                                                   attempts, job_failed=True), cls)

        dead_letter = s.dlq.enabled
        reason = b.reasons.get((what, why))
        if reason is None:
            where = (f"dead-lettered to {s.dlq.topic}" if dead_letter
                     else "dropped (no errors.deadletterqueue.topic.name)")
            reason = b.reasons[(what, why)] = f"skipped, {where}: {what}; {why}"
        info = b.last_info
        if (info is None or info[1] is not reason or info[0] is not category
                or info[2] != attempts):
            info = b.last_info = j.skip_info(category, reason, attempts, dead_letter)
        if state is not None:
            j.records.pop(key)
        j.ids.replace(key, info)          # tolerance.admit added the key
        amounts[_SKIPPED] += 1
        if not dead_letter:
            amounts[_DROPPED] += 1
        return self._error(j, amounts, Verdict(rid, Action.SKIP, category, reason,
                                               attempts), cls, dead_letter=dead_letter)

    def _error(self, j: _Job, amounts: list[int], v: Verdict, cls: Classification, *,
               dead_letter: bool = False) -> _Outcome:
        """Count one KIP-298 error (and its log / DLQ hand-off)."""
        amounts[_ERRORS] += 1
        logged = j.settings.log_enable
        if logged or dead_letter:
            amounts[_LOGGED] += 1
        return (Decision(v, dead_letter), logged, cls.rule)

    @staticmethod
    def _fail_job(j: _Job, reason: str) -> str:
        if not j.failure_reason:
            j.failure_reason = reason
        return j.failure_reason

    # --- progress, recoveries, DLQ acks -----------------------------------------------------

    def record_recovered(self, job: str, task: TaskIdentity, record_ids: Sequence[str]) -> None:
        j = self._job(job)
        now = self._clock.monotonic() * 1000.0
        with j.lock:
            for rid in record_ids:
                st = j.records.pop(hash(rid) & KEY_MASK)
                if st is None:
                    continue
                j.recovered += 1
                cb = j.breakers.find(st.last_class) if st.last_class else None
                if cb is not None:
                    cb.on_success(now)

    def record_progress(self, job: str, task: TaskIdentity,
                        processed: Mapping[StageRef, int]) -> None:
        j = self._job(job)
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
                    self._fail_job(j, result.reason)

    def note_refused(self, job: str, n: int) -> None:
        """``n`` records of a report refused for backpressure: counted, nothing decided."""
        with self._lock:
            j = self._jobs.get(job)
        if j is not None:
            with j.lock:
                j.refused += int(n)

    def undo_dead_letters(self, job: str, record_ids: Sequence[str]) -> int:
        """The DLQ records of these skipped ids were not spooled after all (the spool refused
        the report): a re-report of them is dead-lettered again. Returns how many were marked."""
        j = self._job(job)
        undone = 0
        with j.lock:
            ids = j.ids
            for rid in record_ids:
                key = hash(rid) & KEY_MASK
                # an id names every record reported under it: all of them are undone (one
                # that was spooled after all is then dead-lettered again if re-reported: a
                # duplicate, never a loss)
                for k in (key, *j.other_keys.get(key, ())):
                    info = ids.get(k)
                    if info is not None and info[3]:
                        ids.replace(k, j.skip_info(info[0], info[1], info[2], False))
                        undone += 1
        return undone

    def note_dead_letter_acked(self, job: str, n: int) -> None:
        with self._lock:
            j = self._jobs.get(job)
        if j is None:  # the run ended (or the sidecar restarted) while its records drained
            return
        with j.lock:
            j.dlq_acked += int(n)

    # --- reporting --------------------------------------------------------------------------

    def summary(self, job: str) -> JobSummary:
        j = self._job(job)
        with j.lock:
            return self._summary(j)

    @staticmethod
    def _summary(j: _Job) -> JobSummary:
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

    def stage_counts(self, job: str, stage: str) -> Counts:
        """KIP-298 counts of one stage of a job (zeros if it never failed)."""
        j = self._job(job)
        with j.lock:
            c = j.counts.stages.get(stage)
            return copy_counts(c) if c is not None else Counts()

    def task_counts(self, job: str, task_id: str) -> Counts:
        """KIP-298 counts of one Spark task (``stage.partition``) of a job."""
        j = self._job(job)
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
