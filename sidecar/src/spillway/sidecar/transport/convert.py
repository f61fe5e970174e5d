"""Translation between spillway.v1 protobuf messages and the core's and the service's values.

Pure translation: no policy here. Invalid input raises ValueError naming the field, which the
servicer turns into INVALID_ARGUMENT. The service's answers (`service.values`) become messages
here too, GetStatus's page cut to what one message may carry (`status_to_pb`).
"""

from __future__ import annotations

import dataclasses

from spillway.sidecar.core import model as m
from spillway.sidecar.service.ended import EndedRun, Totals
from spillway.sidecar.service.registry import encode_page_token
from spillway.sidecar.service.values import Ended, Registered, RunSummary, StatusPage
from spillway.v1 import sidecar_pb2 as pb

STAGE_FROM_PB = {
    pb.STAGE_DESERIALIZATION: m.Stage.DESERIALIZATION,
    pb.STAGE_KEY_CONVERTER: m.Stage.KEY_CONVERTER,
    pb.STAGE_VALUE_CONVERTER: m.Stage.VALUE_CONVERTER,
    pb.STAGE_HEADER_CONVERTER: m.Stage.HEADER_CONVERTER,
    pb.STAGE_TRANSFORMATION: m.Stage.TRANSFORMATION,
    pb.STAGE_SINK: m.Stage.SINK,
    pb.STAGE_PRODUCE: m.Stage.PRODUCE,
    pb.STAGE_CUSTOM: m.Stage.CUSTOM,
}

CATEGORY_FROM_PB = {
    pb.CATEGORY_RETRIABLE: m.Category.RETRIABLE,
    pb.CATEGORY_REFRESH_RETRIABLE: m.Category.REFRESH_RETRIABLE,
    pb.CATEGORY_ABORTABLE: m.Category.ABORTABLE,
    pb.CATEGORY_APPLICATION_RECOVERABLE: m.Category.APPLICATION_RECOVERABLE,
    pb.CATEGORY_INVALID_CONFIGURATION: m.Category.INVALID_CONFIGURATION,
    pb.CATEGORY_DATA: m.Category.DATA,
    pb.CATEGORY_CRASH: m.Category.CRASH,
    pb.CATEGORY_TIMEOUT: m.Category.TIMEOUT,
}
CATEGORY_TO_PB = {v: k for k, v in CATEGORY_FROM_PB.items()}
STAGE_TO_PB = {v: k for k, v in STAGE_FROM_PB.items()}

ACTION_TO_PB = {m.Action.RETRY: pb.ACTION_RETRY, m.Action.SKIP: pb.ACTION_SKIP,
                 m.Action.FAIL: pb.ACTION_FAIL}


# StageRef values are immutable and few: one per (stage, custom name) seen, bounded.
_STAGE_REFS: dict[tuple[int, str], m.StageRef] = {}
_MAX_STAGE_REFS = 4096


def stage_ref(stage: int, custom: str, where: str) -> m.StageRef:
    ref = _STAGE_REFS.get((stage, custom))
    if ref is not None:
        return ref
    try:
        s = STAGE_FROM_PB[stage]
    except KeyError:
        raise ValueError(
            f"{where}.stage: must be one of {sorted(pb.Stage.keys())[1:]} (got {stage})"
        ) from None
    if s is m.Stage.CUSTOM and not custom.strip():
        raise ValueError(f"{where}.custom_stage: required with STAGE_CUSTOM")
    ref = m.StageRef(s, custom.strip() if s is m.Stage.CUSTOM else "")
    if len(_STAGE_REFS) >= _MAX_STAGE_REFS:
        _STAGE_REFS.clear()
    _STAGE_REFS[(stage, custom)] = ref
    return ref


def task_identity(t: pb.TaskIdentity) -> m.TaskIdentity:
    return m.TaskIdentity(
        stage_id=t.stage_id, partition_id=t.partition_id, attempt_number=t.attempt_number,
        task_attempt_id=t.task_attempt_id, executor_id=t.executor_id, host=t.host,
    )


def task_pb(t: m.TaskIdentity) -> pb.TaskIdentity:
    return pb.TaskIdentity(
        stage_id=t.stage_id, partition_id=t.partition_id, attempt_number=t.attempt_number,
        task_attempt_id=t.task_attempt_id, executor_id=t.executor_id, host=t.host,
    )


def exception_value(e: pb.ExceptionInfo, where: str) -> m.ExceptionInfo:
    if not e.class_name:
        raise ValueError(f"{where}.exception.class_name: required")
    has = e.HasField
    return m.ExceptionInfo(
        e.class_name,
        tuple(e.class_chain) or (e.class_name,),
        e.message,
        e.stack_trace,
        e.grpc_status_code if has("grpc_status_code") else None,
        e.http_status_code if has("http_status_code") else None,
        e.kafka_retriable if has("kafka_retriable") else None,
        e.kafka_fatal if has("kafka_fatal") else None,
        e.kafka_txn_requires_abort if has("kafka_txn_requires_abort") else None,
        CATEGORY_FROM_PB.get(e.marker_category),
        tuple(e.causes),
        e.kafka_error_code.strip().upper() or None,
    )


def exception_pb(e: m.ExceptionInfo, *, stack_trace: bool = False) -> pb.ExceptionInfo:
    """A core exception value as its message; without its stack trace unless asked (a home
    never needs it to decide)."""
    out = pb.ExceptionInfo(class_name=e.class_name, class_chain=e.class_chain,
                           message=e.message, causes=e.causes,
                           kafka_error_code=e.kafka_error_code or "",
                           stack_trace=e.stack_trace if stack_trace else "")
    for name in ("grpc_status_code", "http_status_code", "kafka_retriable", "kafka_fatal",
                 "kafka_txn_requires_abort"):
        value = getattr(e, name)
        if value is not None:
            setattr(out, name, value)
    if e.marker_category is not None:
        out.marker_category = CATEGORY_TO_PB[e.marker_category]
    return out


class RecordView:
    """What a view of a reported record (`PbFailedRecord`, `columns.ColumnRecord`) shares: it
    compares and prints as the `model.FailedRecord` it stands for."""

    __slots__ = ()

    def to_model(self) -> m.FailedRecord:
        return m.FailedRecord(self.record_id, self.stage, self.exception, self.function_name,
                              self.source, self.key, self.value, self.headers,
                              self.timestamp_ms, self.attempt, self.traceparent,
                              self.tracestate, self.payload)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RecordView):
            other = other.to_model()
        if isinstance(other, m.FailedRecord):
            return self.to_model() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # like the (mutable) dataclass

    @property
    def trace(self) -> tuple[str, str]:
        return (self.traceparent, self.tracestate)

    def __repr__(self) -> str:
        return repr(self.to_model()).replace("FailedRecord(", f"{type(self).__name__}(", 1)


class PbFailedRecord(RecordView):
    """A reported record as the core reads it (`model.FailedRecord`'s fields), over its
    protobuf message: validated and converted up front are only what every record's decision
    reads (record id, stage, exception); the rest (key, value, headers, source, ...) is read
    from the message when asked for, which for most records is never (only a dead-lettered,
    logged or custom-handled record needs them). Treat it as a value, like FailedRecord;
    `to_model()` gives the plain dataclass."""

    # `message`: the record as it was reported (passed on as it is to a run's home)
    __slots__ = ("record_id", "stage", "exception", "message")
    tag = -1  # its payload digest is computed from key and value (`JobState.tag_of`)

    def __init__(self, r: pb.FailedRecord, record_id: str, stage: m.StageRef,
                 exception: m.ExceptionInfo) -> None:
        self.message = r
        self.record_id = record_id
        self.stage = stage
        self.exception = exception

    @property
    def function_name(self) -> str:
        return self.message.function_name

    @property
    def source(self) -> m.SourceCoordinates | None:
        r = self.message
        if not r.HasField("source"):
            return None
        src = r.source
        return m.SourceCoordinates(src.topic, src.partition, src.offset)

    @property
    def key(self) -> bytes | None:
        r = self.message
        return r.key if r.HasField("key") else None

    @property
    def value(self) -> bytes | None:
        r = self.message
        return r.value if r.HasField("value") else None

    @property
    def headers(self) -> tuple[m.Header, ...]:
        headers = self.message.headers
        return tuple((h.key, h.value if h.HasField("value") else None)
                     for h in headers) if headers else ()

    @property
    def timestamp_ms(self) -> int | None:
        r = self.message
        return r.timestamp_ms if r.HasField("timestamp_ms") else None

    @property
    def attempt(self) -> int:
        a = self.message.attempt
        return a if a > 1 else 1

    @property
    def traceparent(self) -> str:
        return self.message.traceparent

    @property
    def payload(self) -> str:
        return m.PAYLOAD_SOURCE if self.message.payload == pb.PAYLOAD_SOURCE else \
            m.PAYLOAD_STAGE_INPUT

    @property
    def tracestate(self) -> str:
        return self.message.tracestate



def failed_records(records) -> list[PbFailedRecord]:
    """A report's records, in order (ValueError naming the first invalid field). Records of a
    batch that failed with an identical exception share one converted value."""
    out = []
    append = out.append
    prev_pb = prev = None
    refs = _STAGE_REFS
    for i, r in enumerate(records):
        rid = r.record_id
        has = r.HasField
        if not rid or not has("exception"):
            if not rid:
                raise ValueError(f"records[{i}].record_id: required (stable across task attempts)")
            raise ValueError(f"records[{i}].exception: required")
        if has("source") and not r.source.topic:
            raise ValueError(f"records[{i}].source.topic: required when source is set")
        stage = refs.get((r.stage, r.custom_stage))
        if stage is None:
            stage = stage_ref(r.stage, r.custom_stage, f"records[{i}]")
        e = r.exception
        if prev_pb is None or prev_pb != e:
            prev = exception_value(e, f"records[{i}]")
            prev_pb = e
        append(PbFailedRecord(r, rid, stage, prev))
    return out


def _verdict_fields(v: m.Verdict, dead_letter: bool) -> dict:
    """Only the fields that differ from their protobuf defaults (cheaper to set)."""
    f = {"record_id": v.record_id, "action": ACTION_TO_PB[v.action],
         "category": CATEGORY_TO_PB[v.category], "reason": v.reason, "attempt": v.attempt}
    if v.retry_delay_ms > 0:
        f["retry_delay_ms"] = int(v.retry_delay_ms)
    if dead_letter:
        f["dead_letter"] = True
    if v.dead_lettered:
        f["dead_lettered"] = True
    if v.job_failed:
        f["job_failed"] = True
    if v.retry_budget_exhausted:
        f["retry_budget_exhausted"] = True
    return f


def report_response(answers, records) -> pb.ReportFailuresResponse:
    """The response for `((verdict, dead_letter), n)` spans of `records`, built in place (no
    per-verdict copy); a span's records (its verdict has no record id) each get their own."""
    resp = pb.ReportFailuresResponse()
    add = resp.verdicts.add
    action_pb, category_pb = ACTION_TO_PB, CATEGORY_TO_PB
    for v, dead_letter in _per_record(answers, records):
        if (v.retry_delay_ms > 0 or dead_letter or v.dead_lettered or v.job_failed
                or v.retry_budget_exhausted):
            add(**_verdict_fields(v, dead_letter))
        else:
            add(record_id=v.record_id, action=action_pb[v.action],
                category=category_pb[v.category], reason=v.reason, attempt=v.attempt)
    return resp


def _per_record(answers, records):
    i = 0
    for (v, dead_letter), n in answers:
        if v.record_id:
            yield v, dead_letter
        else:
            for r in records[i:i + n]:
                yield dataclasses.replace(v, record_id=r.record_id), dead_letter
        i += n


ACTION_FROM_PB = {v: k for k, v in ACTION_TO_PB.items()}


def verdict_from_pb(v: pb.Verdict) -> m.Verdict:
    """A verdict decided by a job's home sidecar, back into a core value."""
    return m.Verdict(
        record_id=v.record_id, action=ACTION_FROM_PB[v.action],
        category=CATEGORY_FROM_PB.get(v.category, m.Category.DATA), reason=v.reason,
        attempt=v.attempt, retry_delay_ms=v.retry_delay_ms, dead_lettered=v.dead_lettered,
        job_failed=v.job_failed, retry_budget_exhausted=v.retry_budget_exhausted,
    )


_U64_MAX = 2**64 - 1
_I64_MAX = 2**63 - 1


def _u64(n: int) -> int:
    """Counters saturate at what a uint64 field carries (they are sums of callers' numbers:
    one out-of-range total must not break every summary and GetStatus)."""
    return n if 0 <= n <= _U64_MAX else (_U64_MAX if n > 0 else 0)


def _i64(n: int) -> int:
    """A timestamp clamped to what an int64 field carries."""
    return min(max(n, -_I64_MAX), _I64_MAX)


def _entries(d: dict[str, int]) -> list[pb.CountEntry]:
    return [pb.CountEntry(key=k, count=_u64(c)) for k, c in sorted(d.items())]


def summary_to_pb(s: m.JobSummary, sidecar_id: str) -> pb.JobSummary:
    c = s.counts
    return pb.JobSummary(
        job=s.job, run_id=s.run_id, failed=s.failed, failure_reason=s.failure_reason,
        records_processed=_u64(s.records_processed),
        total_record_failures=_u64(c.total_record_failures),
        total_record_errors=_u64(c.total_record_errors),
        total_records_skipped=_u64(c.total_records_skipped),
        total_retries=_u64(c.total_retries),
        total_errors_logged=_u64(c.total_errors_logged),
        dlq_records_written=_u64(s.dlq_records_written),
        last_error_timestamp_ms=_i64(c.last_error_timestamp_ms),
        by_stage=_entries(s.by_stage),
        by_category=_entries(s.by_category),
        by_exception_class=_entries(s.by_exception_class),
        sidecar_id=sidecar_id,
        dropped_records=_u64(c.dropped_records),
        retry_budget_exhausted=_u64(s.retry_budget_exhausted),
        records_refused=_u64(s.records_refused),
        record_id_collisions=_u64(s.record_id_collisions),
    )


def summary_from_pb(s: pb.JobSummary) -> RunSummary:
    """A summary another sidecar answered with (its run's home, a node, a sibling process)."""
    counts = m.Counts(
        total_record_failures=s.total_record_failures,
        total_record_errors=s.total_record_errors,
        total_records_skipped=s.total_records_skipped, total_retries=s.total_retries,
        total_errors_logged=s.total_errors_logged, dropped_records=s.dropped_records,
        last_error_timestamp_ms=s.last_error_timestamp_ms)
    return RunSummary(m.JobSummary(
        job=s.job, run_id=s.run_id, failed=s.failed, failure_reason=s.failure_reason,
        records_processed=s.records_processed, counts=counts,
        dlq_records_written=s.dlq_records_written,
        by_stage={e.key: e.count for e in s.by_stage},
        by_category={e.key: e.count for e in s.by_category},
        by_exception_class={e.key: e.count for e in s.by_exception_class},
        retry_budget_exhausted=s.retry_budget_exhausted, records_refused=s.records_refused,
        record_id_collisions=s.record_id_collisions), s.sidecar_id)


def run_summary_pb(s: RunSummary) -> pb.JobSummary:
    return summary_to_pb(s.summary, s.sidecar_id)


def registered_pb(r: Registered) -> pb.RegisterJobResponse:
    return pb.RegisterJobResponse(
        job=r.job, run_id=r.run_id, job_token=r.job_token,
        effective_properties=dict(r.effective_properties), home=r.home,
        home_instance_id=r.home_instance_id, process_port=r.process_port,
        report_columns=r.report_columns)


def registered_from_pb(r: pb.RegisterJobResponse) -> Registered:
    return Registered(
        job=r.job, run_id=r.run_id, job_token=r.job_token,
        effective_properties=dict(r.effective_properties), home=r.home,
        home_instance_id=r.home_instance_id, process_port=r.process_port,
        report_columns=r.report_columns)


def ended_pb(e: Ended) -> pb.EndJobResponse:
    return pb.EndJobResponse(summaries=[run_summary_pb(s) for s in e.summaries],
                             unreachable=e.unreachable)


def ended_from_pb(r: pb.EndJobResponse) -> Ended:
    return Ended([summary_from_pb(s) for s in r.summaries], list(r.unreachable))


# --- GetStatus ---------------------------------------------------------------------------------

_STATUS_REASON_CHARS = 1024       # a run's failure reason in GetStatus (full in GetJobSummary)
_STATUS_BREAKDOWN_KEYS = 20       # per breakdown in GetStatus, the rest summed as "(other)"
_STATUS_KEY_CHARS = 256
# GetStatus pages stop short of this many bytes, so any page fits a default 4 MiB client limit
_STATUS_PAGE_BYTES = 3 * 1024 * 1024
# of which the ended runs take at most this many (the newest first)
_STATUS_ENDED_BYTES = 1024 * 1024


def _status_summary(s: pb.JobSummary) -> pb.JobSummary:
    """A run's summary bounded for GetStatus (which lists many): reason and breakdowns cut."""
    if len(s.failure_reason) > _STATUS_REASON_CHARS:
        s.failure_reason = s.failure_reason[:_STATUS_REASON_CHARS] + "…"
    for entries in (s.by_stage, s.by_category, s.by_exception_class):
        if len(entries) <= _STATUS_BREAKDOWN_KEYS and all(
                len(e.key) <= _STATUS_KEY_CHARS for e in entries):
            continue
        ranked = sorted(entries, key=lambda e: (-e.count, e.key))
        kept = ranked[:_STATUS_BREAKDOWN_KEYS]
        other = sum(e.count for e in ranked[_STATUS_BREAKDOWN_KEYS:])
        cut = [pb.CountEntry(key=e.key[:_STATUS_KEY_CHARS], count=e.count) for e in kept]
        if other:
            cut.append(pb.CountEntry(key="(other)", count=other))
        del entries[:]
        entries.extend(cut)
    return s


def totals_to_pb(t: Totals) -> pb.SidecarTotals:
    c = t.counts
    return pb.SidecarTotals(
        records_processed=_u64(t.records_processed),
        total_record_failures=_u64(c.total_record_failures),
        total_record_errors=_u64(c.total_record_errors),
        total_records_skipped=_u64(c.total_records_skipped),
        total_retries=_u64(c.total_retries), total_errors_logged=_u64(c.total_errors_logged),
        dropped_records=_u64(c.dropped_records),
        dlq_records_written=_u64(t.dlq_records_written),
        runs_ended={k: _u64(v) for k, v in t.runs_ended.items()},
        since_ms=_ms(t.since))


def _ms(seconds: float) -> int:
    return _i64(int(seconds * 1000))


def ended_run_pb(r: EndedRun, sidecar_id: str) -> pb.EndedRun:
    return pb.EndedRun(summary=_status_summary(summary_to_pb(r.summary, sidecar_id)),
                       outcome=r.outcome, started_ms=_ms(r.started), ended_ms=_ms(r.ended),
                       home=r.home)


def status_to_pb(page: StatusPage) -> pb.SidecarStatus:
    """GetStatus's answer: the counters and totals, the ended runs (the newest that fit
    `_STATUS_ENDED_BYTES`) and one page of live runs, bounded twice: by the page size and by
    bytes (it stays under a default 4 MiB client limit); each run's summary cut for listing
    (reason and breakdowns; the full summary is GetJobSummary's)."""
    out = pb.SidecarStatus(
        sidecar_id=page.sidecar_id, version=page.version, counters=page.counters,
        instance_id=page.instance_id, advertised_address=page.advertised_address,
        jobs_total=page.jobs_total, jobs_hidden=page.jobs_hidden)
    if page.totals is not None:
        out.totals.CopyFrom(totals_to_pb(page.totals))
    room = _STATUS_ENDED_BYTES
    for run in page.ended:
        cut = ended_run_pb(run, page.sidecar_id)
        room -= cut.ByteSize() + 8
        if room < 0:
            break
        out.ended_runs.append(cut)
    budget = _STATUS_PAGE_BYTES - out.ByteSize()
    last = None
    for run, summary in page.summaries:
        if len(out.jobs) >= page.size:
            break
        cut = _status_summary(summary_to_pb(summary, page.sidecar_id))
        cost = cut.ByteSize() + 8
        if cost > budget and out.jobs:
            break
        budget -= cost
        out.jobs.append(cut)
        last = run
    if last is not None and page.last != last:
        out.next_page_token = encode_page_token(*last)
    return out
