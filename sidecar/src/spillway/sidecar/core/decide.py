"""The decision algorithm: the sidecar's answer for every failed record of a report
(`Decider`), over a run's state (`jobstate.JobState`) and the report's bookkeeping
(`batch.Batch`). Pure: randomness is injected; nothing here imports grpc, confluent_kafka or
pyspark. `policy.PolicyEngine` is the facade that takes the run's lock and calls it.

For each reported record, in order (docs/POLICY.md has the user-facing version):

1. The job has failed → FAIL (job_failed) with the job's failure reason.
2. The record was already skipped by an earlier report (a task retry, a speculative attempt, a
   re-run action, from any node) → SKIP again, counted once, and NOT dead-lettered again: the
   verdict says it is already in the DLQ (`dead_lettered`). Only if the earlier DLQ write was
   undone (`undo_dead_letters`: its spool refused it) is it dead-lettered now. "The record" is
   its id and its payload (`JobState.identity`).
3. Classify (`classify.py`, KIP-1050) and act on the category:
   - invalid-configuration → the job fails at once;
   - abortable → FAIL this task attempt only; Spark re-runs the task;
   - application-recoverable → FAIL this task attempt only: Spark restarts the task with fresh
     clients and state, which is the recovery KIP-1050 asks the application for;
   - retriable / refresh-retriable → RETRY while the schedule allows (`backoff.py`), deferred
     if need be by the job's retry budget (`budget.py`, a bound on the retry rate) and, if its
     circuit is open, with the circuit's shared wait (`breaker.py`); otherwise the record's
     retries are exhausted;
   - data → never retried;
   - crash / timeout (the record killed its Python worker, or outlasted
     ``errors.record.timeout.ms``) → never retried, as data.
4. An exhausted or data record goes to the KIP-1033 handler (`handlers.py`): FAIL fails the
   job; CONTINUE is subject to the tolerance limits (`tolerance.py`): within them → SKIP
   (dead-lettered when the job has a DLQ topic), past them → the job fails.

The sidecar owns each record's schedule, keyed by (job, record), so a re-attempted Spark task
(new attempt number, same record ids) continues the record's retry count, retry clock and
budget instead of restarting them.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import HandlerError
from .backoff import RetryState
from .batch import DROPPED, ERRORS, FAILURES, LOGGED, RETRIES, SKIPPED, Batch
from .classify import Classification
from .handlers import ErrorHandlerContext, HandlerResponse, invoke
from .idtable import digests
from .jobstate import JobState, RecordState, claim_of, describe
from .model import Action, Category, Decision, ExceptionInfo, FailedRecord, Verdict
from .ports import RandomSource
from .tolerance import WITHIN, record_key


class BudgetRefusal(str):
    """Why a record's retries ended: the retry budget had no slot before its deadline."""

    __slots__ = ()


# One record's answer, plus what to log after the lock is released: (decision, log, rule).
Outcome = tuple[Decision, bool, str]
# answers in order: an answer and how many consecutive records it is for. More than one is a
# streak (consecutive records decided alike): its verdict has no record id, its records' ids
# are their own (`per_record` gives each its verdict)
Streak = tuple[Outcome, int]

_RETRIABLE = frozenset(c for c in Category if c.retriable)
_DATA = Category.DATA
DATA_WHY = "data error: never retried"   # why a data error is not retried (its reason's end)
# why the other categories that are never retried are not: the rest are data errors here
_NOT_RETRIED = {Category.CRASH: "the worker died on this record: never retried",
                Category.TIMEOUT: "past errors.record.timeout.ms: never retried"}
_CONTINUE = HandlerResponse.CONTINUE


class Decider:
    """The decision algorithm over one run's state (`JobState`) and one report's bookkeeping
    (`Batch`), called with the run's lock held. Its only state is the injected randomness."""

    def __init__(self, rng: RandomSource) -> None:
        self._rng = rng

    def decide(self, j: JobState, b: Batch, records: Sequence[FailedRecord]) -> list[Streak]:
        """The answers for `records` in order: `decide_one` for each record, except along a
        streak of records failing the same way for the first time: once a record (first seen,
        a data error, the built-in CONTINUE handler, tolerance without limits) was skipped,
        the records after it with the same exception value and stage get the same answer, so
        they take a short path (their id remembered) and are answered and counted together as
        one `Streak` when it ends: no Decision or Verdict per record (a streak's verdict has no
        record id). Answers and counts are exactly `decide_one`'s (`per_record`); any other
        record ends the streak."""
        out: list[Streak] = []
        append = out.append
        b.unchecked = j.tolerance.room_for(len(records))
        if not streaks_allowed(j, b):
            for r in records:
                append((self.decide_one(j, b, r), 1))
            return out
        ids, tracked, tag_of, tags_of = j.ids, j.records, j.tag_of, j.tags_of
        logged = j.settings.log_enable
        dead_letter = j.settings.dlq.enabled
        streak_exc = streak_ref = info = streak = None
        pending = 0
        n = len(records)
        i = 0
        while i < n:
            r = records[i]
            if r.exception is streak_exc and r.stage is streak_ref:
                if not len(tracked):
                    # nothing retrying: the streak's records failing this way go into the id
                    # table at once, up to the first id it already holds
                    end = i + 1
                    while end < n and records[end].exception is streak_exc \
                            and records[end].stage is streak_ref:
                        end += 1
                    alike = records[i:end]
                    added = ids.add_new(digests([x.record_id for x in alike]),
                                        tags_of(alike), info, 0, end - i)
                    pending += added
                    i += added
                    if i == end:
                        continue
                    r = records[i]
                else:
                    key = record_key(r.record_id)
                    if key not in ids and tracked.get(key) is None:
                        ids.add(key, info, tag_of(r))
                        pending += 1
                        i += 1
                        continue
            i += 1
            if pending:
                count_streak(b, streak_exc, pending, dead_letter, logged)
                append((streak, pending))
                pending = 0
            o = self.decide_one(j, b, r)
            append((o, 1))
            streak_exc = None
            start = streak_start(j, b, o)
            if start is not None:
                reason, info, rule = start
                streak_exc, streak_ref = r.exception, r.stage
                streak = (Decision(Verdict("", Action.SKIP, _DATA, reason, 1), dead_letter),
                          logged, rule)
        if pending:
            count_streak(b, streak_exc, pending, dead_letter, logged)
            append((streak, pending))
        return out

    def decide_one(self, j: JobState, b: Batch, record: FailedRecord) -> Outcome:
        s = j.settings
        rid, exc, ref = record.record_id, record.exception, record.stage
        if ref is b.last_ref:
            stage = b.last_stage        # StageRef.name, once per batch (refs are shared)
        else:
            stage = ref.name
            b.last_ref = ref
        amounts = b.stage_amounts(stage)
        amounts[FAILURES] += 1           # and the batch's wall time as the last error's
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
        ident = j.identity(record, b.collisions)
        key, tag = ident
        skipped = j.ids.get(key)
        if skipped is not None and not j.failure_reason:
            if b.claim and claim_of(skipped) == b.claim:
                # the claimant asking again (a node restarted before it released its held
                # copy): the first answer again, so that the only copy is written, not dropped
                j.ids.touch(key)
                return (Decision(Verdict(rid, Action.SKIP, skipped[0], skipped[1], skipped[2]),
                                 s.dlq.enabled), s.log_enable, "")
            # a re-attempted task met a record an earlier report already skipped: same answer,
            # counted once; its DLQ record was written then, so not again (one per record id)
            again = skipped[3]
            skipped = j.skip_info(skipped[0], skipped[1], skipped[2] + 1, s.dlq.enabled,
                                  claim_of(skipped))
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
            # (`handle` makes one only if the record is not skipped, as it would be kept)
            if exc is b.last_exc and cls is b.last_cls:
                what = b.last_what
            else:
                what = f"{describe(record)} [{cls.describe()}]"
                b.last_exc, b.last_cls, b.last_what = exc, cls, what
            return self.handle(j, b, record, ident, None, DATA_WHY)
        if state is None:
            state = RecordState(first_ms=b.now)
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
            what = f"{describe(record)} [{cls.describe()}]"
            b.last_exc, b.last_cls, b.last_what = exc, cls, what
        if category is Category.INVALID_CONFIGURATION:
            reason = j.fail((
                f"job {s.job!r} failed on an invalid-configuration error in stage {stage} "
                f"(record {rid!r}): {what}; fix the configuration and re-run"))
            return error(j, amounts, Verdict(rid, Action.FAIL, category, reason,
                                             state.attempts, job_failed=True), cls)
        if category is Category.ABORTABLE:
            return error(j, amounts, Verdict(rid, Action.FAIL, category, (
                f"abortable error in stage {stage}: {what}; failing this task attempt only, "
                f"Spark will re-run the task"), state.attempts), cls)
        if category is Category.APPLICATION_RECOVERABLE:
            return error(j, amounts, Verdict(rid, Action.FAIL, category, (
                f"application-recoverable error in stage {stage}: {what}; failing this task "
                f"attempt only, Spark will restart the task with fresh clients and state"),
                state.attempts), cls)

        if category in _RETRIABLE:
            b.charge_reports(j, b.now)
            retry = self.try_retry(j, b, record, state, cls)
            if isinstance(retry, Verdict):
                amounts[RETRIES] += 1
                return (Decision(retry), False, "")
            if isinstance(retry, BudgetRefusal):
                # the budget had no slot before the record's deadline: handled as exhausted,
                # and the final verdict says the budget was why
                out = self.handle(j, b, record, ident, state, f"retries exhausted: {retry}")
                out[0].verdict.retry_budget_exhausted = True
                return out
            why = f"retries exhausted: {retry}"
        else:
            why = _NOT_RETRIED.get(category, DATA_WHY)
        return self.handle(j, b, record, ident, state, why)

    def try_retry(self, j: JobState, b: Batch, record: FailedRecord, state: RecordState,
                  cls: Classification) -> Verdict | str:
        """A RETRY verdict (possibly deferred by the retry budget), or the reason the record's
        retries are exhausted (a `BudgetRefusal` when the budget had no slot before the
        record's deadline)."""
        s, task, now = j.settings, b.task, b.now
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
                return BudgetRefusal(grant.reason)
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
        what = f"{cls.category.value} {describe(record)} [{cls.rule}]"
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

    def handle(self, j: JobState, b: Batch, record: FailedRecord, ident: tuple[int, int],
               state: RecordState | None, why: str) -> Outcome:
        """KIP-1033 handler, then tolerance, for a record that will not be retried. `state`
        None: a data error seen for the first time (attempt 1), whose schedule is made only if
        the record is not skipped (a skipped record's schedule is dropped at once). `ident`:
        the record's (key, payload tag), `JobState.identity`'s. The record's stage and its
        counts, its classification and its description are the batch's last
        (`Batch.stage_amounts`, `last_cls`, `last_what`: `decide_one` set them for it)."""
        s, task, now, wall = j.settings, b.task, b.now, b.wall
        stage, amounts = b.last_stage, b.last_amounts
        cls, what = b.last_cls, b.last_what
        key, tag = ident
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
                headers=record.headers, processor_node_id=record.function_name, task_id=b.tid,
                timestamp=record.timestamp_ms if record.timestamp_ms is not None else wall,
                stage=stage, exception=record.exception, category=category,
                attempt=attempts, reason=why, record=record)
            try:
                response = invoke(j.handler, context)
            except HandlerError as exc:
                j.handler_failures += 1
                reason = j.fail(f"job {s.job!r} failed: {exc} (stage {stage})")
                return error(j, amounts, Verdict(rid, Action.FAIL, category, reason,
                                                 attempts, job_failed=True), cls)

        if response is HandlerResponse.FAIL:
            if j.handler.derived:
                reason = (f"job {s.job!r} failed on its first error: errors.tolerance=none "
                          f"(stage {stage}, record {rid!r}): {what}; {why}")
            else:
                reason = (f"job {s.job!r} failed: errors.handler.class={j.handler.name} returned "
                          f"FAIL for record {rid!r} (stage {stage}): {what}; {why}")
            return error(j, amounts, Verdict(rid, Action.FAIL, category, j.fail(reason),
                                             attempts, job_failed=True), cls)

        tolerance = j.tolerance
        if b.unchecked or tolerance.unlimited:   # no limit to cross: counted at the end
            ids = j.ids
            if key in ids:
                ids.touch(key)            # already counted by an earlier attempt
            else:
                ids.add(key, None, tag)
                new = b.new_errors
                new[stage] = new.get(stage, 0) + 1
            tol = WITHIN
        else:
            tol = tolerance.admit(rid, stage, now, (task.stage_id, task.partition_id), key,
                                  tag)
        if tol.exceeded:
            if state is None:
                state = j.new_state(key, tag, now, record)
            reason = j.fail(f"{tol.reason}; last error: {what} (record {rid!r})")
            return error(j, amounts, Verdict(rid, Action.FAIL, category, reason,
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
            info = b.last_info = j.skip_info(category, reason, attempts, dead_letter,
                                             b.claim)
        if state is not None:
            j.records.pop(key)
        j.ids.replace(key, info)          # tolerance.admit added the key
        amounts[SKIPPED] += 1
        if not dead_letter:
            amounts[DROPPED] += 1
        return error(j, amounts, Verdict(rid, Action.SKIP, category, reason,
                                         attempts), cls, dead_letter=dead_letter)


def per_record(streaks: Sequence[Streak], records: Sequence[FailedRecord]) -> list[Outcome]:
    """`streaks` of `records` (in order) as one outcome per record: a streak's records (its
    verdict has no record id; a record's always has one, ids are required) each get a
    verdict of their own, with their id, as `decide_one` would have made it."""
    out: list[Outcome] = []
    i = 0
    for o, n in streaks:
        v = o[0].verdict
        if v.record_id:
            out.append(o)
        else:
            d, logged, rule = o
            dl, action, category, reason, attempt = (d.dead_letter, v.action, v.category,
                                                     v.reason, v.attempt)
            out.extend((Decision(Verdict(r.record_id, action, category, reason, attempt), dl),
                        logged, rule) for r in records[i:i + n])
        i += n
    return out


def streaks_allowed(j: JobState, b: Batch | None = None) -> bool:
    """Whether records failing the same way can share a skipped record's answer (a streak): the
    built-in CONTINUE handler and no tolerance limit (or, for the report `b`, none it can
    cross), so nothing but the record's id decides."""
    return ((j.tolerance.unlimited or (b is not None and b.unchecked))
            and j.handler.fixed is _CONTINUE)


def streak_start(j: JobState, b: Batch, o: Outcome) -> tuple[str, object, str] | None:
    """(reason, skip info, rule) when `o`, `decide_one`'s answer, opens a streak: the record went
    `handle`'s first-seen data path (skipped at its first attempt, not already in the DLQ),
    so the records after it that fail the same way and are new get the same answer."""
    v = o[0].verdict
    if (v.action is Action.SKIP and v.category is _DATA and v.attempt == 1
            and not v.dead_lettered and not j.failure_reason):
        reason = b.reasons.get((b.last_what, DATA_WHY))
        info = b.last_info
        if (reason is not None and v.reason is reason and info is not None
                and info[0] is _DATA and info[1] == reason and info[2] == 1):
            return reason, info, o[2]
    return None


def count_streak(b: Batch, exc: ExceptionInfo, n: int, dead_letter: bool, logged: bool) -> None:
    """The counts `Decider.decide_one` would have made for ``n`` records of a streak (its stage is
    the batch's last one: no other record came between)."""
    a = b.last_amounts
    a[FAILURES] += n
    a[ERRORS] += n
    a[SKIPPED] += n
    if not dead_letter:
        a[DROPPED] += n
    if logged or dead_letter:
        a[LOGGED] += n
    stage = b.last_stage
    b.by_stage[stage] += n
    cls_key = exc.class_name or "<unknown>"
    b.by_class[cls_key] += n
    b.by_category[_DATA] += n
    b.reports += n
    b.new_errors[stage] = b.new_errors.get(stage, 0) + n


def error(j: JobState, amounts: list[int], v: Verdict, cls: Classification, *,
          dead_letter: bool = False) -> Outcome:
    """Count one KIP-298 error (and its log / DLQ hand-off)."""
    amounts[ERRORS] += 1
    logged = j.settings.log_enable
    if logged or dead_letter:
        amounts[LOGGED] += 1
    return (Decision(v, dead_letter), logged, cls.rule)
