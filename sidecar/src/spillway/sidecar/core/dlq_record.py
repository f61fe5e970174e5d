"""Build the record written to the dead letter queue for one dead-lettered record (pure).

Header families (all values UTF-8):

- the original record's headers, when ``errors.deadletterqueue.copy.record.enable`` is true
  (the default); with it false the DLQ record is context-only: no key, no value, no original
  headers (KIP-1191's copy switch);
- the error-context headers, when ``errors.deadletterqueue.context.headers.enable`` is true, in the
  family ``errors.deadletterqueue.headers.format`` names: ``connect`` writes KIP-298's
  ``__connect.errors.*``, ``dlq`` writes KIP-1191's ``__dlq.errors.*``. They overwrite original
  headers of the same name (KIP-1191);
- spillway's own headers, always: ``spillway.record.id``, ``spillway.error.category``,
  ``spillway.attempts``, ``spillway.reason``, ``spillway.job``, ``spillway.task``,
  ``spillway.sidecar``, ``spillway.timestamp`` (ms since the epoch when the record was
  dead-lettered) and ``spillway.record.copied`` (whether key/value/headers are the original's:
  redrive refuses context-only records);
- ``traceparent`` (and ``tracestate``) when the record carries a valid W3C trace context. An
  invalid one is never copied through, not even from the original headers.

Stack traces are cut to ``errors.deadletterqueue.stacktrace.max.bytes`` on a UTF-8 character
boundary and end with a marker saying how many bytes were cut; 0 leaves the stack trace out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from .model import DlqRecord, FailedRecord, Header, TaskIdentity, Verdict, task_key
from .settings import JobSettings

CONNECT_PREFIX = "__connect.errors."
DLQ_PREFIX = "__dlq.errors."
SPILLWAY_PREFIX = "spillway."

H_RECORD_ID = "spillway.record.id"
H_CATEGORY = "spillway.error.category"
H_ATTEMPTS = "spillway.attempts"
H_REASON = "spillway.reason"
H_JOB = "spillway.job"
H_TASK = "spillway.task"
H_SIDECAR = "spillway.sidecar"
H_TIMESTAMP = "spillway.timestamp"
H_COPIED = "spillway.record.copied"
H_REDRIVE_COUNT = "spillway.redrive.count"
H_TRACEPARENT = "traceparent"
H_TRACESTATE = "tracestate"

_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
_TRACESTATE_MAX = 512  # W3C: vendors may drop a longer tracestate


def valid_traceparent(value: str) -> bool:
    """W3C trace context, version 00: ``00-<32 hex trace id>-<16 hex span id>-<2 hex flags>``,
    lower-case hex, neither id all zeros."""
    m = _TRACEPARENT.fullmatch(value)
    return bool(m) and m.group(1) != "0" * 32 and m.group(2) != "0" * 16


def valid_tracestate(value: str) -> bool:
    """Printable ASCII, at most 512 characters (the W3C bound); empty is not a tracestate."""
    return 0 < len(value) <= _TRACESTATE_MAX and all(0x20 <= ord(c) < 0x7F for c in value)


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "backslashreplace")


def truncate_utf8(text: str, max_bytes: int) -> bytes:
    """`text` as UTF-8, at most `max_bytes` long, cut on a character boundary.

    A cut text ends with ``...[N bytes cut]``, counted within `max_bytes`; when `max_bytes` is
    too small for the marker, only the cut text is kept.
    """
    data = _utf8(text)
    if len(data) <= max_bytes:
        return data

    def boundary(n: int) -> int:  # never split a multi-byte character
        while n > 0 and (data[n] & 0xC0) == 0x80:
            n -= 1
        return n

    longest_marker = len(f"...[{len(data)} bytes cut]")
    if max_bytes < longest_marker:
        return data[:boundary(max_bytes)]
    keep = boundary(max_bytes - longest_marker)
    return data[:keep] + f"...[{len(data) - keep} bytes cut]".encode()


def task_description(task: TaskIdentity) -> str:
    """``spillway.task``: ``<stage>.<partition>.<attempt> tid=<task attempt id> executor=<id>
    host=<host>``."""
    return (f"{task.stage_id}.{task.partition_id}.{task.attempt_number} "
            f"tid={task.task_attempt_id} executor={task.executor_id} host={task.host}")


def _context_headers(settings: JobSettings, record: FailedRecord, verdict: Verdict,
                     task: TaskIdentity) -> list[Header]:
    dlq = settings.dlq
    exc = record.exception
    prefix = CONNECT_PREFIX if dlq.header_format == "connect" else DLQ_PREFIX
    out: list[Header] = []
    if record.source is not None:
        out += [(prefix + "topic", _utf8(record.source.topic)),
                (prefix + "partition", str(record.source.partition).encode()),
                (prefix + "offset", str(record.source.offset).encode())]
    if dlq.header_format == "connect":
        out += [(prefix + "connector.name", _utf8(settings.job)),
                (prefix + "task.id", _utf8(task.task_id))]
    else:
        out += [(prefix + "group", _utf8(settings.job)),
                (prefix + "delivery.count", str(verdict.attempt).encode()),
                (prefix + "task.id", _utf8(task.task_id))]
    out += [(prefix + "stage", _utf8(record.stage.name)),
            (prefix + "class.name", _utf8(record.function_name)),
            (prefix + "exception.class.name", _utf8(exc.class_name)),
            (prefix + "exception.message", _utf8(exc.message))]
    if exc.stack_trace and dlq.stacktrace_max_bytes > 0:
        out.append((prefix + "exception.stacktrace",
                    truncate_utf8(exc.stack_trace, dlq.stacktrace_max_bytes)))
    return out


def _trace_headers(record: FailedRecord, original: Iterable[Header]) -> list[Header]:
    """The record's own trace context wins; else a valid one from the original headers."""
    parent, state = record.traceparent, record.tracestate
    if not valid_traceparent(parent):
        parent, state = "", ""
        orig = dict(original)
        raw_parent = orig.get(H_TRACEPARENT)
        if raw_parent is not None:
            text = raw_parent.decode("ascii", "replace")
            if valid_traceparent(text):
                parent = text
                raw_state = orig.get(H_TRACESTATE)
                state = raw_state.decode("ascii", "replace") if raw_state is not None else ""
    if not parent:
        return []
    out: list[Header] = [(H_TRACEPARENT, parent.encode("ascii"))]
    if valid_tracestate(state):
        out.append((H_TRACESTATE, state.encode("ascii")))
    return out


def build_dlq_record(settings: JobSettings, record: FailedRecord, verdict: Verdict,
                     task: TaskIdentity, *, now_ms: int, sidecar_id: str) -> DlqRecord:
    """The DLQ record for `record`, dead-lettered with `verdict` by `task` of `settings.job`."""
    dlq = settings.dlq
    copy = dlq.copy_record
    added: list[Header] = []
    if dlq.context_headers:
        added += _context_headers(settings, record, verdict, task)
    added += [
        (H_RECORD_ID, _utf8(record.record_id)),
        (H_CATEGORY, verdict.category.value.encode()),
        (H_ATTEMPTS, str(verdict.attempt).encode()),
        (H_REASON, _utf8(verdict.reason)),
        (H_JOB, _utf8(settings.job)),
        (H_TASK, _utf8(task_description(task))),
        (H_SIDECAR, _utf8(sidecar_id)),
        (H_TIMESTAMP, str(now_ms).encode()),
        (H_COPIED, b"true" if copy else b"false"),
    ]
    original = record.headers if copy else ()
    trace = _trace_headers(record, original)
    added += trace
    # Added headers overwrite same-named original ones (KIP-1191); trace headers are always
    # spillway's decision, so an invalid original traceparent/tracestate never passes through.
    replaced = {name for name, _ in added} | {H_TRACEPARENT, H_TRACESTATE}
    headers = tuple(h for h in original if h[0] not in replaced) + tuple(added)
    traceparent = trace[0][1].decode("ascii") if trace else ""
    return DlqRecord(
        topic=dlq.topic,
        key=record.key if copy else None,
        value=record.value if copy else None,
        headers=headers,
        record_id=record.record_id,
        job=settings.job,
        task_key=task_key(settings.job, task),
        traceparent=traceparent,
    )
