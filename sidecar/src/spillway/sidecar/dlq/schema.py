"""The spool on disk: where it lives, its SQLite schema and connection settings, its lock.

Schema 4: ``batches`` (one row per group commit: the concatenated segments, the per-record
``ends``, the per-segment record counts ``segs``, the pending count ``n`` and bytes ``size``),
``settled`` (acknowledged index ranges of partly settled rows), ``rejected`` (one row per record
Kafka can never accept), ``meta``, ``held`` (DLQ records held for their run's home to confirm,
`held.py`) and ``released`` (a batch row whose records are a whole held row's, released as they
were held: the batch row keeps no copy of the data, which stays in the held row until the batch
row is deleted). A row's segments are lists of record tuples or, new in schema 4, a streak's
columns (`codec.py`). Schema 3 (no ``released``, no streaks) is brought to 4 at open; a
version that reads only schema 3 refuses a spool of schema 4, whose rows it could not read.
Schemas 1 and 2 were development formats that no release wrote: a spool in either is refused at
open with a message saying so.
"""

from __future__ import annotations

import fcntl
import os
import re
import sqlite3
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import DlqError

DB_NAME = "dlq-spool.sqlite3"
LOCK_NAME = "dlq-spool.lock"
SCHEMA_VERSION = "4"
MIGRATED = ("3",)   # schemas brought to SCHEMA_VERSION at open (tables added, none changed)

SCHEMA = """
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
CREATE TABLE IF NOT EXISTS held (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run TEXT NOT NULL,
    meta BLOB NOT NULL,
    n INTEGER NOT NULL,
    size INTEGER NOT NULL,
    ends BLOB NOT NULL,
    segs BLOB NOT NULL,
    data BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS released (
    batch INTEGER PRIMARY KEY,
    held INTEGER NOT NULL
);
"""
# A batch row's records as the drain reads them: its own data, or its held row's (`released`)
BATCH_DATA = ("SELECT b.id, b.ends, b.segs, COALESCE(h.data, b.data) FROM batches b "
              "LEFT JOIN released r ON r.batch = b.id LEFT JOIN held h ON h.id = r.held")
# Held rows not yet released (a released one stays until its batch row goes)
UNRELEASED = "id NOT IN (SELECT held FROM released)"


def delete_batches(conn: sqlite3.Connection, lo: int, hi: int) -> None:
    """Delete batch rows ``lo``..``hi`` with what only they use: their settled ranges, and the
    held rows they were released from (inside the caller's transaction)."""
    conn.execute("DELETE FROM held WHERE id IN (SELECT held FROM released WHERE batch "
                 "BETWEEN ? AND ?)", (lo, hi))
    conn.execute("DELETE FROM released WHERE batch BETWEEN ? AND ?", (lo, hi))
    conn.execute("DELETE FROM batches WHERE id BETWEEN ? AND ?", (lo, hi))
    conn.execute("DELETE FROM settled WHERE row BETWEEN ? AND ?", (lo, hi))
COLUMNS = "job, record_id, task_key, topic, key, value, headers, traceparent, size"
PAGE_SIZE = 16384  # bytes per SQLite page for a new spool
CACHE_KIB = 2048  # SQLite page cache per connection (PRAGMA cache_size, negative = KiB)
WAL_LIMIT = 64 * 1024 * 1024  # the WAL file is cut back to this after a checkpoint


@dataclass(eq=False)
class Db:
    """An open spool's two connections: ``conn`` writes, one transaction at a time (under
    ``wlock``); ``reader`` reads (under ``rlock``)."""

    path: str
    conn: sqlite3.Connection
    reader: sqlite3.Connection
    wlock: threading.Lock = field(default_factory=threading.Lock)
    rlock: threading.Lock = field(default_factory=threading.Lock)


def default_spool_dir(props: Mapping[str, str] | None = None) -> str:
    """Where a spool lives when ``spool.dir`` is unset: the per-user state directory
    (``$XDG_STATE_HOME``, else ``~/.local/state``), one spool per listen address, so that two
    sidecars on one host never share a spool."""
    props = props or {}
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"),
                                                            ".local", "state")
    where = props.get("listen.address") or props.get("listen.unix.socket") or "default"
    return os.path.join(base, "spillway", "spool-" + re.sub(r"[^A-Za-z0-9._-]", "_", where))


def take_lock(directory: str) -> int:
    """One process per spool directory: an exclusive flock on the lock file, which names the
    holder's pid; DlqError naming it when another process holds it."""
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


def connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
    # Batch rows are large blobs: big pages mean fewer overflow pages to write, checksum
    # and walk. Only takes effect when the database file is created.
    conn.execute(f"PRAGMA page_size={PAGE_SIZE}")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
    conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT}")
    return conn


def create(conn: sqlite3.Connection, path: str) -> None:
    """Create the tables of a new spool, or check that an existing one is of schema 4 (one of
    schema 3 gets the table it lacks)."""
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    found = None
    if "spool" in tables:
        found = "1"
    elif "batches" in tables and "segs" not in {
            r[1] for r in conn.execute("PRAGMA table_info(batches)")}:
        found = "2"
    elif "meta" in tables:
        row = conn.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
        found = row[0] if row and row[0] not in (SCHEMA_VERSION, *MIGRATED) else None
    if found is not None:
        reads = ", ".join((*MIGRATED, SCHEMA_VERSION))
        raise DlqError(f"the DLQ spool {path} is of schema {found}, which this version does not "
                       f"read (it reads schemas {reads}; schemas 1 and 2 were never released): "
                       f"drain it with the version that wrote it, or move it aside")
    conn.executescript(SCHEMA)
    conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
