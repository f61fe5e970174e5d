"""build_dlq_record: header families, copy switch, overwrite rules, truncation, trace context."""

from __future__ import annotations

import dataclasses

import pytest
from spillway.sidecar.core.dlq_record import (
    DlqBuilder,
    Streak,
    build_dlq_record,
    build_dlq_records,
    new_dlq_record,
    record_id_header,
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

from support.records import SharedTrace

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


def test_connect_format_writes_kip298_headers_only_where_the_original_has_none():
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
    # KIP-298: added "only if they don't already exist in the message": the original's is kept
    # (spillway.* headers stay the sidecar's own account)
    assert h["__connect.errors.stage"] == b"forged"
    assert h["spillway.error.category"] == b"data"
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
    h = hdrs(build(s, failed(source=None, headers=())))
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


# --- the per-report builder gives what building each record from scratch gives ------------------

def _reference(settings, record, verdict, task, *, now_ms, sidecar_id, fallback=""):
    """The DLQ record built the straightforward way (the builder's specification)."""
    import re

    from spillway.sidecar.core.dlq_record import task_description, truncate_utf8
    from spillway.sidecar.core.model import DlqRecord, task_key

    def valid(tp):
        m = re.fullmatch(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}", tp)
        return bool(m) and m.group(1) != "0" * 32 and m.group(2) != "0" * 16

    def utf8(text):
        return text.encode("utf-8", "backslashreplace")

    if not valid(record.traceparent):
        record = dataclasses.replace(record, traceparent=fallback, tracestate="")
    dlq, exc = settings.dlq, record.exception
    added = []
    if dlq.context_headers:
        p = "__connect.errors." if dlq.header_format == "connect" else "__dlq.errors."
        if record.source is not None:
            added += [(p + "topic", utf8(record.source.topic)),
                      (p + "partition", str(record.source.partition).encode()),
                      (p + "offset", str(record.source.offset).encode())]
        if dlq.header_format == "connect":
            added += [(p + "connector.name", utf8(settings.job)),
                      (p + "task.id", utf8(task.task_id))]
        else:
            added += [(p + "group", utf8(settings.job)),
                      (p + "delivery.count", str(verdict.attempt).encode()),
                      (p + "task.id", utf8(task.task_id))]
        added += [(p + "stage", utf8(record.stage.name)),
                  (p + "class.name", utf8(record.function_name)),
                  (p + "exception.class.name", utf8(exc.class_name)),
                  (p + "exception.message", utf8(exc.message))]
        if exc.stack_trace and dlq.stacktrace_max_bytes > 0:
            added.append((p + "exception.stacktrace",
                          truncate_utf8(exc.stack_trace, dlq.stacktrace_max_bytes)))
    copy = dlq.copy_record
    if dlq.context_headers and dlq.header_format == "connect" and copy:
        # KIP-298: a context header only where the original has none of that name
        have = {n for n, _ in record.headers}
        added = [h for h in added if h[0] not in have]
    added += [("spillway.record.id", utf8(record.record_id)),
              ("spillway.error.category", verdict.category.value.encode()),
              ("spillway.attempts", str(verdict.attempt).encode()),
              ("spillway.reason", utf8(verdict.reason)),
              ("spillway.job", utf8(settings.job)),
              ("spillway.task", utf8(task_description(task))),
              ("spillway.sidecar", utf8(sidecar_id)),
              ("spillway.timestamp", str(now_ms).encode()),
              ("spillway.record.copied", b"true" if copy else b"false")]
    if copy:
        added.append(("spillway.payload", record.payload.encode()))
    original = record.headers if copy else ()
    parent, state = record.traceparent, record.tracestate
    if not valid(parent):
        parent, state = "", ""
        orig = dict(original)
        if orig.get("traceparent") is not None:
            text = orig["traceparent"].decode("ascii", "replace")
            if valid(text):
                parent = text
                raw = orig.get("tracestate")
                state = raw.decode("ascii", "replace") if raw is not None else ""
    if parent:
        added.append(("traceparent", parent.encode("ascii")))
        if 0 < len(state) <= 512 and all(0x20 <= ord(c) < 0x7F for c in state):
            added.append(("tracestate", state.encode("ascii")))
    replaced = {n for n, _ in added} | {"traceparent", "tracestate"}
    return DlqRecord(
        topic=dlq.topic, key=record.key if copy else None,
        value=record.value if copy else None,
        headers=tuple(h for h in original if h[0] not in replaced) + tuple(added),
        record_id=record.record_id, job=settings.job, task_key=task_key(settings.job, task),
        traceparent=parent)


def test_the_builder_matches_the_reference_for_varied_records():
    import random

    rnd = random.Random(7)
    bad = "00-00000000000000000000000000000000-00f067aa0ba902b7-01"
    own = "00-aaf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    names = ["content-type", "traceparent", "tracestate", "__connect.errors.stage",
             "__connect.errors.topic", "__dlq.errors.group", "spillway.job",
             "__connect.errors.exception.stacktrace", "x"]
    values = [b"v", TP.encode(), bad.encode(), b"ts=1", None, b"\xff\xfe", "é".encode()]
    stages = [StageRef(Stage.TRANSFORMATION), StageRef(Stage.CUSTOM, "enr\udcff"),
              StageRef(Stage.SINK)]
    n = 0
    for ctx in ("true", "false"):
        for fmt in ("connect", "dlq"):
            for copy in ("true", "false"):
                for max_bytes in ("0", "20", "8000"):
                    s = job_settings("job-é", {
                        "errors.deadletterqueue.topic.name": "dlq.x",
                        "errors.deadletterqueue.context.headers.enable": ctx,
                        "errors.deadletterqueue.headers.format": fmt,
                        "errors.deadletterqueue.copy.record.enable": copy,
                        "errors.deadletterqueue.stacktrace.max.bytes": max_bytes})
                    builder = DlqBuilder(s, TASK, now_ms=123, sidecar_id="sc")
                    shared_builder = DlqBuilder(s, TASK, now_ms=123, sidecar_id="sc")
                    for i in range(40):
                        rec = failed(
                            record_id=f"r-{i}-é", stage=rnd.choice(stages),
                            exception=ExceptionInfo(
                                class_name="builtins.ValueError",
                                message=rnd.choice(["", "bad é", "x\udc80"]),
                                stack_trace=rnd.choice(["", "Traceback\n" + "é" * 50])),
                            function_name=rnd.choice(["", "f.g"]),
                            source=rnd.choice([None, SourceCoordinates("t", 3, 99)]),
                            key=rnd.choice([None, b"k"]), value=rnd.choice([None, b"v"]),
                            headers=tuple((rnd.choice(names), rnd.choice(values))
                                          for _ in range(rnd.randint(0, 5))),
                            traceparent=rnd.choice(["", TP, bad, "junk"]),
                            tracestate=rnd.choice(["", "a=b", "\x01"]),
                            payload=rnd.choice(["source", "stage-input"]))
                        v = Verdict(rec.record_id, Action.SKIP, rnd.choice(list(Category)),
                                    "why é", rnd.randint(1, 12))
                        assert build_dlq_record(s, rec, v, TASK, now_ms=123, sidecar_id="sc") \
                            == _reference(s, rec, v, TASK, now_ms=123, sidecar_id="sc")
                        shared = SharedTrace(*(getattr(rec, f.name)
                                                for f in dataclasses.fields(rec)))
                        for fallback in ("", own, bad):
                            want = _reference(s, rec, v, TASK, now_ms=123, sidecar_id="sc",
                                              fallback=fallback)
                            assert builder.build(rec, v, fallback) == want
                            assert shared_builder.build(shared, v, fallback) == want
                        n += 1
    assert n == 2 * 2 * 2 * 3 * 40


def test_a_span_of_records_decided_alike_builds_what_each_record_builds_alone():
    """`DlqBuilder.build_streak` puts records that fail the same way and share a trace together
    without `build`'s checks: over spans mixing ways of failing, traces, original headers,
    payload kinds and fallbacks, every record is what the reference builds for it, and every
    run of them it notes (`Streak`) describes its records exactly."""
    import random

    rnd = random.Random(11)
    in_streaks = 0
    own = "00-aaf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    excs = [ExceptionInfo("builtins.ValueError", message="bad", stack_trace="Traceback\n é"),
            ExceptionInfo("builtins.KeyError", message="'k'")]
    stages = [StageRef(Stage.TRANSFORMATION), StageRef(Stage.SINK)]
    fns = ["f.g", "h"]
    n = 0
    for ctx in ("false", "true"):
        for copy in ("true", "false"):
            s = job_settings("job", {
                "errors.deadletterqueue.topic.name": "dlq.x",
                "errors.deadletterqueue.context.headers.enable": ctx,
                "errors.deadletterqueue.copy.record.enable": copy})
            for _ in range(30):
                # mostly alike, now and then another way of failing, trace or original headers
                recs = [SharedTrace(*(getattr(r, f.name) for f in dataclasses.fields(r)))
                        for r in (failed(
                            record_id=f"r-{k}", exception=excs[rnd.random() < 0.1],
                            stage=stages[rnd.random() < 0.05], function_name=fns[
                                rnd.random() < 0.05],
                            source=SourceCoordinates("t", rnd.randrange(2), k),
                            key=rnd.choice([None, b"k%d" % k]), value=b"v%d" % k,
                            headers=(("x", b"1"),) if rnd.random() < 0.05 else (),
                            traceparent=TP if rnd.random() < 0.9 else own,
                            payload="source" if rnd.random() < 0.95 else "stage-input")
                            for k in range(rnd.randint(1, 60)))]
                v = Verdict("", Action.SKIP, Category.DATA, "why", 1)
                fallback = rnd.choice(["", own])
                builder = DlqBuilder(s, TASK, now_ms=123, sidecar_id="sc")
                start = rnd.randrange(len(recs))
                count = rnd.randint(0, len(recs) - start)
                out: list = [None]
                streaks: list[Streak] = []
                builder.build_streak(recs, start, count, v, fallback, out, streaks=streaks)
                assert out[0] is None and len(out) == count + 1
                assert out[1:] == [_reference(s, r, v, TASK, now_ms=123, sidecar_id="sc",
                                              fallback=fallback)
                                   for r in recs[start:start + count]]
                n += count
                # each streak noted is exactly its records, in order, none overlapping
                pos = 1
                for st in streaks:
                    assert st.start >= pos and st.n >= 1 and st.start + st.n <= len(out)
                    pos = st.start + st.n
                    for rec in out[st.start:pos]:
                        assert rec == new_dlq_record((
                            st.topic, rec.key if st.copied else None,
                            rec.value if st.copied else None,
                            st.before + (record_id_header(rec.record_id),) + st.after,
                            rec.record_id, st.job, st.task_key, st.traceparent))
                    in_streaks += st.n
    assert n > 1000 and in_streaks > n // 4   # (context headers: never a streak)


def test_build_dlq_records_builds_each_record_of_a_report():
    recs = [failed(record_id=f"r{i}", traceparent=TP if i % 2 else "") for i in range(4)]
    verdicts = [VERDICT] * 4
    own = "00-aaf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    out = build_dlq_records(settings(), TASK, zip(recs, verdicts), now_ms=5, sidecar_id="n",
                            fallback_traceparent=own)
    assert [r.traceparent for r in out] == [own, TP, own, TP]
    assert out[1] == build_dlq_record(settings(), recs[1], VERDICT, TASK, now_ms=5,
                                      sidecar_id="n")


def test_the_fast_dlq_record_factory_builds_ordinary_frozen_records():
    from spillway.sidecar.core import dlq_record
    from spillway.sidecar.core.model import DlqRecord

    assert dlq_record.FAST_DLQ_RECORDS   # the fast path is in use
    args = ("dlq.x", None, b"v", (("h", b"1"),), "r", "j", "j/1.2.0/7", TP)
    rec = dlq_record.new_dlq_record(args)
    want = DlqRecord(*args)
    assert type(rec) is DlqRecord and rec == want and hash(rec) == hash(want)
    assert repr(rec) == repr(want)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.topic = "other"


def test_the_payload_header_says_what_key_and_value_are():
    assert hdrs(build(rec=failed(payload="source")))["spillway.payload"] == b"source"
    assert hdrs(build(rec=failed()))["spillway.payload"] == b"stage-input"  # older clients
    # an original header of that name never survives: the sidecar's word is the only one
    rec = build(rec=failed(payload="stage-input", headers=(("spillway.payload", b"source"),)))
    assert [v for n, v in rec.headers if n == "spillway.payload"] == [b"stage-input"]


def test_a_reports_records_share_the_bytes_of_what_they_share():
    """Records failing alike, decided alike: one bytes object per shared header value, so the
    spool's marshal writes each once per segment (a back-reference after that)."""
    from spillway.sidecar.core.dlq_record import DlqBuilder
    from spillway.sidecar.dlq.codec import encode_segments

    exc = ExceptionInfo(class_name="builtins.ValueError", message="bad",
                        stack_trace="Traceback (most recent call last):\n" + "  frame\n" * 200)
    s = settings(**{"errors.deadletterqueue.context.headers.enable": "true"})
    b = DlqBuilder(s, TASK, now_ms=1, sidecar_id="s")
    reason = "skipped: data error"
    recs = [b.build(failed(record_id=f"r{i}", exception=exc, headers=()), dataclasses.replace(
        VERDICT, record_id=f"r{i}", reason=reason)) for i in range(100)]
    first, second = dict(recs[0].headers), dict(recs[1].headers)
    for name in ("__connect.errors.exception.stacktrace", "__connect.errors.exception.message",
                 "__connect.errors.class.name", "__connect.errors.topic", "spillway.reason"):
        assert first[name] is second[name], name
    assert first["spillway.record.id"] == b"r0" and second["spillway.record.id"] == b"r1"
    stored = sum(len(blob) for blob, _ in encode_segments(recs))
    assert stored < 100 * len(exc.stack_trace) / 4
    # another exception gets its own bytes
    other = b.build(failed(record_id="x", exception=dataclasses.replace(exc, message="worse")),
                    VERDICT)
    assert dict(other.headers)["__connect.errors.exception.message"] == b"worse"
