"""The spool's segments (dlq/codec.py): records built in streaks are stored as columns and
decode to exactly the records built, through every reading path (the hand-off's packed form,
a batch row, a held row released in place, a reopen)."""

from __future__ import annotations

import marshal

import pytest
from spillway.sidecar.core.dlq_record import DlqBuilder, Streak
from spillway.sidecar.core import model
from spillway.sidecar.core.settings import job_settings
from spillway.sidecar.dlq.codec import (
    ROW_BYTES,
    SEG_RECORDS,
    decode_segments,
    encode_segments,
    seg_sizes,
)
from spillway.sidecar.dlq.spool import Spool
from spillway.sidecar.errors import DlqError

from support.records import SharedTrace

TASK = model.TaskIdentity(stage_id=3, partition_id=7, attempt_number=1, task_attempt_id=1234,
                    executor_id="2", host="worker-1")
TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
VERDICT = model.Verdict("", model.Action.SKIP, model.Category.DATA, "why é", 1)


def report(n: int, *, value_size: int = 20, alike: bool = True, first: int = 0
           ) -> list[model.FailedRecord]:
    excs = [model.ExceptionInfo("builtins.ValueError", message="bad é",
                                stack_trace="Traceback\n é"),
            model.ExceptionInfo("builtins.KeyError", message="'k'")]
    stage = model.StageRef(model.Stage.TRANSFORMATION)
    return [SharedTrace(record_id=f"r-{i}-é\udc80", stage=stage,
                         exception=excs[0 if alike or i % 50 else 1], function_name="f.g",
                         source=model.SourceCoordinates("t", 0, i),
                         key=None if i % 5 == 0 else b"k%d" % i, value=b"v" * value_size,
                         traceparent=TP) for i in range(first, first + n)]


def built(records: list[model.FailedRecord], copy: str = "true") -> tuple[list, list[Streak]]:
    s = job_settings("job", {"errors.deadletterqueue.topic.name": "dlq.x",
                             "errors.deadletterqueue.copy.record.enable": copy})
    out: list = []
    streaks: list[Streak] = []
    DlqBuilder(s, TASK, now_ms=5, sidecar_id="sc", run="job@run").build_streak(
        records, 0, len(records), VERDICT, "", out, streaks=streaks)
    return out, streaks


def decoded(segments) -> tuple[list, list[int]]:
    records: list = []
    sizes: list[int] = []
    decode_segments(segments, records, sizes)
    return records, sizes


@pytest.mark.parametrize("copy", ["true", "false"])
@pytest.mark.parametrize("alike", [True, False])
def test_records_built_in_streaks_decode_to_the_records_built(copy, alike):
    out, streaks = built(report(300, alike=alike), copy)
    assert streaks and sum(s.n for s in streaks) > 250
    segments = encode_segments(out, streaks)
    assert sum(n for _, n in segments) == 300
    assert any(type(marshal.loads(blob)) is tuple for blob, _ in segments)   # as columns
    records, sizes = decoded(segments)
    assert records == out
    assert sizes == [x for blob, n in segments for x in seg_sizes(len(blob), n)]
    # and no larger than one field tuple per record (short streaks are encoded so)
    assert sum(len(b) for b, _ in segments) <= sum(len(b) for b, _ in encode_segments(out))


def test_a_streak_is_cut_at_the_segment_and_row_bounds():
    big, big_streaks = built(report(40, value_size=60_000))          # 2.4 MB of values
    segments = encode_segments(big, big_streaks)
    assert len(segments) >= 3 and all(len(b) <= ROW_BYTES for b, n in segments if n > 1)
    assert decoded(segments)[0] == big
    many, many_streaks = built(report(SEG_RECORDS + 10, value_size=1))
    segments = encode_segments(many, many_streaks)
    assert max(n for _, n in segments) <= SEG_RECORDS
    assert decoded(segments)[0] == many


def test_streaks_out_of_order_or_out_of_range_are_refused():
    out, streaks = built(report(40))
    (s,) = streaks
    with pytest.raises(ValueError, match="not within"):
        encode_segments(out[:20], streaks)
    with pytest.raises(ValueError, match="not within"):
        encode_segments(out, [s, s])


def test_a_corrupt_streak_segment_is_an_error_not_records():
    out, streaks = built(report(40))
    columns = list(marshal.loads(encode_segments(out, streaks)[0][0]))
    short = marshal.dumps(tuple(columns[:-1]), 4)
    columns[8] = columns[8][:3]                     # fewer ids than records
    fewer = marshal.dumps(tuple(columns), 4)
    for blob in (short, fewer):
        with pytest.raises(DlqError, match="corrupt DLQ spool row"):
            decoded([(blob, 40)])


def test_the_spool_reads_streak_rows_back_after_a_reopen_and_a_release_in_place(tmp_path):
    out, streaks = built(report(200, alike=False))
    held_out, held_streaks = built(report(50, first=1000))
    s = Spool(str(tmp_path), max_bytes=50_000_000, max_records=10_000)
    try:
        s.append(out, streaks=streaks)
        rid, segments = s.hold(held_out, "job@run", b"m", held_streaks)
        s.append(held_out, release=rid, segments=segments)
        assert [r.record for r in s.read_batch(0, 1000)] == out + held_out
    finally:
        s.close()
    s = Spool(str(tmp_path), max_bytes=50_000_000, max_records=10_000)
    try:
        assert [r.record for r in s.read_batch(0, 1000)] == out + held_out
        assert s.append(out[:3]) == [r.seq for r in s.read_batch(0, 3)]   # the window's
    finally:
        s.close()
