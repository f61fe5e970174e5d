"""The durable local spool: where a DLQ record lives from the moment the sidecar accepts it until
Kafka acknowledges it.

SQLite (stdlib ``sqlite3``) in WAL mode with ``synchronous=FULL``: a committed row survives a
``kill -9`` of the sidecar and a power loss. A report's records are serialized once, as one
segment (one marshal call: a list of their field tuples; cut at _SEG_RECORDS records or 1 MiB).
One row per group commit (its reports' segments, at most 65,536 records, closed before it would
pass 1 MiB): the segments concatenated, their record counts (``segs``), per-record end offsets
(``ends``: each segment's bytes split evenly among its records), the count of records not yet
rejected (``n``) and their bytes (``size``). Rows
are numbered by AUTOINCREMENT (never reused, even after deletes); a record's ``seq`` is virtual:
``row_id * 2**16 + index``, so that seqs keep arrival order.

A row is deleted once every record in it is settled: acknowledged by Kafka, or moved to the
``rejected`` table (which keeps one row per record). Acknowledgements of part of a row are written
as index ranges to the ``settled`` table in the same transaction as the deletes (one per
`delete()` call: the drain groups acknowledgements, at most 0.2 s or 5,000 of them), and kept in
memory as one byte per record for partly settled rows; after a crash only the records of a row
that are neither settled nor rejected are produced again. Duplicates are possible (records in
flight, or acknowledged since the last `delete()`), loss is not.

Deduplication: a record reported again (same job, record id and payload: `dedup_key`) while it
is still pending and among the last ``_DEDUP_WINDOW`` records spooled (recovered ones included)
is stored once, and the caller is told the seq it already has. Older ones may be stored twice.

Group commit: `append()` hands its records to one writer thread, which combines every request
queued meanwhile into one transaction (one INSERT per batch row, one fsync) and then wakes each
caller. A caller returns only once its records are committed.

Bounds and full-policy: ``spool.max.records`` and ``spool.max.bytes`` bound everything the spool
holds (pending records plus rejected ones; a row's bytes count until the row is deleted). An
`append()` that would pass either mark raises BackpressureError and stores none of its records:
never a silent drop.

Rejected records: a record Kafka can never accept (too large, invalid) is copied into the
``rejected`` table and settled in its row, so that it is neither lost nor produced again in a
loop; those keep counting against the bounds until an operator removes them (`purge_rejected()`).

Spools of schema 1 (one ``spool`` row per record) are converted at open, in one transaction,
into batch rows numbered above every seq they used. Rows of schema 2 (each record marshalled on
its own, ``segs`` NULL) are read as they are.

`MemoryQueue` offers the same interface without durability, for ``spool.enable=false``.
"""

from __future__ import annotations

import bisect
import collections
import fcntl
import itertools
import logging
import marshal
import os
import sqlite3
import struct
import threading
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from ..core.model import DlqRecord, Header
from ..errors import BackpressureError, DlqError
from ..memtune import release_memory
from . import perms

log = logging.getLogger(__name__)

DB_NAME = "dlq-spool.sqlite3"
LOCK_NAME = "dlq-spool.lock"
SCHEMA_VERSION = "3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    n INTEGER NOT NULL,
    size INTEGER NOT NULL,
    ends BLOB NOT NULL,
    data BLOB NOT NULL,
    segs BLOB
);
CREATE TABLE IF NOT EXISTS rejected (
    seq INTEGER PRIMARY KEY,
    job TEXT NOT NULL,
    record_id TEXT NOT NULL,
    task_key TEXT NOT NULL,
    topic TEXT NOT NULL,
    key BLOB,
    value BLOB,
    headers BLOB NOT NULL,
    traceparent TEXT NOT NULL,
    size INTEGER NOT NULL,
    error TEXT NOT NULL,
    rejected_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS settled (
    row INTEGER NOT NULL,
    lo INTEGER NOT NULL,
    hi INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS settled_row ON settled (row);
"""
_COLUMNS = "job, record_id, task_key, topic, key, value, headers, traceparent, size"
_ROW_BITS = 16  # seq = row id * 2**16 + index in the row
_IDX_MASK = (1 << _ROW_BITS) - 1
_ROW_RECORDS = 1 << _ROW_BITS  # records per batch row at most
_ROW_BYTES = 1024 * 1024  # a batch row is closed once it holds this much
_SEG_RECORDS = 4096  # records per segment (one marshal call) at most
_DEDUP_WINDOW = 65_536  # recent records a repeated report is matched against


def dedup_key(rec: DlqRecord) -> tuple[str, str, int]:
    """What makes two DLQ records the same record: job, record id and payload (two records
    under one id are two records: core.policy, record identity). Process-local (str hash)."""
    return (rec.job, rec.record_id, hash((rec.key, rec.value)))
_CHUNK = 500  # host parameters per IN (...) list
_PAGE_SIZE = 16384  # bytes per SQLite page for a new spool
_CACHE_KIB = 2048  # SQLite page cache per connection (PRAGMA cache_size, negative = KiB)
_WAL_LIMIT = 64 * 1024 * 1024  # the WAL file is cut back to this after a checkpoint
# After a drain leaves the spool empty, memory is handed back to the OS once it held this much.
_RELEASE_AFTER_BYTES = 16 * 1024 * 1024


class Placed(NamedTuple):
    """Where an appended record went: its seq, the task_key stored with it, whether
    this append created the row (False: the record was already spooled), and the bytes the
    record accounts for against ``spool.max.bytes``."""

    seq: int
    owner: str
    fresh: bool
    size: int = 0


OnCommit = Callable[[Sequence[Placed]], None]


# --- header codec ---------------------------------------------------------------------------
# marshal (format version 4) of the headers tuple: one C call each way. Blobs written by earlier
# versions (count:u32 big-endian, then per header: name length:u16, name (UTF-8), value
# length:i32 (-1: None), value) start with a zero byte, which a marshalled tuple never does, and
# are still read.

_MARSHAL_VERSION = 4
_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")
_I32 = struct.Struct(">i")


def encode_headers(headers: Sequence[Header]) -> bytes:
    if type(headers) is not tuple:
        headers = tuple(headers)
    return marshal.dumps(headers, _MARSHAL_VERSION)


def decode_headers(blob: bytes) -> tuple[Header, ...]:
    if blob[:1] == b"\x00":
        return _decode_legacy(blob)
    out = marshal.loads(blob)
    if type(out) is not tuple:
        raise DlqError(f"corrupt DLQ spool row: headers decode to {type(out).__name__}")
    return out


def _decode_legacy(blob: bytes) -> tuple[Header, ...]:
    (count,) = _U32.unpack_from(blob, 0)
    pos = 4
    out: list[Header] = []
    for _ in range(count):
        (nlen,) = _U16.unpack_from(blob, pos)
        pos += 2
        name = blob[pos:pos + nlen].decode("utf-8")
        pos += nlen
        (vlen,) = _I32.unpack_from(blob, pos)
        pos += 4
        if vlen < 0:
            out.append((name, None))
        else:
            out.append((name, bytes(blob[pos:pos + vlen])))
            pos += vlen
    return tuple(out)


def record_size(rec: DlqRecord, headers_blob: bytes) -> int:
    """The bytes a record accounts for against ``spool.max.bytes``."""
    return (len(rec.key or b"") + len(rec.value or b"") + len(headers_blob) + len(rec.topic)
            + len(rec.record_id) + len(rec.job) + len(rec.task_key) + len(rec.traceparent))


def encode_segments(records: Sequence[DlqRecord]) -> list[tuple[bytes, int]]:
    """A report's records as stored: one marshal call per segment (a list of their field
    tuples), with its record count. One call per report instead of one per record: marshal's
    per-call set-up and its reference table (the header names repeat in every record) are paid
    once. A segment holds at most _SEG_RECORDS records and, unless it is one record, at most
    _ROW_BYTES (a larger one is cut and encoded again: rare, reports are small)."""
    fields = [(r.topic, r.key, r.value, r.headers if type(r.headers) is tuple else tuple(r.headers),
               r.record_id, r.job, r.task_key, r.traceparent) for r in records]
    out: list[tuple[bytes, int]] = []
    for i in range(0, len(fields), _SEG_RECORDS):
        _encode_into(fields[i:i + _SEG_RECORDS], out)
    return out


def _encode_into(fields: list[tuple], out: list[tuple[bytes, int]]) -> None:
    blob = marshal.dumps(fields, _MARSHAL_VERSION)
    if len(blob) <= _ROW_BYTES or len(fields) == 1:
        out.append((blob, len(fields)))
        return
    parts = -(-len(blob) // _ROW_BYTES)  # a part that is still too large is cut again
    step = -(-len(fields) // parts)
    for i in range(0, len(fields), step):
        _encode_into(fields[i:i + step], out)


def _seg_sizes(nbytes: int, count: int) -> list[int]:
    """The bytes each record of a segment accounts for: the segment's bytes split evenly (the
    remainder on its last record), so that a row's per-record ends fall on segment bounds."""
    q, r = divmod(nbytes, count)
    sizes = [q] * count
    sizes[-1] += r
    return sizes


def _decode(data: bytes, start: int, end: int) -> DlqRecord:
    fields = marshal.loads(memoryview(data)[start:end])
    if type(fields) is not tuple or len(fields) != 8:
        raise DlqError("corrupt DLQ spool row: a record does not decode to its 8 fields")
    return DlqRecord(*fields)


def _record(row: Sequence) -> DlqRecord:
    job, record_id, task_key, topic, key, value, blob, traceparent = row
    return DlqRecord(topic=topic, key=key, value=value, headers=decode_headers(blob),
                     record_id=record_id, job=job, task_key=task_key, traceparent=traceparent)


def seq_ranges(seqs: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted, de-duplicated runs of consecutive seqs as (first, last) pairs."""
    ordered = sorted(set(seqs))
    out: list[tuple[int, int]] = []
    lo = hi = ordered[0]
    for s in ordered[1:]:
        if s == hi + 1:
            hi = s
        else:
            out.append((lo, hi))
            lo = hi = s
    out.append((lo, hi))
    return out


@dataclass(frozen=True, slots=True)
class SpooledRecord:
    seq: int
    record: DlqRecord
    size: int


@dataclass(frozen=True, slots=True)
class RejectedRecord:
    seq: int
    record: DlqRecord
    error: str
    rejected_ms: int


class RecordStore(Protocol):
    """What the drain needs from where accepted records wait for Kafka (Spool or MemoryQueue)."""

    durable: bool
    max_records: int
    max_bytes: int

    def append(self, records: Sequence[DlqRecord], on_commit: OnCommit | None = None
               ) -> list[int]: ...
    def read_batch(self, after_seq: int, limit: int) -> list[SpooledRecord]: ...
    def delete(self, seqs: Sequence[int]) -> int: ...
    def reject(self, items: Sequence[tuple[int, str]], now_ms: int) -> int: ...
    def last_seq(self) -> int: ...
    def depth(self) -> int: ...
    def bytes(self) -> int: ...
    def rejected_count(self) -> int: ...
    def high_water(self) -> bool: ...
    def close(self) -> None: ...


def _backpressure(n: int, size: int, held_records: int, held_bytes: int, max_records: int,
                  max_bytes: int) -> BackpressureError:
    if n > max_records or size > max_bytes:
        return BackpressureError(
            f"a batch of {n} DLQ records ({size} bytes) can never fit in the spool "
            f"(spool.max.records={max_records}, spool.max.bytes={max_bytes}): submit smaller "
            f"batches or raise the limits")
    return BackpressureError(
        f"DLQ spool at its high-water mark: holds {held_records} records / {held_bytes} bytes, "
        f"{n} more records / {size} bytes would pass spool.max.records={max_records} or "
        f"spool.max.bytes={max_bytes}; retry later (Kafka is behind or unreachable)")


@dataclass(eq=False)
class _Request:
    records: Sequence[DlqRecord]
    segments: list[tuple[bytes, int]]  # the records encoded (`encode_segments`)
    n: int  # records
    size: int  # bytes of the segments
    on_commit: OnCommit | None
    done: threading.Event = field(default_factory=threading.Event)
    placed: list[Placed] = field(default_factory=list)
    error: BaseException | None = None


class _Row:
    """What the spool keeps in memory per batch row: its record count, the records not yet
    settled (acknowledged or rejected), the bytes it holds, and, only once some but not all of
    its records are settled, one byte per record saying which."""

    __slots__ = ("total", "left", "size", "done")

    def __init__(self, total: int, left: int, size: int) -> None:
        self.total = total
        self.left = left
        self.size = size
        self.done: bytearray | None = None

    def pending(self, idx: int) -> bool:
        return idx < self.total and (self.done is None or not self.done[idx])


def _ends(data_ends: bytes) -> array:
    a = array("I")
    a.frombytes(data_ends)
    return a


def _decode_row(rid: int, ends: bytes, segs: bytes | None, data: bytes, start: int, row: _Row
                ) -> Iterator[tuple[int, SpooledRecord]]:
    """The pending records of a batch row from index `start` on, in order. `segs` NULL: each
    record marshalled on its own (rows written before schema 3); else the record count of each
    segment (one marshalled list of records), in order."""
    e = _ends(ends)
    done = row.done
    base = rid << _ROW_BITS
    if segs is None:
        prev = e[start - 1] if 0 < start <= len(e) else 0
        for i in range(start, len(e)):
            end = e[i]
            if done is None or not done[i]:
                yield i, SpooledRecord(base | i, _decode(data, prev, end), end - prev)
            prev = end
        return
    first = 0
    for count in _ends(segs):
        last = first + count
        lo = max(first, start)
        if last > lo and (done is None or not all(done[lo:last])):
            seg_start = e[first - 1] if first else 0
            items = marshal.loads(memoryview(data)[seg_start:e[last - 1]])
            if type(items) is not list or len(items) != count:
                raise DlqError("corrupt DLQ spool row: a segment does not decode to its records")
            prev = e[lo - 1] if lo else 0
            for i in range(lo, last):
                end = e[i]
                if done is None or not done[i]:
                    fields = items[i - first]
                    if type(fields) is not tuple or len(fields) != 8:
                        raise DlqError("corrupt DLQ spool row: a record does not decode to its "
                                       "8 fields")
                    yield i, SpooledRecord(base | i, DlqRecord(*fields), end - prev)
                prev = end
        first = last


def _split_segments(segments: list[tuple[bytes, int]]) -> list[list[tuple[bytes, int]]]:
    """Cut segments into batch rows, in order: a row takes segments while they fit in _ROW_BYTES
    (a larger segment gets a row of its own) and _ROW_RECORDS records."""
    rows: list[list[tuple[bytes, int]]] = []
    cur: list[tuple[bytes, int]] = []
    nbytes = nrecs = 0
    for seg in segments:
        if cur and (nbytes + len(seg[0]) > _ROW_BYTES or nrecs + seg[1] > _ROW_RECORDS):
            rows.append(cur)
            cur, nbytes, nrecs = [], 0, 0
        cur.append(seg)
        nbytes += len(seg[0])
        nrecs += seg[1]
    if cur:
        rows.append(cur)
    return rows


class Spool:
    """SQLite-backed, group-committed, bounded spool in `directory` (one process at a time)."""

    durable = True

    def __init__(self, directory: str, *, max_bytes: int, max_records: int,
                 max_group_records: int = 20_000, append_timeout_s: float = 60.0,
                 group: str = "") -> None:
        if max_bytes < 1 or max_records < 1:
            raise ValueError("spool bounds must be >= 1")
        self.directory = directory
        self.path = os.path.join(directory, DB_NAME)
        self.max_bytes = max_bytes
        self.max_records = max_records
        self._max_group = max_group_records
        self._append_timeout_s = append_timeout_s
        self._rows: dict[int, _Row] = {}
        # the dedup window: `dedup_key` -> (seq, task_key) of recently spooled records, in
        # two generations of at most _DEDUP_WINDOW // 2 each
        self._recent: dict[_DedupKey, tuple[int, str]] = {}
        self._recent_old: dict[_DedupKey, tuple[int, str]] = {}
        # DLQ payloads at rest: directory 0700, files 0600 (spool.group: 0750 / 0640)
        perms.prepare(directory, self.path, (os.path.join(directory, LOCK_NAME),), group)
        self._lock_fd = self._take_lock(directory)
        try:
            self._conn = self._connect()
            self._conn.executescript(_SCHEMA)
            self._migrate_v1()
            self._add_segments_column()
            self._conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)",
                               (SCHEMA_VERSION,))
            self._reader = self._connect()
            pending_bytes = self._load_rows()
            (self._rejected, rejected_bytes) = self._conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM rejected").fetchone()
            self._bytes = pending_bytes + rejected_bytes
            self._peak_bytes = self._bytes
            row = self._conn.execute(
                "SELECT seq FROM sqlite_sequence WHERE name = 'batches'").fetchone()
            last_row = row[0] if row else 0
            # every seq of the last row (whatever its size) is at or below this one
            self._last_seq = (last_row << _ROW_BITS) | _IDX_MASK if last_row else 0
            self._fill_dedup_window()
        except sqlite3.Error as exc:
            os.close(self._lock_fd)
            raise DlqError(f"cannot open the DLQ spool {self.path}: {exc}") from exc
        self.recovered = self._depth
        if self._depth:
            log.info("DLQ spool %s: recovered %d records (%d bytes) to drain", self.path,
                     self._depth, pending_bytes)
        self._lock = threading.Lock()     # counters and the per-row state
        self._wlock = threading.Lock()    # one write transaction at a time
        self._rlock = threading.Lock()    # the reader connection
        self._cv = threading.Condition()  # the writer's queue
        self._queue: collections.deque[_Request] = collections.deque()
        self._closing = False
        self._writer = threading.Thread(target=self._write_loop, name="spillway-spool-writer",
                                        daemon=True)
        self._writer.start()

    # -- opening --------------------------------------------------------------------------

    @staticmethod
    def _take_lock(directory: str) -> int:
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise DlqError(f"the DLQ spool in {directory} is in use by another process "
                           f"(pid {holder}); use one spool.dir per sidecar") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=30.0)
        # Batch rows are large blobs: big pages mean fewer overflow pages to write, checksum
        # and walk. Only takes effect when the database file is created.
        conn.execute(f"PRAGMA page_size={_PAGE_SIZE}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute(f"PRAGMA cache_size=-{_CACHE_KIB}")
        conn.execute(f"PRAGMA journal_size_limit={_WAL_LIMIT}")
        return conn

    def _migrate_v1(self) -> None:
        """A spool written by an earlier version (one ``spool`` row per record): move its rows,
        in seq order, into batch rows numbered after every seq it used, in one transaction."""
        conn = self._conn
        if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'spool'"
                        ).fetchone() is None:
            return
        try:
            conn.execute("BEGIN IMMEDIATE")
            (old_max,) = conn.execute(
                "SELECT MAX(m) FROM (SELECT COALESCE(MAX(seq), 0) AS m FROM spool "
                "UNION ALL SELECT COALESCE(MAX(seq), 0) FROM rejected "
                "UNION ALL SELECT seq FROM sqlite_sequence WHERE name = 'spool')").fetchone()
            base = (old_max or 0) >> _ROW_BITS  # new seqs start above every old one
            if conn.execute("UPDATE sqlite_sequence SET seq = MAX(seq, ?) WHERE name = 'batches'",
                            (base,)).rowcount == 0:
                conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('batches', ?)",
                             (base,))
            moved = 0
            cur = conn.execute(
                "SELECT job, record_id, task_key, topic, key, value, headers, traceparent "
                "FROM spool ORDER BY seq")
            while True:
                old = cur.fetchmany(_SEG_RECORDS)
                if not old:
                    break
                for segments in _split_segments(encode_segments([_record(r) for r in old])):
                    self._insert_row(conn, segments)
                moved += len(old)
            conn.execute("DROP TABLE spool")
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        log.info("DLQ spool %s: converted %d records from the per-record format (schema 1) to "
                 "batch rows", self.path, moved)

    def _add_segments_column(self) -> None:
        """A spool of schema 2 (every record marshalled on its own) gets the ``segs`` column;
        its rows keep it NULL and are read as they were written: nothing is rewritten."""
        cols = {r[1] for r in self._conn.execute("PRAGMA table_info(batches)")}
        if "segs" not in cols:
            self._conn.execute("ALTER TABLE batches ADD COLUMN segs BLOB")

    def _load_rows(self) -> int:
        """Rebuild the per-row state from the table; returns the pending bytes."""
        depth = pending_bytes = 0
        for rid, n, size, total in self._conn.execute(
                "SELECT id, n, size, length(ends) / 4 FROM batches"):
            self._rows[rid] = _Row(total, n, size)
            depth += n
            pending_bytes += size
        if self._rows:  # records of those rows already moved to the rejected table
            for (seq,) in self._conn.execute("SELECT seq FROM rejected WHERE seq >= ?",
                                             (min(self._rows) << _ROW_BITS,)):
                row = self._rows.get(seq >> _ROW_BITS)
                if row is not None and (seq & _IDX_MASK) < row.total:
                    if row.done is None:
                        row.done = bytearray(row.total)
                    row.done[seq & _IDX_MASK] = 1
            depth -= self._load_settled()
        self._depth = depth
        return pending_bytes

    def _load_settled(self) -> int:
        """Apply the acknowledged index ranges of partly settled rows; returns how many
        records they settle. A row they settle completely (never written so, but cheap to
        guard) is deleted now."""
        settled = 0
        for rid, lo, hi in self._conn.execute("SELECT row, lo, hi FROM settled"):
            row = self._rows.get(rid)
            if row is None:
                continue
            if row.done is None:
                row.done = bytearray(row.total)
            done = row.done
            for i in range(max(lo, 0), min(hi, row.total - 1) + 1):
                if not done[i]:
                    done[i] = 1
                    row.left -= 1
                    settled += 1
        emptied = [rid for rid, row in self._rows.items() if row.left <= 0]
        if emptied:
            with self._conn:
                for rid in emptied:
                    self._conn.execute("DELETE FROM batches WHERE id = ?", (rid,))
                    self._conn.execute("DELETE FROM settled WHERE row = ?", (rid,))
            for rid in emptied:
                del self._rows[rid]
        self._conn.execute("DELETE FROM settled WHERE row NOT IN (SELECT id FROM batches)")
        return settled

    def _fill_dedup_window(self) -> None:
        """Put the newest recovered records in the dedup window (at most half of it)."""
        room = _DEDUP_WINDOW // 2
        window: list[tuple[_DedupKey, tuple[int, str]]] = []
        cur = self._conn.execute("SELECT id, ends, segs, data FROM batches ORDER BY id DESC")
        for rid, ends, segs, data in cur:
            row = self._rows[rid]
            for i, rec in reversed(list(_decode_row(rid, ends, segs, data, 0, row))):
                window.append((dedup_key(rec.record),
                               (rec.seq, rec.record.task_key)))
            if len(window) >= room:
                break
        cur.close()
        self._recent_old = dict(reversed(window))

    @staticmethod
    def _insert_row(conn: sqlite3.Connection, segments: list[tuple[bytes, int]]) -> int:
        """One batch row of `segments` (marshalled lists of records, record count). Its ``ends``
        are the per-record ends (each segment's bytes split evenly among its records: what each
        counts against the bounds); ``segs`` the record count per segment (NULL only in rows
        written before schema 3, where each record is marshalled on its own)."""
        sizes: list[int] = []
        for blob, count in segments:
            sizes += _seg_sizes(len(blob), count)
        ends = array("I", itertools.accumulate(sizes))
        segs = array("I", [c for _, c in segments]).tobytes()
        return conn.execute(
            "INSERT INTO batches (n, size, ends, data, segs) VALUES (?, ?, ?, ?, ?)",
            (len(sizes), ends[-1], ends.tobytes(), b"".join(b for b, _ in segments),
             segs)).lastrowid

    # -- writing --------------------------------------------------------------------------

    def append(self, records: Sequence[DlqRecord], on_commit: OnCommit | None = None
               ) -> list[int]:
        """Store `records` durably; return their seqs (an already-spooled record: its seq).

        `on_commit(placed)` runs in the writer thread right after the commit, before any later
        delete can run. Raises BackpressureError past the bounds, DlqError if the disk fails.
        """
        if not records:
            return []
        segments = encode_segments(records)
        req = _Request(records, segments, len(records), sum(len(b) for b, _ in segments),
                       on_commit)
        with self._lock:
            held_records, held_bytes = self._depth + self._rejected, self._bytes
        if (held_records + req.n > self.max_records
                or held_bytes + req.size > self.max_bytes):
            raise _backpressure(req.n, req.size, held_records, held_bytes,
                                self.max_records, self.max_bytes)
        with self._cv:
            if self._closing:
                raise DlqError("the DLQ spool is closed")
            self._queue.append(req)
            self._cv.notify()
        if not req.done.wait(self._append_timeout_s):
            raise DlqError(f"the DLQ spool did not commit within {self._append_timeout_s}s "
                           f"(disk stalled?); the records may or may not be spooled")
        if req.error is not None:
            raise req.error
        return [p.seq for p in req.placed]

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft()]
                n = batch[0].n
                while self._queue and n + self._queue[0].n <= self._max_group:
                    req = self._queue.popleft()
                    n += req.n
                    batch.append(req)
            try:
                self._commit(batch)
            except BaseException as exc:  # never leave a caller waiting
                log.exception("DLQ spool writer failed")
                for req in batch:
                    if req.error is None and not req.placed:
                        req.error = DlqError(f"DLQ spool write failed: {exc}")
            finally:
                for req in batch:
                    req.done.set()
            # not held while waiting for the next request: the last group of a burst (its
            # records, blobs, placements) would stay alive, and pin allocator arenas, until then
            del batch, req

    def _spooled(self, key: _DedupKey) -> tuple[int, str] | None:
        """(seq, task_key) of this record when it is in the dedup window and still pending."""
        hit = self._recent.get(key) or self._recent_old.get(key)
        if hit is not None:
            row = self._rows.get(hit[0] >> _ROW_BITS)
            if row is not None and row.pending(hit[0] & _IDX_MASK):
                return hit
        return None

    def _plan(self, accepted: list[_Request]
              ) -> tuple[list[list[tuple[bytes, int]]], list[list[tuple[int, int, str, bool]]]]:
        """Where each record goes when some were seen before: (row number in this group, index,
        task_key, True) for a new one; (-1, its seq, its task_key, False) for one still spooled,
        or (row number, index, task_key, False) for one repeated within this group. The new
        records of each row are encoded again, as that row's segments."""
        rows: list[list[DlqRecord]] = [[]]
        row_bytes = 0
        plans: list[list[tuple[int, int, str, bool]]] = []
        local: dict[_DedupKey, tuple[int, int, str]] = {}
        for req in accepted:
            plan = []
            avg = req.size // req.n
            for rec in req.records:
                key = dedup_key(rec)
                hit = local.get(key)
                if hit is not None:
                    plan.append((hit[0], hit[1], hit[2], False))
                    continue
                old = self._spooled(key)
                if old is not None:
                    plan.append((-1, old[0], old[1], False))
                    continue
                cur = rows[-1]
                if len(cur) >= _ROW_RECORDS or row_bytes >= _ROW_BYTES:
                    cur = []
                    rows.append(cur)
                    row_bytes = 0
                local[key] = at = (len(rows) - 1, len(cur), rec.task_key)
                cur.append(rec)
                row_bytes += avg
                plan.append((*at, True))
            plans.append(plan)
        return [encode_segments(r) for r in rows if r], plans

    def _commit(self, batch: list[_Request]) -> None:
        with self._wlock:
            with self._lock:
                held_records, held_bytes = self._depth + self._rejected, self._bytes
            accepted: list[_Request] = []
            for req in batch:
                n = req.n
                if (held_records + n > self.max_records
                        or held_bytes + req.size > self.max_bytes):
                    req.error = _backpressure(n, req.size, held_records, held_bytes,
                                              self.max_records, self.max_bytes)
                    continue
                held_records += n
                held_bytes += req.size
                accepted.append(req)
            if not accepted:
                return
            keys = [dedup_key(r) for req in accepted for r in req.records]
            if (len(set(keys)) == len(keys) and self._recent.keys().isdisjoint(keys)
                    and self._recent_old.keys().isdisjoint(keys)):
                # all new: the requests' segments, in order
                rows = _split_segments([seg for req in accepted for seg in req.segments])
                plans = None
            else:
                rows, plans = self._plan(accepted)
            conn = self._conn
            ids: list[int] = []
            try:
                if rows:
                    conn.execute("BEGIN IMMEDIATE")
                    for segments in rows:
                        ids.append(self._insert_row(conn, segments))
                    conn.execute("COMMIT")
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                err = DlqError(f"DLQ spool write failed ({self.path}): {exc}")
                err.__cause__ = exc
                for req in accepted:
                    req.error = err
                return
            # per row: its records' sizes (as _insert_row wrote its ends)
            row_sizes: list[list[int]] = []
            for segments in rows:
                sizes: list[int] = []
                for blob, count in segments:
                    sizes += _seg_sizes(len(blob), count)
                row_sizes.append(sizes)
            new_n = sum(map(len, row_sizes))
            new_bytes = 0
            with self._lock:
                for rid, sizes in zip(ids, row_sizes, strict=True):
                    size = sum(sizes)
                    self._rows[rid] = _Row(len(sizes), len(sizes), size)
                    new_bytes += size
                self._depth += new_n
                self._bytes += new_bytes
                self._peak_bytes = max(self._peak_bytes, self._bytes)
            recent = self._recent
            if plans is None:
                seqs: list[int] = []
                all_sizes: list[int] = []
                for rid, sizes in zip(ids, row_sizes, strict=True):
                    seqs.extend(range(rid << _ROW_BITS, (rid << _ROW_BITS) + len(sizes)))
                    all_sizes += sizes
                owners = [r.task_key for req in accepted for r in req.records]
                recent.update(zip(keys, zip(seqs, owners)))
                pos = 0
                for req in accepted:
                    end = pos + req.n
                    req.placed = list(map(Placed, seqs[pos:end], owners[pos:end],
                                          itertools.repeat(True), all_sizes[pos:end]))
                    pos = end
            else:
                for req, plan in zip(accepted, plans, strict=True):
                    placed = req.placed = []
                    avg = req.size // req.n
                    for (rn, idx, owner, fresh), rec in zip(plan, req.records, strict=True):
                        if rn < 0:
                            placed.append(Placed(idx, owner, fresh, avg))
                            continue
                        seq = (ids[rn] << _ROW_BITS) | idx
                        placed.append(Placed(seq, owner, fresh, row_sizes[rn][idx]))
                        if fresh:
                            recent[dedup_key(rec)] = (seq, owner)
            if len(recent) >= _DEDUP_WINDOW // 2:
                self._recent_old, self._recent = recent, {}
            for req in accepted:
                if req.on_commit is not None:
                    try:
                        req.on_commit(req.placed)
                    except Exception:
                        log.exception("DLQ spool on_commit hook failed")
            if ids:
                with self._lock:  # published once every hook of the group has run
                    self._last_seq = (ids[-1] << _ROW_BITS) | (len(row_sizes[-1]) - 1)

    def _settle(self, seqs: Sequence[int]
                ) -> tuple[list[tuple[int, _Row, list[int]]], list[int]]:
        """Which records of `seqs` are still pending, per row (row id, row, indexes); and which
        rows that empties. Per row, not per record, when the seqs cover the whole row (the usual
        case: the drain acknowledges rows in order)."""
        ordered = sorted(seqs)
        marks: list[tuple[int, _Row, list[int]]] = []
        emptied: list[int] = []
        rows = self._rows
        i, n = 0, len(ordered)
        while i < n:
            rid = ordered[i] >> _ROW_BITS
            j = bisect.bisect_left(ordered, (rid + 1) << _ROW_BITS, i)
            row = rows.get(rid)
            if row is not None:
                base = rid << _ROW_BITS
                if (row.done is None and j - i == row.total and ordered[i] == base
                        and ordered[i:j] == list(range(base, base + row.total))):
                    # every record of the row, each once (a repeat with a gap between the
                    # same first and last seq must not stand in for the missing record)
                    fresh = list(range(row.total))
                else:
                    done = row.done
                    fresh = sorted({s & _IDX_MASK for s in ordered[i:j]
                                    if (s & _IDX_MASK) < row.total
                                    and (done is None or not done[s & _IDX_MASK])})
                if fresh:
                    marks.append((rid, row, fresh))
                    if len(fresh) == row.left:
                        emptied.append(rid)
            i = j
        return marks, emptied

    def _apply(self, marks: list[tuple[int, _Row, list[int]]], emptied: list[int]
               ) -> tuple[int, int]:
        """Record settled records in memory (under both locks); returns (records, bytes freed)."""
        n = freed = 0
        for _, row, idxs in marks:
            row.left -= len(idxs)
            n += len(idxs)
            if row.left:
                if row.done is None:
                    row.done = bytearray(row.total)
                for i in idxs:
                    row.done[i] = 1
        for rid in emptied:
            freed += self._rows.pop(rid).size
        return n, freed

    def delete(self, seqs: Sequence[int]) -> int:
        """Settle records Kafka acknowledged; returns how many were pending.

        One transaction: a batch row is deleted (one statement per run of consecutive row ids)
        once all of its records are settled; the records settled in a row that still has
        pending ones are written as index ranges to the ``settled`` table, so that a restart
        does not produce them again. When this leaves the spool empty after it held a lot,
        SQLite's caches and the process's freed heap are handed back to the OS.
        """
        if not seqs:
            return 0
        with self._wlock:
            marks, emptied = self._settle(seqs)
            if not marks:
                return 0
            conn = self._conn
            # ranges settled in rows that keep pending records (emptied rows are deleted)
            gone = set(emptied)
            partial = [(rid, lo, hi) for rid, _, idxs in marks if rid not in gone
                       for lo, hi in seq_ranges(idxs)]
            try:
                # settling loses nothing if a power cut undoes it (a record would be produced
                # again): no fsync of its own; the next append's commit syncs the WAL anyway
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute("BEGIN IMMEDIATE")
                for lo, hi in seq_ranges(emptied) if emptied else ():
                    conn.execute("DELETE FROM batches WHERE id BETWEEN ? AND ?", (lo, hi))
                    conn.execute("DELETE FROM settled WHERE row BETWEEN ? AND ?", (lo, hi))
                if partial:
                    conn.executemany("INSERT INTO settled (row, lo, hi) VALUES (?, ?, ?)",
                                     partial)
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise DlqError(f"DLQ spool delete failed ({self.path}): {exc}") from exc
            finally:
                conn.execute("PRAGMA synchronous=FULL")
            with self._lock:
                n, freed = self._apply(marks, emptied)
                self._depth -= n
                self._bytes -= freed
                empty = self._depth == 0
                release = empty and self._peak_bytes >= _RELEASE_AFTER_BYTES
                if release:
                    self._peak_bytes = self._bytes
            if empty:  # nothing pending: the dedup window can match nothing (see _spooled)
                self._recent, self._recent_old = {}, {}
            if release:
                self._release_memory()
        return n

    def _release_memory(self) -> None:
        """The spool is empty after having been large: shrink SQLite's page caches and give
        freed heap back to the OS (under the write lock)."""
        try:
            self._conn.execute("PRAGMA shrink_memory")
            with self._rlock:
                self._reader.execute("PRAGMA shrink_memory")
        except sqlite3.Error as exc:
            log.debug("DLQ spool: releasing memory failed: %s", exc)
        release_memory()
        log.info("DLQ spool %s drained: released SQLite caches and freed heap", self.path)

    def reject(self, items: Sequence[tuple[int, str]], now_ms: int) -> int:
        """Copy records Kafka can never accept to the rejected table, with the reason, and
        settle them in their batch rows (the row's count and bytes columns drop accordingly)."""
        if not items:
            return 0
        errors = dict(items)
        with self._wlock:
            marks, emptied = self._settle(list(errors))
            if not marks:
                return 0
            shrink: list[tuple[_Row, int]] = []  # applied once committed
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                for rid, row, idxs in marks:
                    ends, segs, data = conn.execute(
                        "SELECT ends, segs, data FROM batches WHERE id = ?", (rid,)).fetchone()
                    wanted = set(idxs)
                    found = {i: sr for i, sr in _decode_row(rid, ends, segs, data, 0,
                                                            _Row(row.total, row.total, 0))
                             if i in wanted}
                    moved_bytes = 0
                    for i in idxs:
                        r, size = found[i].record, found[i].size
                        moved_bytes += size
                        seq = (rid << _ROW_BITS) | i
                        conn.execute(
                            f"INSERT OR REPLACE INTO rejected (seq, {_COLUMNS}, error, "
                            f"rejected_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (seq, r.job, r.record_id, r.task_key, r.topic, r.key, r.value,
                             encode_headers(r.headers), r.traceparent, size, errors[seq],
                             now_ms))
                    if rid in emptied:
                        conn.execute("DELETE FROM batches WHERE id = ?", (rid,))
                        conn.execute("DELETE FROM settled WHERE row = ?", (rid,))
                    else:
                        conn.execute("UPDATE batches SET n = n - ?, size = size - ? "
                                     "WHERE id = ?", (len(idxs), moved_bytes, rid))
                    shrink.append((row, moved_bytes))
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise DlqError(f"DLQ spool reject failed ({self.path}): {exc}") from exc
            with self._lock:
                for row, moved_bytes in shrink:
                    row.size -= moved_bytes
                n, freed = self._apply(marks, emptied)
                self._depth -= n
                self._rejected += n
                self._bytes -= freed
        return n

    def purge_rejected(self, seqs: Sequence[int] | None = None) -> int:
        """Drop rejected rows (all, or these seqs) once an operator has dealt with them."""
        with self._wlock:
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                if seqs is None:
                    rows = conn.execute("DELETE FROM rejected RETURNING size").fetchall()
                else:
                    rows = []
                    for i in range(0, len(seqs), _CHUNK):
                        part = list(seqs[i:i + _CHUNK])
                        marks = ",".join("?" * len(part))
                        rows += conn.execute(
                            f"DELETE FROM rejected WHERE seq IN ({marks}) RETURNING size",
                            part).fetchall()
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise DlqError(f"DLQ spool purge failed ({self.path}): {exc}") from exc
            with self._lock:
                self._rejected -= len(rows)
                self._bytes -= sum(r[0] for r in rows)
        return len(rows)

    # -- reading --------------------------------------------------------------------------

    def read_batch(self, after_seq: int, limit: int) -> list[SpooledRecord]:
        """Up to `limit` pending records with seq > `after_seq`, in seq order (records of a
        batch row already settled in this process are left out)."""
        out: list[SpooledRecord] = []
        if limit <= 0:
            return out
        first_row = after_seq >> _ROW_BITS
        with self._lock:
            last_row = self._last_seq >> _ROW_BITS
        with self._rlock:
            cur = self._reader.execute(
                "SELECT id, ends, segs, data FROM batches WHERE id >= ? AND id <= ? "
                "ORDER BY id",
                (first_row, last_row))
            try:
                for rid, ends, segs, data in cur:
                    with self._lock:
                        row = self._rows.get(rid)
                        if row is None:  # settled and deleted meanwhile
                            continue
                        row_view = _Row(row.total, row.left, row.size)
                        row_view.done = bytes(row.done) if row.done is not None else None
                    start = (after_seq & _IDX_MASK) + 1 if rid == first_row else 0
                    for _, r in _decode_row(rid, ends, segs, data, start, row_view):
                        out.append(r)
                        if len(out) >= limit:
                            return out
            finally:
                cur.close()
        return out

    def rejected(self, limit: int = 100) -> list[RejectedRecord]:
        with self._rlock:
            rows = self._reader.execute(
                "SELECT seq, job, record_id, task_key, topic, key, value, headers, traceparent, "
                "error, rejected_ms FROM rejected ORDER BY seq LIMIT ?", (limit,)).fetchall()
        return [RejectedRecord(r[0], _record(r[1:9]), r[9], r[10]) for r in rows]

    # -- status ---------------------------------------------------------------------------

    def last_seq(self) -> int:
        """The highest seq committed whose on_commit hooks have all run."""
        with self._lock:
            return self._last_seq

    def depth(self) -> int:
        """Records waiting for Kafka."""
        with self._lock:
            return self._depth

    def bytes(self) -> int:
        """Bytes held: batch rows not yet deleted plus rejected records."""
        with self._lock:
            return self._bytes

    def rejected_count(self) -> int:
        with self._lock:
            return self._rejected

    def high_water(self) -> bool:
        """True when the spool is full: the next append gets BackpressureError."""
        with self._lock:
            return (self._depth + self._rejected >= self.max_records
                    or self._bytes >= self.max_bytes)

    def close(self) -> None:
        """Commit what is queued, stop the writer, close the database, release the directory."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            self._cv.notify_all()
        self._writer.join(self._append_timeout_s)
        with self._wlock, self._rlock:
            self._conn.close()
            self._reader.close()
        os.close(self._lock_fd)


class MemoryQueue:
    """The spool's interface in memory, for ``spool.enable=false``: bounded the same way, but a
    crash or an unflushed shutdown loses what it holds."""

    durable = False

    def __init__(self, *, max_bytes: int, max_records: int) -> None:
        self.max_bytes = max_bytes
        self.max_records = max_records
        self._lock = threading.Lock()
        self._rows: dict[int, SpooledRecord] = {}
        self._index: dict[_DedupKey, int] = {}
        self._rejected: dict[int, RejectedRecord] = {}
        self._bytes = 0
        self._last_seq = 0

    def append(self, records: Sequence[DlqRecord], on_commit: OnCommit | None = None
               ) -> list[int]:
        if not records:
            return []
        sized = []
        for rec in records:
            sized.append((rec, record_size(rec, encode_headers(rec.headers))))
        size = sum(s for _, s in sized)
        with self._lock:
            held = len(self._rows) + len(self._rejected)
            if held + len(sized) > self.max_records or self._bytes + size > self.max_bytes:
                raise _backpressure(len(sized), size, held, self._bytes, self.max_records,
                                    self.max_bytes)
            placed = []
            for rec, s in sized:
                key = dedup_key(rec)
                seq = self._index.get(key)
                if seq is None:
                    self._last_seq += 1
                    seq = self._last_seq
                    self._rows[seq] = SpooledRecord(seq, rec, s)
                    self._index[key] = seq
                    self._bytes += s
                    placed.append(Placed(seq, rec.task_key, True, s))
                else:
                    placed.append(Placed(seq, self._rows[seq].record.task_key, False, s))
            if on_commit is not None:
                on_commit(placed)
        return [p.seq for p in placed]

    def read_batch(self, after_seq: int, limit: int) -> list[SpooledRecord]:
        out: list[SpooledRecord] = []
        with self._lock:
            seq = after_seq + 1
            while seq <= self._last_seq and len(out) < limit:
                row = self._rows.get(seq)
                if row is not None:
                    out.append(row)
                seq += 1
        return out

    def delete(self, seqs: Sequence[int]) -> int:
        n = 0
        with self._lock:
            for seq in seqs:
                row = self._rows.pop(seq, None)
                if row is not None:
                    self._index.pop(dedup_key(row.record), None)
                    self._bytes -= row.size
                    n += 1
        return n

    def reject(self, items: Sequence[tuple[int, str]], now_ms: int) -> int:
        n = 0
        with self._lock:
            for seq, error in items:
                row = self._rows.pop(seq, None)
                if row is not None:
                    self._index.pop(dedup_key(row.record), None)
                    self._rejected[seq] = RejectedRecord(seq, row.record, error, now_ms)
                    n += 1
        return n

    def rejected(self, limit: int = 100) -> list[RejectedRecord]:
        with self._lock:
            return [self._rejected[s] for s in sorted(self._rejected)[:limit]]

    def last_seq(self) -> int:
        with self._lock:
            return self._last_seq

    def depth(self) -> int:
        with self._lock:
            return len(self._rows)

    def bytes(self) -> int:
        with self._lock:
            return self._bytes

    def rejected_count(self) -> int:
        with self._lock:
            return len(self._rejected)

    def high_water(self) -> bool:
        with self._lock:
            return (len(self._rows) + len(self._rejected) >= self.max_records
                    or self._bytes >= self.max_bytes)

    def close(self) -> None:
        with self._lock:
            if self._rows:
                log.error("spool.enable=false: %d DLQ records were never acknowledged by Kafka "
                          "and are lost with this process", len(self._rows))
