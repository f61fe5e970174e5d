"""KIP-298 error log: one structured line per error, with its context (``errors.log.enable``).

The engine builds the fields (`error_fields`) and hands them to an `ErrorLogger` port; the
default adapter `JsonErrorLogger` writes them as one JSON line to the ``spillway.errors``
stdlib logger. The record's key, value and headers are included only with
``errors.log.include.messages=true`` (KIP-298: records may be sensitive or large); without it
the line still carries the minimal coordinates (topic, partition, offset, record id).
Bytes are written as UTF-8 text when they decode, else as base64 with ``*_encoding`` saying so.
"""

from __future__ import annotations

import base64
import json
import logging

from .model import FailedRecord, TaskIdentity, Verdict

LOGGER_NAME = "spillway.errors"
MAX_STACK_CHARS = 8192


def _text(data: bytes | None) -> tuple[str | None, str]:
    if data is None:
        return None, "null"
    try:
        return data.decode("utf-8"), "utf8"
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), "base64"


def error_fields(*, job: str, task: TaskIdentity, record: FailedRecord, verdict: Verdict,
                 include_messages: bool, wall_ms: int, rule: str = "") -> dict[str, object]:
    exc = record.exception
    fields: dict[str, object] = {
        "timestamp_ms": wall_ms,
        "job": job,
        "task_id": task.task_id,
        "stage_id": task.stage_id,
        "partition_id": task.partition_id,
        "task_attempt": task.attempt_number,
        "task_attempt_id": task.task_attempt_id,
        "executor_id": task.executor_id,
        "host": task.host,
        "stage": record.stage.name,
        "function": record.function_name,
        "record_id": record.record_id,
        "attempt": verdict.attempt,
        "action": verdict.action.value,
        "category": verdict.category.value,
        "classified_by": rule,
        "reason": verdict.reason,
        "job_failed": verdict.job_failed,
        "exception_class": exc.class_name,
        "exception_message": exc.message,
        "stack_trace": exc.stack_trace[:MAX_STACK_CHARS],
        "causes": list(exc.causes),
    }
    if record.source is not None:
        fields.update(topic=record.source.topic, partition=record.source.partition,
                      offset=record.source.offset)
    if record.traceparent:
        fields["traceparent"] = record.traceparent
    if include_messages:
        key, key_enc = _text(record.key)
        value, value_enc = _text(record.value)
        headers = []
        for name, raw in record.headers:
            text, enc = _text(raw)
            headers.append({"key": name, "value": text, "encoding": enc})
        fields.update(key=key, key_encoding=key_enc, value=value, value_encoding=value_enc,
                      headers=headers, record_timestamp_ms=record.timestamp_ms)
    return fields


class JsonErrorLogger:
    """The default ErrorLogger: a JSON line on the ``spillway.errors`` logger, level ERROR."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._logger = logger or logging.getLogger(LOGGER_NAME)

    def log_error(self, fields: dict[str, object]) -> None:
        self._logger.error(json.dumps(fields, default=str, separators=(",", ":")))
