"""Reports and flushes: a report's verdicts (decided here, or by the run's home), its dead
letters spooled before it is answered; a task's flush barrier.

`Reporting` is handed what it uses: the engine, the live runs, the backpressure gate, the DLQ
pipeline, the runs' durable state, telemetry, a node's confirmations and its side of the home
protocol. `Reporting.report` runs once per report on every node: nothing in it is done once
per record (a run of records decided alike stays one span).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from itertools import accumulate, islice
from operator import attrgetter
from typing import TYPE_CHECKING

from spillway.sidecar.core.dlq_record import DlqBuilder
from spillway.sidecar.core.model import Action, Verdict, task_key
from spillway.sidecar.core.policy import PolicyEngine
from spillway.sidecar.core.ports import SystemClock
from spillway.sidecar.errors import BackpressureError, JobAccessError
from spillway.sidecar.federation.confirm import Confirmations
from spillway.sidecar.federation.peers import HomeError
from spillway.sidecar.federation.tallying import NodeTally
from spillway.sidecar.observability.telemetry import Telemetry
from spillway.sidecar.service.admission import Admission
from spillway.sidecar.service.registry import Caller, Registry, Run
from spillway.sidecar.service.runstate import RunStore, keep
from spillway.sidecar.service.values import Answer, Flush, Report

if TYPE_CHECKING:
    from spillway.sidecar.dlq import DlqPipeline

log = logging.getLogger("spillway.sidecar")

_ACTION_CATEGORY = attrgetter("action", "category")
# Per-record span events cost more than the decision itself at 100% sampling: a decision span
# carries counts for the whole report, and events for at most this many records (RETRY and FAIL
# verdicts before SKIPs, since they are the ones worth reading).
MAX_VERDICT_EVENTS = 8


class Reporting:
    """ReportFailures and FlushTask."""

    def __init__(self, *, engine: PolicyEngine, registry: Registry,
                 pipeline: DlqPipeline | None,
                 admission: Admission | None, runstate: RunStore | None, telemetry: Telemetry,
                 confirmations: Confirmations | None, node_tally: NodeTally,
                 sidecar_id: str) -> None:
        self._engine = engine
        self._registry = registry
        self._pipeline = pipeline     # with bootstrap.servers
        self._admission = admission   # with a DLQ pipeline
        self._runstate = runstate
        self._telemetry = telemetry
        self._confirmations = confirmations
        self._node_tally = node_tally
        self._sidecar_id = sidecar_id

    def report(self, report: Report, *, caller: Caller, timeout_s: float,
               token: str | None = None) -> list[Answer]:
        """Verdicts for the report's records, each with whether the caller must dead-letter it
        (only for decide_only requests from another node's sidecar), as spans: a verdict and
        how many consecutive records it answers. The run's token is checked first; under
        backpressure the report is then refused (BackpressureError) before anything is
        decided (admission.py)."""
        if report.decide_only and not caller.peer:
            raise JobAccessError("ReportFailures.decide_only is for sidecar-to-sidecar calls "
                                 "only (an authenticated peer)")
        run = self._registry.run_for(report.job, report.run_id, token)
        gate, records = self._admission, report.records
        if gate is None or not records or report.decide_only:
            return self._report(run, report, timeout_s=timeout_s, token=token)
        try:
            reservation = gate.admit(len(records), report.size())
        except BackpressureError:
            self._engine.note_refused(run.key, len(records))
            raise
        try:
            return self._report(run, report, timeout_s=timeout_s, token=token)
        except BackpressureError:  # the estimate was short: decided, yet not spooled
            log.warning("job %s: the DLQ spool refused %d records admitted by the backpressure "
                        "estimate; they were decided and counted", report.job, len(records))
            gate.refused_after_admission(len(records))
            self._engine.note_refused(run.key, len(records))
            raise
        finally:
            gate.release(reservation)

    def _report(self, run: Run, report: Report, *, timeout_s: float,
                token: str | None) -> list[Answer]:
        engine, job, key = self._engine, run.job, run.key
        home, task, records = run.home, report.task, report.records
        if home is None and report.recovered_ids:
            engine.record_recovered(key, task, list(report.recovered_ids))
        if report.undo_ids:
            if home is None:
                undone: list = []
                engine.undo_dead_letters(key, list(report.undo_ids), journal=undone)
                keep(self._runstate, engine, key, undone)
        if not records:
            if home is not None and report.recovered_ids:
                home.report(report, timeout_s, token=token)
            return []
        started = time.perf_counter()
        telemetry = self._telemetry
        tracer = telemetry.tracer
        with tracer.start_as_current_span(
                "spillway.decide", attributes={"spillway.job": job,
                                               "spillway.run": run.run_id,
                                               "spillway.task.id": task.task_id,
                                               "spillway.records": len(records),
                                               "spillway.home": home.address if home else ""}
        ) as span:
            # this report's slice of the run's durable state: written once its dead letters
            # are spooled (a refused report leaves none behind), or at once for a peer's
            # decide_only report (the peer spools, and says so if it could not)
            journal: list | None = [] if self._runstate is not None else None
            # A record reported without a trace context still gets one: the decision's
            # (made here once for a run homed elsewhere, whose records may be held first).
            own = traceparent(span) if home is not None else ""
            held = self._confirmations
            if home is not None and held is not None and not report.recovered_ids:
                # answered now, its DLQ records held until the home confirms them
                provisional = held.answer(run, task, records, token, own)
                if provisional is not None:
                    if span.is_recording():
                        annotate(span, [v for v, n in provisional for _ in range(n)], records)
                        span.set_attribute("spillway.provisional", True)
                    telemetry.record_verdict_duration(time.perf_counter() - started)
                    return [((v, False), n) for v, n in provisional]
            guard = None
            if home is not None:  # the job's home decides; durability stays on this node
                decisions, guard = self._node_tally.decide(run, report, timeout_s=timeout_s,
                                                           token=token, traceparent=own)
                decided = [(d, 1) for d in decisions]
            else:   # a streak of records decided alike stays one answer (no object per record)
                decided = [(o[0], n) for o, n in engine.decide(key, task, records,
                                                               journal=journal)]
            if report.decide_only:
                keep(self._runstate, engine, key, journal)
                return [((d.verdict, d.dead_letter), n) for d, n in decided]
            if span.is_recording():
                annotate(span, [d.verdict for d, n in decided for _ in range(n)], records)
            # each streak's first record: its index is the lengths of the streaks before it
            to_dlq = [(i, n, d.verdict) for i, (d, n) in zip(
                accumulate((n for _, n in decided), initial=0), decided) if d.dead_letter]
            if to_dlq:
                own = own or traceparent(span)
                settings = engine.settings(key)
                now_ms = SystemClock().wall_ms()
                build = DlqBuilder(settings, task, now_ms=now_ms,
                                   sidecar_id=self._sidecar_id, run=key,
                                   run_id=report.run_id).build_streak
                dlq: list = []
                streaks: list = []
                for i, n, v in to_dlq:
                    build(records, i, n, v, own, dlq, streaks=streaks)
                with tracer.start_as_current_span(
                        "spillway.spool", attributes={"spillway.records": len(dlq)}):
                    try:   # durable (spooled) before we answer; held copies go with it
                        self._pipeline.submit(dlq, release=guard.rid if guard else 0,
                                              streaks=streaks)
                    except BaseException:
                        # nothing spooled: the home must not answer a re-report "already in
                        # the DLQ" (one dead letter per record id), so it forgets these
                        self._undo_dead_letters(run, task, [r.record_id for i, n, _ in to_dlq
                                                            for r in records[i:i + n]], token)
                        if guard is not None:
                            held.drop(guard)
                        raise
                for _, _, v in to_dlq:  # fresh values from this call's decisions: marked here
                    v.dead_lettered = True
            elif guard is not None:   # nothing to write: the held copies go
                held.drop(guard)
            keep(self._runstate, engine, key, journal)
        telemetry.record_verdict_duration(time.perf_counter() - started)
        return [((d.verdict, False), n) for d, n in decided]

    def _undo_dead_letters(self, run: Run, task, record_ids: list[str],
                           token: str | None) -> None:
        if run.home is None:
            undone: list = []
            self._engine.undo_dead_letters(run.key, record_ids, journal=undone)
            keep(self._runstate, self._engine, run.key, undone)
            return
        try:
            run.home.undo_dead_letters(run.job, run.run_id, task, record_ids, 5.0, token=token)
        except HomeError as exc:  # the report fails anyway; a re-report may then be refused
            log.warning("could not tell the home of job %r run %r that %d DLQ records were "
                        "not spooled (a re-report of them may not be dead-lettered): %s",
                        run.job, run.run_id, len(record_ids), exc)

    def flush(self, flush: Flush, *, caller: Caller, timeout_s: float,
              token: str | None = None) -> int:
        """FlushTask: the task's counts recorded (at the run's home), then, within
        `timeout_s`, its held reports confirmed and its DLQ records acknowledged; how many."""
        if flush.progress_only and not caller.peer:
            raise JobAccessError("FlushTask.progress_only is for sidecar-to-sidecar calls only "
                                 "(an authenticated peer)")
        run = self._registry.run_for(flush.job, flush.run_id, token)
        key, home, task, processed = run.key, run.home, flush.task, flush.processed
        if home is not None:
            if processed or flush.recovered_ids:
                home.progress(flush, min(timeout_s, 10.0), token=token)
        else:
            if flush.recovered_ids:
                self._engine.record_recovered(key, task, list(flush.recovered_ids))
            if processed:
                progress: list = []
                self._engine.record_progress(key, task, processed, journal=progress)
                keep(self._runstate, self._engine, key, progress)
        if self._pipeline is None or flush.progress_only:
            return 0
        deadline = time.monotonic() + timeout_s
        if home is not None and self._confirmations is not None:
            self._confirmations.wait_task(key, task, timeout_s)   # held: confirmed first
        return self._pipeline.wait_task(task_key(key, task),
                                        max(0.0, deadline - time.monotonic()))


def annotate(span, verdicts: Sequence[Verdict], records) -> None:
    """Summarise a report's verdicts (one per record of `records`, in order) on its decision
    span (docs/OBSERVABILITY.md)."""
    # counted in C (Counter over (action, category)); the event scans stop once they have
    # enough, and the one for non-SKIPs is skipped when the counts say there is none
    kinds = Counter(map(_ACTION_CATEGORY, verdicts))
    skip = Action.SKIP
    skipped = sum(n for (a, _), n in kinds.items() if a is skip)
    others = len(verdicts) - skipped
    picked = list(islice((i for i, v in enumerate(verdicts) if v.action is not skip),
                         min(others, MAX_VERDICT_EVENTS))) if others else []
    if len(picked) < MAX_VERDICT_EVENTS and skipped:
        picked = sorted(picked + list(islice(
            (i for i, v in enumerate(verdicts) if v.action is skip),
            min(skipped, MAX_VERDICT_EVENTS - len(picked)))))
    attrs: dict[str, int] = {}
    for (a, c), n in kinds.items():
        for name in (f"spillway.verdicts.{a.value.lower()}",
                     f"spillway.verdicts.category.{c.value}"):
            attrs[name] = attrs.get(name, 0) + n
    attrs["spillway.verdicts.events.omitted"] = len(verdicts) - len(picked)
    span.set_attributes(attrs)
    for i in picked:
        v = verdicts[i]
        span.add_event("spillway.verdict", {   # a span's verdict has no id: the record has
            "spillway.record.id": records[i].record_id, "spillway.action": v.action.value,
            "spillway.category": v.category.value, "spillway.reason": v.reason,
            "spillway.attempt": v.attempt})


def traceparent(span) -> str:
    """The W3C traceparent of `span` ('' when it has no valid context)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


__all__ = ["MAX_VERDICT_EVENTS", "Reporting", "annotate", "traceparent"]
