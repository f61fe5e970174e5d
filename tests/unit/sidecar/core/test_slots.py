"""Per-record objects made column-wise in C (core/_slots.c, core/slots.py): the same report
views, DLQ records, streaks and drain entries as the Python constructors make, the refusals of a
class it cannot make, and its bounds checked."""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass

import pytest
from spillway.client import columns
from spillway.sidecar.core import model as m
from spillway.sidecar.core import slots
from spillway.sidecar.core.dlq_record import DlqBuilder
from spillway.sidecar.core.settings import job_settings
from spillway.sidecar.dlq import codec
from spillway.sidecar.dlq.handoff import Entry, entries_of
from spillway.sidecar.transport import columns as side
from spillway.sidecar.transport import validate
from spillway.v1 import sidecar_pb2 as pb

native = pytest.mark.skipif(not slots.BUILT, reason="the sidecar was installed without its "
                                                    "C extensions (no compiler)")
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TASK = m.TaskIdentity(stage_id=3, partition_id=7, attempt_number=1, task_attempt_id=1234,
                      executor_id="1", host="h")
VERDICT = m.Verdict("", m.Action.SKIP, m.Category.DATA, "why é", 1)


@pytest.fixture
def both():
    """Runs the body with the extension (where built) and without, giving back its setting."""
    def run(body):
        slots.use_extension(False)
        try:
            plain = body()
        finally:
            slots.use_extension(True)
        return body(), plain
    return run


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001 - a test's own exception
        return e


def _report(n: int, *, kinds: int = 1, headers_every: int = 0, trace_every: int = 0,
            absent_every: int = 0) -> pb.RecordColumns:
    excs = [_raised(ValueError("bad é")), _raised(KeyError("k")), _raised(TypeError("t"))]
    fs = []
    for i in range(n):
        kw: dict = {"function_name": "app.parse", "source": ("orders", i % 3, i),
                    "key": None if absent_every and i % absent_every == 0 else b"k%d" % i,
                    "value": b"v" * (i % 7)}
        if headers_every and i % headers_every == 0:
            kw["headers"] = [("a", b"1"), ("b", None)]
        if trace_every and i % trace_every == 0:
            kw["headers"] = [*kw.get("headers", []), ("traceparent", TRACE.encode())]
        fs.append(columns.failure(f"r-{i}-é" if i % 11 == 0 else f"r-{i}",
                                  "TRANSFORMATION", excs[(i // 5) % kinds], **kw))
    cols = columns.encode(fs)
    req = pb.ReportFailuresRequest(job="j", columns=cols)
    validate.check("ReportFailures", pb.ReportFailuresRequest.FromString(req.SerializeToString()))
    return req.columns


SHAPES = [dict(), dict(kinds=3), dict(headers_every=4), dict(trace_every=9, kinds=2),
          dict(absent_every=3), dict(kinds=2, headers_every=50, absent_every=7)]


@native
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: ",".join(s) or "alike")
def test_report_views_are_the_python_ones(shape, both):
    cols = _report(200, **shape)
    made, plain = both(lambda: side.records(cols))
    assert [type(r) for r in made] == [side.ColumnRecord] * 200
    assert [r.to_model() for r in made] == [r.to_model() for r in plain]
    # records of one way of failing share its converted values, as the Python ones do
    assert made[0].exception is made[1].exception
    assert made[0]._c is made[-1]._c
    assert [r.trace for r in made] == [r.trace for r in plain]


@native
@pytest.mark.parametrize("copy", ["true", "false"])
@pytest.mark.parametrize("context", ["true", "false"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: ",".join(s) or "alike")
def test_a_reports_dlq_records_and_streaks_are_the_python_ones(shape, copy, context, both):
    cols = _report(300, **shape)
    settings = job_settings("job", {"errors.deadletterqueue.topic.name": "dlq.x",
                                    "errors.deadletterqueue.copy.record.enable": copy,
                                    "errors.deadletterqueue.context.headers.enable": context})

    def build():
        recs = side.records(cols)
        out: list = []
        streaks: list = []
        b = DlqBuilder(settings, TASK, now_ms=5, sidecar_id="sc", run="job@run",
                       run_id="run").build_streak
        b(recs, 0, 120, VERDICT, TRACE, out, streaks=streaks)
        b(recs, 120, 180, VERDICT, "", out, streaks=streaks)
        decoded: list = []   # as the hand-off and the drain read them back
        codec.decode_segments(codec.encode_segments(out, streaks), decoded, [])
        return out, streaks, decoded

    (made, made_streaks, made_back), (plain, plain_streaks, plain_back) = both(build)
    assert made == plain == made_back == plain_back
    assert made_streaks == plain_streaks
    assert all(type(r) is m.DlqRecord for r in made + made_back)
    for s in made_streaks:   # each streak describes its records, as the spool stores them
        assert all(s.describes(r) for r in made[s.start:s.start + s.n])
    if copy == "true" and context == "false" and not shape:
        assert made_streaks and made_streaks[0].n > 100   # the column-wise path ran


@native
def test_drain_entries_are_the_python_ones(both):
    recs = [m.DlqRecord("t", b"k", None, (), f"r{i}", "j", "j/1", "") for i in range(50)]
    made, plain = both(lambda: entries_of(list(range(100, 150)), recs, [7] * 50))
    assert made == plain == [Entry(100 + i, recs[i], 7) for i in range(50)]
    made[0].attempts += 1   # an entry stays mutable
    assert made[0].attempts == 1 and made[1].attempts == 0


@native
def test_made_objects_hold_and_free_exactly_their_references():
    shared, value = object(), b"x" * 100
    maker = slots.Maker(Entry, ("seq", "rec", "size"), ("attempts", "solo", "sent_ns"),
                        lambda v: Entry(**v), {"seq": 1, "rec": None, "size": 2, "attempts": 0,
                                               "solo": False, "sent_ns": 0})
    assert maker.native()
    refs = sys.getrefcount(shared), sys.getrefcount(value)
    made = maker.make(([1, 2, 3], [value] * 3, [4, 5, 6]), (shared, False, 0))
    assert sys.getrefcount(shared) == refs[0] + 3
    del made
    gc.collect()
    assert (sys.getrefcount(shared), sys.getrefcount(value)) == refs


@dataclass(slots=True)
class _Counted:
    a: int
    b: int

    def __post_init__(self) -> None:   # an __init__ that does more than set the fields
        self.b += 1


class _WithDict:
    def __init__(self, a) -> None:
        self.a = a


@dataclass(slots=True)
class _Pair:
    a: int
    b: int


@native
def test_a_class_it_cannot_make_as_its_constructor_does_is_left_to_its_constructor():
    def maker(cls, per=("a",), shared=("b",)):
        return slots.Maker(cls, per, shared, lambda v: cls(**v), {"a": 1, "b": 2})

    assert not maker(_Counted).usable          # __post_init__
    assert not maker(_WithDict, shared=()).usable   # no __slots__: a __dict__
    assert not maker(_Pair, shared=()).usable       # a slot no column or value sets
    assert not maker(_Pair, per=("a", "b"), shared=("b",)).usable   # a slot named twice
    assert maker(_Pair).usable
    slots.use_extension(False)
    try:
        assert not maker(_Pair).native()
    finally:
        slots.use_extension(True)


@native
def test_bad_arguments_are_errors_not_crashes():
    from spillway.sidecar.core import _slots

    pair = _Pair.__dict__["a"], _Pair.__dict__["b"]
    with pytest.raises(ValueError, match="length"):
        _slots.make(_Pair, pair, ([1, 2], [3]), (), ())
    with pytest.raises(ValueError, match="length"):
        _slots.make(_Pair, pair, ([1, 2], (3, 4)), (), ())
    with pytest.raises(TypeError, match="data descriptor"):
        _slots.make(_Pair, (pair[0], 5), ([1], [2]), (), ())
    with pytest.raises(ValueError, match="one column per descriptor"):
        _slots.make(_Pair, pair, ([1],), (), ())
    with pytest.raises(TypeError):   # a descriptor of another class
        _slots.make(Entry, pair, ([1], [2]), (), ())
    objs = [_Pair(1, 2)] * 3
    with pytest.raises(IndexError):
        _slots.alike_until(objs, 0, 4, ("a",), (1,))
    with pytest.raises(IndexError):
        _slots.alike_until(objs, 2, 1, ("a",), (1,))
    with pytest.raises(AttributeError):
        _slots.alike_until(objs, 0, 3, ("nope",), (1,))
    with pytest.raises(TypeError, match=r"ids\[1\] is not a str"):
        _slots.id_headers((), "n", ["a", b"b"], ())


@pytest.mark.parametrize("on", [True, False])
def test_alike_until_and_id_headers_answer_as_their_python_loops(on):
    objs = [_Pair(1, 2), _Pair(1, 2), _Pair(1, 3), _Pair(1, 2)]
    one, two = objs[0].a, objs[0].b
    slots.use_extension(on)
    try:
        assert slots.alike_until(objs, 0, 4, ("a", "b"), (one, two)) == 2
        assert slots.alike_until(objs, 3, 4, ("a", "b"), (one, two)) == 4
        assert slots.alike_until(objs, 1, 1, ("a",), (one,)) == 1
        heads = slots.id_headers((("x", b"1"),), "id", ["a", "é\udc80"], (("y", b"2"),))
    finally:
        slots.use_extension(True)
    assert heads == [(("x", b"1"), ("id", b"a"), ("y", b"2")),
                     (("x", b"1"), ("id", "é\udc80".encode("utf-8", "backslashreplace")),
                      ("y", b"2"))]


@native
def test_the_extension_turned_off_by_the_environment_makes_objects_in_python(monkeypatch,
                                                                             caplog):
    """SPILLWAY_NO_EXTENSIONS=slots: the benchmarks' side-by-side switch (target 11 (h)); the
    start says so, and a start with the extension says nothing about it."""
    import logging

    from spillway.sidecar.server import start_server

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "per-record objects" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="spillway.sidecar.runtime.bootstrap"):
        start_server({"listen.address": "127.0.0.1:0", "spool.enable": "false"}).stop(0)
        assert slots.NATIVE and not said()
        monkeypatch.setenv("SPILLWAY_NO_EXTENSIONS", "slots")
        try:
            start_server({"listen.address": "127.0.0.1:0", "spool.enable": "false"}).stop(0)
            assert not slots.NATIVE
        finally:
            slots.use_extension(True)
    assert slots.NATIVE
    assert len(said()) == 1 and "turned off, SPILLWAY_NO_EXTENSIONS" in said()[0]


def _streak_blob(**change) -> tuple[bytes, int]:
    import marshal

    fields = {"kind": 1, "topic": "t", "before": (("a", b"1"),), "name": "spillway.record.id",
              "after": (), "job": "j", "task_key": "j/1", "parent": "", "ids": ["r1", "r2"],
              "keys": [b"k", None], "values": [b"v", b""]}
    fields.update(change)
    return marshal.dumps(tuple(fields.values()), 4), 2


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("change", [
    {"ids": ("r1", "r2")}, {"ids": ["r1", 2]}, {"ids": ["r1"]}, {"keys": [b"k"]},
    {"keys": None}, {"values": (b"v", b"")}, {"name": b"spillway.record.id"},
    {"before": [("a", b"1")]}, {"kind": 2}], ids=str)
def test_a_corrupt_streak_segment_is_a_spool_error_either_way(change, on):
    from spillway.sidecar.errors import DlqError

    slots.use_extension(on)
    try:
        good: list = []
        codec.decode_segments([_streak_blob()], good, [])
        assert [(r.record_id, r.key, r.value, r.headers[-1]) for r in good] == [
            ("r1", b"k", b"v", ("spillway.record.id", b"r1")),
            ("r2", None, b"", ("spillway.record.id", b"r2"))]
        with pytest.raises(DlqError, match="corrupt DLQ spool row"):
            codec.decode_segments([_streak_blob(**change)], [], [])
    finally:
        slots.use_extension(True)
