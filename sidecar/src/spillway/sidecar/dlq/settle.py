"""Settling spooled records: acknowledged by Kafka (`delete`), moved to the rejected table
(`reject`), or removed from it by an operator (`purge_rejected`).

`Settlement` is one of the parts `spool.Spool` is composed of: it is given the spool's
connections (`schema.Db`), its in-memory rows and counters (`state.SpoolState`) and its dedup
window (emptied when the spool is). A row is deleted once every record in it is settled;
acknowledgements of part of a row go to the ``settled`` table as index ranges in the same
transaction.
"""

from __future__ import annotations

import bisect
import logging
import sqlite3
from collections.abc import Sequence

from spillway.sidecar.runtime.memtune import release_memory

from ..errors import DlqError
from . import schema
from .codec import IDX_MASK, ROW_BITS, decode_row, encode_headers, seq_ranges
from .dedup import DedupWindow
from .schema import Db
from .state import Row, SpoolState

log = logging.getLogger("spillway.sidecar.dlq.spool")

_CHUNK = 500  # host parameters per IN (...) list
# After a drain leaves the spool empty, memory is handed back to the OS once it held this much.
_RELEASE_AFTER_BYTES = 16 * 1024 * 1024


class Settlement:
    """The spool's settling operations, over the connections, rows and counters it is given."""

    def __init__(self, db: Db, state: SpoolState, window: DedupWindow) -> None:
        self._db = db
        self._state = state
        self._window = window

    def load(self) -> int:
        """At open: apply the acknowledged index ranges of partly settled rows; returns how many
        records they settle. A row they settle completely (never written so, but cheap to
        guard) is deleted now."""
        settled = 0
        conn, rows = self._db.conn, self._state.rows
        for rid, lo, hi in conn.execute("SELECT row, lo, hi FROM settled"):
            row = rows.get(rid)
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
        emptied = [rid for rid, row in rows.items() if row.left <= 0]
        if emptied:
            with conn:
                for rid in emptied:
                    schema.delete_batches(conn, rid, rid)
            for rid in emptied:
                del rows[rid]
        with conn:   # what a deleted batch row left (never written so: its delete takes them)
            conn.execute("DELETE FROM settled WHERE row NOT IN (SELECT id FROM batches)")
            conn.execute("DELETE FROM held WHERE id IN (SELECT held FROM released WHERE batch "
                         "NOT IN (SELECT id FROM batches))")
            conn.execute("DELETE FROM released WHERE batch NOT IN (SELECT id FROM batches)")
        return settled

    def _settle(self, seqs: Sequence[int]
                ) -> tuple[list[tuple[int, Row, list[int]]], list[int]]:
        """Which records of `seqs` are still pending, per row (row id, row, indexes); and which
        rows that empties. Per row, not per record, when the seqs cover the whole row (the usual
        case: the drain acknowledges rows in order)."""
        ordered = sorted(seqs)
        marks: list[tuple[int, Row, list[int]]] = []
        emptied: list[int] = []
        rows = self._state.rows
        i, n = 0, len(ordered)
        while i < n:
            rid = ordered[i] >> ROW_BITS
            j = bisect.bisect_left(ordered, (rid + 1) << ROW_BITS, i)
            row = rows.get(rid)
            if row is not None:
                base = rid << ROW_BITS
                if (row.done is None and j - i == row.total and ordered[i] == base
                        and ordered[i:j] == list(range(base, base + row.total))):
                    # every record of the row, each once (a repeat with a gap between the
                    # same first and last seq must not stand in for the missing record)
                    fresh = list(range(row.total))
                else:
                    done = row.done
                    fresh = sorted({s & IDX_MASK for s in ordered[i:j]
                                    if (s & IDX_MASK) < row.total
                                    and (done is None or not done[s & IDX_MASK])})
                if fresh:
                    marks.append((rid, row, fresh))
                    if len(fresh) == row.left:
                        emptied.append(rid)
            i = j
        return marks, emptied

    def _apply(self, marks: list[tuple[int, Row, list[int]]], emptied: list[int]
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
        rows = self._state.rows
        for rid in emptied:
            freed += rows.pop(rid).size
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
        db, st = self._db, self._state
        with db.wlock:
            marks, emptied = self._settle(seqs)
            if not marks:
                return 0
            conn = db.conn
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
                    schema.delete_batches(conn, lo, hi)
                if partial:
                    conn.executemany("INSERT INTO settled (row, lo, hi) VALUES (?, ?, ?)",
                                     partial)
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise DlqError(f"DLQ spool delete failed ({db.path}): {exc}") from exc
            finally:
                conn.execute("PRAGMA synchronous=FULL")
            with st.lock:
                n, freed = self._apply(marks, emptied)
                st.depth -= n
                st.bytes -= freed
                empty = st.depth == 0
                release = empty and st.peak_bytes >= _RELEASE_AFTER_BYTES
                if release:
                    st.peak_bytes = st.bytes
            if empty:  # nothing pending: the dedup window can match nothing (see `spooled`)
                self._window.clear()
            if release:
                self._release_memory()
        return n

    def _release_memory(self) -> None:
        """The spool is empty after having been large: shrink SQLite's page caches and give
        freed heap back to the OS (under the write lock)."""
        db = self._db
        try:
            db.conn.execute("PRAGMA shrink_memory")
            with db.rlock:
                db.reader.execute("PRAGMA shrink_memory")
        except sqlite3.Error as exc:
            log.debug("DLQ spool: releasing memory failed: %s", exc)
        release_memory()
        log.info("DLQ spool %s drained: released SQLite caches and freed heap", db.path)

    def reject(self, items: Sequence[tuple[int, str]], now_ms: int) -> int:
        """Copy records Kafka can never accept to the rejected table, with the reason, and
        settle them in their batch rows (the row's count and bytes columns drop accordingly)."""
        if not items:
            return 0
        errors = dict(items)
        db, st = self._db, self._state
        with db.wlock:
            marks, emptied = self._settle(list(errors))
            if not marks:
                return 0
            shrink: list[tuple[Row, int]] = []  # applied once committed
            conn = db.conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                for rid, row, idxs in marks:
                    _, ends, segs, data = conn.execute(
                        f"{schema.BATCH_DATA} WHERE b.id = ?", (rid,)).fetchone()
                    wanted = set(idxs)
                    found = {i: sr for i, sr in decode_row(rid, ends, segs, data, 0, None)
                             if i in wanted}
                    moved_bytes = 0
                    for i in idxs:
                        r, size = found[i].record, found[i].size
                        moved_bytes += size
                        seq = (rid << ROW_BITS) | i
                        conn.execute(
                            f"INSERT OR REPLACE INTO rejected (seq, {schema.COLUMNS}, error, "
                            f"rejected_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (seq, r.job, r.record_id, r.task_key, r.topic, r.key, r.value,
                             encode_headers(r.headers), r.traceparent, size, errors[seq],
                             now_ms))
                    if rid in emptied:
                        schema.delete_batches(conn, rid, rid)
                    else:
                        conn.execute("UPDATE batches SET n = n - ?, size = size - ? "
                                     "WHERE id = ?", (len(idxs), moved_bytes, rid))
                    shrink.append((row, moved_bytes))
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise DlqError(f"DLQ spool reject failed ({db.path}): {exc}") from exc
            with st.lock:
                for row, moved_bytes in shrink:
                    row.size -= moved_bytes
                n, freed = self._apply(marks, emptied)
                st.depth -= n
                st.rejected += n
                st.bytes -= freed
        return n

    def purge_rejected(self, seqs: Sequence[int] | None = None) -> int:
        """Drop rejected rows (all, or these seqs) once an operator has dealt with them."""
        db, st = self._db, self._state
        with db.wlock:
            conn = db.conn
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
                raise DlqError(f"DLQ spool purge failed ({db.path}): {exc}") from exc
            with st.lock:
                st.rejected -= len(rows)
                st.bytes -= sum(r[0] for r in rows)
        return len(rows)
