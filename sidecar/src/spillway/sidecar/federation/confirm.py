"""Provisional verdicts on a node (docs/POLICY.md, "Provisional verdicts"): a report of a run
homed at another sidecar, whose verdicts nothing but the records' identity decides, is answered
at once; its DLQ records are held in the spool (`dlq/held.py`) and confirmed with the home in
the background, many reports a call.

- `Confirmations.answer` (the report's path): the verdicts the home gives records it meets
  first (`core/provisional.py`), or None when the report needs the home's answer now; the held
  row carries the report's tally (ids, payload digests, groups) and a random 64-bit *claim*.
- The confirmer sends each run's held reports to its home (TallyFailures, the claim in each
  report; a call lingers for others, one in flight per run, a few runs at once) and applies
  the answers: records the home calls new are released to Kafka
  (`DlqPipeline.submit(..., release=)`, one transaction with the held row's delete), the rest
  dropped; the error log lines are written then. Asked again with the same claim (a node
  killed between the home's answer and the release), the home answers as the first time, so the
  only copy is never dropped.
- The flush barrier (`wait_task`) waits for a task's held reports to be confirmed, and fails
  the task when the home answered one of its records otherwise than SKIP (the run failed
  meanwhile): the task learns it at its flush instead of at its report.
- `Confirmations.guard` (a report that waits for its home): copies of its data errors' DLQ
  records held under the claim sent with it, released with the answer's records, so that a node
  killed between the home's answer and its spool does not lose them.
- A run with an error limit is answered so only under a slice of its error budget that its
  home granted this node (`node_slices.py`, docs/POLICY.md "Budget slices").
- After a restart, a run's held rows are confirmed again once the run registers here again
  (`adopt`, with its token: tokens are never on disk). Rows of runs that do not come back
  within ``job.idle.timeout.ms`` are released as they are: a possible duplicate, never a loss.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import TYPE_CHECKING

import grpc
from spillway.sidecar.core.dlq_record import DlqBuilder
from spillway.sidecar.core.model import Action, TaskIdentity, Verdict, task_key
from spillway.sidecar.core.policy import PolicyEngine
from spillway.sidecar.core.ports import SystemClock
from spillway.sidecar.errors import FlushTimeoutError, JobConflictError, UnknownJobError
from spillway.sidecar.federation.node_slices import NodeSlices
from spillway.sidecar.federation.peers import HomeError
from spillway.sidecar.service.registry import Registry, Run
from spillway.sidecar.transport import convert, tally
from spillway.v1 import sidecar_pb2 as pb

if TYPE_CHECKING:
    from spillway.sidecar.dlq import DlqPipeline

log = logging.getLogger(__name__)

MAX_REPORTS = 64          # held reports per confirmation call (peers.MAX_TALLY_REPORTS)
MAX_RECORDS = 16_384      # and records (peers.MAX_TALLY_RECORDS)
# held records whose reports are kept in memory (records for the log lines, DLQ records to
# release) while their home has not answered; past it reports wait for their home as before
MAX_HELD_IN_MEMORY = 65_536
CALLERS = 4               # confirmation calls in flight at once (one per run)
MAX_TASK_FAILURES = 10_000  # task failures kept for flushes that have not come yet
_RETRY_S = (0.05, 2.0)    # backoff between failed confirmation calls, first and last


@dataclass(eq=False)
class Held:
    """One held report: its row in the spool and what confirming it takes."""

    rid: int                     # the held row
    key: str                     # its run
    tk: str                      # its task's flush key
    report: pb.TallyReport       # its tally, with its claim
    token: str | None = None
    records: Sequence | None = None   # converted records, for the log lines (None: adopted)
    dlq: list | None = None      # the held DLQ records (None: read back from the spool)
    segments: list | None = None
    at: float = field(default_factory=time.monotonic)   # when it was queued


@dataclass(eq=False)
class _RunQueue:
    job: str
    run_id: str
    queue: collections.deque = field(default_factory=collections.deque)
    error: HomeError | None = None   # the last confirmation call's failure
    retry_at: float = 0.0
    failures: int = 0
    inflight: int = 0   # reports taken for a call not yet applied
    dispatched: bool = False   # a confirmer thread has it
    records: int = 0    # records queued
    urgent: bool = False   # a flush or an end waits: send without lingering


class Confirmations:
    """A node's held reports and their confirmation (one thread for all runs): over the
    engine (provisional verdicts, payload digests, log lines), the DLQ pipeline that holds and
    releases the rows (one that holds: `DlqPipeline.holds`), the registry (a run still here when
    its answer comes) and the properties (``home.confirm.*``, read when a report comes)."""

    def __init__(self, *, engine: PolicyEngine, pipeline: DlqPipeline,
                 registry: Registry,
                 props: Mapping[str, object], sidecar_id: str) -> None:
        self._engine = engine
        self._pipeline = pipeline
        self._registry = registry
        self._props = props
        self._sidecar_id = sidecar_id
        self._cv = threading.Condition()
        self._runs: dict[str, _RunQueue] = {}
        self._tasks: dict[str, list] = {}      # flush key -> [held reports, failure reason]
        # tasks whose held reports are all answered, one of them otherwise than the node did:
        # for their flush (bounded: a task that never flushes ages out)
        self._failures: collections.OrderedDict[str, list] = collections.OrderedDict()
        self._failed: set[str] = set()         # runs a confirmation found failed: no more held
        self._in_memory = 0                    # records of queued reports held in memory
        # held rows kept from before a restart, until their run registers again (`adopt`)
        self._orphans: set[int] = set()
        if pipeline is not None and pipeline.holds:
            self._orphans = {rid for rid, _, _ in pipeline.store.held_rows()}
        self._orphans_at = time.monotonic() + registry.idle_timeout_s
        # how long a held report may wait for others to share its call (a flush does not wait)
        self._linger_s = props["home.confirm.linger.ms"] / 1000
        self._closing = False
        self.confirmed = self.released = self.dropped = self.calls = 0
        self.slices = NodeSlices()   # this node's slices of its runs' error budgets
        # one call in flight per run, a few runs at a time: a slow home holds up its own runs only
        self._pool = ThreadPoolExecutor(CALLERS, thread_name_prefix="spillway-confirm-call")
        self._thread = threading.Thread(target=self._loop, name="spillway-confirm", daemon=True)
        self._thread.start()

    # --- the report's path -------------------------------------------------------------

    def answer(self, run: Run, task: TaskIdentity, records, token: str | None,
               traceparent: str) -> list[tuple[Verdict, int]] | None:
        """Provisional verdicts for a report of `run` (homed elsewhere), its DLQ records held,
        as spans (a verdict and how many consecutive records it is for); None when the home
        must answer it now (`core.provisional`, a home that predates TallyFailures, a spool
        that cannot hold)."""
        engine = self._engine
        if not self._may_hold(run):
            return None
        key = run.key
        if self._in_memory + len(records) > MAX_HELD_IN_MEMORY:
            return None
        # a limited run: only under a slice of its error budget (`node_slices.py`)
        sliced = engine.sliceable(key)
        if sliced and not self.slices.holds(key):
            return None
        spans = engine.provisional(key, records, sliced=sliced)
        if spans is None:
            return None
        sid = self.slices.take(key, len(records)) if sliced else 0
        if sliced and not sid:
            return None
        try:
            held = self._hold(run, task, records, spans,
                              digests=engine.payload_digests(key, records), token=token,
                              traceparent=traceparent, tk=task_key(key, task), slice_id=sid)
        except BaseException:
            if sid:
                self.slices.give_back(key, sid, len(records))
            raise
        self._queue(run, held)
        for v, _ in spans:   # in the DLQ once confirmed: this copy, or the one before it
            v.dead_lettered = True
        return spans

    def _may_hold(self, run: Run) -> bool:
        pipeline = self._pipeline
        return (self._props.get("home.confirm.async", True) and pipeline is not None
                and pipeline.holds and run.home.tally_supported and run.key not in self._failed)

    def slice_ask(self, run: Run, n: int) -> tuple[int, list] | None:
        """What a report of `n` records that waits for its home says about its run's budget
        slices (`NodeSlices.ask`); None when the run has none or its reports are not held."""
        if not self._may_hold(run) or not self._engine.sliceable(run.key):
            return None
        return self.slices.ask(run.key, n)

    def guard(self, run: Run, task: TaskIdentity, records, digests: bytes,
              token: str | None, traceparent: str) -> Held | None:
        """Before a report waits for its home: copies of the DLQ records its data errors get
        if the home skips them, held under a claim sent with the report. The home keeps the
        claim with each record it skips, so a node killed after the home answered but before
        it spooled confirms the held row after its restart and writes those records (the home
        answers the claim as the first time) instead of losing them to a re-report answered
        "already in the DLQ". None when no record could be dead-lettered this way or the
        spool cannot hold."""
        pipeline = self._pipeline
        if pipeline is None or not pipeline.holds:
            return None
        key = run.key
        skips = self._engine.first_seen_skips(key, records)
        if not skips:
            return None
        idx = [i for i, v in enumerate(skips) if v is not None]
        if not idx:
            return None
        view = memoryview(digests)
        return self._hold(run, task, [records[i] for i in idx], [(skips[i], 1) for i in idx],
                          digests=b"".join(view[8 * i:8 * i + 8] for i in idx), token=token,
                          traceparent=traceparent, tk="")

    def _hold(self, run: Run, task: TaskIdentity, records, spans, *, digests: bytes,
              token: str | None, traceparent: str, tk: str, slice_id: int = 0) -> Held:
        """`records`' DLQ records, built from `spans` of verdicts (a verdict and how many
        consecutive records it is for), held in the spool as one row with their tally under a
        fresh claim (BackpressureError past the spool's bounds); `slice_id`: the budget slice
        they were answered under."""
        key = run.key
        report = tally.tally_report(convert.task_pb(task), records, digests)
        report.claim = secrets.randbits(64) or 1
        report.slice = slice_id
        build = DlqBuilder(self._engine.settings(key), task, now_ms=SystemClock().wall_ms(),
                           sidecar_id=self._sidecar_id, run=key, run_id=run.run_id).build_streak
        dlq: list = []
        streaks: list = []
        for i, (v, n) in zip(accumulate((n for _, n in spans), initial=0), spans):
            build(records, i, n, v, traceparent, dlq, streaks=streaks)
        rid, segments = self._pipeline.hold(dlq, key, report.SerializeToString(), streaks)
        return Held(rid, key, tk, report, token, records, dlq, segments)

    def confirm_later(self, run: Run, guard: Held) -> None:
        """A guarded report whose home call failed (its answer may have been committed): its
        held copies are confirmed in the background under its claim, as after a restart (read
        back from the spool then, so that a home down for long costs no memory)."""
        self._queue(run, replace(guard, records=None, dlq=None, segments=None))

    def drop(self, guard: Held) -> None:
        """Discard a guard's held copies (a failure here leaves them held: confirmed again
        after a restart, a possible duplicate, never a loss)."""
        try:
            self._pipeline.submit((), release=guard.rid)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not discard held DLQ row %d: %s", guard.rid, exc)

    def _queue(self, run: Run, item: Held) -> None:
        with self._cv:
            q = self._runs.get(item.key)
            if q is None:
                q = self._runs[item.key] = _RunQueue(run.job, run.run_id)
            q.queue.append(item)
            q.records += len(item.report.record_ids)
            if item.dlq is not None:
                self._in_memory += len(item.dlq)
            t = self._tasks.get(item.tk)
            if t is None:
                t = self._tasks[item.tk] = [0, ""]
            t[0] += 1
            self._cv.notify_all()

    # --- barriers ----------------------------------------------------------------------

    def wait_task(self, key: str, task, timeout_s: float) -> None:
        """Until the task's held reports are confirmed: FlushTimeoutError past `timeout_s`
        (the home's last error, when a call failed), JobConflictError (FAILED_PRECONDITION)
        when the home answered one of its records otherwise than the node did."""
        tk = task_key(key, task)
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                t = self._tasks.get(tk)
                if t is None:
                    failed = self._failures.pop(tk, None)
                    if failed is not None:
                        raise JobConflictError(failed[1])
                    return
                q = self._runs.get(key)
                if q is not None and not q.urgent:
                    q.urgent = True    # confirmed now, not after the linger
                    self._cv.notify_all()
                error = q.error if q is not None else None
                if error is not None and error.code is grpc.StatusCode.NOT_FOUND:
                    raise error   # the home lost the run: the caller registers it again
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise FlushTimeoutError(
                        f"{t[0]} held report(s) of task {tk} not confirmed by the run's home "
                        f"within {timeout_s:g}s; they stay held and are confirmed later"
                        + (f"; last error: {error}" if error else ""))
                self._cv.wait(min(remaining, 0.1))

    def wait_run(self, key: str, timeout_s: float) -> None:
        """Until the run's held reports are confirmed (the run is ending here); those left past
        `timeout_s` are released as they are (a possible duplicate, never a loss)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                q = self._runs.get(key)
                if q is None or not (q.queue or q.inflight) or time.monotonic() >= deadline:
                    break
                if not q.urgent:
                    q.urgent = True
                    self._cv.notify_all()
                self._cv.wait(min(max(deadline - time.monotonic(), 0.01), 0.1))
            q = self._runs.pop(key, None)
            left = list(q.queue) if q is not None else []
            self._failed.discard(key)
        self.slices.forget(key)
        if left:
            log.warning("run %s ends with %d held report(s) its home did not confirm: their "
                        "DLQ records are written as they are (possibly a second copy)", key,
                        len(left))
            for item in left:
                self._apply(item, None)

    def stats(self) -> dict[str, float]:
        """Counters for GetStatus and the metrics."""
        store = self._pipeline.store if self._pipeline is not None else None
        return {
            "held-records": float(store.held_count() if store is not None else 0),
            "held-reports-confirmed": float(self.confirmed),
            "held-records-released": float(self.released),
            "held-records-dropped": float(self.dropped),
            "home-confirm-calls": float(self.calls),
            "budget-slices-granted": float(self.slices.granted),
            "slice-records-answered": float(self.slices.answered),
        }

    # --- after a restart ---------------------------------------------------------------

    def adopt(self, run: Run, token: str | None) -> int:
        """The spool's held rows of `run` (kept from before a restart), queued to be confirmed
        again with its home (their claims make that safe); returns how many."""
        pipeline = self._pipeline
        if pipeline is None or not pipeline.holds or run.home is None or not token:
            return 0
        n = 0
        for rid, key, meta in pipeline.store.held_rows():
            with self._cv:
                if key != run.key or rid not in self._orphans:
                    continue
                self._orphans.discard(rid)
            report = pb.TallyReport.FromString(meta)
            task = convert.task_identity(report.task)
            self._queue(run, Held(rid, key, task_key(key, task), report, token))
            n += 1
        if n:
            log.info("job %r run %r: %d held report(s) kept from before a restart are "
                     "confirmed with its home again", run.job, run.run_id, n)
        return n

    # --- the confirmer -----------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                now = time.monotonic()
                ready, waits = [], [1.0]
                for k, q in self._runs.items():
                    if not q.queue or q.inflight or q.dispatched:
                        continue
                    # a call goes when it is full, a flush waits, or its first report has
                    # lingered long enough for others to share it (after a failed call: its
                    # backoff)
                    at = q.queue[0].at + self._linger_s
                    if q.records >= MAX_RECORDS or q.urgent:
                        at = now
                    at = max(at, q.retry_at)
                    if at <= now:
                        q.dispatched = True
                        ready.append((k, q))
                    else:
                        waits.append(at - now)
                if not ready and not self._closing:
                    self._cv.wait(min(waits))
                if self._closing:
                    return
            for key, q in ready:
                self._pool.submit(self._call, key, q)
            if time.monotonic() >= self._orphans_at:
                self._orphans_at = float("inf")
                self._pool.submit(self._release_orphans)

    def _call(self, key: str, q: _RunQueue) -> None:
        try:   # a confirmer never dies of one run's trouble
            self._confirm(key, q)
        except Exception:  # noqa: BLE001
            log.exception("confirming held reports of run %s failed (tried again)", key)
            with self._cv:
                q.retry_at = time.monotonic() + _RETRY_S[1]
        finally:
            with self._cv:
                q.dispatched = False
                self._cv.notify_all()

    def _confirm(self, key: str, q: _RunQueue) -> None:
        with self._cv:
            batch: list[Held] = []
            weight = 0
            while q.queue and len(batch) < MAX_REPORTS:
                n = len(q.queue[0].report.record_ids)
                if batch and weight + n > MAX_RECORDS:
                    break
                batch.append(q.queue.popleft())
                weight += n
            q.inflight += len(batch)
            q.records -= weight
            if not q.queue:
                q.urgent = False
        if not batch:
            return
        run = self._registry.get(q.job, q.run_id)
        if run is None:
            # ended or expired here while these were held (a report racing the run's end):
            # nobody can confirm them now, so they are written as they are
            with self._cv:
                q.inflight -= len(batch)
                if self._runs.get(key) is q and not q.queue and not q.inflight:
                    del self._runs[key]
                self._cv.notify_all()
            log.warning("job %r run %r ended with %d held report(s) unconfirmed: their DLQ "
                        "records are written as they are (possibly a second copy)", q.job,
                        q.run_id, len(batch))
            for item in batch:
                self._apply(item, None)
            return
        try:
            if run.home is None:
                raise HomeError(grpc.StatusCode.NOT_FOUND, f"job {q.job!r} run {q.run_id!r} "
                                "is no longer registered here")
            token = next((i.token for i in reversed(batch) if i.token), None)
            for sid, used in self.slices.closes(key):   # said with any call (lost: leased)
                batch[0].report.closed_slices.add(id=sid, used=used)
            self.calls += 1
            answers = run.home.confirm(q.job, q.run_id, [i.report for i in batch], 30.0,
                                       token=token)
        except Exception as exc:  # noqa: BLE001 - the reports stay queued: tried again
            if not isinstance(exc, HomeError):
                exc = HomeError(grpc.StatusCode.INTERNAL, f"confirming with the home: {exc!r}")
            if exc.code is grpc.StatusCode.UNIMPLEMENTED:   # a home older than TallyFailures
                log.warning("job %r run %r: its home cannot confirm held reports (an older "
                            "version): %d are written as they are (possibly a second copy); "
                            "later reports wait for the home", q.job, q.run_id, len(batch))
                with self._cv:
                    q.inflight -= len(batch)
                    self._cv.notify_all()
                for item in batch:
                    self._apply(item, None)
                return
            with self._cv:
                q.inflight -= len(batch)
                ended = self._runs.get(key) is not q   # the run ended here meanwhile
                if not ended:
                    q.queue.extendleft(reversed(batch))
                    q.records += sum(len(i.report.record_ids) for i in batch)
                    q.error = exc
                    q.failures += 1
                    q.retry_at = time.monotonic() + min(_RETRY_S[0] * 2 ** q.failures,
                                                        _RETRY_S[1])
                self._cv.notify_all()
            if ended:   # written as they are, as `wait_run` does with what is left
                for item in batch:
                    self._apply(item, None)
                return
            log.warning("job %r run %r: could not confirm %d held report(s) with its home "
                        "(tried again): %s", q.job, q.run_id, len(batch), exc)
            return
        with self._cv:
            q.error, q.failures, q.retry_at = None, 0, 0.0
        try:
            for item, outcomes in zip(batch, answers, strict=True):
                self._apply(item, outcomes)
        finally:
            with self._cv:
                q.inflight -= len(batch)
                self._cv.notify_all()

    def _apply(self, item: Held, outcomes: list | None) -> None:
        """Release the records the home called new (None: all of them) and drop the rest; log;
        settle the task's count (and its failure, if the home answered otherwise)."""
        pipeline = self._pipeline
        failure = ""
        try:
            dlq = item.dlq if item.dlq is not None else pipeline.store.held_records(item.rid)
            if outcomes is None:
                keep = dlq
            elif type(outcomes) is tally.AlikeOutcomes:   # the usual answer: read once
                if len(outcomes) != len(dlq):
                    raise ValueError(f"{len(outcomes)} answers for {len(dlq)} held records")
                keep = dlq if outcomes.dead_letter else []
                if outcomes.action is not Action.SKIP and dlq:
                    failure = self._otherwise(item, outcomes[0][0].verdict)
            else:
                keep = [r for r, o in zip(dlq, outcomes, strict=True) if o[0].dead_letter]
                bad = next((o[0].verdict for o in outcomes
                            if o[0].verdict.action is not Action.SKIP), None)
                if bad is not None:
                    failure = self._otherwise(item, bad)
            segments = item.segments if len(keep) == len(dlq) else None
            pipeline.submit(keep, release=item.rid, segments=segments)
            self.confirmed += 1
            self.released += len(keep)
            self.dropped += len(dlq) - len(keep)
        except Exception as exc:  # noqa: BLE001 - the row stays held: confirmed again later
            log.error("could not settle held DLQ row %d of run %s (it stays held and is "
                      "confirmed again after a restart): %s", item.rid, item.key, exc)
            failure = failure or f"its held DLQ records could not be released: {exc}"
            outcomes = None
        if (outcomes is not None and item.records is not None
                and (type(outcomes) is not tally.AlikeOutcomes or outcomes.logged)):
            try:   # the error log lines, with the records' whole context, once released
                self._engine.write_logs(item.key, convert.task_identity(item.report.task),
                                    item.records, outcomes)
            except UnknownJobError:
                pass   # the run ended here meanwhile
        with self._cv:
            if item.dlq is not None:
                self._in_memory -= len(item.dlq)
            t = self._tasks.get(item.tk)
            if t is not None:
                t[0] -= 1
                if failure and not t[1]:
                    t[1] = failure
                if t[0] <= 0:
                    if t[1]:   # kept for the task's flush; a task that never flushes ages out
                        self._failures[item.tk] = self._tasks.pop(item.tk)
                        while len(self._failures) > MAX_TASK_FAILURES:
                            self._failures.popitem(last=False)
                    else:
                        del self._tasks[item.tk]
            self._cv.notify_all()

    def _otherwise(self, item: Held, bad: Verdict) -> str:
        """The task's failure when its home answered a record otherwise than SKIP."""
        if bad.job_failed:
            self._failed.add(item.key)   # its next reports wait for the home
        return (f"the run's home answered record {bad.record_id!r} {bad.action.value} after "
                f"this sidecar answered SKIP: {bad.reason}")

    def _release_orphans(self) -> None:
        """Held rows of runs that did not register again within job.idle.timeout.ms of the
        start: released as they are."""
        pipeline = self._pipeline
        if pipeline is None or not pipeline.holds or not self._orphans:
            return
        try:
            rows = pipeline.store.held_rows()
        except Exception:  # noqa: BLE001 - tried again at the next restart
            log.exception("could not read the held rows kept from before the restart")
            return
        for rid, key, meta in rows:
            with self._cv:
                if rid not in self._orphans:
                    continue
                self._orphans.discard(rid)
            report = pb.TallyReport.FromString(meta)
            log.warning("run %s did not register again within job.idle.timeout.ms: its %d held "
                        "DLQ record(s) are written unconfirmed (possibly a second copy)", key,
                        len(report.record_ids))
            self._apply(Held(rid, key, "", report), None)

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(5.0)
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["Confirmations"]
