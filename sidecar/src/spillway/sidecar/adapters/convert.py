"""Translation between spillway.v1 protobuf messages and the core's domain values.

Pure translation: no policy here. Invalid input raises ValueError naming the field, which the
servicer turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

from spillway.v1 import sidecar_pb2 as pb

from ..core import model as m

_STAGE_FROM_PB = {
    pb.STAGE_DESERIALIZATION: m.Stage.DESERIALIZATION,
    pb.STAGE_KEY_CONVERTER: m.Stage.KEY_CONVERTER,
    pb.STAGE_VALUE_CONVERTER: m.Stage.VALUE_CONVERTER,
    pb.STAGE_HEADER_CONVERTER: m.Stage.HEADER_CONVERTER,
    pb.STAGE_TRANSFORMATION: m.Stage.TRANSFORMATION,
    pb.STAGE_SINK: m.Stage.SINK,
    pb.STAGE_PRODUCE: m.Stage.PRODUCE,
    pb.STAGE_CUSTOM: m.Stage.CUSTOM,
}
_STAGE_TO_PB = {v: k for k, v in _STAGE_FROM_PB.items()}

_CATEGORY_FROM_PB = {
    pb.CATEGORY_RETRIABLE: m.Category.RETRIABLE,
    pb.CATEGORY_REFRESH_RETRIABLE: m.Category.REFRESH_RETRIABLE,
    pb.CATEGORY_ABORTABLE: m.Category.ABORTABLE,
    pb.CATEGORY_APPLICATION_RECOVERABLE: m.Category.APPLICATION_RECOVERABLE,
    pb.CATEGORY_INVALID_CONFIGURATION: m.Category.INVALID_CONFIGURATION,
    pb.CATEGORY_DATA: m.Category.DATA,
}
_CATEGORY_TO_PB = {v: k for k, v in _CATEGORY_FROM_PB.items()}

_ACTION_TO_PB = {m.Action.RETRY: pb.ACTION_RETRY, m.Action.SKIP: pb.ACTION_SKIP,
                 m.Action.FAIL: pb.ACTION_FAIL}


def stage_ref(stage: int, custom: str, where: str) -> m.StageRef:
    try:
        s = _STAGE_FROM_PB[stage]
    except KeyError:
        raise ValueError(
            f"{where}.stage: must be one of {sorted(pb.Stage.keys())[1:]} (got {stage})"
        ) from None
    if s is m.Stage.CUSTOM and not custom.strip():
        raise ValueError(f"{where}.custom_stage: required with STAGE_CUSTOM")
    return m.StageRef(s, custom.strip() if s is m.Stage.CUSTOM else "")


def stage_to_pb(ref: m.StageRef) -> tuple[int, str]:
    return _STAGE_TO_PB[ref.stage], ref.custom


def task_identity(t: pb.TaskIdentity) -> m.TaskIdentity:
    return m.TaskIdentity(
        stage_id=t.stage_id, partition_id=t.partition_id, attempt_number=t.attempt_number,
        task_attempt_id=t.task_attempt_id, executor_id=t.executor_id, host=t.host,
    )


def _exception(e: pb.ExceptionInfo, where: str) -> m.ExceptionInfo:
    if not e.class_name:
        raise ValueError(f"{where}.exception.class_name: required")
    return m.ExceptionInfo(
        class_name=e.class_name,
        class_chain=tuple(e.class_chain) or (e.class_name,),
        message=e.message,
        stack_trace=e.stack_trace,
        grpc_status_code=e.grpc_status_code if e.HasField("grpc_status_code") else None,
        http_status_code=e.http_status_code if e.HasField("http_status_code") else None,
        kafka_retriable=e.kafka_retriable if e.HasField("kafka_retriable") else None,
        kafka_fatal=e.kafka_fatal if e.HasField("kafka_fatal") else None,
        kafka_txn_requires_abort=(e.kafka_txn_requires_abort
                                  if e.HasField("kafka_txn_requires_abort") else None),
        marker_category=_CATEGORY_FROM_PB.get(e.marker_category),
        causes=tuple(e.causes),
    )


def failed_record(r: pb.FailedRecord, index: int) -> m.FailedRecord:
    where = f"records[{index}]"
    if not r.record_id:
        raise ValueError(f"{where}.record_id: required (stable across task attempts)")
    if not r.HasField("exception"):
        raise ValueError(f"{where}.exception: required")
    source = None
    if r.HasField("source"):
        if not r.source.topic:
            raise ValueError(f"{where}.source.topic: required when source is set")
        source = m.SourceCoordinates(r.source.topic, r.source.partition, r.source.offset)
    return m.FailedRecord(
        record_id=r.record_id,
        stage=stage_ref(r.stage, r.custom_stage, where),
        exception=_exception(r.exception, where),
        function_name=r.function_name,
        source=source,
        key=r.key if r.HasField("key") else None,
        value=r.value if r.HasField("value") else None,
        headers=tuple((h.key, h.value if h.HasField("value") else None) for h in r.headers),
        timestamp_ms=r.timestamp_ms if r.HasField("timestamp_ms") else None,
        attempt=max(1, r.attempt),
        traceparent=r.traceparent,
        tracestate=r.tracestate,
    )


def verdict_to_pb(v: m.Verdict, dead_letter: bool = False) -> pb.Verdict:
    return pb.Verdict(
        dead_letter=dead_letter,
        record_id=v.record_id,
        action=_ACTION_TO_PB[v.action],
        retry_delay_ms=max(0, int(v.retry_delay_ms)),
        category=_CATEGORY_TO_PB[v.category],
        reason=v.reason,
        dead_lettered=v.dead_lettered,
        attempt=v.attempt,
        job_failed=v.job_failed,
    )


_ACTION_FROM_PB = {v: k for k, v in _ACTION_TO_PB.items()}


def verdict_from_pb(v: pb.Verdict) -> m.Verdict:
    """A verdict decided by a job's home sidecar, back into a core value."""
    return m.Verdict(
        record_id=v.record_id, action=_ACTION_FROM_PB[v.action],
        category=_CATEGORY_FROM_PB.get(v.category, m.Category.DATA), reason=v.reason,
        attempt=v.attempt, retry_delay_ms=v.retry_delay_ms, dead_lettered=v.dead_lettered,
        job_failed=v.job_failed,
    )


def _entries(d: dict[str, int]) -> list[pb.CountEntry]:
    return [pb.CountEntry(key=k, count=c) for k, c in sorted(d.items())]


def summary_to_pb(s: m.JobSummary, sidecar_id: str) -> pb.JobSummary:
    c = s.counts
    return pb.JobSummary(
        job=s.job, failed=s.failed, failure_reason=s.failure_reason,
        records_processed=s.records_processed,
        total_record_failures=c.total_record_failures,
        total_record_errors=c.total_record_errors,
        total_records_skipped=c.total_records_skipped,
        total_retries=c.total_retries,
        total_errors_logged=c.total_errors_logged,
        dlq_records_written=s.dlq_records_written,
        last_error_timestamp_ms=c.last_error_timestamp_ms,
        by_stage=_entries(s.by_stage),
        by_category=_entries(s.by_category),
        by_exception_class=_entries(s.by_exception_class),
        sidecar_id=sidecar_id,
        dropped_records=c.dropped_records,
    )
