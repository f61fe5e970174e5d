"""build_dlq_record: header families, copy switch, overwrite rules, truncation, trace context."""

from __future__ import annotations

import pytest
from spillway.sidecar.core.dlq_record import (
    build_dlq_record,
    truncate_utf8,
    valid_traceparent,
)
from spillway.sidecar.core.model import (
    Action,
    Category,
    ExceptionInfo,
    FailedRecord,
    SourceCoordinates,
    Stage,
    StageRef,
    TaskIdentity,
    Verdict,
)
from spillway.sidecar.core.settings import job_settings

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TASK = TaskIdentity(stage_id=3, partition_id=7, attempt_number=1, task_attempt_id=1234,
                    executor_id="2", host="worker-1")


def settings(**props: str):
    base = {"errors.deadletterqueue.topic.name": "dlq.orders"}
    base.update(props)
    return job_settings("orders-etl", base)


def failed(**kw) -> FailedRecord:
    args = dict(
        record_id="rec-1",
        stage=StageRef(Stage.TRANSFORMATION),
        exception=ExceptionInfo(class_name="builtins.ValueError", message="bad amount: 'x'",
                                stack_trace="Traceback (most recent call last):\n  boom"),
        function_name="etl.parse_amount",
        source=SourceCoordinates("orders", 4, 1234567),
        key=b"order-42",
        value=b'{"amount": "x"}',
        headers=(("content-type", b"application/json"), ("__connect.errors.stage", b"forged")),
    )
    args.update(kw)
    return FailedRecord(**args)


VERDICT = Verdict(record_id="rec-1", action=Action.SKIP, category=Category.DATA,
                  reason="not retriable: data error", attempt=2)


def build(s=None, rec=None, verdict=VERDICT):
    return build_dlq_record(s or settings(), rec or failed(), verdict, TASK,
                            now_ms=1_700_000_000_123, sidecar_id="node-a")


def hdrs(record) -> dict[str, bytes | None]:
    names = [n for n, _ in record.headers]
    assert len(names) == len(set(names)), f"duplicate header names: {names}"
    return dict(record.headers)


def test_connect_format_writes_kip298_headers_and_overwrites_same_named_originals():
    rec = build(settings(**{"errors.deadletterqueue.context.headers.enable": "true"}))
    h = hdrs(rec)
    assert rec.topic == "dlq.orders"
    assert rec.key == b"order-42" and rec.value == b'{"amount": "x"}'
    assert rec.task_key == "orders-etl/3.7.1/1234"
    assert rec.job == "orders-etl" and rec.record_id == "rec-1"
    assert h["content-type"] == b"application/json"
    assert h["__connect.errors.topic"] == b"orders"
    assert h["__connect.errors.partition"] == b"4"
    assert h["__connect.errors.offset"] == b"1234567"
    assert h["__connect.errors.connector.name"] == b"orders-etl"
    assert h["__connect.errors.task.id"] == b"3.7"
    assert h["__connect.errors.stage"] == b"TRANSFORMATION"  # the forged original is replaced
    assert h["__connect.errors.class.name"] == b"etl.parse_amount"
    assert h["__connect.errors.exception.class.name"] == b"builtins.ValueError"
    assert h["__connect.errors.exception.message"] == b"bad amount: 'x'"
    assert h["__connect.errors.exception.stacktrace"].startswith(b"Traceback")
    assert not any(n.startswith("__dlq.") for n in h)


def test_dlq_format_writes_kip1191_headers():
    s = settings(**{"errors.deadletterqueue.context.headers.enable": "true",
                    "errors.deadletterqueue.headers.format": "dlq"})
    h = hdrs(build(s, failed(stage=StageRef(Stage.CUSTOM, "enrich"))))
    assert h["__dlq.errors.topic"] == b"orders"
    assert h["__dlq.errors.partition"] == b"4"
    assert h["__dlq.errors.offset"] == b"1234567"
    assert h["__dlq.errors.group"] == b"orders-etl"
    assert h["__dlq.errors.delivery.count"] == b"2"
    assert h["__dlq.errors.stage"] == b"enrich"
    assert h["__dlq.errors.exception.class.name"] == b"builtins.ValueError"
    assert h["__dlq.errors.exception.message"] == b"bad amount: 'x'"
    assert h["__dlq.errors.class.name"] == b"etl.parse_amount"
    # the original's __connect header is an original header here: kept as it was
    assert h["__connect.errors.stage"] == b"forged"


def test_source_coordinates_only_when_known():
    s = settings(**{"errors.deadletterqueue.context.headers.enable": "true"})
    h = hdrs(build(s, failed(source=None)))
    assert "__connect.errors.topic" not in h
    assert "__connect.errors.partition" not in h
    assert "__connect.errors.offset" not in h
    assert h["__connect.errors.stage"] == b"TRANSFORMATION"


def test_no_context_headers_by_default_but_spillway_headers_always():
    rec = build()
    h = hdrs(rec)
    assert not any(n.startswith("__connect.errors.") and n != "__connect.errors.stage" for n in h)
    assert h["spillway.record.id"] == b"rec-1"
    assert h["spillway.error.category"] == b"data"
    assert h["spillway.attempts"] == b"2"
    assert h["spillway.reason"] == b"not retriable: data error"
    assert h["spillway.job"] == b"orders-etl"
    assert h["spillway.task"] == b"3.7.1 tid=1234 executor=2 host=worker-1"
    assert h["spillway.sidecar"] == b"node-a"
    assert h["spillway.timestamp"] == b"1700000000123"
    assert h["spillway.record.copied"] == b"true"


def test_copy_record_disabled_gives_a_context_only_record():
    s = settings(**{"errors.deadletterqueue.copy.record.enable": "false",
                    "errors.deadletterqueue.context.headers.enable": "true"})
    rec = build(s)
    h = hdrs(rec)
    assert rec.key is None and rec.value is None
    assert "content-type" not in h
    assert h["__connect.errors.stage"] == b"TRANSFORMATION"
    assert h["spillway.record.copied"] == b"false"
    assert h["spillway.record.id"] == b"rec-1"


def test_context_headers_are_utf8():
    s = settings(**{"errors.deadletterqueue.context.headers.enable": "true"})
    exc = ExceptionInfo(class_name="app.Ünïcode", message="prix: 12 € — faux")
    h = hdrs(build(s, failed(exception=exc)))
    assert h["__connect.errors.exception.message"].decode("utf-8") == "prix: 12 € — faux"
    assert h["__connect.errors.exception.class.name"].decode("utf-8") == "app.Ünïcode"
    assert "__connect.errors.exception.stacktrace" not in h  # none reported


def test_stacktrace_is_cut_on_a_utf8_boundary_with_a_marker():
    trace = "€" * 1000  # 3 bytes each
    s = settings(**{"errors.deadletterqueue.context.headers.enable": "true",
                    "errors.deadletterqueue.stacktrace.max.bytes": "100"})
    exc = ExceptionInfo(class_name="E", message="m", stack_trace=trace)
    value = hdrs(build(s, failed(exception=exc)))["__connect.errors.exception.stacktrace"]
    assert len(value) <= 100
    text = value.decode("utf-8")  # would raise on a split character
    body, marker = text.split("...[")
    assert set(body) == {"€"}
    assert marker == f"{3000 - len(body.encode())} bytes cut]"


def test_stacktrace_zero_bytes_leaves_it_out_and_short_traces_are_untouched():
    exc = ExceptionInfo(class_name="E", message="m", stack_trace="short trace")
    s0 = settings(**{"errors.deadletterqueue.context.headers.enable": "true",
                     "errors.deadletterqueue.stacktrace.max.bytes": "0"})
    assert "__connect.errors.exception.stacktrace" not in hdrs(build(s0, failed(exception=exc)))
    s1 = settings(**{"errors.deadletterqueue.context.headers.enable": "true"})
    assert hdrs(build(s1, failed(exception=exc)))[
        "__connect.errors.exception.stacktrace"] == b"short trace"


@pytest.mark.parametrize("text,limit,expected", [
    ("abcdef", 6, b"abcdef"),
    ("a" * 50, 30, b"a" * 13 + b"...[37 bytes cut]"),
    ("é" * 10, 5, b"\xc3\xa9" * 2),  # too small for the marker: cut text only, whole chars
])
def test_truncate_utf8(text, limit, expected):
    assert truncate_utf8(text, limit) == expected


@pytest.mark.parametrize("value,ok", [
    (TP, True),
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", True),
    ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),   # version
    ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", False),   # zero trace id
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", False),   # zero span id
    ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", False),   # upper case
    ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", False),    # short trace id
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1", False),    # short flags
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x", False), # trailing data
    ("", False),
])
def test_traceparent_validation(value, ok):
    assert valid_traceparent(value) is ok


def test_valid_traceparent_and_tracestate_are_written():
    rec = build(rec=failed(traceparent=TP, tracestate="vendor=abc"))
    h = hdrs(rec)
    assert h["traceparent"] == TP.encode()
    assert h["tracestate"] == b"vendor=abc"
    assert rec.traceparent == TP


def test_invalid_traceparent_is_never_copied_through():
    bad = "00-00000000000000000000000000000000-00f067aa0ba902b7-01"
    rec = build(rec=failed(traceparent=bad, tracestate="vendor=abc",
                           headers=(("traceparent", bad.encode()), ("tracestate", b"v=1"))))
    h = hdrs(rec)
    assert "traceparent" not in h and "tracestate" not in h
    assert rec.traceparent == ""


def test_a_valid_original_traceparent_header_is_kept_when_the_record_carries_none():
    rec = build(rec=failed(headers=(("traceparent", TP.encode()),)))
    assert hdrs(rec)["traceparent"] == TP.encode()
    assert rec.traceparent == TP
