"""The home protocol's two sides in the service (docs/POLICY.md, "The home protocol").

On a node: a report of a run homed elsewhere is decided by its home from columns
(`TallyFailures`), the error log lines written here where the records are (`decide_at_home`).
At the home: a node's tally is decided like any report (`tally`). The wire format is
`transport/tally.py`'s; the calls to the home are `peers.Home`'s.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

import grpc
from spillway.sidecar.core.model import Decision
from spillway.sidecar.core.slices import SliceAsk
from spillway.sidecar.errors import JobAccessError, JobConflictError
from spillway.sidecar.service.registry import Caller, Run
from spillway.sidecar.transport import security
from spillway.v1 import sidecar_pb2 as pb

if TYPE_CHECKING:
    from spillway.sidecar.federation.confirm import Held
    from spillway.sidecar.service.sidecar import Sidecar


# a call to the home that failed so that it may have been decided there all the same
_UNSURE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                     grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                     grpc.StatusCode.INTERNAL})


def decide_at_home(s: Sidecar, run: Run, request: pb.ReportFailuresRequest, task, records,
                   timeout_s: float, token: str | None, traceparent: str = ""
                   ) -> tuple[list[Decision], Held | None]:
    """A report of a run homed elsewhere, decided by its home: as columns (ids, payload
    digests, each way of failing once; reports arriving while one is in flight go together in
    the next call) when the run's handler is a built-in one; else, or to a home that predates
    it, the whole report (ReportFailures.decide_only). With columns, copies of the DLQ records
    its data errors would get are held first under a claim the home keeps (a guard,
    `Confirmations.guard`): the
    caller releases the records the home answered into the spool (`release=guard.rid`)."""
    home, key, engine = run.home, run.key, s.engine
    if (home.tally_supported and engine.builtin_handler(key)
            and not request.recovered_record_ids):
        digests = engine.payload_digests(key, records)
        guard = (s.confirmations.guard(run, request.task, task, records, digests, token,
                                       traceparent)
                 if s.confirmations is not None else None)
        ask = (s.confirmations.slice_ask(run, len(records))
               if s.confirmations is not None else None)
        try:
            answer = home.tally(request.job, request.run_id, request.task, records, digests,
                                timeout_s, token=token, claim=guard.report.claim if guard else 0,
                                slices=ask)
        except BaseException as exc:
            if guard is not None:
                if getattr(exc, "code", None) in _UNSURE:   # it may have been answered:
                    s.confirmations.confirm_later(run, guard)   # asked again later
                else:   # refused before anything was decided
                    s.confirmations.drop(guard)
            raise
        if answer is not None:
            outcomes, grant = answer
            if grant is not None:
                s.confirmations.slices.grant(key, grant)
            engine.write_logs(key, task, records, outcomes)
            return [o[0] for o in outcomes], guard
        if guard is not None:   # an older home: the whole report goes, nothing was claimed
            s.confirmations.drop(guard)
    return home.report(request, timeout_s, token=token, records=records), None


def tally(s: Sidecar, request: pb.TallyRequest, reports, *, token: str | None,
          caller: Caller | None = None) -> list[tuple[list, pb.BudgetSlice | None]]:
    """TallyFailures, at a run's home: a node's reports as columns (each with its task: record
    ids, payload digests, groups failing the same way), each decided like any report, in
    order; the node logs and dead-letters. A report with a claim confirms a node's held
    records (docs/POLICY.md, "Provisional verdicts"); one may also close and ask for slices of
    a limited run's error budget ("Budget slices"). Answers per report: (outcome, records)
    spans (`PolicyEngine.decide_tallies`, under one hold of the run's lock) and the slice
    granted, if any; their journal is taken once and written in one transaction for the call."""
    if not (caller or security.current_caller()).peer:
        raise JobAccessError("TallyFailures is for sidecar-to-sidecar calls only (an "
                             "authenticated peer)")
    run = s.run_for(request.job, request.run_id, token)
    if run.home is not None:
        raise JobConflictError(
            f"job {run.job!r} run {run.run_id!r} is homed at {run.home.address}, not at this "
            "sidecar: TallyFailures goes to a run's home")
    key = run.key
    if not s.engine.builtin_handler(key):
        raise JobConflictError(
            f"job {run.job!r} run {run.run_id!r} has a user errors.handler.class, which is "
            "given each record's whole context: send the report with "
            "ReportFailures.decide_only")
    journal: list | None = [] if s.runstate is not None else None
    sliced = s.engine.sliceable(key)
    asks = [_slice_ask(report) if sliced else None for report in request.reports]
    todo = [k for k, ((_, (ids, _, _)), ask) in enumerate(zip(reports, asks, strict=True))
            if ids or ask is not None]
    tallies = [(reports[k][0], *reports[k][1], request.reports[k].claim, asks[k]) for k in todo]
    around = None
    if s.telemetry.exporting():   # a span per report; none to drop while nothing exports them
        start_span = s.telemetry.tracer.start_as_current_span

        def around(i: int):
            task, ids = tallies[i][0], tallies[i][1]
            return start_span("spillway.decide", attributes={
                "spillway.job": run.job, "spillway.run": run.run_id,
                "spillway.task.id": task.task_id, "spillway.records": len(ids),
                "spillway.tally": True})
    out: list[tuple[list, pb.BudgetSlice | None]] = [([], None) for _ in reports]
    try:
        decided = s.engine.decide_tallies(key, tallies, journal, around) if tallies else []
    finally:
        s.persist(key, journal)  # the node spools, and says so if it could not
    for k, spans in zip(todo, decided, strict=True):
        ask, grant = asks[k], None
        if ask is not None and ask.granted:
            grant = pb.BudgetSlice(id=ask.new_id, size=ask.granted, lease_ms=ask.lease_ms)
        out[k] = (spans, grant)
    return out


def _slice_ask(report: pb.TallyReport) -> SliceAsk | None:
    """What a report says about budget slices (None: nothing); a new slice's id is drawn here,
    at random, so that a node cannot guess another's."""
    if not (report.slice or report.want_slice or report.closed_slices):
        return None
    return SliceAsk(report.slice, [(c.id, c.used) for c in report.closed_slices],
                    report.want_slice, secrets.randbits(64) or 1 if report.want_slice else 0)


__all__ = ["decide_at_home", "tally"]
