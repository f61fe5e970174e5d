"""The home protocol's two sides in the service (docs/POLICY.md, "The home protocol").

On a node (`NodeTally`): a report of a run homed elsewhere is decided by its home from columns
(`TallyFailures`), the error log lines written here where the records are. At the home
(`HomeTally`): a node's tally is decided like any report. The wire format is
`transport/tally.py`'s; the calls to the home are `peers.Home`'s; both sides take and return
plain values.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from spillway.sidecar.core.model import Decision, TaskIdentity
from spillway.sidecar.core.policy import PolicyEngine
from spillway.sidecar.core.slices import SliceAsk
from spillway.sidecar.errors import JobAccessError, JobConflictError
from spillway.sidecar.federation.confirm import Confirmations, Held
from spillway.sidecar.federation.node_slices import SliceGrant
from spillway.sidecar.observability.telemetry import Telemetry
from spillway.sidecar.service.registry import Caller, Registry, Run
from spillway.sidecar.service.runstate import RunStore, keep
from spillway.sidecar.service.values import Report

# a call to the home that failed so that it may have been decided there all the same
_UNSURE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                     grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                     grpc.StatusCode.INTERNAL})


class NodeTally:
    """A node's side: its reports of runs homed elsewhere, decided by their homes."""

    def __init__(self, *, engine: PolicyEngine, confirmations: Confirmations | None) -> None:
        self._engine = engine
        self._confirmations = confirmations

    def decide(self, run: Run, report: Report, *, timeout_s: float, token: str | None,
               traceparent: str = "") -> tuple[list[Decision], Held | None]:
        """A report of a run homed elsewhere, decided by its home: as columns (ids, payload
        digests, each way of failing once; reports arriving while one is in flight go together
        in the next call) when the run's handler is a built-in one; else, or to a home that
        predates it, the whole report (ReportFailures.decide_only). With columns, copies of the
        DLQ records its data errors would get are held first under a claim the home keeps (a
        guard, `Confirmations.guard`): the caller releases the records the home answered into
        the spool (`release=guard.rid`)."""
        home, key, engine, held = run.home, run.key, self._engine, self._confirmations
        records = report.records
        if (home.tally_supported and engine.builtin_handler(key)
                and not report.recovered_ids):
            digests = engine.payload_digests(key, records)
            guard = (held.guard(run, report.task, records, digests, token, traceparent)
                     if held is not None else None)
            ask = held.slice_ask(run, len(records)) if held is not None else None
            try:
                answer = home.tally(report.job, report.run_id, report.task, records, digests,
                                    timeout_s, token=token,
                                    claim=guard.report.claim if guard else 0, slices=ask)
            except BaseException as exc:
                if guard is not None:
                    if getattr(exc, "code", None) in _UNSURE:   # it may have been answered:
                        held.confirm_later(run, guard)   # asked again later
                    else:   # refused before anything was decided
                        held.drop(guard)
                raise
            if answer is not None:
                outcomes, grant = answer
                if grant is not None:
                    held.slices.grant(key, grant)
                engine.write_logs(key, report.task, records, outcomes)
                return [o[0] for o in outcomes], guard
            if guard is not None:   # an older home: the whole report goes, nothing was claimed
                held.drop(guard)
        return home.report(report, timeout_s, token=token), None


@dataclass(frozen=True, slots=True)
class SliceWant:
    """What a node's report says about its run's budget slices: the slice it was answered
    under, the slices it closed (id, records answered under each), the size it wants."""

    slice: int = 0
    closed: Sequence[tuple[int, int]] = ()
    want: int = 0


@dataclass(frozen=True, slots=True)
class TallyIn:
    """One report of a node's TallyFailures call: its task, its columns (record ids, payload
    digests, groups failing the same way: `transport/tally.tally_groups`), its claim and what
    it says about slices (None: nothing)."""

    task: TaskIdentity
    columns: tuple
    claim: int = 0
    slices: SliceWant | None = None


class HomeTally:
    """The home's side: a node's tallies, each decided like any report."""

    def __init__(self, *, engine: PolicyEngine, registry: Registry, runstate: RunStore | None,
                 telemetry: Telemetry) -> None:
        self._engine = engine
        self._registry = registry
        self._runstate = runstate
        self._telemetry = telemetry

    def tally(self, job: str, run_id: str, reports: Sequence[TallyIn], *, token: str | None,
              caller: Caller) -> list[tuple[list, SliceGrant | None]]:
        """TallyFailures, at a run's home: a node's reports as columns (each with its task:
        record ids, payload digests, groups failing the same way), each decided like any
        report, in order; the node logs and dead-letters. A report with a claim confirms a
        node's held records (docs/POLICY.md, "Provisional verdicts"); one may also close and
        ask for slices of a limited run's error budget ("Budget slices"). Answers per report:
        (outcome, records) spans (`PolicyEngine.decide_tallies`, under one hold of the run's
        lock) and the slice granted, if any; their journal is taken once and written in one
        transaction for the call."""
        if not caller.peer:
            raise JobAccessError("TallyFailures is for sidecar-to-sidecar calls only (an "
                                 "authenticated peer)")
        engine = self._engine
        run = self._registry.run_for(job, run_id, token)
        if run.home is not None:
            raise JobConflictError(
                f"job {run.job!r} run {run.run_id!r} is homed at {run.home.address}, not at "
                "this sidecar: TallyFailures goes to a run's home")
        key = run.key
        if not engine.builtin_handler(key):
            raise JobConflictError(
                f"job {run.job!r} run {run.run_id!r} has a user errors.handler.class, which is "
                "given each record's whole context: send the report with "
                "ReportFailures.decide_only")
        journal: list | None = [] if self._runstate is not None else None
        sliced = engine.sliceable(key)
        asks = [_slice_ask(r.slices) if sliced else None for r in reports]
        todo = [k for k, (r, ask) in enumerate(zip(reports, asks, strict=True))
                if r.columns[0] or ask is not None]
        tallies = [(reports[k].task, *reports[k].columns, reports[k].claim, asks[k])
                   for k in todo]
        around = None
        if self._telemetry.exporting():   # a span per report; none while nothing exports them
            start_span = self._telemetry.tracer.start_as_current_span

            def around(i: int):
                task, ids = tallies[i][0], tallies[i][1]
                return start_span("spillway.decide", attributes={
                    "spillway.job": run.job, "spillway.run": run.run_id,
                    "spillway.task.id": task.task_id, "spillway.records": len(ids),
                    "spillway.tally": True})
        out: list[tuple[list, SliceGrant | None]] = [([], None) for _ in reports]
        try:
            decided = engine.decide_tallies(key, tallies, journal, around) if tallies else []
        finally:
            keep(self._runstate, engine, key, journal)  # the node spools, and says so if not
        for k, spans in zip(todo, decided, strict=True):
            ask, grant = asks[k], None
            if ask is not None and ask.granted:
                grant = SliceGrant(ask.new_id, ask.granted, ask.lease_ms)
            out[k] = (spans, grant)
        return out


def _slice_ask(want: SliceWant | None) -> SliceAsk | None:
    """What a report says about budget slices (None: nothing); a new slice's id is drawn here,
    at random, so that a node cannot guess another's."""
    if want is None or not (want.slice or want.want or want.closed):
        return None
    return SliceAsk(want.slice, list(want.closed), want.want,
                    secrets.randbits(64) or 1 if want.want else 0)


__all__ = ["HomeTally", "NodeTally", "SliceWant", "TallyIn"]
