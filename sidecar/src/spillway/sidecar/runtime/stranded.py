"""What a start would strand in spool directories it does not open, refused before it serves.

One sidecar process keeps its DLQ spool and its runs' kept states in ``spool.dir`` itself;
``sidecar.processes=N`` keeps one set per process in ``spool.dir/process-i`` (processes.py), and
``spool.enable=false`` keeps none. A restart with another process count, or with the spool
turned off, opens other directories than the last start did, and what the old ones hold would
sit there without a word: DLQ records spooled and not yet written to Kafka (never produced,
though their reports were answered), records held for their run's home to confirm, records
Kafka rejected (kept for the operator), and the state of live runs (whose limits a restart must
never loosen). So such a start is refused, naming each directory, what it holds and the
setting that opens it again. Directories that hold nothing are left alone; runs idle past
``job.idle.timeout.ms`` do not count (a start drops them anyway).

Read-only: the SQLite files are opened ``mode=ro``, and the spool's lock file is never taken.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sqlite3
import time
from collections.abc import Mapping
from contextlib import closing as _closing
from dataclasses import dataclass

from spillway.sidecar.dlq import schema
from spillway.sidecar.errors import ConfigError
from spillway.sidecar.service import runstate
from spillway.sidecar.service.runstate import FILE_NAME as RUNS_FILE

log = logging.getLogger("spillway.sidecar")
_PROCESS_DIR = re.compile(r"process-(\d+)")


@dataclass(frozen=True)
class Holdings:
    """What one directory holds (counts of records and of live runs)."""

    directory: str
    pending: int = 0
    held: int = 0
    rejected: int = 0
    runs: int = 0
    unreadable: str = ""

    def __bool__(self) -> bool:
        return bool(self.pending or self.held or self.rejected or self.runs or self.unreadable)

    def describe(self) -> str:
        user = _holder(self.directory)
        where = f"{self.directory} (in use by pid {user})" if user else self.directory
        if self.unreadable:
            return f"{where} could not be read ({self.unreadable})"
        parts = []
        if self.pending:
            parts.append(f"{self.pending} DLQ record(s) not yet written to Kafka")
        if self.held:
            parts.append(f"{self.held} DLQ record(s) held for their run's home to confirm")
        if self.rejected:
            parts.append(f"{self.rejected} record(s) Kafka rejected, kept for the operator")
        if self.runs:
            parts.append(f"the kept state of {self.runs} live run(s)")
        return f"{where} holds " + ", ".join(parts)


def _holder(directory: str) -> int:
    """The pid holding the spool's lock (0: none), from /proc/locks: a sidecar still serving
    from that directory. Looked up, not locked: a start must not race it for the lock."""
    try:
        st = os.stat(os.path.join(directory, schema.LOCK_NAME))
        with open("/proc/locks") as f:
            table = f.read()
    except OSError:
        return 0
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table.splitlines():   # "1: FLOCK  ADVISORY  WRITE 4242 fd:01:1234 0 EOF"
        f = line.split()
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == dev and f[4].isdigit():
            return int(f[4])
    return 0


def opened(root: str, processes: int, spool: bool) -> list[str]:
    """The directories a start opens: ``spool.dir`` itself, one per process, or none."""
    if not spool:
        return []
    if processes > 1:
        return [os.path.join(root, f"process-{i}") for i in range(processes)]
    return [root]


def _ro(path: str) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def holdings(directory: str, max_idle_s: float) -> Holdings:
    """What `directory` holds (read-only; a file that cannot be read is reported as such)."""
    pending = held = rejected = runs = 0
    spool = os.path.join(directory, schema.DB_NAME)
    store = os.path.join(directory, RUNS_FILE)
    try:
        if os.path.exists(spool):
            with _closing(_ro(spool)) as conn:
                tables = _tables(conn)
                if "batches" in tables:
                    rows, total = conn.execute(
                        "SELECT COUNT(*), COALESCE(SUM(n), 0) FROM batches").fetchone()
                    settled = conn.execute(
                        "SELECT COALESCE(SUM(hi - lo + 1), 0) FROM settled").fetchone()[0] \
                        if "settled" in tables else 0
                    pending = max(total - settled, rows)   # a row kept has a record pending
                if "held" in tables:   # (a spool written before held rows has none)
                    # a released row stays until its batch row goes (schema 4): counted there
                    unreleased = (f" WHERE {schema.UNRELEASED}" if "released" in tables
                                  else "")
                    held = conn.execute(
                        f"SELECT COALESCE(SUM(n), 0) FROM held{unreleased}").fetchone()[0]
                if "rejected" in tables:
                    rejected = conn.execute("SELECT COUNT(*) FROM rejected").fetchone()[0]
        if os.path.exists(store):
            with _closing(_ro(store)) as conn:
                if "runs" in _tables(conn):
                    runs = conn.execute("SELECT COUNT(*) FROM runs WHERE updated >= ?",
                                        (time.time() - max_idle_s,)).fetchone()[0]
    except sqlite3.Error as exc:
        return Holdings(directory, unreadable=f"{type(exc).__name__}: {exc}")
    return Holdings(directory, pending, held, rejected, runs)


def _setting(root: str, directory: str) -> str:
    """The start that opens `directory` of `root`."""
    m = _PROCESS_DIR.fullmatch(os.path.basename(directory))
    if directory != root and m:
        return f"sidecar.processes={max(int(m.group(1)) + 1, 2)} or more"
    return "sidecar.processes=1"


def stranded(root: str, processes: int, spool: bool, max_idle_s: float, *,
             runs_kept: bool = False) -> list[Holdings]:
    """The directories under `root` (and `root` itself) this start would not open that still
    hold something. ``runs_kept``: a start without a spool that keeps run states in `root`
    (log-only) opens it for those, not for DLQ records."""
    try:
        entries = os.listdir(root)
    except OSError:   # absent, or not ours to read: opening the spool says so if it matters
        return []
    mine = set(opened(root, processes, spool))
    candidates = [root] + sorted(
        (os.path.join(root, e) for e in entries if _PROCESS_DIR.fullmatch(e)),
        key=lambda d: int(_PROCESS_DIR.fullmatch(os.path.basename(d)).group(1)))
    out = []
    for d in candidates:
        if d not in mine and os.path.isdir(d):
            h = holdings(d, max_idle_s)
            if runs_kept and d == root:
                h = dataclasses.replace(h, runs=0)
            if h:
                out.append(h)
    return out


def check(root: str, props: Mapping[str, object]) -> None:
    """Refuse (ConfigError) a start that would strand what another layout's directories hold;
    then `warn_elsewhere`."""
    processes = int(props["sidecar.processes"])
    spool = bool(props["bootstrap.servers"]) and bool(props["spool.enable"])
    # a log-only start keeps its runs' states in spool.dir too
    runs_kept = not props["bootstrap.servers"] and processes == 1 and runstate.wanted(props)
    found = stranded(root, processes, spool, int(props["job.idle.timeout.ms"]) / 1000,
                     runs_kept=runs_kept)
    if not found:
        warn_elsewhere(root, props)
        return
    this = (f"sidecar.processes={processes}" if spool else
            "spool.enable=false" if props["bootstrap.servers"] else "no bootstrap.servers")
    what = "; ".join(f"{h.describe()}, and only a start with {_setting(root, h.directory)} "
                     "(and the spool on) opens it" for h in found)
    raise ConfigError(
        "spool.dir",
        f"{what}. This start ({this}) would leave that there, never written and not counted. "
        "Start with that setting again until the records are written (`spillway status` "
        "shows the spool's depth) and the runs have ended (EndJob, or job.idle.timeout.ms "
        f"without a report), or move that away to discard what it holds (a process-N "
        f"directory; for spool.dir itself, its {schema.DB_NAME}* and {RUNS_FILE}* files)")


_SIBLINGS_MAX = 64   # default directories read at a start, at most


def elsewhere(root: str, max_idle_s: float) -> list[Holdings]:
    """Default spool directories of other listen addresses (``spool-<address>`` beside `root`)
    that no live sidecar serves from and that still hold something: a sidecar left them when
    it was started on another address with ``spool.dir`` unset. They may be another sidecar's
    that is only stopped, so they are reported, not refused (`warn_elsewhere`)."""
    parent, mine = os.path.split(root)
    try:
        names = sorted(e for e in os.listdir(parent) if e.startswith("spool-") and e != mine)
    except OSError:
        return []
    out = []
    for name in names[:_SIBLINGS_MAX]:
        d = os.path.join(parent, name)
        if os.path.isdir(d):
            out += [h for h in stranded(d, 1, False, max_idle_s) if not _holder(h.directory)]
    return out


def warn_elsewhere(root: str, props: Mapping[str, object]) -> None:
    """Log what `elsewhere` finds, when this start uses the default ``spool.dir``."""
    if props.get("spool.dir"):
        return
    for h in elsewhere(root, int(props["job.idle.timeout.ms"]) / 1000):
        log.warning("%s, and no sidecar serves from it: a sidecar with spool.dir unset left it "
                    "when it listened on another address (the directory's name). Start one "
                    "there, or with spool.dir set to it, to write them", h.describe())


__all__ = ["Holdings", "check", "elsewhere", "holdings", "opened", "stranded", "warn_elsewhere"]
