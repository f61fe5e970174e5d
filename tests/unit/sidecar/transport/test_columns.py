"""Columnar reports, both ends without a network: the executor's `columns.failure` / `encode`
and the sidecar's `transport/columns.records` describe every record exactly as the FailedRecord
message path does, the DLQ record built from either is the same, malformed columns are refused
naming the field, and verdict columns read back as the verdicts they encode."""

from __future__ import annotations

import pytest
from spillway.client import columns, report
from spillway.client.errors import SidecarProtocolError
from spillway.sidecar.core import model as m
from spillway.sidecar.core.dlq_record import DlqBuilder
from spillway.sidecar.core.settings import job_settings
from spillway.sidecar.transport import columns as side
from spillway.sidecar.transport import convert, validate
from spillway.v1 import sidecar_pb2 as pb

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class _Retriable(Exception):
    status_code = 503


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001 - a test's own exception
        return e


def _cases() -> list[tuple[tuple, dict]]:
    """Arguments for `failure` / `failed_record`: every optional field present and absent,
    several ways of failing interleaved."""
    bad, worse = _raised(ValueError("bad row")), _raised(_Retriable("upstream down"))
    try:
        try:
            raise KeyError("k")
        except KeyError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as e:
        chained = e
    return [
        (("r0", "TRANSFORMATION", bad), {"function_name": "app.parse"}),
        (("r1", "TRANSFORMATION", bad), {"function_name": "app.parse", "key": b"k1",
                                          "value": b"", "source": ("orders", 3, 17),
                                          "timestamp_ms": 1_700_000_000_000}),
        (("r2", "SINK", worse), {"key": "", "headers": [("a", b"1"), ("b", None), ("c", "")],
                                 "attempt": 3, "payload": "source"}),
        (("r3", "CUSTOM", chained), {"custom_stage": "enrich", "value": "v3",
                                     "source": ("clicks", 0, -1), "timestamp_ms": -1}),
        (("r4", "TRANSFORMATION", bad), {"function_name": "app.parse",
                                          "headers": [("traceparent", TRACE.encode())]}),
        (("r5", "DESERIALIZATION", worse), {"source": ("orders", 1, 2**40), "key": b"\x00\xff",
                                             "value": b"v" * 1000, "payload": "stage-input"}),
    ]


def _failures(context=None) -> tuple[list[columns.Failure], list[pb.FailedRecord]]:
    fs, msgs = [], []
    for args, kw in _cases():
        fs.append(columns.failure(*args, **kw, context=context))
        msgs.append(report.failed_record(*args, **kw, context=context))
    return fs, msgs


def _decoded(fs) -> list[side.ColumnRecord]:
    cols = columns.encode(fs)
    req = pb.ReportFailuresRequest(job="j", columns=cols)
    validate.check("ReportFailures", pb.ReportFailuresRequest.FromString(req.SerializeToString()))
    return side.records(req.columns)


def test_a_failure_is_the_record_failed_record_builds():
    fs, msgs = _failures()
    assert [f.to_pb() for f in fs] == msgs


def _parse(text: str, note: str = "") -> BaseException:
    try:
        int(text)
    except ValueError as e:
        if note:
            e.add_note(note)
        return e
    raise AssertionError("parsed")


def _parse_elsewhere(text: str) -> BaseException:
    try:
        int(text)
    except ValueError as e:
        return e
    raise AssertionError("parsed")


def test_a_failure_alike_an_earlier_one_is_described_as_the_message_path_does():
    """Failures of one class with one message at one place share one description, looked up
    without formatting; any difference (message, place, a note, a cause) is described anew."""
    cases = [_parse("x"), _parse("x"), _parse("y"), _parse_elsewhere("x"), _parse("x", "a note"),
             _parse("x"), _raised(ValueError("invalid literal for int() with base 10: 'x'"))]
    try:
        try:
            int("x")
        except ValueError as inner:
            raise ValueError("invalid literal for int() with base 10: 'x'") from inner
    except ValueError as e:
        cases.append(e)
    fs = [columns.failure(f"r{i}", "TRANSFORMATION", e) for i, e in enumerate(cases)]
    for i, (f, e) in enumerate(zip(fs, cases, strict=True)):
        assert f.to_pb() == report.failed_record(f"r{i}", "TRANSFORMATION", e), i
    assert fs[1].exception is fs[0].exception and fs[5].exception is fs[0].exception
    assert len({id(f.exception) for f in fs}) == 6
    assert "a note" in fs[4].exception.stack_trace and "a note" not in fs[5].exception.stack_trace
    assert "direct cause" in fs[-1].exception.stack_trace
    long = [_raised(ValueError("x" * 5000)) for _ in range(2)]   # kept whole by no table
    before = len(columns._alike)
    assert [columns.failure("r", "TRANSFORMATION", e).to_pb() for e in long] == [
        report.failed_record("r", "TRANSFORMATION", e) for e in long]
    assert len(columns._alike) == before


def test_columns_describe_every_record_as_the_messages_do():
    fs, msgs = _failures()
    from_columns = [r.to_model() for r in _decoded(fs)]
    from_messages = [r.to_model() for r in convert.failed_records(msgs)]
    assert from_columns == from_messages
    # each way of failing once on the wire, and records of one way share one converted value
    cols = columns.encode(fs)
    assert len(cols.kinds) == 4
    recs = _decoded(fs)
    assert recs[0].exception is recs[1].exception is recs[4].exception


def test_a_trace_context_and_the_dlq_record_are_the_same_either_way():
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    ctx = trace.set_span_in_context(NonRecordingSpan(SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True,
        trace_flags=TraceFlags(1))))
    fs, msgs = _failures(ctx)
    settings = job_settings("orders", {"errors.deadletterqueue.topic.name": "dlq.orders",
                                       "errors.deadletterqueue.context.headers.enable": "true"})
    task = m.TaskIdentity(1, 2, 0, 9, "e1", "h1")
    build = DlqBuilder(settings, task, now_ms=1, sidecar_id="s").build
    verdict = m.Verdict("x", m.Action.SKIP, m.Category.DATA, "skipped", 1)
    for a, b in zip(_decoded(fs), convert.failed_records(msgs), strict=True):
        assert a.traceparent == b.traceparent != ""
        assert build(a, verdict) == build(b, verdict)


def test_a_report_of_one_way_of_failing_sends_its_exception_once():
    exc = _raised(ValueError("same"))
    fs = [columns.failure(f"r{i}", "TRANSFORMATION", exc, key=b"k", value=b"v" * 100)
          for i in range(256)]
    cols = columns.encode(fs)
    assert len(cols.kinds) == 1 and cols.kind_index == b""
    msgs = pb.ReportFailuresRequest(records=[f.to_pb() for f in fs])
    assert pb.ReportFailuresRequest(columns=cols).ByteSize() < msgs.ByteSize() / 2
    assert [r.record_id for r in side.records(cols)] == [f"r{i}" for i in range(256)]


def _refused(cols: pb.RecordColumns, field: str, **req) -> None:
    with pytest.raises(ValueError, match=field):
        validate.check("ReportFailures", pb.ReportFailuresRequest(job="j", columns=cols, **req))


def _good() -> pb.RecordColumns:
    return columns.encode(_failures()[0])


@pytest.mark.parametrize("mutate, field", [
    (lambda c: c.ClearField("kinds"), r"columns\.kinds"),
    (lambda c: setattr(c, "kind_index", c.kind_index[:-1]), r"columns\.kind_index: 4 bytes"),
    (lambda c: setattr(c, "kind_index", b"\x09\x00\x00\x00" * 6), r"columns\.kind_index: an "
                                                                    r"index past"),
    (lambda c: c.keys.append(b"x"), r"columns\.keys: one per record"),
    (lambda c: setattr(c, "absent", b"\x00"), r"columns\.absent"),
    (lambda c: setattr(c, "topic_index", b"\x07\x00\x00\x00" * 6), r"columns\.topic_index"),
    (lambda c: c.ClearField("partitions"), r"columns\.partitions, columns\.offsets"),
    (lambda c: setattr(c, "partitions", b"\xfe\xff\xff\xff" * 6), r"columns\.partitions: "
                                                                  r"must be >= -1"),
    (lambda c: setattr(c, "attempts", b"\xff\xff\xff\x7f" * 6), r"columns\.attempts"),
    (lambda c: setattr(c, "timestamps_ms", b"\xfe" + b"\xff" * 7 + bytes(40)),
     r"columns\.timestamps_ms"),
    (lambda c: c.headers.add(key="extra"), r"columns\.header_counts: add up"),
    (lambda c: c.topics.append(""), r"columns\.topics\[2\]: required"),
    (lambda c: c.tracestates.extend(["a", "b"]), r"columns\.tracestates"),
    (lambda c: setattr(c.kinds[0].exception, "stack_trace", "x" * (256 * 1024 + 1)),
     r"columns\.kinds\[0\]\.exception\.stack_trace"),
    (lambda c: c.kinds[0].ClearField("exception"), r"columns\.kinds\[0\]\.exception: required"),
    (lambda c: setattr(c.kinds[0], "function_name", "bad\nname"), r"columns\.kinds\[0\]"),
    (lambda c: c.record_ids.__setitem__(2, ""), r"columns\.record_ids\[2\]"),
    (lambda c: c.kinds.extend([c.kinds[0]] * 6), r"columns\.kinds: at most 6"),
])
def test_malformed_columns_are_refused_naming_the_field(mutate, field):
    cols = _good()
    mutate(cols)
    _refused(cols, field)


def test_records_and_columns_together_are_refused():
    _refused(_good(), "records or columns, not both", records=[_failures()[1][0]])


def test_a_kind_with_an_unknown_stage_is_refused_when_converted():
    cols = _good()
    cols.kinds[0].stage = 99
    with pytest.raises(ValueError, match=r"columns\.kinds\[0\]\.stage"):
        side.records(cols)


def test_verdict_columns_read_back_as_the_verdicts():
    answers = [
        (m.Verdict("a", m.Action.SKIP, m.Category.DATA, "skipped", 1, dead_lettered=True), False),
        (m.Verdict("b", m.Action.RETRY, m.Category.RETRIABLE, "retry", 2, retry_delay_ms=750),
         False),
        (m.Verdict("c", m.Action.FAIL, m.Category.DATA, "limit", 1, job_failed=True,
                   retry_budget_exhausted=True), True),
    ]
    wire = pb.TallyVerdicts.FromString(
        side.verdict_columns([(a, 1) for a in answers]).SerializeToString())
    got = columns.verdicts(wire, ["a", "b", "c"], "test")
    assert [v.to_pb() for v in got] == [
        pb.Verdict(record_id="a", action=pb.ACTION_SKIP, category=pb.CATEGORY_DATA,
                   reason="skipped", attempt=1, dead_lettered=True),
        pb.Verdict(record_id="b", action=pb.ACTION_RETRY, category=pb.CATEGORY_RETRIABLE,
                   reason="retry", attempt=2, retry_delay_ms=750),
        pb.Verdict(record_id="c", action=pb.ACTION_FAIL, category=pb.CATEGORY_DATA,
                   reason="limit", attempt=1, job_failed=True, retry_budget_exhausted=True,
                   dead_letter=True),
    ]
    assert len(wire.reasons) == 3 and not wire.rules
    # the actions are read without a verdict object each; indexing, slices and joining the
    # answers of two halves (`_split`) give the same verdicts
    assert list(got.actions) == [pb.ACTION_SKIP, pb.ACTION_RETRY, pb.ACTION_FAIL]
    assert len(got) == 3 and got[-1].to_pb() == list(got)[2].to_pb()
    assert [v.record_id for v in got[1:]] == ["b", "c"]
    assert [v.record_id for v in got + got[:1]] == ["a", "b", "c", "a"]


def test_verdict_columns_write_a_run_once_and_keep_every_difference():
    skip = "skipped: data error"
    V = m.Verdict

    def run(n, **kw):
        return [(V(f"r{i}", m.Action.SKIP, m.Category.DATA, skip, 1, **kw), False)
                for i in range(n)]

    answers = (run(3) + run(2, dead_lettered=True) + run(1)
               + [(V("x", m.Action.SKIP, m.Category.DATA, skip, 2), False),
                  (V("y", m.Action.SKIP, m.Category.DATA, skip, 1), True),
                  (V("z", m.Action.RETRY, m.Category.RETRIABLE, skip, 1, retry_delay_ms=5),
                   False),
                  (V("w", m.Action.RETRY, m.Category.RETRIABLE, skip, 1, retry_delay_ms=6),
                   False),
                  (V("u", m.Action.FAIL, m.Category.DATA, skip, 1, job_failed=True), False),
                  (V("t", m.Action.FAIL, m.Category.DATA, skip, 1, job_failed=True,
                     retry_budget_exhausted=True), False),
                  (V("s", m.Action.SKIP, m.Category.DATA, "another reason", 1), False)])
    wire = pb.TallyVerdicts.FromString(
        side.verdict_columns([(a, 1) for a in answers]).SerializeToString())
    ids = [v.record_id for v, _ in answers]
    got = columns.verdicts(wire, ids, "test")
    assert [v.to_pb() for v in got] == [
        pb.Verdict(record_id=v.record_id, action=convert.ACTION_TO_PB[v.action],
                   category=convert.CATEGORY_TO_PB[v.category], reason=v.reason,
                   attempt=v.attempt, dead_lettered=v.dead_lettered, dead_letter=dl,
                   job_failed=v.job_failed, retry_budget_exhausted=v.retry_budget_exhausted,
                   retry_delay_ms=v.retry_delay_ms)
        for v, dl in answers]
    assert list(wire.reasons) == [skip, "another reason"]


def test_a_span_of_records_decided_alike_answers_each_of_them_in_columns_and_messages():
    """A sidecar deciding its own report answers a run of records decided alike as one span
    (its verdict has no record id); both answer formats give each record its own verdict."""
    run = m.Verdict("", m.Action.SKIP, m.Category.DATA, "skipped", 1, dead_lettered=True)
    one = m.Verdict("d", m.Action.RETRY, m.Category.RETRIABLE, "retry", 1, retry_delay_ms=9)
    answers = [((run, False), 3), ((one, False), 1)]
    ids = ["a", "b", "c", "d"]
    recs = [m.FailedRecord(i, m.StageRef(m.Stage.TRANSFORMATION), m.ExceptionInfo("E"), "f")
            for i in ids]
    want = [pb.Verdict(record_id=i, action=pb.ACTION_SKIP, category=pb.CATEGORY_DATA,
                       reason="skipped", attempt=1, dead_lettered=True) for i in "abc"] + [
        pb.Verdict(record_id="d", action=pb.ACTION_RETRY, category=pb.CATEGORY_RETRIABLE,
                   reason="retry", attempt=1, retry_delay_ms=9)]
    wire = pb.TallyVerdicts.FromString(side.verdict_columns(answers).SerializeToString())
    assert [v.to_pb() for v in columns.verdicts(wire, ids, "test")] == want
    assert list(convert.report_response(answers, recs).verdicts) == want
    assert run.record_id == ""   # the span's verdict is not changed


def test_verdict_columns_that_do_not_answer_the_report_are_a_protocol_error():
    answers = [((m.Verdict("a", m.Action.SKIP, m.Category.DATA, "s", 1), False), 1)]
    wire = side.verdict_columns(answers)
    with pytest.raises(SidecarProtocolError, match="do not answer the 2 records"):
        columns.verdicts(wire, ["a", "b"], "test")
    wire.actions = bytes([0])   # ACTION_UNSPECIFIED
    with pytest.raises(SidecarProtocolError):
        columns.verdicts(wire, ["a"], "test")


def test_which_runs_take_columns_is_bounded_and_forgotten(monkeypatch):
    monkeypatch.setattr(columns, "_takes", type(columns._takes)(2))
    for i in range(3):
        columns.note("t", "j", f"r{i}", True)
    assert not columns.takes("t", "j", "r0")
    assert columns.takes("t", "j", "r2")
    columns.forget("t", "j", "r2")
    columns.note("t", "j", "r1", False)
    assert not columns.takes("t", "j", "r1") and not columns.takes("t", "j", "r2")


def test_a_columnar_report_passed_on_to_a_home_as_messages_is_the_same_report():
    """A whole report forwarded to a home (decide_only, which may predate columns) goes as
    FailedRecord messages describing exactly the records the columns held."""
    fs, msgs = _failures()
    again = side.as_messages(_decoded(fs))
    assert [r.to_model() for r in convert.failed_records(again)] == [
        r.to_model() for r in convert.failed_records(msgs)]
    assert again[0].exception.stack_trace == msgs[0].exception.stack_trace != ""


def test_any_columns_are_refused_naming_a_field_or_read_whole():
    """Whatever columns arrive, validation refuses them with a ValueError (INVALID_ARGUMENT)
    or every record they describe reads without an error: no IndexError or struct error can
    reach the servicer (which would answer UNKNOWN). Columns are drawn mostly well-shaped
    (one entry per record, small indexes) so that many get past validation."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    good = _good()
    hits: list[int] = []

    def le(vals, width: int, signed: bool = False) -> bytes:
        return b"".join(v.to_bytes(width, "little", signed=signed) for v in vals)

    @st.composite
    def report(draw):
        """Well-formed columns of n records, then (half the time) one column replaced by
        random bytes or an out-of-range value."""
        n = draw(st.integers(1, 4))
        ints = lambda lo, hi: draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))  # noqa: E731
        rows = st.lists(st.binary(max_size=4), min_size=n, max_size=n)
        k, t, p = draw(st.integers(1, n)), draw(st.integers(1, n)), draw(st.integers(1, n))
        counts = ints(0, 2)
        cols = pb.RecordColumns(
            record_ids=[f"r{i}" for i in range(n)], kinds=[good.kinds[0]] * k,
            kind_index=draw(st.sampled_from([b"", le(ints(0, k - 1), 4)])),
            keys=draw(st.one_of(st.just([]), rows)), values=draw(st.one_of(st.just([]), rows)),
            absent=draw(st.sampled_from([b"", bytes(ints(0, 7))])),
            timestamps_ms=draw(st.sampled_from([b"", le(ints(-1, 2**45), 8, True)])),
            attempts=draw(st.sampled_from([b"", le(ints(0, 9), 4)])),
            headers=[pb.Header(key="h", value=b"v") if i % 2 else pb.Header(key="g")
                     for i in range(sum(counts))],
            header_counts=le(counts, 4) if sum(counts) else b"")
        if draw(st.booleans()):
            cols.topics.extend(f"t{i}" for i in range(t))
            cols.topic_index = le(ints(0, t), 4)
            cols.partitions = le(ints(-1, 9), 4, True)
            cols.offsets = le(ints(-1, 2**40), 8, True)
        if draw(st.booleans()):
            cols.traceparents.extend([TRACE] * p)
            if draw(st.booleans()):
                cols.tracestates.extend(["s=1"] * p)
            cols.trace_index = le(ints(0, p), 4)
        if draw(st.booleans()):   # one fault
            field = draw(st.sampled_from(
                ["kind_index", "absent", "topic_index", "partitions", "offsets", "timestamps_ms",
                 "attempts", "trace_index", "header_counts"]))
            setattr(cols, field, draw(st.binary(max_size=4 * n + 8)))
        return cols

    @settings(max_examples=600, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cols=report())
    def check(cols):
        try:
            validate.check("ReportFailures", pb.ReportFailuresRequest(job="j", columns=cols))
            recs = side.records(cols)
        except ValueError:
            return
        assert [r.record_id for r in recs] == list(cols.record_ids)
        for r in recs:
            r.to_model()
        hits.append(len(recs))

    check()
    # the strategy reaches the records, not only refusals
    assert sum(1 for n in hits if n) >= 200, len(hits)
