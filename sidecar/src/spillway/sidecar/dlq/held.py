"""Held DLQ records: spooled durably, but not to be produced until the run's home says they are
the records' first dead letters (docs/POLICY.md, "Provisional verdicts").

`Holding` is the held half of `spool.Spool` (a mixin, as `settle.Settlement` is: the state is
the spool's). A node that answered a report provisionally holds its DLQ records as one row of
the ``held`` table (the report's records encoded once, as a batch row is, and what the node
needs to ask the home again after a restart: its run and its ``meta``). The home's answer then
either *releases* the row (the records it confirmed go into ``batches``, to be produced, and
the held row is deleted in the same transaction: a kill -9 leaves one or the other, never both
and never neither) or *discards* it (deleted: every copy was already dead-lettered). Held
records count against the spool's bounds from the moment they are held, so a release is never
refused for room. The spool's writer thread writes all three (`hold`, `Spool.append` with
``release=``, `discard`), so they group-commit with the spool's other writes.
"""

from __future__ import annotations

import itertools
import sqlite3
import threading
from array import array

from ..core.model import DlqRecord
from ..errors import DlqError
from .codec import decode_row, seg_sizes


def insert_held(conn: sqlite3.Connection, run: str, meta: bytes,
                segments: list[tuple[bytes, int]]) -> tuple[int, int, int]:
    """One held row of `segments` (as `Spool._insert_row` writes a batch row); returns (its id,
    its records, its bytes)."""
    sizes: list[int] = []
    for blob, count in segments:
        sizes += seg_sizes(len(blob), count)
    ends = array("I", itertools.accumulate(sizes))
    size = ends[-1] if sizes else 0
    rid = conn.execute(
        "INSERT INTO held (run, meta, n, size, ends, segs, data) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (run, meta, len(sizes), size, ends.tobytes(),
         array("I", [c for _, c in segments]).tobytes(),
         b"".join(b for b, _ in segments))).lastrowid
    return rid, len(sizes), size


class Holding:
    """The spool's held rows, over the state `spool.Spool` opens and keeps."""

    _conn: sqlite3.Connection
    _reader: sqlite3.Connection
    _lock: threading.Lock
    _rlock: threading.Lock
    _bytes: int
    # held row id -> (records, bytes): what each counts against the bounds until released
    _held: dict[int, tuple[int, int]]
    _held_n: int

    def _load_held(self) -> int:
        """The held rows' counts, at open; returns their bytes."""
        self._held = {rid: (n, size) for rid, n, size in
                      self._conn.execute("SELECT id, n, size FROM held")}
        self._held_n = sum(n for n, _ in self._held.values())
        return sum(size for _, size in self._held.values())

    def _unhold(self, rid: int) -> None:
        """Take a released or discarded row out of the counts (under `_lock`)."""
        n, size = self._held.pop(rid, (0, 0))
        self._held_n -= n
        self._bytes -= size

    def held_rows(self) -> list[tuple[int, str, bytes]]:
        """Every held row as (id, run, meta), oldest first: what a restarted node must ask its
        homes about again."""
        with self._rlock:
            return self._reader.execute(
                "SELECT id, run, meta FROM held ORDER BY id").fetchall()

    def held_records(self, rid: int) -> list[DlqRecord]:
        """The records of held row `rid`, in order (DlqError if it is gone)."""
        with self._rlock:
            row = self._reader.execute(
                "SELECT ends, segs, data FROM held WHERE id = ?", (rid,)).fetchone()
        if row is None:
            raise DlqError(f"held DLQ row {rid} is not in the spool (released or discarded)")
        return [r.record for _, r in decode_row(0, row[0], row[1], row[2], 0, None)]

    def held_count(self) -> int:
        """Records held for their homes' confirmation."""
        with self._lock:
            return self._held_n


def check_release(held: dict[int, tuple[int, int]], rid: int, n: int) -> None:
    """A release of `n` records from held row `rid` (DlqError: no such row, or more records
    than it holds: a confirmation applied twice)."""
    have = held.get(rid)
    if have is None:
        raise DlqError(f"held DLQ row {rid} is not in the spool (already released or "
                       "discarded)")
    if n > have[0]:
        raise DlqError(f"held DLQ row {rid} holds {have[0]} records, not {n}")


__all__ = ["Holding", "check_release", "insert_held"]
