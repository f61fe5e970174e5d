"""Building FailedRecords from exceptions: names, causes, classification hints, trace context."""

from __future__ import annotations

import builtins
import json
import subprocess
import sys

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import set_span_in_context
from spillway.client import (
    DataError,
    JobFailedError,
    RecordFailedError,
    RefreshRetriableError,
    RetriableError,
    ToleranceExceededError,
    error_for_verdict,
    report,
)
from spillway.v1 import sidecar_pb2 as pb


def _raise(exc):
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001 - we want the traceback attached
        return e


def test_names_chain_message_and_stack():
    exc = _raise(json.JSONDecodeError("Expecting value", "{x", 1))
    info = report.exception_info(exc)
    assert info.class_name == "json.decoder.JSONDecodeError"
    assert list(info.class_chain) == ["json.decoder.JSONDecodeError", "builtins.ValueError",
                                      "builtins.Exception", "builtins.BaseException"]
    assert info.message.startswith("Expecting value")
    assert "Traceback (most recent call last)" in info.stack_trace
    assert "test_client_report.py" in info.stack_trace
    assert report.exception_info(_raise(ValueError("v"))).class_name == "builtins.ValueError"


def test_causes_outermost_first_and_suppressed_context_is_left_out():
    def inner():
        try:
            raise KeyError("k")
        except KeyError as e:
            raise OSError("disk") from e

    try:
        try:
            inner()
        except OSError:
            raise ValueError("outer")  # noqa: B904 - the implicit __context__ is the point
    except ValueError as exc:
        assert report.causes(exc) == ["builtins.OSError: disk", "builtins.KeyError: 'k'"]
    try:
        try:
            raise KeyError("hidden")
        except KeyError:
            raise ValueError("clean") from None
    except ValueError as exc:
        assert report.causes(exc) == []


def test_grpc_status_code_hint():
    class FakeRpcError(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

    info = report.exception_info(_raise(FakeRpcError()))
    assert info.HasField("grpc_status_code") and info.grpc_status_code == 14
    assert not report.exception_info(_raise(ValueError())).HasField("grpc_status_code")


@pytest.mark.parametrize("make, status", [
    (lambda: type("E", (Exception,), {"status_code": 503})(), 503),
    (lambda: type("E", (Exception,), {"status": 429})(), 429),
    (lambda: type("E", (Exception,), {"response": type("R", (), {"status_code": 404})()})(), 404),
    (lambda: type("E", (Exception,), {"status": "bad", "response": None})(), None),
    (lambda: type("E", (Exception,), {"status_code": True})(), None),
])
def test_http_status_hint(make, status):
    info = report.exception_info(_raise(make()))
    assert (info.http_status_code if info.HasField("http_status_code") else None) == status


def test_kafka_flags_by_duck_typing():
    class KafkaError:  # shaped like confluent_kafka.KafkaError
        def retriable(self):
            return True

        def fatal(self):
            return False

        def txn_requires_abort(self):
            return True

        def code(self):
            return -185  # not a grpc code: ignored

    class KafkaException(Exception):
        pass

    info = report.exception_info(_raise(KafkaException(KafkaError())))
    assert (info.kafka_retriable, info.kafka_fatal, info.kafka_txn_requires_abort) == (
        True, False, True)
    assert not info.HasField("grpc_status_code")
    plain = report.exception_info(_raise(RuntimeError("x")))
    assert not plain.HasField("kafka_retriable") and not plain.HasField("kafka_fatal")


def test_marker_categories_and_wrapped_causes():
    cause = _raise(ConnectionResetError("peer"))
    exc = _raise(RetriableError("db busy", cause=cause))
    info = report.exception_info(exc)
    assert info.marker_category == pb.CATEGORY_RETRIABLE
    assert list(info.causes) == ["builtins.ConnectionResetError: peer"]
    assert report.exception_info(_raise(RefreshRetriableError())).marker_category == \
        pb.CATEGORY_REFRESH_RETRIABLE

    class BadPayload(DataError):
        pass

    info = report.exception_info(_raise(BadPayload("no")))
    assert info.marker_category == pb.CATEGORY_DATA
    assert "spillway.client.markers.DataError" in info.class_chain
    assert report.exception_info(_raise(ValueError())).marker_category == \
        pb.CATEGORY_UNSPECIFIED


def test_failed_record_fields_and_trace_context():
    tracer = TracerProvider().get_tracer("test")
    span = tracer.start_span("spillway.TRANSFORMATION parse")
    ctx = set_span_in_context(span)
    rec = report.failed_record(
        "orders/1/5", "TRANSFORMATION", _raise(ValueError("bad")), function_name="app.parse",
        source=("orders", 1, 5), key=b"k", value="v", headers=[("a", b"1"), ("n", None)],
        timestamp_ms=1700000000000, attempt=2, context=ctx)
    span.end()
    sc = span.get_span_context()
    assert rec.traceparent == f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"
    assert sc.trace_flags.sampled
    assert (rec.source.topic, rec.source.partition, rec.source.offset) == ("orders", 1, 5)
    assert (rec.key, rec.value, rec.timestamp_ms, rec.attempt) == (b"k", b"v", 1700000000000, 2)
    assert [(h.key, h.value if h.HasField("value") else None) for h in rec.headers] == [
        ("a", b"1"), ("n", None)]
    bare = report.failed_record("x:p0:r1", pb.STAGE_SINK, _raise(ValueError()))
    assert bare.traceparent == "" and not bare.HasField("source") and not bare.HasField("key")
    with pytest.raises(ValueError, match="custom_stage"):
        report.failed_record("r", "CUSTOM", _raise(ValueError()))
    with pytest.raises(ValueError, match="record_id"):
        report.failed_record("", "SINK", _raise(ValueError()))


def test_current_span_is_the_default_context():
    tracer = TracerProvider().get_tracer("test")
    assert report.trace_context() == ("", "")
    with tracer.start_as_current_span("s") as span:
        tp, _ = report.trace_context()
    assert tp.split("-")[2] == f"{span.get_span_context().span_id:016x}"


def test_stage_names():
    assert report.stage_value("TASK_PUT") == pb.STAGE_SINK
    assert report.stage_value("stage_value_converter") == pb.STAGE_VALUE_CONVERTER
    assert report.stage_value(pb.STAGE_CUSTOM) == pb.STAGE_CUSTOM
    assert report.stage_name(pb.STAGE_KEY_CONVERTER) == "KEY_CONVERTER"
    with pytest.raises(ValueError, match="allowed: .*TRANSFORMATION"):
        report.stage_value("TRANSFORM")
    with pytest.raises(ValueError):
        report.stage_value(0)


def test_qualified_names_of_functions():
    def local():
        pass

    import functools

    assert report.qualified_name(local).endswith(
        "test_client_report.test_qualified_names_of_functions.<locals>.local")
    assert report.qualified_name(functools.partial(local)) == report.qualified_name(local)
    assert report.qualified_name(len) == "builtins.len"


def _failed(job_failed, reason, category=pb.CATEGORY_DATA):
    rec = report.failed_record("orders/0/3", "VALUE_CONVERTER", _raise(ValueError("bad json")),
                               function_name="app.decode")
    return rec, pb.Verdict(record_id=rec.record_id, action=pb.ACTION_FAIL, reason=reason,
                           job_failed=job_failed, category=category)


def test_fail_verdicts_become_readable_errors():
    rec, v = _failed(True, "tolerance exceeded: errors.tolerance=none allows 0 errors, saw 1")
    err = error_for_verdict("orders-job", rec, v)
    assert type(err) is ToleranceExceededError
    for part in ("orders-job", "VALUE_CONVERTER", "builtins.ValueError", "bad json",
                 "errors.tolerance=none", "orders/0/3"):
        assert part in str(err)
    rec, v = _failed(True, "invalid configuration", pb.CATEGORY_INVALID_CONFIGURATION)
    assert type(error_for_verdict("j", rec, v)) is JobFailedError
    rec, v = _failed(False, "abortable: Spark re-runs the task", pb.CATEGORY_ABORTABLE)
    err = error_for_verdict("j", rec, v)
    assert type(err) is RecordFailedError and "re-runs" in str(err)
    import pickle

    again = pickle.loads(pickle.dumps(err))
    assert type(again) is RecordFailedError and str(again) == str(err)
    assert again.stage == "VALUE_CONVERTER"


def test_client_package_imports_no_spark_kafka_or_otel_sdk():
    code = ("import sys, spillway.client, spillway.client.report, spillway.client.client\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('pyspark', 'confluent_kafka',"
            " 'pandas', 'pyarrow') or m.startswith('opentelemetry.sdk')]\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- stack traces: formatted once per frame signature ------------------------------------------


def _fail_at_site(message):
    raise ValueError(message)


def _fail_elsewhere(message):
    return {}[message]


def _chained(message):
    try:
        _fail_elsewhere(message)
    except KeyError as e:
        raise ValueError(message) from e


def _implicit(message):
    try:
        _fail_elsewhere(message)
    except KeyError:
        raise RuntimeError(message)  # noqa: B904 - the implicit __context__ is the point


def _suppressed(message):
    try:
        _fail_elsewhere(message)
    except KeyError:
        raise ValueError(message) from None


def _with_notes(message):
    e = ValueError(message)
    e.add_note("first note\nsecond line")
    raise e


def _empty_message(_message):
    raise ValueError("")


def _json(message):
    json.loads("{" + message)


def _syntax(_message):
    compile("x = (", "<cell>", "exec")


def _group(message):
    raise builtins.ExceptionGroup("group", [ValueError(message)])


def _caught(fn, message="m"):
    try:
        fn(message)
    except BaseException as e:  # noqa: BLE001 - we want the traceback attached
        return e
    raise AssertionError("did not raise")


@pytest.fixture
def cache(monkeypatch):
    from spillway.client import _stack

    fresh = report.StackCache(maxsize=8)
    monkeypatch.setattr(_stack, "stack_cache", fresh)   # where format_stack_trace reads it
    return fresh


@pytest.mark.parametrize("fn", [_fail_at_site, _fail_elsewhere, _chained, _implicit, _suppressed,
                                _with_notes, _empty_message, _json, _syntax, _group])
def test_stack_trace_is_exactly_tracebacks_text(cache, fn):
    import traceback

    for message in ("one", "two", "one"):  # a miss, then hits
        exc = _caught(fn, message)
        assert report.format_stack_trace(exc) == "".join(traceback.format_exception(exc))
        assert report.exception_info(exc).stack_trace == report.format_stack_trace(exc)


def test_same_site_is_formatted_once_and_gives_the_same_text(cache):
    first = report.format_stack_trace(_caught(_fail_at_site, "same"))
    second = report.format_stack_trace(_caught(_fail_at_site, "same"))
    assert first == second
    assert cache.misses == 1 and cache.hits >= 1 and len(cache) == 1


def test_a_different_message_changes_only_the_message(cache):
    a = report.format_stack_trace(_caught(_fail_at_site, "alpha"))
    b = report.format_stack_trace(_caught(_fail_at_site, "beta"))
    assert a != b
    assert a.endswith("ValueError: alpha\n") and b.endswith("ValueError: beta\n")
    assert a.removesuffix("alpha\n") == b.removesuffix("beta\n")
    assert cache.misses == 1


def test_a_different_site_gives_a_different_trace(cache):
    a = report.format_stack_trace(_caught(_fail_at_site, "x"))
    b = report.format_stack_trace(_caught(_chained, "x"))
    assert "_fail_at_site" in a and "_fail_at_site" not in b
    assert "_chained" in b and "_fail_elsewhere" in b
    assert cache.misses >= 2


def test_the_cache_is_bounded_least_recently_used_first():
    cache = report.StackCache(maxsize=2)
    tb = [_caught(fn).__traceback__ for fn in (_fail_at_site, _fail_elsewhere, _json)]
    cache.frames(tb[0])
    cache.frames(tb[1])
    cache.frames(tb[0])  # tb[0] is now the most recently used
    cache.frames(tb[2])  # evicts tb[1]
    assert len(cache) == 2
    misses = cache.misses
    cache.frames(tb[0])
    assert cache.misses == misses  # kept
    cache.frames(tb[1])
    assert cache.misses == misses + 1  # was evicted, formatted again
    with pytest.raises(ValueError, match="maxsize"):
        report.StackCache(maxsize=0)


def test_trace_context_of_the_same_context_is_reused():
    provider = TracerProvider()
    span = provider.get_tracer("t").start_span("s")
    ctx = set_span_in_context(span)
    first = report.trace_context(ctx)
    assert first[0].startswith("00-") and report.trace_context(ctx) is first
    other = set_span_in_context(provider.get_tracer("t").start_span("s2"))
    assert report.trace_context(other) != first


def _reference_record(record_id, stage, exc, *, custom_stage="", function_name="", source=None,
                      key=None, value=None, headers=(), timestamp_ms=None, attempt=1,
                      context=None):
    """failed_record built the straightforward way: every field passed, nested messages
    copied in (what failed_record must still produce)."""
    import traceback

    tp, ts = report.trace_context(context)
    info = pb.ExceptionInfo(
        class_name=report.qualified_name(type(exc)),
        class_chain=[report.qualified_name(c) for c in type(exc).__mro__ if c is not object],
        message=str(exc), stack_trace="".join(traceback.format_exception(exc)),
        causes=report.causes(exc))
    if (code := report.grpc_status_code(exc)) is not None:
        info.grpc_status_code = code
    if (status := report.http_status_code(exc)) is not None:
        info.http_status_code = status
    retriable, fatal, abort = report.kafka_flags(exc)
    if retriable is not None:
        info.kafka_retriable = retriable
    if fatal is not None:
        info.kafka_fatal = fatal
    if abort is not None:
        info.kafka_txn_requires_abort = abort
    rec = pb.FailedRecord(
        record_id=record_id, stage=report.stage_value(stage), custom_stage=custom_stage,
        function_name=function_name,
        headers=[pb.Header(key=k, value=report.as_bytes(v)) if v is not None
                 else pb.Header(key=k) for k, v in headers],
        exception=info, attempt=max(1, int(attempt)), traceparent=tp, tracestate=ts)
    if source is not None:
        rec.source.CopyFrom(pb.SourceCoordinates(topic=source[0], partition=int(source[1]),
                                                 offset=int(source[2])))
    if key is not None:
        rec.key = report.as_bytes(key)
    if value is not None:
        rec.value = report.as_bytes(value)
    if timestamp_ms is not None:
        rec.timestamp_ms = int(timestamp_ms)
    return rec


def test_failed_record_matches_the_reference_construction_byte_for_byte():
    class Http(Exception):
        status_code = 503

    def chained(_msg):
        try:
            raise KeyError("k")
        except KeyError as e:
            raise ValueError("v") from e

    def suppressed(_msg):
        try:
            raise KeyError("k")
        except KeyError:
            raise ValueError("none") from None

    def during(_msg):
        try:
            raise KeyError("k")
        except KeyError:
            raise ValueError("during")  # noqa: B904 - the implicit context is the point

    noted = ValueError("n")
    noted.add_note("note 1\nnote 2")
    excs = [_raise(ValueError("plain é")), ValueError("no traceback"), _raise(Http("h")),
            _raise(noted), _caught(chained), _caught(suppressed), _caught(during),
            _raise(builtins.ExceptionGroup("g", [ValueError(1), TypeError(2)]))]
    span_ctx = set_span_in_context(TracerProvider().get_tracer("t").start_span("s"))
    variants = [
        dict(),
        dict(custom_stage="c", function_name="f.g", source=("t", 0, 0), key="k", value=b"",
             headers=[("a", None), ("b", "s"), ("c", b"x")], timestamp_ms=0, attempt=0,
             context=span_ctx),
        dict(source=("topic", 3, 2**40), key=b"", value="é", timestamp_ms=17, attempt=5),
        dict(source=("", 0, 0), headers=(("h", bytearray(b"1")),), context=span_ctx),
    ]
    for exc in excs:
        for kw in variants:
            stage = "CUSTOM" if kw.get("custom_stage") else "SINK"
            got = report.failed_record("rid", stage, exc, **kw)
            want = _reference_record("rid", stage, exc, **kw)
            assert got == want
            assert got.SerializeToString(deterministic=True) == \
                want.SerializeToString(deterministic=True)
            assert got.HasField("source") == want.HasField("source")
            assert report.exception_info(exc) == want.exception


def test_exceptions_without_hints_skip_the_lookups_with_the_same_answer(monkeypatch):
    """`exception_fields` skips the duck-typed hint lookups for an exception that cannot carry
    one; every kind of exception gets the fields the full lookups give."""

    class KafkaLike:
        def retriable(self):
            return True

        def fatal(self):
            return False

        def name(self):
            return "NOT_LEADER_FOR_PARTITION"

    class ClassHint(Exception):
        status_code = 503

    class Dynamic(Exception):
        def __getattr__(self, name):
            return 404 if name == "status" else None

    class GrpcLike(Exception):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

    def caught(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - collecting them
            return exc
        raise AssertionError("no exception")

    def wrapped_kafka():
        try:
            raise Exception(KafkaLike())
        except Exception as inner:
            raise RuntimeError("produce failed") from inner

    instance_hint = ValueError("rate limited")
    instance_hint.status_code = 429
    excs = [caught(lambda: json.loads("{")), caught(lambda: int("x")), caught(lambda: {}["k"]),
            ValueError("plain"), ClassHint("c"), Dynamic("d"), GrpcLike(), instance_hint,
            Exception(KafkaLike()), caught(wrapped_kafka), DataError("marked"),
            caught(lambda: __import__("no_such_module_here")), OSError(2, "missing"),
            KeyboardInterrupt()]
    fast = [report.exception_fields(e) for e in excs]
    assert report.hintless(excs[0]) and not report.hintless(instance_hint)
    assert not report.hintless(Dynamic("d")) and not report.hintless(Exception(KafkaLike()))
    monkeypatch.setattr(report, "hintless", lambda exc: False)
    assert fast == [report.exception_fields(e) for e in excs]
    assert fast[5]["http_status_code"] == 404 and fast[7]["http_status_code"] == 429
    assert fast[9]["kafka_error_code"] == "NOT_LEADER_FOR_PARTITION"
