"""Held DLQ records: spooled durably, but not to be produced until the run's home says they are
the records' first dead letters (docs/POLICY.md, "Provisional verdicts").

`Holding` is one of the parts `spool.Spool` is composed of: it owns the held rows' counts and
reads them back, over the spool's connections and counters it is given. A node that answered a
report provisionally holds its DLQ records as one row of the ``held`` table (the report's
records encoded once, as a batch row is, and what the node needs to ask the home again after a
restart: its run and its ``meta``). The home's answer then either *releases* the row into
``batches``, to be produced, or *discards* it (deleted: every copy was already dead-lettered).
A release of every record of the row, as held, writes a batch row without data and a
``released`` row naming the held row, whose data the batch row is read from until it is
deleted with it (`schema.delete_batches`): the records are written once. A release of some of
them writes their batch row as usual and deletes the held row. Either way in one transaction:
a kill -9 leaves the row held or released, never both and never neither. Held records count
against the spool's bounds from the moment they are held, so a release is never refused for
room. The spool's writer thread writes all three (`hold`, `Spool.append` with ``release=``,
`discard`), so they group-commit with the spool's other writes.
"""

from __future__ import annotations

import itertools
import sqlite3
from array import array

from ..core.model import DlqRecord
from ..errors import DlqError
from .codec import decode_row, seg_sizes, split_segments
from .schema import UNRELEASED, Db
from .state import SpoolState


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
    """The spool's held rows: what each counts against the bounds until it is released or
    discarded, and reading them back."""

    def __init__(self, db: Db, state: SpoolState) -> None:
        self._db = db
        self._state = state
        # held row id -> (records, bytes): what each counts against the bounds until released
        self._rows: dict[int, tuple[int, int]] = {}

    def load(self) -> int:
        """At open: the held rows' counts (records into the spool's counters); returns their
        bytes."""
        self._rows = {rid: (n, size) for rid, n, size in self._db.conn.execute(
            f"SELECT id, n, size FROM held WHERE {UNRELEASED}")}
        self._state.held = sum(n for n, _ in self._rows.values())
        return sum(size for _, size in self._rows.values())

    def check_release(self, rid: int, n: int) -> None:
        """A release of `n` records from held row `rid` (DlqError: no such row, or more records
        than it holds: a confirmation applied twice)."""
        have = self._rows.get(rid)
        if have is None:
            raise DlqError(f"held DLQ row {rid} is not in the spool (already released or "
                           "discarded)")
        if n > have[0]:
            raise DlqError(f"held DLQ row {rid} holds {have[0]} records, not {n}")

    def whole_rows(self, releases: list[tuple[int, int, list[tuple[bytes, int]]]]) -> set[int]:
        """Of `releases` (held row, records released, their segments as the row holds them),
        the rows released whole that fit one batch row: a batch row can read their data in
        place."""
        rows = self._rows
        return {rid for rid, n, segments in releases
                if (have := rows.get(rid)) is not None and have[0] == n
                and len(split_segments(segments)) == 1}

    def add(self, rid: int, n: int, size: int) -> None:
        """Count a row just held (under the state's lock)."""
        st = self._state
        self._rows[rid] = (n, size)
        st.held += n
        st.bytes += size

    def unhold(self, rid: int) -> None:
        """Take a released or discarded row out of the counts (under the state's lock)."""
        st = self._state
        n, size = self._rows.pop(rid, (0, 0))
        st.held -= n
        st.bytes -= size

    def held_rows(self) -> list[tuple[int, str, bytes]]:
        """Every held row as (id, run, meta), oldest first: what a restarted node must ask its
        homes about again."""
        db = self._db
        with db.rlock:
            return db.reader.execute(
                f"SELECT id, run, meta FROM held WHERE {UNRELEASED} ORDER BY id").fetchall()

    def held_records(self, rid: int) -> list[DlqRecord]:
        """The records of held row `rid`, in order (DlqError if it is gone)."""
        db = self._db
        with db.rlock:
            row = db.reader.execute(
                f"SELECT ends, segs, data FROM held WHERE id = ? AND {UNRELEASED}",
                (rid,)).fetchone()
        if row is None:
            raise DlqError(f"held DLQ row {rid} is not in the spool (released or discarded)")
        return [r.record for _, r in decode_row(0, row[0], row[1], row[2], 0, None)]

    def held_count(self) -> int:
        """Records held for their homes' confirmation."""
        with self._state.lock:
            return self._state.held


__all__ = ["Holding", "insert_held"]
