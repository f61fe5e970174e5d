"""The gRPC servicer of spillway.v1: it only translates.

Each RPC turns protobuf into core and service values (`convert`, `service.values`), calls the
application service (`service.Sidecar`) with the caller `security`'s interceptor authenticated,
and turns its plain answer into protobuf; a typed sidecar error becomes a status code through
one table (`_STATUS_OF`) and `context.abort(code, details)`; a DLQ topic guardrail refusal
also says so in its trailing metadata (the client raises TopicGuardrailError for it).
Decisions belong to `core.policy`, durability to `dlq.pipeline`, the run bookkeeping to
`service`.
"""

from __future__ import annotations

from contextlib import contextmanager

import grpc
from spillway.client.errors import ERROR_PROPERTY_KEY, ERROR_REASON_KEY, TOPIC_GUARDRAIL_REASON
from spillway.sidecar.errors import (
    BackpressureError,
    ConfigError,
    DlqError,
    FlushTimeoutError,
    JobAccessError,
    JobConflictError,
    KafkaUnreachableError,
    LiveRunsExhaustedError,
    RunStateError,
    SpillwayError,
    TopicGuardrailError,
    UnknownJobError,
)
from spillway.sidecar.federation.node_slices import SliceGrant
from spillway.sidecar.federation.peers import HomeError
from spillway.sidecar.federation.tallying import SliceWant, TallyIn
from spillway.sidecar.service.registry import JOB_TOKEN_METADATA
from spillway.sidecar.service.sidecar import Sidecar
from spillway.sidecar.service.values import Flush, Registration, Report, StatusQuery
from spillway.sidecar.transport import columns, convert, security, tally
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ErrorSidecar"].full_name
# Flush barriers answer a little before the caller's deadline so the caller sees our error.
_DEADLINE_MARGIN_S = 0.05
_NO_DEADLINE_S = 1e8   # a time_remaining() beyond this (years) is no deadline at all


# How the sidecar's typed errors answer over gRPC: the first row whose type matches wins (a
# TopicGuardrailError is a ConfigError before it is a DlqError; a HomeError relays its own code).
_STATUS_OF: tuple[tuple[type[SpillwayError], grpc.StatusCode], ...] = (
    (JobAccessError, grpc.StatusCode.PERMISSION_DENIED),
    (LiveRunsExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RunStateError, grpc.StatusCode.DATA_LOSS),
    (JobConflictError, grpc.StatusCode.FAILED_PRECONDITION),
    (UnknownJobError, grpc.StatusCode.NOT_FOUND),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (BackpressureError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (FlushTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    # not UNAVAILABLE (which gRPC clients retry): the sidecar answered, its Kafka did not
    (KafkaUnreachableError, grpc.StatusCode.FAILED_PRECONDITION),
    # e.g. a record Kafka can never accept: kept aside, the task must fail
    (DlqError, grpc.StatusCode.FAILED_PRECONDITION),
)


@contextmanager
def _answering(context, *, dlq_what: str = ""):
    """Abort the call with the status of a typed sidecar error raised in the block; ``dlq_what``
    prefixes the message of a plain DlqError (what the call was doing with the DLQ)."""
    try:
        yield
    except HomeError as exc:
        context.abort(exc.code, str(exc))
    except SpillwayError as exc:
        if isinstance(exc, TopicGuardrailError):   # INVALID_ARGUMENT alone does not say it
            context.set_trailing_metadata(((ERROR_REASON_KEY, TOPIC_GUARDRAIL_REASON),
                                           (ERROR_PROPERTY_KEY, exc.property)))
        for kind, code in _STATUS_OF:
            if isinstance(exc, kind):
                prefix = dlq_what if kind is DlqError else ""
                context.abort(code, f"{prefix}{exc}")
        raise


class ErrorSidecarServicer(pb_grpc.ErrorSidecarServicer):
    def __init__(self, sidecar: Sidecar) -> None:
        self._s = sidecar

    def RegisterJob(self, request, context):
        registration = Registration(
            job=request.job, run_id=request.run_id, properties=dict(request.properties),
            home=request.home, home_instance_id=request.home_instance_id, peer=request.peer,
            token_escrow=request.token_escrow, claim_token=request.claim_token)
        with _answering(context, dlq_what="DLQ topic check failed: "):
            answer = self._s.register_job(registration, token=_job_token(context),
                                          caller=_caller(), timeout_s=_timeout(context))
        return convert.registered_pb(answer)

    def ReportFailures(self, request, context):
        try:
            task = convert.task_identity(request.task)
            records = (columns.records(request.columns) if request.HasField("columns")
                       else convert.failed_records(request.records))
            if request.undo_dead_letter_record_ids and not request.decide_only:
                raise ValueError("undo_dead_letter_record_ids: only for sidecar-to-sidecar "
                                 "(decide_only) requests")
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        report = Report(job=request.job, run_id=request.run_id, task=task, records=records,
                        recovered_ids=request.recovered_record_ids,
                        undo_ids=request.undo_dead_letter_record_ids,
                        decide_only=request.decide_only, size=request.ByteSize)
        with _answering(context):
            answers = self._s.report(report, caller=_caller(), timeout_s=_timeout(context),
                                     token=_job_token(context))
        if request.verdict_columns:
            return pb.ReportFailuresResponse(columns=columns.verdict_columns(answers))
        return convert.report_response(answers, records)

    def TallyFailures(self, request, context):
        """The home protocol (sidecar to sidecar): reports decided from their columns."""
        try:
            reports = [TallyIn(convert.task_identity(r.task),
                               tally.tally_groups(r, f"reports[{i}]"), r.claim, _slices(r))
                       for i, r in enumerate(request.reports)]
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        with _answering(context):
            answers = self._s.tally(request.job, request.run_id, reports,
                                    token=_job_token(context), caller=_caller())
        return pb.TallyResponse(reports=[tally.tally_streak_verdicts(o, _grant_pb(grant))
                                         for o, grant in answers])

    def FlushTask(self, request, context):
        try:
            task = convert.task_identity(request.task)
            processed = {}
            for i, sc in enumerate(request.processed):
                ref = convert.stage_ref(sc.stage, sc.custom_stage, f"processed[{i}]")
                processed[ref] = processed.get(ref, 0) + sc.records
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        flush = Flush(job=request.job, run_id=request.run_id, task=task, processed=processed,
                      recovered_ids=request.recovered_record_ids,
                      progress_only=request.progress_only)
        with _answering(context):
            acked = self._s.flush(flush, caller=_caller(),
                                  timeout_s=_timeout(context, self._s.flush_timeout_s),
                                  token=_job_token(context))
        return pb.FlushTaskResponse(dlq_records_acknowledged=acked)

    def GetJobSummary(self, request, context):
        with _answering(context):
            summary = self._s.job_summary(request.job, request.run_id,
                                          token=_job_token(context))
        return convert.run_summary_pb(summary)

    def GetStatus(self, request, context):
        query = StatusQuery(job=request.job, page_size=request.page_size,
                            page_token=request.page_token)
        with _answering(context):
            page = self._s.status_page(query, caller=_caller(), token=_job_token(context))
            return convert.status_to_pb(page)   # its runs' summaries are read as it is cut

    def EndJob(self, request, context):
        with _answering(context):
            ended = self._s.end_job(request.job, request.run_id, local_only=request.local_only,
                                    token=_job_token(context), caller=_caller(),
                                    timeout_s=_timeout(context))
        return convert.ended_pb(ended)


def _slices(report: pb.TallyReport) -> SliceWant | None:
    """What a tally report says about its run's budget slices (None: nothing)."""
    if not (report.slice or report.want_slice or report.closed_slices):
        return None
    return SliceWant(report.slice, [(c.id, c.used) for c in report.closed_slices],
                     report.want_slice)


def _grant_pb(grant: SliceGrant | None) -> pb.BudgetSlice | None:
    if grant is None:
        return None
    return pb.BudgetSlice(id=grant.id, size=grant.size, lease_ms=grant.lease_ms)


def _job_token(context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == JOB_TOKEN_METADATA:
            return value if isinstance(value, str) else None
    return None


def _caller() -> security.Caller:
    """Who is calling (authenticated by `security`'s interceptor before any servicer code)."""
    return security.current_caller()


def _timeout(context, default: float = 15.0) -> float:
    """What is left of the caller's deadline, less a margin so the caller sees our answer;
    `default` when the caller set none (grpc then answers ~9.2e18 s, not None: a FlushTask
    without a deadline waited for ever instead of flush.timeout.ms)."""
    remaining = context.time_remaining()
    if remaining is None or remaining > _NO_DEADLINE_S:
        return default
    return max(0.0, remaining - _DEADLINE_MARGIN_S)


__all__ = ["ErrorSidecarServicer", "SERVICE_NAME"]
