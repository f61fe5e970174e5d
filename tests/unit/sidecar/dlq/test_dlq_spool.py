"""The durable spool: group commit, bounds, order, recovery, rejection, header codec."""

from __future__ import annotations

import itertools
import marshal
import os
import sqlite3
import threading
from array import array

import pytest
from spillway.sidecar.core.model import DlqRecord
from spillway.sidecar.dlq.codec import decode_headers, encode_headers, seq_ranges
from spillway.sidecar.dlq.memqueue import MemoryQueue
from spillway.sidecar.dlq.spool import Spool
from spillway.sidecar.dlq.store import FreshRun, Placed, dedup_key, dedup_keys
from spillway.sidecar.errors import BackpressureError, DlqError


def rec(i: int, *, size: int = 10, job: str = "job", task: str = "job/0.0.0/1") -> DlqRecord:
    return DlqRecord(topic="dlq.t", key=f"k{i}".encode(), value=b"v" * size,
                     headers=(("n", b"x"), ("none", None), ("ü", "€".encode())),
                     record_id=f"r{i}", job=job, task_key=task, traceparent="")


@pytest.fixture
def spool(tmp_path):
    s = Spool(str(tmp_path), max_bytes=10_000_000, max_records=100_000)
    yield s
    s.close()


def test_header_codec_round_trips_none_empty_and_unicode():
    headers = (("a", b""), ("b", None), ("ключ", b"\x00\xff"), ("", b"v"))
    assert decode_headers(encode_headers(headers)) == headers
    assert decode_headers(encode_headers(())) == ()


def test_append_read_delete_in_order(spool):
    seqs = spool.append([rec(i) for i in range(5)])
    assert seqs == sorted(seqs) and len(set(seqs)) == 5
    rows = spool.read_batch(0, 3)
    assert [r.seq for r in rows] == seqs[:3]
    assert rows[0].record == rec(0)
    assert [r.seq for r in spool.read_batch(seqs[2], 100)] == seqs[3:]
    assert spool.depth() == 5
    assert spool.delete(seqs[:2]) == 2
    assert spool.delete(seqs[:2]) == 0  # already gone
    assert spool.depth() == 3
    assert [r.record.record_id for r in spool.read_batch(0, 100)] == ["r2", "r3", "r4"]


def test_seq_is_never_reused_after_deletes(spool):
    first = spool.append([rec(1)])
    spool.delete(first)
    second = spool.append([rec(2)])
    assert second[0] > first[0]


def test_same_job_and_record_id_is_stored_once(spool):
    a = spool.append([rec(1), rec(2)])
    b = spool.append([rec(2, task="job/0.0.1/9"), rec(3)])
    assert b[0] == a[1]
    assert spool.depth() == 3
    other_job = spool.append([rec(1, job="other")])
    assert other_job[0] not in a
    assert spool.depth() == 4


def test_concurrent_appends_are_group_committed(spool, monkeypatch):
    commits = []
    real_commit = Spool._commit

    def counting(self, batch):
        commits.append(sum(len(r.records) for r in batch))
        return real_commit(self, batch)

    monkeypatch.setattr(Spool, "_commit", counting)
    gate = threading.Barrier(40)
    results: dict[int, list[int]] = {}

    def worker(n: int) -> None:
        gate.wait()
        results[n] = spool.append([rec(n * 100 + i) for i in range(25)])

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(commits) == 1000
    assert len(commits) < 40  # several callers shared a transaction
    all_seqs = [s for seqs in results.values() for s in seqs]
    assert len(set(all_seqs)) == 1000
    assert spool.depth() == 1000
    for seqs in results.values():
        assert seqs == list(range(seqs[0], seqs[0] + 25))  # a caller's rows stay together


def test_on_commit_runs_after_commit_with_where_each_record_went(spool):
    seen = []

    def hook(placed):
        # the rows are committed: a separate connection sees them
        rows = ",".join(str(p.seq >> 16) for p in placed if p.fresh)  # seq = row id * 2**16 + i
        con = sqlite3.connect(spool.path)
        n = con.execute(f"SELECT SUM(n) FROM batches WHERE id IN ({rows})").fetchone()[0]
        con.close()
        assert all(p.size > 0 for p in placed)
        seen.append(([p._replace(size=0) for p in placed], n))  # sizes: checked above

    seqs = spool.append([rec(1), rec(2)], on_commit=hook)
    assert seen == [([Placed(seqs[0], "job/0.0.0/1", True),
                      Placed(seqs[1], "job/0.0.0/1", True)], 2)]
    seen.clear()
    # reported again, by another task attempt and twice in one call: rows are not duplicated,
    # and each position says which row holds it and whose it is
    again = spool.append([rec(2, task="job/0.0.1/2"), rec(3, task="job/0.0.1/2"),
                          rec(3, task="job/0.0.1/2")], on_commit=hook)
    assert again[0] == seqs[1] and again[1] == again[2] > seqs[1]
    assert seen == [([Placed(seqs[1], "job/0.0.0/1", False),
                      Placed(again[1], "job/0.0.1/2", True),
                      Placed(again[1], "job/0.0.1/2", False)], 1)]
    assert spool.depth() == 3


def test_a_commit_of_new_records_places_them_as_columns_that_read_as_placements(spool):
    """The usual commit (every record new) hands its hook a FreshRun, not a Placed per record:
    it must read exactly as the placements it stands for, by index, slice and iteration."""
    seen = []
    records = [rec(i, task=f"job/0.0.0/{i % 3}") for i in range(5)]
    seqs = spool.append(records, on_commit=seen.append)
    (placed,) = seen
    assert type(placed) is FreshRun and placed.seqs == seqs
    want = [Placed(s, r.task_key, True, size) for s, r, size in
            zip(seqs, records, placed.sizes, strict=True)]
    assert list(placed) == want and len(placed) == 5 and placed == want
    assert [placed[i] for i in range(-5, 5)] == want + want
    assert placed[1:4] == want[1:4] and placed[::-2] == want[::-2]
    assert all(p.fresh and p.size > 0 for p in placed)
    with pytest.raises(IndexError):
        placed[5]
    # two requests in one group commit each get their own slice
    seen.clear()
    barrier = threading.Barrier(2)

    def append(base):
        barrier.wait()
        spool.append([rec(base + i) for i in range(3)], on_commit=seen.append)

    threads = [threading.Thread(target=append, args=(b,)) for b in (100, 200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(len(p) for p in seen) == [3, 3]
    assert len({p.seq for run in seen for p in run}) == 6


def test_dedup_keys_are_each_records_dedup_key():
    records = [rec(i) for i in range(4)] + [rec(1, job="other"), rec(2, task="job/0.0.1/2"),
                                            DlqRecord("t", None, None, (), "r", "job", "tk")]
    assert dedup_keys(records) == [dedup_key(r) for r in records]
    assert dedup_keys([]) == []


def test_record_bound_raises_backpressure_and_stores_nothing(tmp_path):
    s = Spool(str(tmp_path), max_bytes=10_000_000, max_records=10)
    try:
        s.append([rec(i) for i in range(8)])
        with pytest.raises(BackpressureError, match="spool.max.records=10"):
            s.append([rec(i) for i in range(8, 11)])
        assert s.depth() == 8
        assert not s.high_water()
        s.append([rec(8), rec(9)])
        assert s.high_water()
        with pytest.raises(BackpressureError):
            s.append([rec(10)])
        s.delete([r.seq for r in s.read_batch(0, 1)])
        s.append([rec(10)])
        assert s.depth() == 10
    finally:
        s.close()


def test_byte_bound_raises_backpressure(tmp_path):
    s = Spool(str(tmp_path), max_bytes=5_000, max_records=1_000)
    try:
        s.append([rec(0, size=3_000)])
        with pytest.raises(BackpressureError, match="spool.max.bytes=5000"):
            s.append([rec(1, size=3_000)])
        with pytest.raises(BackpressureError, match="can never fit"):
            s.append([rec(2, size=6_000)])
        assert s.depth() == 1 and s.bytes() < 5_000
    finally:
        s.close()


def test_reopen_recovers_rows_in_order_and_counters(tmp_path):
    s = Spool(str(tmp_path), max_bytes=10_000_000, max_records=1_000)
    first = s.append([rec(i) for i in range(10)])
    seqs = s.append([rec(i) for i in range(10, 100)])
    s.delete(first)  # a whole batch row settled: deleted
    nbytes = s.bytes()
    s.close()
    again = Spool(str(tmp_path), max_bytes=10_000_000, max_records=1_000)
    try:
        assert again.recovered == 90
        assert again.depth() == 90 and again.bytes() == nbytes
        rows = again.read_batch(0, 1_000)
        assert [r.record.record_id for r in rows] == [f"r{i}" for i in range(10, 100)]
        assert [r.seq for r in rows] == seqs
        assert rows[0].record == rec(10)
        assert again.append([rec(1000)])[0] > seqs[-1]
    finally:
        again.close()


def test_a_batch_row_is_deleted_only_once_every_record_in_it_is_settled(spool):
    seqs = spool.append([rec(i) for i in range(4)])
    held = spool.bytes()
    assert spool.delete(seqs[:3]) == 3
    assert spool.depth() == 1 and spool.bytes() == held  # the row still holds its bytes
    con = sqlite3.connect(spool.path)
    try:
        assert con.execute("SELECT COUNT(*) FROM batches").fetchone()[0] == 1
        assert [r.seq for r in spool.read_batch(0, 10)] == seqs[3:]
        assert spool.delete(seqs[3:]) == 1
        assert con.execute("SELECT COUNT(*) FROM batches").fetchone()[0] == 0
    finally:
        con.close()
    assert spool.depth() == 0 and spool.bytes() == 0


def test_a_partly_acknowledged_row_replays_only_its_unacknowledged_records(tmp_path):
    s = Spool(str(tmp_path), max_bytes=10_000_000, max_records=1_000)
    seqs = s.append([rec(i) for i in range(10)])
    assert s.delete(seqs[:4]) == 4        # acknowledgements of part of the row, persisted
    assert s.delete([seqs[6], seqs[8]]) == 2
    assert s.reject([(seqs[9], "too large")], now_ms=1) == 1
    assert s.depth() == 3
    held = s.bytes()
    s.close()                              # as good as a crash: close() persists nothing more
    again = Spool(str(tmp_path), max_bytes=10_000_000, max_records=1_000)
    try:
        assert again.recovered == 3 and again.depth() == 3 and again.bytes() == held
        rows = again.read_batch(0, 100)
        assert [r.record for r in rows] == [rec(4), rec(5), rec(7)]
        assert [r.seq for r in rows] == [seqs[4], seqs[5], seqs[7]]
        assert again.delete(seqs) == 3 and again.depth() == 0
        con = sqlite3.connect(again.path)
        try:  # the row is gone, and its settled ranges with it
            assert con.execute("SELECT COUNT(*) FROM batches").fetchone()[0] == 0
            assert con.execute("SELECT COUNT(*) FROM settled").fetchone()[0] == 0
        finally:
            con.close()
    finally:
        again.close()


def test_appends_larger_than_a_row_are_split_and_seqs_stay_ordered(spool):
    seqs = spool.append([rec(i, size=100_000) for i in range(25)])  # 2.5 MB: three rows
    assert seqs == sorted(seqs) and len({s >> 16 for s in seqs}) == 3
    assert [r.record.record_id for r in spool.read_batch(seqs[3], 100)] == [
        f"r{i}" for i in range(4, 25)]
    assert spool.delete(seqs) == 25 and spool.bytes() == 0


def test_a_spool_directory_is_used_by_one_process_at_a_time(tmp_path):
    s = Spool(str(tmp_path), max_bytes=1_000, max_records=10)
    try:
        with pytest.raises(DlqError, match=f"in use by another process \\(pid {os.getpid()}\\)"):
            Spool(str(tmp_path), max_bytes=1_000, max_records=10)
    finally:
        s.close()
    Spool(str(tmp_path), max_bytes=1_000, max_records=10).close()


def test_reject_moves_rows_out_of_the_pending_table_and_keeps_counting_them(tmp_path):
    s = Spool(str(tmp_path), max_bytes=10_000_000, max_records=3)
    try:
        seqs = s.append([rec(1), rec(2)])
        assert s.reject([(seqs[0], "MSG_SIZE_TOO_LARGE: too big")], now_ms=42) == 1
        assert s.depth() == 1 and s.rejected_count() == 1
        assert [r.seq for r in s.read_batch(0, 10)] == [seqs[1]]
        (row,) = s.rejected()
        assert (row.seq, row.record, row.error, row.rejected_ms) == (
            seqs[0], rec(1), "MSG_SIZE_TOO_LARGE: too big", 42)
        s.append([rec(3)])
        with pytest.raises(BackpressureError):  # rejected rows still count against the bound
            s.append([rec(4)])
        assert s.purge_rejected() == 1
        s.append([rec(4)])
    finally:
        s.close()
    again = Spool(str(tmp_path), max_bytes=10_000_000, max_records=3)
    try:
        assert again.rejected_count() == 0 and again.depth() == 3
    finally:
        again.close()


def test_closed_spool_refuses_appends(tmp_path):
    s = Spool(str(tmp_path), max_bytes=1_000, max_records=10)
    s.close()
    with pytest.raises(DlqError, match="closed"):
        s.append([rec(1)])


def test_memory_queue_has_the_same_contract():
    q = MemoryQueue(max_bytes=10_000, max_records=3)
    seqs = q.append([rec(1), rec(2)])
    assert q.append([rec(2)]) == [seqs[1]]
    assert [r.record for r in q.read_batch(0, 10)] == [rec(1), rec(2)]
    assert [r.seq for r in q.read_batch(seqs[0], 10)] == [seqs[1]]
    with pytest.raises(BackpressureError):
        q.append([rec(3), rec(4)])
    assert q.delete([seqs[0]]) == 1
    assert q.reject([(seqs[1], "bad")], now_ms=1) == 1
    assert q.depth() == 0 and q.rejected_count() == 1
    assert q.rejected()[0].error == "bad"


def test_delete_by_ranges_counts_only_rows_that_are_there(spool):
    seqs = spool.append([rec(i) for i in range(10)])
    assert seq_ranges([5, 1, 2, 3, 9, 3]) == [(1, 3), (5, 5), (9, 9)]
    # non-contiguous, repeated, unknown seqs
    assert spool.delete([seqs[0], seqs[1], seqs[4], seqs[1], seqs[9] + 100]) == 3
    assert spool.depth() == 7
    assert spool.delete(seqs) == 7
    assert spool.depth() == 0 and spool.bytes() == 0


def test_whole_rows_settle_at_once_and_repeats_never_stand_in_for_a_missing_record(spool):
    a = spool.append([rec(i) for i in range(3)])
    b = spool.append([rec(i) for i in range(3, 6)])
    assert a[0] >> 16 != b[0] >> 16  # two batch rows
    # as many seqs as row a has records, but one repeated and one missing: a stays
    assert spool.delete([a[0], a[0], a[1]]) == 2
    assert [r.seq for r in spool.read_batch(0, 10)] == [a[2], *b]
    # row b whole, out of order, with a row-a repeat: b is deleted, a keeps its last record
    assert spool.delete([b[2], a[1], b[0], b[1]]) == 3
    assert spool.depth() == 1 and [r.seq for r in spool.read_batch(0, 10)] == [a[2]]
    assert spool.delete(a) == 1
    assert spool.depth() == 0 and spool.bytes() == 0


def test_a_repeat_inside_a_whole_row_span_never_settles_the_record_it_skips(spool):
    a = spool.append([rec(i) for i in range(4)])
    # first and last seq of the row, as many seqs as it has records, one repeated, one missing
    assert spool.delete([a[0], a[1], a[1], a[3]]) == 3
    assert [r.seq for r in spool.read_batch(0, 10)] == [a[2]]
    assert spool.depth() == 1


def test_rejecting_one_record_of_a_batch_keeps_the_others_and_survives_a_restart(tmp_path):
    s = Spool(str(tmp_path), max_bytes=10_000_000, max_records=1_000)
    seqs = s.append([rec(i) for i in range(3)])
    held = s.bytes()
    assert s.reject([(seqs[1], "INVALID_RECORD: bad")], now_ms=7) == 1
    assert s.reject([(seqs[1], "again")], now_ms=8) == 0  # already settled
    assert s.depth() == 2 and s.rejected_count() == 1 and s.bytes() == held
    assert [r.seq for r in s.read_batch(0, 10)] == [seqs[0], seqs[2]]
    s.close()
    again = Spool(str(tmp_path), max_bytes=10_000_000, max_records=1_000)
    try:
        assert again.depth() == 2 and again.rejected_count() == 1 and again.bytes() == held
        assert [r.seq for r in again.read_batch(0, 10)] == [seqs[0], seqs[2]]  # never again
        (row,) = again.rejected()
        assert (row.seq, row.record, row.error) == (seqs[1], rec(1), "INVALID_RECORD: bad")
        assert again.delete([seqs[0], seqs[2]]) == 2
        assert again.depth() == 0 and again.bytes() == row_size(again)
        assert again.purge_rejected() == 1 and again.bytes() == 0
    finally:
        again.close()


def row_size(s: Spool) -> int:
    con = sqlite3.connect(s.path)
    try:
        return con.execute("SELECT COALESCE(SUM(size), 0) FROM rejected").fetchone()[0]
    finally:
        con.close()


def _write_v1_spool(directory, records, rejected=()) -> None:
    """A spool as the previous version wrote it: one `spool` row per record."""
    con = sqlite3.connect(os.path.join(directory, "dlq-spool.sqlite3"))
    con.executescript("""
        CREATE TABLE spool (seq INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL,
            record_id TEXT NOT NULL, task_key TEXT NOT NULL, topic TEXT NOT NULL, key BLOB,
            value BLOB, headers BLOB NOT NULL, traceparent TEXT NOT NULL, size INTEGER NOT NULL,
            UNIQUE (job, record_id));
        CREATE TABLE rejected (seq INTEGER PRIMARY KEY, job TEXT NOT NULL,
            record_id TEXT NOT NULL, task_key TEXT NOT NULL, topic TEXT NOT NULL, key BLOB,
            value BLOB, headers BLOB NOT NULL, traceparent TEXT NOT NULL, size INTEGER NOT NULL,
            error TEXT NOT NULL, rejected_ms INTEGER NOT NULL);
        CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema', '1');
    """)
    cols = "job, record_id, task_key, topic, key, value, headers, traceparent, size"
    for r in records:
        con.execute(f"INSERT INTO spool ({cols}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (r.job, r.record_id, r.task_key, r.topic, r.key, r.value,
                     encode_headers(r.headers), r.traceparent, 50))
    for seq, r in rejected:
        con.execute(f"INSERT INTO rejected (seq, {cols}, error, rejected_ms) "
                    f"VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'old', 1)",
                    (seq, r.job, r.record_id, r.task_key, r.topic, r.key, r.value,
                     encode_headers(r.headers), r.traceparent, 50))
    con.execute("DELETE FROM spool WHERE record_id = 'r0'")  # used seqs are never reused
    con.commit()
    con.close()


def _write_v2_spool(directory, rows, settled=()) -> list[int]:
    """A spool as schema 2 wrote it (up to this session): batch rows without the `segs` column,
    each record marshalled on its own; `settled`: (row index, lo, hi) acknowledged ranges.
    Returns the row ids."""
    con = sqlite3.connect(os.path.join(directory, "dlq-spool.sqlite3"))
    con.executescript("""
        CREATE TABLE batches (id INTEGER PRIMARY KEY AUTOINCREMENT, n INTEGER NOT NULL,
            size INTEGER NOT NULL, ends BLOB NOT NULL, data BLOB NOT NULL);
        CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE settled (row INTEGER NOT NULL, lo INTEGER NOT NULL, hi INTEGER NOT NULL);
        INSERT INTO meta VALUES ('schema', '2');
    """)
    ids = []
    for records in rows:
        blobs = [marshal.dumps((r.topic, r.key, r.value, tuple(r.headers), r.record_id, r.job,
                                r.task_key, r.traceparent), 4) for r in records]
        ends = array("I", itertools.accumulate(map(len, blobs)))
        ids.append(con.execute("INSERT INTO batches (n, size, ends, data) VALUES (?, ?, ?, ?)",
                               (len(blobs), ends[-1], ends.tobytes(), b"".join(blobs))).lastrowid)
    for i, lo, hi in settled:
        con.execute("INSERT INTO settled VALUES (?, ?, ?)", (ids[i], lo, hi))
    con.commit()
    con.close()
    return ids


@pytest.mark.parametrize("write", [_write_v1_spool, _write_v2_spool], ids=["schema1", "schema2"])
def test_a_spool_of_an_unreleased_schema_is_refused_naming_it(tmp_path, write):
    """Schemas 1 and 2 were development formats no release wrote: opening one is a clear error
    (nothing is read, converted or dropped), and the directory's lock is released."""
    write(str(tmp_path), [[rec(0)]] if write is _write_v2_spool else [rec(0)])

    def tables() -> set[str]:
        con = sqlite3.connect(os.path.join(str(tmp_path), "dlq-spool.sqlite3"))
        try:
            return {n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        finally:
            con.close()

    before = tables()
    for _ in range(2):  # the second attempt is refused the same way: the lock was released
        with pytest.raises(DlqError, match=r"is of schema [12], which this version does not read"):
            Spool(str(tmp_path), max_bytes=10_000_000, max_records=1_000)
    assert tables() == before  # nothing was created or converted


def test_a_report_is_stored_as_one_segment_and_read_back_record_by_record(spool):
    seqs = spool.append([rec(i) for i in range(300)])
    con = sqlite3.connect(spool.path)
    try:
        (segs, n, size), = con.execute("SELECT segs, n, size FROM batches").fetchall()
    finally:
        con.close()
    assert array("I", segs).tolist() == [300] and n == 300 and size == spool.bytes()
    got = spool.read_batch(seqs[149], 1000)  # from the middle of the segment
    assert [r.record for r in got] == [rec(i) for i in range(150, 300)]
    assert sum(r.size for r in spool.read_batch(0, 1000)) == size  # sizes add up to the row
    assert spool.delete(seqs[:299]) == 299 and spool.depth() == 1
    assert [r.record for r in spool.read_batch(0, 10)] == [rec(299)]


def test_reading_back_takes_every_pending_record_in_its_window_once(spool):
    """Rows of one and of several segments, records settled inside segments (partly settled
    rows): a read of (after, limit, upto) is the pending records after `after` up to `upto`,
    the first `limit` of them, with the bytes each accounts for."""
    records, seqs = [], []
    for n in (3, 7, 4100, 5):  # one group commit each; 4,100 records make two segments
        batch = [rec(len(records) + i, size=(len(records) + i) % 7) for i in range(n)]
        records += batch
        seqs += spool.append(batch)
    gone = set(seqs[1:3] + seqs[10:14] + seqs[4000:4200] + seqs[-2:])
    spool.delete(sorted(gone))
    pending = [(s, r) for s, r in zip(seqs, records, strict=True) if s not in gone]
    whole = spool.read_batch(0, 10_000)
    assert [(r.seq, r.record) for r in whole] == pending
    size_of = {r.seq: r.size for r in whole}
    for after in [0, *seqs[::331], seqs[3999], seqs[4095], seqs[4096]]:
        for upto in [None, *seqs[2::1000], seqs[4105]]:
            for limit in (1, 3, 100, 5000):
                want = [(s, r) for s, r in pending
                        if s > after and (upto is None or s <= upto)][:limit]
                got_seqs, got_records, got_sizes = spool.read_columns(after, limit, upto)
                assert list(zip(got_seqs, got_records)) == want, (after, upto, limit)
                assert got_sizes == [size_of[s] for s in got_seqs]
    assert spool.read_columns(0, 0) == ([], [], [])
