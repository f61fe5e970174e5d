"""Held DLQ records (dlq/held.py): held durably, counted against the bounds, then released into
the spool's batches (atomically: a whole row in place, some of its records as a copy with the
held row's delete) or discarded; kept across a reopen."""

from __future__ import annotations

import os
import sqlite3
import threading

import pytest
from spillway.sidecar.core.model import DlqRecord
from spillway.sidecar.dlq.schema import DB_NAME
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


# -- a whole release: the records are written once (schema 4's ``released``) ---------------------

def _table(path, sql: str) -> list[tuple]:
    con = sqlite3.connect(os.path.join(path, DB_NAME))
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_a_whole_release_reads_the_held_data_in_place(tmp_path, spool):
    records = [rec(i, 50) for i in range(20)]
    rid, segments = spool.hold(records, "job/run", b"m")
    held_bytes = spool.bytes()
    seqs = spool.append(records, release=rid, segments=segments)
    (batch, data_len), = _table(tmp_path, "SELECT id, length(data) FROM batches")
    assert data_len == 0                                    # no second copy of the records
    assert _table(tmp_path, "SELECT batch, held FROM released") == [(batch, rid)]
    assert _table(tmp_path, "SELECT id FROM held") == [(rid,)]
    assert [r.record for r in spool.read_batch(0, 100)] == records
    assert spool.held_rows() == [] and spool.held_count() == 0 and spool.depth() == 20
    assert spool.bytes() == held_bytes                      # counted once, now as pending
    with pytest.raises(DlqError, match="released or discarded"):
        spool.held_records(rid)
    spool.delete(seqs[:5])
    assert _table(tmp_path, "SELECT id FROM held") == [(rid,)]   # still read by the batch row
    spool.delete(seqs[5:])
    assert _table(tmp_path, "SELECT COUNT(*) FROM batches UNION ALL SELECT COUNT(*) FROM held "
                            "UNION ALL SELECT COUNT(*) FROM released") == [(0,), (0,), (0,)]
    assert spool.bytes() == 0 and spool.depth() == 0


def test_a_whole_release_survives_a_reopen_pending_and_not_held(tmp_path):
    s = Spool(str(tmp_path), max_bytes=10_000_000, max_records=100)
    records = [rec(i) for i in range(6)]
    rid, segments = s.hold(records, "job/run", b"m")
    seqs = s.append(records, release=rid, segments=segments)
    s.delete(seqs[:2])
    s.close()                                 # as after a kill -9: 4 records not acknowledged
    s = Spool(str(tmp_path), max_bytes=10_000_000, max_records=100)
    try:
        assert s.held_rows() == [] and s.held_count() == 0 and s.depth() == 4
        assert [r.record for r in s.read_batch(0, 100)] == records[2:]
        # the dedup window was filled from the held data: a repeat is stored once
        assert s.append([records[3]]) == [seqs[3]]
        s.reject([(seqs[5], "too large")], 0)
        assert [r.record for r in s.rejected()] == [records[5]]
        assert s.delete(seqs[2:5]) == 3
        assert _table(tmp_path, "SELECT COUNT(*) FROM held UNION ALL "
                                "SELECT COUNT(*) FROM released") == [(0,), (0,)]
    finally:
        s.close()


def test_a_release_of_some_records_or_from_a_reopened_row_writes_them_again(tmp_path, spool):
    rid, segments = spool.hold([rec(i) for i in range(4)], "job/run", b"m")
    spool.append([rec(0), rec(1)], release=rid)          # some: a batch row of their own
    assert _table(tmp_path, "SELECT COUNT(*) FROM held UNION ALL SELECT COUNT(*) FROM released "
                            "UNION ALL SELECT MIN(length(data)) > 0 FROM batches") == [
        (0,), (0,), (1,)]
    other, _ = spool.hold([rec(i) for i in range(10, 13)], "job/run", b"m")
    spool.append([rec(i) for i in range(10, 13)], release=other)   # no segments given
    assert _table(tmp_path, "SELECT COUNT(*) FROM released") == [(0,)]
    assert [r.record.record_id for r in spool.read_batch(0, 100)] == [
        "r0", "r1", "r10", "r11", "r12"]


def test_whole_releases_and_appends_committed_together_keep_their_order(tmp_path, spool):
    a = [rec(i) for i in range(3)]
    b = [rec(i) for i in range(10, 14)]
    rid, segments = spool.hold(a, "job/run", b"m")
    done: list = []
    threads = [threading.Thread(target=lambda: done.append(spool.append(b))),
               threading.Thread(target=lambda: done.append(
                   spool.append(a, release=rid, segments=segments)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = [r.record for r in spool.read_batch(0, 100)]
    assert sorted(got, key=lambda r: r.record_id) == sorted(a + b, key=lambda r: r.record_id)
    assert all(seq == sorted(seq) for seq in done) and len(set(sum(done, []))) == 7
    assert _table(tmp_path, "SELECT held FROM released") == [(rid,)]


def test_a_schema_3_spool_opens_as_schema_4_and_a_newer_one_is_refused(tmp_path):
    s = Spool(str(tmp_path), max_bytes=10_000_000, max_records=100)
    s.append([rec(1)])
    s.close()
    con = sqlite3.connect(os.path.join(tmp_path, DB_NAME))
    con.execute("DROP TABLE released")
    con.execute("UPDATE meta SET value = '3' WHERE name = 'schema'")
    con.commit()
    con.close()
    s = Spool(str(tmp_path), max_bytes=10_000_000, max_records=100)
    try:
        assert [r.record for r in s.read_batch(0, 10)] == [rec(1)]
    finally:
        s.close()
    assert _table(tmp_path, "SELECT value FROM meta WHERE name = 'schema'") == [("4",)]
    con = sqlite3.connect(os.path.join(tmp_path, DB_NAME))
    con.execute("UPDATE meta SET value = '5' WHERE name = 'schema'")
    con.commit()
    con.close()
    with pytest.raises(DlqError, match="is of schema 5, which this version does not read "
                                       r"\(it reads schemas 3, 4"):
        Spool(str(tmp_path), max_bytes=10_000_000, max_records=100)


def test_releases_in_place_beside_repeated_reports_lose_nothing_and_store_repeats_once(
        tmp_path, spool):
    first = [rec(i) for i in range(100, 110)]
    seqs_first = spool.append(first)
    rows = [spool.hold([rec(10 * k + i) for i in range(5)], "job/run", b"m") for k in range(8)]
    threads = [threading.Thread(target=spool.append, args=([rec(10 * k + i) for i in range(5)],),
                                kwargs={"release": rid, "segments": segments})
               for k, (rid, segments) in enumerate(rows)]
    repeats: list = []
    threads += [threading.Thread(target=lambda: repeats.append(spool.append(first)))
                for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert repeats == [seqs_first] * 4               # a repeated report is stored once
    got = sorted(r.record.record_id for r in spool.read_batch(0, 1000))
    assert got == sorted([f"r{10 * k + i}" for k in range(8) for i in range(5)]
                         + [f"r{i}" for i in range(100, 110)])
    assert spool.held_count() == 0 and spool.held_rows() == []
    spool.delete([r.seq for r in spool.read_batch(0, 1000)])
    assert _table(tmp_path, "SELECT COUNT(*) FROM batches UNION ALL SELECT COUNT(*) FROM held "
                            "UNION ALL SELECT COUNT(*) FROM released") == [(0,), (0,), (0,)]
    assert spool.bytes() == 0
