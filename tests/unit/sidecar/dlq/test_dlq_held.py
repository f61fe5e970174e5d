"""Held DLQ records (dlq/held.py): held durably, counted against the bounds, then released into
the spool's batches (atomically with the held row's delete) or discarded; kept across a
reopen."""

from __future__ import annotations

import pytest
from spillway.sidecar.core.model import DlqRecord
from spillway.sidecar.dlq.spool import Spool
from spillway.sidecar.errors import BackpressureError, DlqError


def rec(i: int, size: int = 10) -> DlqRecord:
    return DlqRecord(topic="dlq.t", key=f"k{i}".encode(), value=b"v" * size,
                     headers=(("n", b"x"),), record_id=f"r{i}", job="job",
                     task_key="job/run/0.0.0/1", traceparent="")


@pytest.fixture
def spool(tmp_path):
    s = Spool(str(tmp_path), max_bytes=10_000_000, max_records=100)
    yield s
    s.close()


def test_held_records_are_not_pending_until_released(spool):
    rid, segments = spool.hold([rec(i) for i in range(5)], "job/run", b"meta")
    assert spool.depth() == 0 and spool.held_count() == 5
    assert spool.read_batch(0, 100) == []           # the drain never sees them
    assert spool.held_rows() == [(rid, "job/run", b"meta")]
    assert spool.held_records(rid) == [rec(i) for i in range(5)]
    released = [rec(i) for i in range(5)]
    seqs = spool.append(released, release=rid, segments=segments)
    assert len(seqs) == 5 and spool.depth() == 5 and spool.held_count() == 0
    assert [r.record for r in spool.read_batch(0, 100)] == released
    assert spool.held_rows() == []


def test_a_partial_release_spools_only_the_confirmed_records(spool):
    rid, _ = spool.hold([rec(i) for i in range(4)], "job/run", b"m")
    spool.append([rec(1), rec(3)], release=rid)
    assert [r.record.record_id for r in spool.read_batch(0, 100)] == ["r1", "r3"]
    assert spool.held_count() == 0


def test_a_discard_drops_the_row_and_its_room(spool):
    before = spool.bytes()
    rid, _ = spool.hold([rec(i) for i in range(3)], "job/run", b"m")
    assert spool.bytes() > before
    spool.discard(rid)
    assert spool.held_count() == 0 and spool.bytes() == before and spool.depth() == 0


def test_a_row_is_released_or_discarded_once(spool):
    rid, _ = spool.hold([rec(0)], "job/run", b"m")
    spool.discard(rid)
    with pytest.raises(DlqError, match="already released or discarded"):
        spool.append([rec(0)], release=rid)
    with pytest.raises(DlqError, match="already released or discarded"):
        spool.discard(rid)
    assert spool.depth() == 0
    other, _ = spool.hold([rec(1)], "job/run", b"m")
    with pytest.raises(DlqError, match="holds 1 records, not 2"):
        spool.append([rec(1), rec(2)], release=other)
    assert spool.held_count() == 1 and spool.depth() == 0    # a refused release changes nothing


def test_held_records_count_against_the_bounds_and_a_release_is_never_refused(spool):
    rid, segments = spool.hold([rec(i) for i in range(60)], "job/run", b"m")
    with pytest.raises(BackpressureError):
        spool.append([rec(100 + i) for i in range(41)])
    with pytest.raises(BackpressureError):
        spool.hold([rec(200 + i) for i in range(41)], "job/run", b"m")
    assert spool.high_water() is False
    spool.append([rec(300 + i) for i in range(40)])
    assert spool.high_water() is True
    # full, yet the held row's release goes through: its records were counted when held
    assert len(spool.append([rec(i) for i in range(60)], release=rid, segments=segments)) == 60
    assert spool.depth() == 100 and spool.held_count() == 0


def test_held_rows_survive_a_reopen_and_count_again(tmp_path):
    s = Spool(str(tmp_path), max_bytes=10_000_000, max_records=100)
    rid, _ = s.hold([rec(i) for i in range(3)], "job/run", b"claim")
    kept, _ = s.hold([rec(9)], "job/other", b"x")
    s.discard(kept)
    held_bytes = s.bytes()
    s.close()
    s = Spool(str(tmp_path), max_bytes=10_000_000, max_records=100)
    try:
        assert s.held_count() == 3 and s.bytes() == held_bytes and s.depth() == 0
        assert s.held_rows() == [(rid, "job/run", b"claim")]
        records = s.held_records(rid)
        assert records == [rec(i) for i in range(3)]
        s.append(records, release=rid)
        assert [r.record for r in s.read_batch(0, 100)] == records
    finally:
        s.close()
