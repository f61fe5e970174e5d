"""One run's state in the policy engine (`JobState`): its settings and handler, its tables
(retry schedules and remembered record ids, by digest, with their payload digests), counters and
breakdowns, and record identity (`JobState.identity`). Pure: imports nothing but the core.

Memory is bounded: per job at most ``MAX_TRACKED_RECORDS`` schedules (least recently reported
evicted; recovered and skipped records leave at once) and ``tolerance.MAX_COUNTED_IDS`` counted
error ids, which also hold the skipped records' answers (one table: a skipped record is a
counted one). Both tables are keyed by a 60-bit digest of the record id (`tolerance.record_key`),
not the id string, in flat arrays (`idtable.IdTable`: no Python object per id), each entry with
a 64-bit digest of its record's payload (`tolerance.payload_tag`); a skipped record's answer is
a (category, reason, attempts, dead-lettered) tuple shared by every record skipped the same way
(`JobState.skip_info`).

Record identity: a record is its id *and* its payload. The same id with another payload is
another record (positions reused, ids that are not unique): it gets a key of its own and is
decided on its own, and counted and logged as a collision (docs/POLICY.md, Record identity).
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from .backoff import schedule_from_settings
from .breaker import Breakers
from .budget import RetryBudget
from .classify import Classifier
from .counters import EVICTED_TASK, ScopedCounts, copy_counts
from .handlers import LoadedHandler
from .model import Category, FailedRecord
from .settings import JobSettings
from .slices import SliceBook, sliceable
from .tolerance import (
    KEY_MASK,
    IdTable,
    ToleranceTracker,
    payload_tagger,
    payload_tags,
    record_key,
)

log = logging.getLogger("spillway.sidecar.policy")

MAX_TRACKED_RECORDS = 100_000
MAX_SKIP_INFOS = 4_096    # distinct skip answers shared per job (cleared when full)
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
class RecordState:
    first_ms: float
    attempts: int = 0          # failed attempts reported (Verdict.attempt)
    retries: int = 0           # retries charged to the record's schedule
    holds: int = 0             # free waits imposed by an open circuit
    last_delay_ms: float = 0.0
    last_class: str = ""


# A skipped record's answer, (category, reason, attempts, dead-lettered): immutable and shared by
# every record skipped the same way (`JobState.skip_info`), so remembering a skipped id costs no
# object of its own. dead-lettered: a DLQ record was handed to a spool for it (so a re-report
# is not written again), until `undo_dead_letters` says that spool refused it.
# (category, reason, attempt, dead-lettered, claim): claim is the provisional claim the record
# was first skipped under (0: none; states written before claims hold 4-tuples)
SkipInfo = tuple


class JobState:
    """One run: its policy, tables and counts. Guarded by its own ``lock`` (the engine holds it
    while the run's records are decided)."""

    def __init__(self, settings: JobSettings, handler: LoadedHandler, run_id: str = "",
                 tag_secret: bytes = b"") -> None:
        self.settings = settings
        self.tag_secret = tag_secret   # the key of its payload digests (`tolerance.run_secret`)
        self._payload_tag = payload_tagger(tag_secret)
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
        self.records: IdTable[RecordState] = IdTable(MAX_TRACKED_RECORDS)  # by record_key
        self.ids = self.tolerance.ids   # record_key -> SkipInfo (None: counted, not skipped)
        self.skip_infos: dict[SkipInfo, SkipInfo] = {}
        self.counts = ScopedCounts()
        self.by_stage: dict[str, int] = {}
        self.by_category: dict[str, int] = {}
        self.by_class: dict[str, int] = {}
        self.failure_reason = ""
        self.dlq_acked = 0
        self.ended = False      # its final summary was taken (`PolicyEngine.end_job`)
        self.refused = 0        # records of reports refused for backpressure (never decided)
        self.recovered = 0
        self.handler_failures = 0
        self.log_failures = 0
        self.collisions = 0     # distinct records reported under an id known with another payload
        self.other_keys: dict[int, list[int]] = {}   # id key -> its other records' keys
        # the error budget's slices granted to nodes (`slices.py`), when the limit allows them
        self.slices = (SliceBook(settings.tolerance.max_errors)
                       if sliceable(settings, handler) else None)
        # durable state (`enable_journal`): what changed the run's job-wide state, in order
        self.journal: list | None = None
        self.generation = 0     # journal slices taken (`take_journal`)

    # --- durable state ---------------------------------------------------------------------
    # What a restart must not lose (docs/POLICY.md, "Across a restart"): counted ids with their
    # skip answers (one dead letter per record), counted errors and processed records (the
    # tolerance limits), the failure, and the summary's counts. Every change to those is
    # journaled; the sidecar writes each slice beside the spool (`runstate`) and a restarted
    # sidecar replays them. Retry schedules, the retry budget and circuit breakers are not kept.

    _SUMMARY = ("by_stage", "by_category", "by_class", "recovered", "collisions", "refused",
                "handler_failures", "log_failures")

    def _summary_state(self) -> dict:
        """The summary's counts: job-wide and per stage only. The per-task scopes (up to
        10,000) are metric labels a restart starts afresh, not worth pickling every report."""
        state = {n: getattr(self, n) for n in self._SUMMARY}
        state["counts.job"], state["counts.stages"] = self.counts.job, self.counts.stages
        return state

    def _restore_summary(self, state: dict) -> None:
        c = self.counts
        for name, value in state.items():
            if name == "counts.job":
                c.job = value
            elif name == "counts.stages":
                c.stages = value
                # the stages' earlier tasks, folded as eviction folds them: sums over the
                # (stage, task) labels stay equal to the stages' counts
                c.pairs.clear()
                c.pairs.update(((st, EVICTED_TASK), copy_counts(v)) for st, v in value.items())
            else:
                setattr(self, name, value)

    def enable_journal(self) -> None:
        self.journal = []
        self.tolerance.journal = self.ids.journal = self.journal
        if self.slices is not None:
            self.slices.journal = self.journal

    def take_journal(self, counted: bool = False) -> tuple[int, list]:
        """The changes since the last call, numbered (replayed in that order), with the
        summary's counts as they are now; (gen, []) when nothing changed (``counted``: the
        counts did, whether or not anything else was journaled)."""
        if not self.journal and not counted:
            return self.generation, []
        entries = self.journal[:]
        self.journal.clear()  # the list the tracker and the id table append to
        entries.append(("s", self._summary_state()))
        self.generation += 1
        return self.generation, entries

    def replay(self, entries: Sequence) -> None:
        """Redo journaled changes (from `take_journal` or `snapshot`), in order."""
        journal = self.journal
        self.tolerance.journal = self.ids.journal = None
        book = self.slices
        if book is not None:
            book.journal = None
        try:
            ids, tol = self.ids, self.tolerance
            for e in entries:
                kind = e[0]
                if kind == "i":
                    ids.add(e[1], e[2], e[3])
                elif kind == "I":   # a snapshot's whole id table (`IdTable.export`)
                    ids.load(e[1], e[2], e[3])
                elif kind == "n":   # a stretch of new ids with one value (`IdTable.add_new`)
                    ids.load(e[1], e[2], [e[3]] * (len(e[1]) // 8))
                elif kind == "r":
                    ids.replace(e[1], e[2])
                elif kind == "e":
                    tol.count_errors(e[1], tuple(e[2]), e[4], e[3])
                elif kind == "g":
                    tol.record_progress(tuple(e[1]), e[2], e[3])
                elif kind == "f":
                    self.failure_reason = self.failure_reason or e[1]
                elif kind == "s":
                    self._restore_summary(e[1])
                elif kind == "T":
                    tol.set_state(e[1])
                elif kind == "b" and book is not None:
                    book.redo(e[1], e[2], e[3])
                elif kind == "B" and book is not None:
                    book.set_state(e[1])
        finally:
            self.tolerance.journal = self.ids.journal = journal
            if book is not None:
                book.journal = journal

    def snapshot(self) -> tuple[int, list]:
        """The whole durable state as entries (a compaction of the journal so far): the
        tolerance counters, every counted id least recently used first, the failure and the
        summary's counts. Numbered like `take_journal`; the journal is left empty."""
        gen, pending = self.take_journal()
        out: list = [("T", self.tolerance.state()), ("I", *self.ids.export())]
        if self.failure_reason:
            out.append(("f", self.failure_reason))
        if self.slices is not None and self.slices.slices:
            out.append(("B", self.slices.state()))
        out.append(("s", self._summary_state()))
        if not pending:
            self.generation += 1
            gen = self.generation
        return gen, out

    @property
    def records_evicted(self) -> int:
        return self.records.evicted

    def skip_info(self, category: Category, reason: str, attempts: int,
                  dead_lettered: bool, claim: int = 0) -> SkipInfo:
        """The shared answer for records skipped this way (reasons are per report and per
        exception message: equal ones across reports are merged here). ``claim``: the
        provisional claim of the report that skipped them first (docs/POLICY.md, "Provisional
        verdicts"); 0 for none, kept out of the tuple so that unclaimed answers stay shared
        with states written before claims."""
        info = (category, reason, attempts, dead_lettered, claim) if claim else (
            category, reason, attempts, dead_lettered)
        shared = self.skip_infos.get(info)
        if shared is None:
            if len(self.skip_infos) >= MAX_SKIP_INFOS:
                self.skip_infos.clear()   # entries keep theirs; only sharing starts afresh
            shared = self.skip_infos[info] = info
        return shared

    def new_state(self, key: int, tag: int, now_ms: float,
                  record: FailedRecord) -> RecordState:
        """The schedule of a data error first seen now (attempt 1), made when it is kept."""
        st = RecordState(first_ms=now_ms, attempts=1, last_class=record.exception.class_name)
        self.records.add(key, st, tag)
        return st

    def fail(self, reason: str) -> str:
        """The run fails with ``reason`` unless it already failed; returns the reason it has."""
        if not self.failure_reason:
            self.failure_reason = reason
            if self.journal is not None:
                self.journal.append(("f", reason))
        return self.failure_reason

    def tag_of(self, record: FailedRecord) -> int:
        """The record's payload digest: given (a tally's record has no payload) or computed."""
        tag = record.tag
        return tag if tag >= 0 else self._payload_tag(record.key, record.value)

    def tags_of(self, records: Sequence[FailedRecord]) -> array:
        """`tag_of` of each record, as an array('Q') (`tolerance.payload_tags`: one C call)."""
        return payload_tags(self.tag_secret, records, self._payload_tag)

    def identity(self, record: FailedRecord,
                 collisions: list[FailedRecord]) -> tuple[int, int]:
        """The key under which this record is remembered, and its payload tag.

        A record is its id *and* its payload: the key is the id's digest, unless the id is
        remembered (skipped, counted or retrying) with another payload. Then this is another
        record that happens to share the id (positions reused, a record_id function that is
        not unique, ...): it gets a key of its own, from id and payload, and is decided,
        counted and dead-lettered on its own; the first such report is counted as a collision
        and added to ``collisions`` (logged by the caller once the lock is released). The same
        id with the same payload is the same record (a re-report)."""
        rid = record.record_id
        key = record_key(rid)
        tag = self.tag_of(record)
        known = self.ids.tag(key)
        if known < 0:
            known = self.records.tag(key)
        if known < 0 or known == tag:
            return key, tag
        other = hash((rid, tag)) & KEY_MASK     # this record's own key
        if self.ids.tag(other) == tag or self.records.tag(other) == tag:
            return other, tag                # a re-report of that other record
        self.collisions += 1
        collisions.append(record)
        keys = self.other_keys.get(key)
        if keys is None:
            if len(self.other_keys) >= MAX_COLLIDED_IDS:
                del self.other_keys[next(iter(self.other_keys))]
            keys = self.other_keys[key] = []
        if len(keys) < MAX_KEYS_PER_ID:
            keys.append(other)
        return other, tag


def claim_of(info: SkipInfo) -> int:
    """The provisional claim a skipped record's answer was made under (0: none)."""
    return info[4] if len(info) > 4 else 0


def describe(record: FailedRecord) -> str:
    exc = record.exception
    msg = exc.message if len(exc.message) <= MAX_MESSAGE_CHARS else (
        exc.message[:MAX_MESSAGE_CHARS] + "…")
    return f"{exc.class_name or '<unknown exception>'}: {msg}" if msg else (
        exc.class_name or "<unknown exception>")


def warn_collisions(j: JobState, records: Sequence[FailedRecord]) -> None:
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

