"""A run's job-wide state, durable beside the spool: a sidecar killed and restarted mid-run
resumes each run where it was (docs/POLICY.md, "Across a restart").

The policy core journals what changes a run's durable state (`core.jobstate.JobState`); the
service writes each slice here, numbered, once the report it belongs to is answered for (its
dead letters spooled), and a sidecar that registers a run it finds here replays the slices in
their order. SQLite in WAL mode with ``synchronous=NORMAL`` in the spool's directory (0700): a
committed slice survives the process being killed (kill -9); what the machine's power loses is
the last slices, as for any WAL database so configured.

Record ids are remembered as digests from Python's ``hash()`` (fast, and keyed by the
process's hash seed, so nobody outside can craft colliding ids; payloads as digests keyed by
the run's token, `tolerance.payload_tag`): a kept state is only usable by a process with the
same seed and digest format (`FORMAT`). `spillway serve` therefore pins the seed per spool
(`hash_seed`: a random seed kept 0600 in the spool's directory, the process re-executed
with ``PYTHONHASHSEED`` set to it); kept states written under another seed (a sidecar embedded
without it) are dropped at start, with a warning, rather than misread.

Bounds: a run's slices are compacted into one snapshot once they pass `COMPACT_BYTES`; a run's
rows go when it ends (EndJob, idle expiry). A slice numbered at or below the run's snapshot is
already in it and is not written again.
"""

from __future__ import annotations

import logging
import os
import shlex
import sqlite3
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from spillway.sidecar.dlq.schema import default_spool_dir, take_lock
from spillway.sidecar.errors import RunStateError

log = logging.getLogger("spillway.sidecar.service.runstate")

FILE_NAME = "runs.sqlite"
SEED_FILE = "hashseed"
_SEED_PROBE = "spillway.runstate.seed-probe"
# 4: slices hold a stretch of new ids as columns ("n" entries); 3: snapshots hold the id table as
# columns ("I" entries); 2: payload digests are keyed BLAKE2b (1: hash()). This version reads
# what 2 and 3 wrote; an older sidecar drops what a newer one wrote rather than misread it.
FORMAT = "4"
_READABLE = ("2", "3", "4")
COMPACT_BYTES = 8 * 1024 * 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    key TEXT PRIMARY KEY, job TEXT NOT NULL, run_id TEXT NOT NULL, digest BLOB NOT NULL,
    snapshot_gen INTEGER NOT NULL DEFAULT 0, bytes INTEGER NOT NULL DEFAULT 0,
    updated REAL NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS slices (
    key TEXT NOT NULL, gen INTEGER NOT NULL, blob BLOB NOT NULL, PRIMARY KEY (key, gen));
"""


@dataclass(slots=True, eq=False)
class _Append:
    """One `RunStore.append` call, queued for the next group commit."""

    key: str
    slices: list[tuple[int, bytes]]
    total: int = 0
    done: bool = False


def unreadable_state(store: RunStore, job: str, run_id: str, exc: BaseException
                     ) -> RunStateError:
    """The refusal of a run whose kept state cannot be read: it is not resumed (its counted
    errors and remembered records are unknown, so resuming could loosen a limit or repeat a
    dead letter), and nothing of it is registered; the operator decides."""
    return RunStateError(
        f"job {job!r} run {run_id!r}: the state this sidecar kept for it before a restart, in "
        f"{store.path}, cannot be read ({type(exc).__name__}: {exc}); the run is not resumed, "
        "since its counted errors and dead-lettered records are unknown. Run the job under "
        "a new run id, or drop the kept state to start this run afresh here (its tolerance "
        "count and dead letters start from zero): spillway job forget "
        f"{shlex.quote(job)} --run {shlex.quote(run_id)} "
        f"--spool-dir {shlex.quote(str(store.path.parent))}")


def forget(directory: str | os.PathLike, key: str) -> bool:
    """Drop the state kept for run `key` in `directory` (`spillway job forget`); whether there
    was one. Opens the file as it is (no seed check: that would drop every other run)."""
    path = Path(directory) / FILE_NAME
    if not path.exists():
        return False
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    try:
        conn.execute("BEGIN IMMEDIATE")
        n = conn.execute("DELETE FROM runs WHERE key = ?", (key,)).rowcount
        conn.execute("DELETE FROM slices WHERE key = ?", (key,))
        conn.execute("COMMIT")
        return n > 0
    finally:
        conn.close()


class RunStore:
    """One sidecar's durable run states. Thread-safe (one connection, one lock)."""

    def __init__(self, directory: str | os.PathLike, max_idle_s: float | None = None, *,
                 lock: bool = False) -> None:
        """``lock``: take the directory's one-process lock (`dlq.schema.take_lock`), for a
        sidecar without a spool (log-only), where no spool holds it."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock_fd = take_lock(str(d)) if lock else None
        self.path = d / FILE_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)  # never readable by others
        os.close(fd)
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(_SCHEMA)
        self._lock = threading.Lock()   # the connection's; held by whoever writes
        self._qlock = threading.Lock()  # the queue of appends waiting for a group commit
        self._queue: list[_Append] = []
        self.write_failures = 0
        self._check_seed()
        if max_idle_s is not None:
            self.prune(max_idle_s)

    def _check_seed(self) -> None:
        """Drop kept states whose digests this process cannot reproduce (another hash seed)."""
        seed = f"{hash(_SEED_PROBE)}"
        mine = f"{seed}/{FORMAT}"
        with self._lock, self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            row = self._conn.execute("SELECT value FROM meta WHERE name = 'seed'").fetchone()
            if row is not None and row[0] not in {f"{seed}/{f}" for f in _READABLE}:
                n = self._conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
                self._conn.execute("DELETE FROM slices")
                self._conn.execute("DELETE FROM runs")
                if n:
                    log.warning("dropped the kept state of %d run(s) in %s: it was written by a "
                                "process with another hash seed or digest format (start the "
                                "sidecar with "
                                "`spillway serve`, which pins it per spool)", n, self.path)
            self._conn.execute("INSERT OR REPLACE INTO meta (name, value) VALUES ('seed', ?)",
                               (mine,))

    def prune(self, max_idle_s: float) -> int:
        """Drop the runs nobody wrote for `max_idle_s` (job.idle.timeout.ms): had the sidecar
        lived, they would have expired. Returns how many."""
        cutoff = time.time() - max_idle_s
        with self._lock, self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            old = [k for (k,) in self._conn.execute("SELECT key FROM runs WHERE updated < ?",
                                                     (cutoff,))]
            for k in old:
                self._conn.execute("DELETE FROM slices WHERE key = ?", (k,))
                self._conn.execute("DELETE FROM runs WHERE key = ?", (k,))
        if old:
            log.info("dropped the kept state of %d run(s) idle for over %.0f s", len(old),
                     max_idle_s)
        return len(old)

    def close(self) -> None:
        with self._lock:
            self._conn.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def load(self, key: str, job: str = "", run_id: str = "") -> tuple[bytes, list[bytes]] | None:
        """The run's token digest and its slices, oldest first; None when not kept here
        (RunStateError when the file cannot be read)."""
        try:
            with self._lock:
                row = self._conn.execute("SELECT digest FROM runs WHERE key = ?",
                                         (key,)).fetchone()
                if row is None:
                    return None
                blobs = [b for (b,) in self._conn.execute(
                    "SELECT blob FROM slices WHERE key = ? ORDER BY gen", (key,))]
        except sqlite3.Error as exc:
            raise unreadable_state(self, job or key, run_id, exc) from exc
        return bytes(row[0]), blobs

    def open_run(self, key: str, job: str, run_id: str, digest: bytes) -> None:
        """Keep a new run (any earlier one of this key is dropped: its state ended with it)."""
        with self._lock, self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute("DELETE FROM slices WHERE key = ?", (key,))
            self._conn.execute("INSERT OR REPLACE INTO runs (key, job, run_id, digest, updated) "
                               "VALUES (?, ?, ?, ?, ?)", (key, job, run_id, digest,
                                                          time.time()))

    def append(self, key: str, slices: list[tuple[int, bytes]]) -> int:
        """Write journal slices; returns the run's bytes kept since its snapshot (0: the run is
        not kept here), once they are committed. A write that fails is logged and counted: the
        run goes on in memory.

        Group commit: the slices of calls made while another call's transaction runs wait for
        it and are then written together, by whichever of them takes the lock first, in one
        transaction (reports answered at once share one commit instead of queueing one each)."""
        if not slices:
            return 0
        mine = _Append(key, slices)
        with self._qlock:
            self._queue.append(mine)
        with self._lock:
            if not mine.done:
                with self._qlock:
                    batch, self._queue = self._queue, []
                self._write(batch)
        return mine.total

    def _write(self, batch: list[_Append]) -> None:
        """One transaction for `batch` (under the lock); every one of them is done after it."""
        runs: dict[str, list[int] | None] = {}  # key -> [snapshot_gen, bytes]; None: not kept
        try:
            with self._conn:
                self._conn.execute("BEGIN IMMEDIATE")
                for a in batch:
                    if a.key not in runs:
                        row = self._conn.execute(
                            "SELECT snapshot_gen, bytes FROM runs WHERE key = ?",
                            (a.key,)).fetchone()
                        runs[a.key] = None if row is None else list(row)
                    run = runs[a.key]
                    if run is None:
                        continue
                    fresh = [(a.key, g, b) for g, b in a.slices if g > run[0]]
                    self._conn.executemany("INSERT OR REPLACE INTO slices (key, gen, blob) "
                                           "VALUES (?, ?, ?)", fresh)
                    run[1] += sum(len(b) for _, _, b in fresh)
                    a.total = run[1]
                now = time.time()
                self._conn.executemany("UPDATE runs SET bytes = ?, updated = ? WHERE key = ?",
                                       [(r[1], now, k) for k, r in runs.items() if r is not None])
        except sqlite3.Error as exc:
            self.write_failures += len(batch)
            for a in batch:
                a.total = 0
            log.error("run(s) %s: their state could not be written to %s (%s); a restart would "
                      "forget this part of it", ", ".join(sorted({repr(a.key) for a in batch})),
                      self.path, exc)
        finally:
            for a in batch:
                a.done = True

    def compact(self, key: str, gen: int, snapshot: bytes) -> None:
        """Replace the run's slices up to `gen` with `snapshot` (numbered `gen`)."""
        try:
            with self._lock, self._conn:
                self._conn.execute("BEGIN IMMEDIATE")
                self._conn.execute("DELETE FROM slices WHERE key = ? AND gen <= ?", (key, gen))
                self._conn.execute("INSERT OR REPLACE INTO slices (key, gen, blob) "
                                   "VALUES (?, ?, ?)", (key, gen, snapshot))
                left = self._conn.execute(
                    "SELECT COALESCE(SUM(LENGTH(blob)), 0) FROM slices WHERE key = ?",
                    (key,)).fetchone()[0]
                self._conn.execute("UPDATE runs SET snapshot_gen = ?, bytes = ? WHERE key = ?",
                                   (gen, left, key))
        except sqlite3.Error as exc:
            self.write_failures += 1
            log.error("run %r: compacting its state in %s failed: %s", key, self.path, exc)

    # --- with the policy engine (`core.policy.PolicyEngine`) --------------------------------

    def attach(self, engine, key: str, job: str, run_id: str, digest: bytes,
               kept: tuple[bytes, list[bytes]] | None) -> None:
        """Journal a run just registered in `engine`: resume it from `kept` (`load`, its token
        already checked), or keep it as a new run. A kept state that does not replay is
        refused (RunStateError, DATA_LOSS) and the run unregistered from `engine` again."""
        engine.enable_journal(key)
        if kept is None:
            self.open_run(key, job, run_id, digest)
            return
        try:
            engine.restore(key, kept[1])
        except Exception as exc:   # refused: the engine forgets the run again
            engine.end_job(key)
            raise unreadable_state(self, job, run_id, exc) from exc

    def persist(self, engine, key: str, slices: list[tuple[int, bytes]]) -> None:
        """Write a run's journal slices; compact the run once it has grown past COMPACT_BYTES."""
        if self.append(key, slices) <= COMPACT_BYTES:
            return
        try:
            gen, snap = engine.snapshot(key)
        except LookupError:  # the run ended meanwhile (UnknownJobError)
            return
        self.compact(key, gen, snap)

    def drop(self, key: str) -> None:
        with self._lock, self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute("DELETE FROM slices WHERE key = ?", (key,))
            self._conn.execute("DELETE FROM runs WHERE key = ?", (key,))

    def keys(self) -> list[str]:
        with self._lock:
            return [k for (k,) in self._conn.execute("SELECT key FROM runs ORDER BY key")]


def keep(store: RunStore | None, engine, key: str, slices: list | None) -> None:
    """Write a call's journal slices of run `key`, when runs' states are kept and it has any."""
    if store is not None and slices:
        store.persist(engine, key, slices)


def wanted(props: Mapping) -> bool:
    """Whether a sidecar with these (parsed) properties keeps run states: not with
    ``run.state.durable`` or ``spool.enable`` off, nor without Kafka on an ephemeral port
    (``:0``) with no ``spool.dir`` (a restart cannot come back at its address, and its default
    directory would be shared with every other such sidecar). A log-only sidecar otherwise keeps
    them like a Kafka-backed one, in the spool's directory (docs/POLICY.md)."""
    if not (props["run.state.durable"] and props["spool.enable"]):
        return False
    return bool(props["spool.dir"] or props["bootstrap.servers"] or props["listen.unix.socket"]
                or not str(props["listen.address"]).endswith(":0"))


def directory(props: Mapping, raw: Mapping[str, str]) -> str | None:
    """Where a sidecar with these (parsed) properties keeps run states (`wanted`), or None."""
    return (props["spool.dir"] or default_spool_dir(raw)) if wanted(props) else None


def hash_seed(directory: str | os.PathLike) -> str | None:
    """The hash seed kept in `directory` (created, random, 0600, on first use), which `spillway
    serve` runs under (runtime/restart.py: ``PYTHONHASHSEED``); None when it cannot be kept
    (then a warning: a restart will not resume runs)."""
    import secrets

    d = Path(directory)
    path = d / SEED_FILE
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            seed = path.read_text().strip()
        except FileNotFoundError:
            seed = str(secrets.randbelow(2**32 - 1) + 1)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(seed + "\n")
        if not seed.isdigit() or not 0 < int(seed) < 2**32:
            raise ValueError(f"{path} holds no hash seed")
    except (OSError, ValueError) as exc:
        log.warning("cannot keep the hash seed in %s (%s): a restart will not resume runs",
                    directory, exc)
        return None
    return seed
