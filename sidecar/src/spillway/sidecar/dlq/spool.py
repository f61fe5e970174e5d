"""The durable local spool: where a DLQ record lives from the moment the sidecar accepts it until
Kafka acknowledges it.

SQLite (stdlib ``sqlite3``) in WAL mode with ``synchronous=FULL``: a committed row survives a
``kill -9`` of the sidecar and a power loss. Rows are kept in arrival order under a monotonically
increasing ``seq`` (AUTOINCREMENT: never reused, even after deletes), unique per
``(job, record_id)`` (a record reported twice while still spooled is stored once), with the
``task_key`` of the task attempt that first reported it.

Group commit: `append()` hands its rows to one writer thread, which combines every request queued
meanwhile into one transaction (one fsync) and then wakes each caller. A caller returns only once
its rows are committed.

Bounds and full-policy: ``spool.max.records`` and ``spool.max.bytes`` bound everything the spool
holds (pending rows plus rejected rows). An `append()` that would pass either mark raises
BackpressureError and stores none of its rows: never a silent drop.

Rejected rows: a record Kafka can never accept (too large, invalid) is moved out of the pending
table into the ``rejected`` table, so that it is neither lost nor produced again in a loop; those
rows keep counting against the bounds until an operator removes them (`purge_rejected()`).

`MemoryQueue` offers the same interface without durability, for ``spool.enable=false``.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import logging
import marshal
import os
import sqlite3
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from ..core.model import DlqRecord, Header
from ..errors import BackpressureError, DlqError

log = logging.getLogger(__name__)

DB_NAME = "dlq-spool.sqlite3"
LOCK_NAME = "dlq-spool.lock"
SCHEMA_VERSION = "1"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS spool (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job TEXT NOT NULL,
    record_id TEXT NOT NULL,
    task_key TEXT NOT NULL,
    topic TEXT NOT NULL,
    key BLOB,
    value BLOB,
    headers BLOB NOT NULL,
    traceparent TEXT NOT NULL,
    size INTEGER NOT NULL,
    UNIQUE (job, record_id)
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
"""
_COLUMNS = "job, record_id, task_key, topic, key, value, headers, traceparent, size"
_INSERT = f"INSERT OR IGNORE INTO spool ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
_CHUNK = 500  # host parameters per IN (...) list
_CACHE_KIB = 2048  # SQLite page cache per connection (PRAGMA cache_size, negative = KiB)
_WAL_LIMIT = 64 * 1024 * 1024  # the WAL file is cut back to this after a checkpoint
# After a drain leaves the spool empty, memory is handed back to the OS once it held this much.
_RELEASE_AFTER_BYTES = 16 * 1024 * 1024


class Placed(NamedTuple):
    """Where an appended record went: its row's seq, the task_key stored on that row, whether
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


def _load_malloc_trim() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)`` (hands freed heap pages back to the OS), or None elsewhere."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return None
        fn = ctypes.CDLL(None).malloc_trim  # the process's own libc
    except (ValueError, OSError, AttributeError):  # not glibc: no malloc_trim
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return lambda: fn(0)


_malloc_trim = _load_malloc_trim()


def release_memory() -> None:
    """Give freed heap memory back to the OS (glibc only; a no-op elsewhere)."""
    if _malloc_trim is not None:
        try:
            _malloc_trim()
        except Exception:  # pragma: no cover - never let housekeeping fail a drain
            log.debug("malloc_trim failed", exc_info=True)


def record_size(rec: DlqRecord, headers_blob: bytes) -> int:
    """The bytes a record accounts for against ``spool.max.bytes``."""
    return (len(rec.key or b"") + len(rec.value or b"") + len(headers_blob) + len(rec.topic)
            + len(rec.record_id) + len(rec.job) + len(rec.task_key) + len(rec.traceparent))


def _row(rec: DlqRecord) -> tuple:
    blob = encode_headers(rec.headers)
    return (rec.job, rec.record_id, rec.task_key, rec.topic, rec.key, rec.value, blob,
            rec.traceparent, record_size(rec, blob))


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
    rows: list[tuple]
    size: int
    on_commit: OnCommit | None
    done: threading.Event = field(default_factory=threading.Event)
    placed: list[Placed] = field(default_factory=list)
    error: BaseException | None = None


class Spool:
    """SQLite-backed, group-committed, bounded spool in `directory` (one process at a time)."""

    durable = True

    def __init__(self, directory: str, *, max_bytes: int, max_records: int,
                 max_group_records: int = 20_000, append_timeout_s: float = 60.0) -> None:
        if max_bytes < 1 or max_records < 1:
            raise ValueError("spool bounds must be >= 1")
        self.directory = directory
        self.path = os.path.join(directory, DB_NAME)
        self.max_bytes = max_bytes
        self.max_records = max_records
        self._max_group = max_group_records
        self._append_timeout_s = append_timeout_s
        os.makedirs(directory, exist_ok=True)
        self._lock_fd = self._take_lock(directory)
        try:
            self._conn = self._connect()
            self._conn.executescript(_SCHEMA)
            self._conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)",
                               (SCHEMA_VERSION,))
            self._reader = self._connect()
            (self._depth, pending_bytes) = self._conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM spool").fetchone()
            (self._rejected, rejected_bytes) = self._conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM rejected").fetchone()
            self._bytes = pending_bytes + rejected_bytes
            self._peak_bytes = self._bytes
            row = self._conn.execute(
                "SELECT seq FROM sqlite_sequence WHERE name = 'spool'").fetchone()
            self._last_seq = row[0] if row else 0
        except sqlite3.Error as exc:
            os.close(self._lock_fd)
            raise DlqError(f"cannot open the DLQ spool {self.path}: {exc}") from exc
        self.recovered = self._depth
        if self._depth:
            log.info("DLQ spool %s: recovered %d records (%d bytes) to drain", self.path,
                     self._depth, pending_bytes)
        self._lock = threading.Lock()     # counters
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
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute(f"PRAGMA cache_size=-{_CACHE_KIB}")
        conn.execute(f"PRAGMA journal_size_limit={_WAL_LIMIT}")
        return conn

    # -- writing --------------------------------------------------------------------------

    def append(self, records: Sequence[DlqRecord], on_commit: OnCommit | None = None
               ) -> list[int]:
        """Store `records` durably; return their seqs (an already-spooled record: its row's).

        `on_commit(placed)` runs in the writer thread right after the commit, before any later
        delete can run. Raises BackpressureError past the bounds, DlqError if the disk fails.
        """
        if not records:
            return []
        rows = [_row(r) for r in records]
        req = _Request(rows, sum(r[8] for r in rows), on_commit)
        with self._lock:
            held_records, held_bytes = self._depth + self._rejected, self._bytes
        if (held_records + len(rows) > self.max_records
                or held_bytes + req.size > self.max_bytes):
            raise _backpressure(len(rows), req.size, held_records, held_bytes,
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
                n = len(batch[0].rows)
                while self._queue and n + len(self._queue[0].rows) <= self._max_group:
                    req = self._queue.popleft()
                    n += len(req.rows)
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

    def _commit(self, batch: list[_Request]) -> None:
        with self._wlock:
            with self._lock:
                held_records, held_bytes = self._depth + self._rejected, self._bytes
            accepted: list[_Request] = []
            for req in batch:
                n = len(req.rows)
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
            rows = [row for req in accepted for row in req.rows]
            conn = self._conn
            before = self._last_seq
            try:
                conn.execute("BEGIN IMMEDIATE")
                inserted = conn.executemany(_INSERT, rows).rowcount
                row = conn.execute(
                    "SELECT seq FROM sqlite_sequence WHERE name = 'spool'").fetchone()
                last = row[0] if row else 0
                if inserted == len(rows) and last - before == len(rows):
                    placed = [Placed(seq, r[2], True, r[8])
                              for seq, r in zip(range(before + 1, last + 1), rows, strict=True)]
                else:  # some were already spooled (or repeated in this batch): look each up
                    placed, seen = [], set()
                    for r in rows:
                        seq, owner = conn.execute(
                            "SELECT seq, task_key FROM spool WHERE job = ? AND record_id = ?",
                            (r[0], r[1])).fetchone()
                        placed.append(Placed(seq, owner, seq > before and seq not in seen,
                                             r[8]))
                        seen.add(seq)
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                err = DlqError(f"DLQ spool write failed ({self.path}): {exc}")
                err.__cause__ = exc
                for req in accepted:
                    req.error = err
                return
            new_n, new_bytes = 0, 0
            for p, r in zip(placed, rows, strict=True):
                if p.fresh:
                    new_n += 1
                    new_bytes += r[8]
            with self._lock:
                self._depth += new_n
                self._bytes += new_bytes
                self._peak_bytes = max(self._peak_bytes, self._bytes)
            pos = 0
            for req in accepted:
                req.placed = placed[pos:pos + len(req.rows)]
                pos += len(req.rows)
                if req.on_commit is not None:
                    try:
                        req.on_commit(req.placed)
                    except Exception:
                        log.exception("DLQ spool on_commit hook failed")
            with self._lock:  # published once every hook of the group has run
                self._last_seq = last

    def delete(self, seqs: Sequence[int]) -> int:
        """Remove rows Kafka acknowledged; returns how many were there.

        The seqs are deleted by contiguous ranges (``seq BETWEEN ? AND ?``), one statement per
        run of consecutive seqs. When this leaves the spool empty after it held a lot, SQLite's
        caches and the process's freed heap are handed back to the OS.
        """
        if not seqs:
            return 0
        ranges = seq_ranges(seqs)
        n, freed = 0, 0
        with self._wlock:
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                for lo, hi in ranges:
                    count, size = conn.execute(
                        "SELECT COUNT(*), TOTAL(size) FROM spool WHERE seq BETWEEN ? AND ?",
                        (lo, hi)).fetchone()
                    if count:
                        n += count
                        freed += int(size)
                        conn.execute("DELETE FROM spool WHERE seq BETWEEN ? AND ?", (lo, hi))
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise DlqError(f"DLQ spool delete failed ({self.path}): {exc}") from exc
            with self._lock:
                self._depth -= n
                self._bytes -= freed
                release = (self._depth == 0 and self._peak_bytes >= _RELEASE_AFTER_BYTES)
                if release:
                    self._peak_bytes = self._bytes
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
        """Move rows Kafka can never accept to the rejected table, with the reason."""
        if not items:
            return 0
        moved = 0
        with self._wlock:
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                for seq, error in items:
                    cur = conn.execute(
                        f"INSERT OR REPLACE INTO rejected (seq, {_COLUMNS}, error, rejected_ms) "
                        f"SELECT seq, {_COLUMNS}, ?, ? FROM spool WHERE seq = ?",
                        (error, now_ms, seq))
                    if cur.rowcount:
                        conn.execute("DELETE FROM spool WHERE seq = ?", (seq,))
                        moved += 1
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise DlqError(f"DLQ spool reject failed ({self.path}): {exc}") from exc
            with self._lock:
                self._depth -= moved
                self._rejected += moved
        return moved

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
        """Up to `limit` pending rows with seq > `after_seq`, in seq order."""
        with self._rlock:
            rows = self._reader.execute(
                "SELECT seq, size, job, record_id, task_key, topic, key, value, headers, "
                "traceparent FROM spool WHERE seq > ? ORDER BY seq LIMIT ?",
                (after_seq, limit)).fetchall()
        return [SpooledRecord(r[0], _record(r[2:]), r[1]) for r in rows]

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
        """Bytes held: waiting records plus rejected ones."""
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
        self._index: dict[tuple[str, str], int] = {}
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
                key = (rec.job, rec.record_id)
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
                    self._index.pop((row.record.job, row.record.record_id), None)
                    self._bytes -= row.size
                    n += 1
        return n

    def reject(self, items: Sequence[tuple[int, str]], now_ms: int) -> int:
        n = 0
        with self._lock:
            for seq, error in items:
                row = self._rows.pop(seq, None)
                if row is not None:
                    self._index.pop((row.record.job, row.record.record_id), None)
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
