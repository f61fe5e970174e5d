"""The durable local spool: where a DLQ record lives from the moment the sidecar accepts it until
Kafka acknowledges it.

SQLite (stdlib ``sqlite3``) in WAL mode with ``synchronous=FULL``: a committed row survives a
``kill -9`` of the sidecar and a power loss. A report's records are serialized once, as one
segment (one marshal call: a list of their field tuples; cut at _SEG_RECORDS records or 1 MiB).
One row per group commit (its reports' segments, at most 65,536 records, closed before it would
pass 1 MiB; a held row released whole is a row of its own that reads the held row's data,
`held.py`): the segments concatenated, their record counts (``segs``), per-record end offsets
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

Deduplication: a record reported again while it is still pending and recent is stored once
(dedup.py); a held row released whole skips that window (its run's home deduplicated it).

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

`Spool` is composed of parts that each own their share and are given what they use: its rows
and counters in memory (`state.SpoolState`, under one lock) and its connections
(`schema.Db`) are handed to `settle.Settlement` (acknowledging, rejecting and purging records,
and the settled ranges read at open), `held.Holding` (records held for a home's confirmation)
and `dedup.DedupWindow` (the dedup window); the spool itself opens, writes (the group-commit
writer) and reads. Its neighbours: codec.py (how records are serialized into segments and
rows), schema.py (the tables, the connection settings, the directory lock), store.py (the
`RecordStore` interface the drain uses) and memqueue.py (`MemoryQueue`, the same interface
without durability, for ``spool.enable=false``).
"""

from __future__ import annotations

import collections
import itertools
import logging
import operator
import os
import sqlite3
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..core.dlq_record import Streak
from ..core.model import DlqRecord
from ..errors import DlqError
from . import perms, schema
from .codec import (
    IDX_MASK,
    ROW_BITS,
    ROW_RECORDS,
    decode_columns,
    encode_segments,
    record_from_row,
    rows_in_order,
    seg_sizes,
)
from .dedup import DedupWindow
from .held import Holding, insert_held
from .schema import DB_NAME, LOCK_NAME, Db
from .settle import Settlement
from .state import Row, SpoolState
from .store import (
    DedupKey,
    FreshRun,
    OnCommit,
    Placed,
    RejectedRecord,
    SpooledRecord,
    backpressure_error,
    dedup_key,
    dedup_keys,
)

log = logging.getLogger(__name__)

_task_key_of = operator.attrgetter("task_key")



@dataclass(eq=False)
class _Request:
    records: Sequence[DlqRecord]
    segments: list[tuple[bytes, int]]  # the records encoded (`encode_segments`)
    n: int  # records
    size: int  # bytes of the segments
    on_commit: OnCommit | None
    done: threading.Event = field(default_factory=threading.Event)
    placed: Sequence[Placed] = field(default_factory=list)  # FreshRun: every record new
    error: BaseException | None = None
    hold: tuple[str, bytes] | None = None  # (run, meta): a held row (`held.py`), not a batch
    release: int = 0  # a held row these records come from, deleted in the same transaction
    held_id: int = 0  # the held row written (`hold`)
    as_held: bool = False  # with `release`: `segments` are the held row's (`hold` returned them)


class Spool:
    """SQLite-backed, group-committed, bounded spool in `directory` (one process at a time).
    Settling records (acknowledged, rejected, purged) is its `settle.Settlement`'s part; records
    held for a home's confirmation, its `held.Holding`'s; the dedup window, its
    `dedup.DedupWindow`'s."""

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
        self._state = st = SpoolState()   # the rows and counters, under st.lock
        self._window = DedupWindow(st)
        # DLQ payloads at rest: directory 0700, files 0600 (spool.group: 0750 / 0640)
        perms.prepare(directory, self.path, (os.path.join(directory, LOCK_NAME),), group)
        self._lock_fd = schema.take_lock(directory)
        try:
            conn = schema.connect(self.path)
            schema.create(conn, self.path)
            self._db = Db(self.path, conn, schema.connect(self.path))
            self._settlement = Settlement(self._db, st, self._window)
            self._holding = Holding(self._db, st)
            pending_bytes = self._load_rows()
            (st.rejected, rejected_bytes) = conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM rejected").fetchone()
            st.bytes = pending_bytes + rejected_bytes + self._holding.load()
            st.peak_bytes = st.bytes
            row = conn.execute(
                "SELECT seq FROM sqlite_sequence WHERE name = 'batches'").fetchone()
            last_row = row[0] if row else 0
            # every seq of the last row (whatever its size) is at or below this one
            st.last_seq = (last_row << ROW_BITS) | IDX_MASK if last_row else 0
            self._window.fill(conn)
        except sqlite3.Error as exc:
            os.close(self._lock_fd)
            raise DlqError(f"cannot open the DLQ spool {self.path}: {exc}") from exc
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.recovered = st.depth
        if st.depth:
            log.info("DLQ spool %s: recovered %d records (%d bytes) to drain", self.path,
                     st.depth, pending_bytes)
        if st.held:
            log.info("DLQ spool %s: recovered %d records held for their runs' homes to confirm",
                     self.path, st.held)
        self._cv = threading.Condition()  # the writer's queue
        self._queue: collections.deque[_Request] = collections.deque()
        self._closing = False
        self._writer = threading.Thread(target=self._write_loop, name="spillway-spool-writer",
                                        daemon=True)
        self._writer.start()

    # -- opening --------------------------------------------------------------------------

    def _load_rows(self) -> int:
        """Rebuild the per-row state from the table; returns the pending bytes."""
        depth = pending_bytes = 0
        conn, rows = self._db.conn, self._state.rows
        for rid, n, size, total in conn.execute(
                "SELECT id, n, size, length(ends) / 4 FROM batches"):
            rows[rid] = Row(total, n, size)
            depth += n
            pending_bytes += size
        if rows:  # records of those rows already moved to the rejected table
            for (seq,) in conn.execute("SELECT seq FROM rejected WHERE seq >= ?",
                                       (min(rows) << ROW_BITS,)):
                row = rows.get(seq >> ROW_BITS)
                if row is not None and (seq & IDX_MASK) < row.total:
                    if row.done is None:
                        row.done = bytearray(row.total)
                    row.done[seq & IDX_MASK] = 1
            depth -= self._settlement.load()
        self._state.depth = depth
        return pending_bytes

    @staticmethod
    def _insert_row(conn: sqlite3.Connection, segments: list[tuple[bytes, int]],
                    held: int = 0) -> int:
        """One batch row of `segments` (marshalled lists of records, record count). Its ``ends``
        are the per-record ends (each segment's bytes split evenly among its records: what each
        counts against the bounds); ``segs`` the record count per segment (NULL only in rows
        written before schema 3, where each record is marshalled on its own). ``held``: the
        held row whose data these segments are (`held.py`): the row keeps no copy of it."""
        sizes: list[int] = []
        for blob, count in segments:
            sizes += seg_sizes(len(blob), count)
        ends = array("I", itertools.accumulate(sizes))
        segs = array("I", [c for _, c in segments]).tobytes()
        rid = conn.execute(
            "INSERT INTO batches (n, size, ends, data, segs) VALUES (?, ?, ?, ?, ?)",
            (len(sizes), ends[-1], ends.tobytes(),
             b"" if held else b"".join(b for b, _ in segments), segs)).lastrowid
        if held:
            conn.execute("INSERT INTO released (batch, held) VALUES (?, ?)", (rid, held))
        return rid

    # -- writing --------------------------------------------------------------------------

    def append(self, records: Sequence[DlqRecord], on_commit: OnCommit | None = None, *,
               release: int = 0, segments: list[tuple[bytes, int]] | None = None,
               streaks: Sequence[Streak] = ()) -> list[int]:
        """Store `records` durably; return their seqs (an already-spooled record: its seq).

        `on_commit(placed)` runs in the writer thread right after the commit, before any later
        delete can run. Raises BackpressureError past the bounds, DlqError if the disk fails.
        ``release``: held row `records` come from (`held.py`), released in the same transaction
        (never refused for room: its records were counted when held); no records: the row is
        discarded. ``segments``: `records` already encoded; with ``release``, only as `hold`
        returned them (then, when `records` are all of the row's, the batch row reads the held
        row's data instead of writing it again). ``streaks``: how `records` were built
        (`codec.encode_segments`).
        """
        if not records and not release:
            return []
        given = segments is not None and bool(release)
        if segments is None:
            segments = encode_segments(records, streaks) if records else []
        req = _Request(records, segments, len(records), sum(len(b) for b, _ in segments),
                       on_commit, release=release, as_held=given)
        if not release:
            self._check_room(req)
        self._submit(req)
        placed = req.placed
        return list(placed.seqs) if type(placed) is FreshRun else [p.seq for p in placed]

    def hold(self, records: Sequence[DlqRecord], run: str, meta: bytes,
             streaks: Sequence[Streak] = ()) -> tuple[int, list[tuple[bytes, int]]]:
        """Store `records` durably as one held row (`held.py`), with the `run` they belong to
        and the `meta` their confirmation needs; return its id and the records' segments (for
        `append(..., release=id, segments=...)`). BackpressureError past the bounds.
        ``streaks``: how `records` were built (`codec.encode_segments`)."""
        segments = encode_segments(records, streaks)
        req = _Request(records, segments, len(records), sum(len(b) for b, _ in segments),
                       None, hold=(run, meta))
        self._check_room(req)
        self._submit(req)
        return req.held_id, segments

    def discard(self, rid: int) -> None:
        """Delete held row `rid`: none of its records is to be produced."""
        self.append((), release=rid)

    def _check_room(self, req: _Request) -> None:
        st = self._state
        with st.lock:
            held_records = st.records()
            held_bytes = st.bytes
        if (held_records + req.n > self.max_records
                or held_bytes + req.size > self.max_bytes):
            raise backpressure_error(req.n, req.size, held_records, held_bytes,
                                     self.max_records, self.max_bytes)

    def _submit(self, req: _Request) -> None:
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

    def _commit(self, batch: list[_Request]) -> None:
        st, window, holding = self._state, self._window, self._holding
        with self._db.wlock:
            with st.lock:
                held_records = st.records()
                held_bytes = st.bytes
            accepted: list[_Request] = []
            releases: list[int] = []
            for req in batch:
                n = req.n
                if req.release:   # counted since it was held
                    try:
                        if req.release in releases:
                            raise DlqError(f"held DLQ row {req.release} released twice")
                        holding.check_release(req.release, n)
                    except DlqError as exc:
                        req.error = exc
                        continue
                    releases.append(req.release)
                    accepted.append(req)
                    continue
                if (held_records + n > self.max_records
                        or held_bytes + req.size > self.max_bytes):
                    req.error = backpressure_error(n, req.size, held_records, held_bytes,
                                              self.max_records, self.max_bytes)
                    continue
                held_records += n
                held_bytes += req.size
                accepted.append(req)
            if not accepted:
                return
            holds = [req for req in accepted if req.hold is not None]
            if holds or releases:   # the requests that spool records, as batch rows
                accepted = [req for req in accepted if req.hold is None and req.n]
            records = (accepted[0].records if len(accepted) == 1 else
                       list(itertools.chain.from_iterable(req.records for req in accepted)))
            # A held row released whole is neither matched against the dedup window nor
            # remembered in it: its run's home answered each of its records as the record's
            # first dead letter in the run (docs/POLICY.md, "Provisional verdicts"), and only
            # such answers put a record of that run into this spool.
            whole = holding.whole_rows([(req.release, req.n, req.segments)
                                        for req in accepted if req.as_held])
            checked = ([req for req in accepted if req.release not in whole] if whole
                       else accepted)
            keys = dedup_keys(records if checked is accepted else list(
                itertools.chain.from_iterable(req.records for req in checked)))
            if window.all_new(keys):
                # all new: the requests' segments, in order
                rows, srcs = rows_in_order([(req.segments, req.release if req.release in whole
                                             else 0) for req in accepted])
                plans = None
            else:   # (every record through the window, a held row's copied)
                whole = set()
                rows, plans = window.plan(accepted)
                srcs = [0] * len(rows)
            conn = self._db.conn
            ids: list[int] = []
            held: list[tuple[int, int, int]] = []
            try:
                if rows or holds or releases:
                    conn.execute("BEGIN IMMEDIATE")
                    for segments, src in zip(rows, srcs, strict=True):
                        ids.append(self._insert_row(conn, segments, src))
                    for req in holds:
                        held.append(insert_held(conn, *req.hold, req.segments))
                    for rid in releases:
                        if rid not in whole:   # else deleted with its batch row
                            conn.execute("DELETE FROM held WHERE id = ?", (rid,))
                    conn.execute("COMMIT")
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                err = DlqError(f"DLQ spool write failed ({self.path}): {exc}")
                err.__cause__ = exc
                for req in (*accepted, *holds):
                    req.error = err
                return
            if holds or releases:
                with st.lock:
                    for req, (rid, n, size) in zip(holds, held, strict=True):
                        req.held_id = rid
                        holding.add(rid, n, size)
                    for rid in releases:
                        holding.unhold(rid)
                    st.peak_bytes = max(st.peak_bytes, st.bytes)
                if not accepted:
                    return
            # per row: its records' sizes (as _insert_row wrote its ends)
            row_sizes: list[list[int]] = []
            for segments in rows:
                sizes: list[int] = []
                for blob, count in segments:
                    sizes += seg_sizes(len(blob), count)
                row_sizes.append(sizes)
            new_n = sum(map(len, row_sizes))
            new_bytes = 0
            with st.lock:
                rows_of = st.rows
                for rid, sizes in zip(ids, row_sizes, strict=True):
                    size = sum(sizes)
                    rows_of[rid] = Row(len(sizes), len(sizes), size)
                    new_bytes += size
                st.depth += new_n
                st.bytes += new_bytes
                st.peak_bytes = max(st.peak_bytes, st.bytes)
            if plans is None:
                seqs: list[int] = []
                all_sizes: list[int] = []
                for rid, sizes in zip(ids, row_sizes, strict=True):
                    seqs.extend(range(rid << ROW_BITS, (rid << ROW_BITS) + len(sizes)))
                    all_sizes += sizes
                owners = list(map(_task_key_of, records))
                if checked is accepted:
                    window.remember(zip(keys, zip(seqs, owners)))
                elif checked:
                    pos, kept = 0, []
                    for req in accepted:
                        if req.release not in whole:
                            kept += zip(seqs[pos:pos + req.n], owners[pos:pos + req.n])
                        pos += req.n
                    window.remember(zip(keys, kept))
                if len(accepted) == 1:
                    accepted[0].placed = FreshRun(seqs, owners, all_sizes,
                                                  accepted[0].segments)
                else:
                    pos = 0
                    for req in accepted:
                        end = pos + req.n
                        req.placed = FreshRun(seqs[pos:end], owners[pos:end],
                                              all_sizes[pos:end], req.segments)
                        pos = end
            else:
                spooled: dict[DedupKey, tuple[int, str]] = {}
                for req, plan in zip(accepted, plans, strict=True):
                    placed = req.placed = []
                    avg = req.size // req.n
                    for (rn, idx, owner, fresh), rec in zip(plan, req.records, strict=True):
                        if rn < 0:
                            placed.append(Placed(idx, owner, fresh, avg))
                            continue
                        seq = (ids[rn] << ROW_BITS) | idx
                        placed.append(Placed(seq, owner, fresh, row_sizes[rn][idx]))
                        if fresh:
                            spooled[dedup_key(rec)] = (seq, owner)
                window.remember(spooled)
            for req in accepted:
                if req.on_commit is not None:
                    try:
                        req.on_commit(req.placed)
                    except Exception:
                        log.exception("DLQ spool on_commit hook failed")
            if ids:
                with st.lock:  # published once every hook of the group has run
                    st.last_seq = (ids[-1] << ROW_BITS) | (len(row_sizes[-1]) - 1)

    # -- reading --------------------------------------------------------------------------

    def read_batch(self, after_seq: int, limit: int, upto: int | None = None
                   ) -> list[SpooledRecord]:
        """Up to `limit` pending records with `after_seq` < seq <= `upto` (default: the last
        published), in seq order (records of a batch row already settled in this process are
        left out)."""
        return list(map(SpooledRecord, *self.read_columns(after_seq, limit, upto)))

    def read_columns(self, after_seq: int, limit: int, upto: int | None = None
                     ) -> tuple[list[int], list[DlqRecord], list[int]]:
        """`read_batch` as columns: (seqs, records, bytes)."""
        seqs: list[int] = []
        records: list[DlqRecord] = []
        sizes: list[int] = []
        columns = (seqs, records, sizes)
        if limit <= 0:
            return columns
        first_row = after_seq >> ROW_BITS
        st, db = self._state, self._db
        with st.lock:
            last = st.last_seq if upto is None else min(upto, st.last_seq)
        last_row = last >> ROW_BITS
        with db.rlock:
            cur = db.reader.execute(
                f"{schema.BATCH_DATA} WHERE b.id >= ? AND b.id <= ? ORDER BY b.id",
                (first_row, last_row))
            try:
                for rid, ends, segs, data in cur:
                    with st.lock:
                        row = st.rows.get(rid)
                        if row is None:  # settled and deleted meanwhile
                            continue
                        done = bytes(row.done) if row.done is not None else None
                    start = (after_seq & IDX_MASK) + 1 if rid == first_row else 0
                    stop = (last & IDX_MASK) + 1 if rid == last_row else ROW_RECORDS
                    if done is None:  # no record left out: the limit is an index
                        stop = min(stop, start + limit - len(seqs))
                    decode_columns(rid, ends, segs, data, start=start, stop=stop, done=done,
                                   into=columns)
                    if len(seqs) >= limit:
                        del seqs[limit:], records[limit:], sizes[limit:]
                        break
            finally:
                cur.close()
        return seqs, records, sizes

    def rejected(self, limit: int = 100) -> list[RejectedRecord]:
        db = self._db
        with db.rlock:
            rows = db.reader.execute(
                "SELECT seq, job, record_id, task_key, topic, key, value, headers, traceparent, "
                "error, rejected_ms FROM rejected ORDER BY seq LIMIT ?", (limit,)).fetchall()
        return [RejectedRecord(r[0], record_from_row(r[1:9]), r[9], r[10]) for r in rows]

    # -- settling and held rows: its parts' -------------------------------------------------

    def delete(self, seqs: Sequence[int]) -> int:
        """Settle records Kafka acknowledged; returns how many were pending
        (`settle.Settlement.delete`)."""
        return self._settlement.delete(seqs)

    def reject(self, items: Sequence[tuple[int, str]], now_ms: int) -> int:
        """Move records Kafka can never accept to the rejected table
        (`settle.Settlement.reject`)."""
        return self._settlement.reject(items, now_ms)

    def purge_rejected(self, seqs: Sequence[int] | None = None) -> int:
        """Drop rejected rows (all, or these seqs) once an operator has dealt with them."""
        return self._settlement.purge_rejected(seqs)

    def held_rows(self) -> list[tuple[int, str, bytes]]:
        """Every held row as (id, run, meta), oldest first (`held.Holding.held_rows`)."""
        return self._holding.held_rows()

    def held_records(self, rid: int) -> list[DlqRecord]:
        """The records of held row `rid`, in order (DlqError if it is gone)."""
        return self._holding.held_records(rid)

    def held_count(self) -> int:
        """Records held for their homes' confirmation."""
        return self._holding.held_count()

    # -- status ---------------------------------------------------------------------------

    def last_seq(self) -> int:
        """The highest seq committed whose on_commit hooks have all run."""
        with self._state.lock:
            return self._state.last_seq

    def depth(self) -> int:
        """Records waiting for Kafka."""
        with self._state.lock:
            return self._state.depth

    def bytes(self) -> int:
        """Bytes held: batch rows not yet deleted, rejected records and held rows."""
        with self._state.lock:
            return self._state.bytes

    def rejected_count(self) -> int:
        with self._state.lock:
            return self._state.rejected

    def high_water(self) -> bool:
        """True when the spool is full: the next append gets BackpressureError."""
        st = self._state
        with st.lock:
            return st.records() >= self.max_records or st.bytes >= self.max_bytes

    def close(self) -> None:
        """Commit what is queued, stop the writer, close the database, release the directory."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            self._cv.notify_all()
        self._writer.join(self._append_timeout_s)
        db = self._db
        with db.wlock, db.rlock:
            db.conn.close()
            db.reader.close()
        os.close(self._lock_fd)


__all__ = ["DB_NAME", "Spool"]
