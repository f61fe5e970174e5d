"""The hand-off keeps a durable commit as the spool stored it and makes entries when taken."""

from __future__ import annotations

from spillway.sidecar.core.model import DlqRecord
from spillway.sidecar.dlq.codec import encode_segments, seg_sizes
from spillway.sidecar.dlq.handoff import Handoff
from spillway.sidecar.dlq.store import FreshRun


def _recs(prefix: str, n: int) -> list[DlqRecord]:
    return [DlqRecord(topic="dlq.t", key=f"k{i}".encode(), value=f"{prefix}{i}".encode(),
                      headers=(("h", b"x"),), record_id=f"{prefix}{i}", job="job",
                      task_key="t") for i in range(n)]


def _packed(records: list[DlqRecord], first_seq: int) -> FreshRun:
    segments = encode_segments(records)
    sizes = [s for blob, count in segments for s in seg_sizes(len(blob), count)]
    seqs = list(range(first_seq, first_seq + len(records)))
    return FreshRun(seqs, ["t"] * len(records), sizes, segments)


def test_a_packed_commit_is_taken_whole_or_in_parts_in_order_with_its_sizes():
    h = Handoff(max_bytes=1 << 20, max_records=1, skipped_upto=0)
    first, second = _recs("a", 10), _recs("b", 4)
    run1, run2 = _packed(first, 1), _packed(second, 11)
    h.give(first, run1, True)
    h.give(second, run2, True)   # held as bytes: the records bound (1) does not apply
    assert h.overflows == 0
    part, skipped, none_left = h.take(0, 3, 1 << 20)   # a part: the commit is unpacked
    assert [e.seq for e in part] == [1, 2, 3] and not none_left and skipped == 0
    assert [e.rec for e in part] == first[:3]
    rest, _, _ = h.take(3, 100, 1 << 20)
    assert [e.seq for e in rest] == list(range(4, 15))
    assert [e.rec for e in rest] == first[3:] + second
    assert [e.size for e in part + rest] == run1.sizes + run2.sizes
    assert h.take(14, 100, 1 << 20) == ([], 0, True)


def test_the_byte_budget_stops_a_take_and_packed_bytes_bound_the_hand_off():
    records = _recs("c", 8)
    run = _packed(records, 1)
    total = sum(run.sizes)
    h = Handoff(max_bytes=total, max_records=1, skipped_upto=0)
    h.give(records, run, True)
    taken, _, _ = h.take(0, 100, run.sizes[0])   # the last one taken may pass the budget
    assert [e.seq for e in taken] == [1]
    more = _recs("d", 1)
    h.give(more, _packed(more, 9), True)         # past the bytes: it lets go of everything
    assert h.overflows == 1 and h.skipped_upto == 9 and not h.waiting()


def test_records_given_as_objects_count_against_the_records_bound():
    records = _recs("e", 3)
    h = Handoff(max_bytes=1 << 20, max_records=2, skipped_upto=0)
    h.give(records, FreshRun([1, 2, 3], ["t"] * 3, [10, 10, 10]), True)   # no segments
    assert h.overflows == 1 and h.skipped_upto == 3


def test_commits_wait_as_objects_up_to_the_records_bound_then_as_spooled_bytes():
    h = Handoff(max_bytes=1 << 20, max_records=5, skipped_upto=0)
    a, b, c = _recs("f", 3), _recs("g", 4), _recs("h", 2)
    h.give(a, _packed(a, 1), True)
    h.give(b, _packed(b, 4), True)    # 3 + 4 objects would pass 5: kept as bytes
    h.give(c, _packed(c, 8), True)    # 3 + 2: objects again
    forms = [group[0] is not None for group in h._groups]
    assert forms == [True, False, True] and h.overflows == 0
    assert h._groups[0][0][0].rec is a[0]    # the writer's objects themselves, not decoded
    taken, _, none_left = h.take(0, 100, 1 << 20)
    assert [e.seq for e in taken] == list(range(1, 10)) and [e.rec for e in taken] == a + b + c
    assert not none_left and h.take(9, 100, 1 << 20) == ([], 0, True)
