"""The DLQ pipeline: the DeadLetterSink port over the durable spool and one Kafka producer.

    submit() ──group commit──▶ spool (SQLite, fsync) ──drain worker──▶ producer ──▶ Kafka
        returns once durable          bounded: backpressure       delivery report = proof
                                                                   ack ─▶ settle record,
                                                                          wake wait_task()

A record the sidecar has accepted (``submit()`` returned) is never lost: it stays in the spool
until Kafka acknowledges it, across broker outages and sidecar restarts (``kill -9`` included);
after a restart the spool's records are drained in order. Duplicates are possible: the records in
flight when the sidecar died (``max_inflight_records`` / ``max_inflight_bytes``: Kafka may have
written some without our seeing the acknowledgement), the acknowledged ones not yet settled in
the spool (acknowledgements are settled within ``_SETTLE_AFTER_S`` or ``delete_batch`` records),
and a re-produce after a timeout that had in fact been written.

Seqs are per record (the spool's virtual seqs: batch row id * 2**16 + index), so ordering, the
per-task counts and read-back work per record; "deleting" a seq settles it in its batch row, and
the spool deletes the row once all of its records are settled.

``spool.enable=false``: records wait in a bounded in-memory queue instead, and `submit()` returns
once they are in it, i.e. handed to the pipeline's producer side. That mode is NOT crash-safe:
a crash, or a shutdown before Kafka acknowledged them, loses them (the loss is logged).

Drain worker: one thread, woken by an Event. The spool's writer hands it each committed record
from memory (``handoff_bytes``, 16 MiB: a burst of reports from 32 executors fits): nothing just
written is read back. When that hand-off is full (Kafka behind or gone), and after a restart,
the drain reads the spool instead, in seq order and in chunks (``read_chunk``), until it has
caught up, so that a million spooled records never sit in memory (at most
``max_inflight_records`` / ``max_inflight_bytes`` do, plus the hand-off). It hands many records
to librdkafka before serving delivery reports (one poll per batch, never one flush per record),
settles acknowledged records in batches, gives freed heap back to the OS once a large backlog
has drained, and acts on failures by their category (see `producer.classify`):

- retriable: produced again after an exponential backoff (``write-retries``);
- fatal (producer unusable): the producer is closed and rebuilt, its records produced again;
- never acceptable (too large, invalid): the record is first produced alone (it may only have
  shared a batch with the culprit); refused alone too, it is moved to the spool's bounded
  ``rejected`` table, counted (``deadletterqueue-produce-failures``, ``write-failures``,
  ``rejected-records``) and logged with its record id: neither lost nor produced in a loop.

Lock order: the writer thread calls `_register` under the spool's write lock; nothing here calls
the store while holding ``self._lock``.
"""

from __future__ import annotations

import collections
import heapq
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Producer

from ..core.model import DlqRecord
from ..core.ports import Clock, RandomSource, SystemClock
from ..errors import BackpressureError, ConfigError, DlqError, FlushTimeoutError
from ..memtune import release_memory
from .memqueue import MemoryQueue
from .producer import DeliveryFailure, KafkaDlqProducer, Outcome, ProduceRefused, producer_config
from .schema import default_spool_dir
from .spool import Spool
from .store import Placed, RecordStore
from .tracing import record_batch_spans

log = logging.getLogger(__name__)

OnAck = Callable[[str, int], None]
_TASKS_KEPT = 65_536  # finished task attempts whose counts wait_task can still report
_TRIM_AFTER_RECORDS = 10_000  # records drained before an idle drain gives memory back


# Acknowledged records are settled in the spool (one small transaction) at least this often:
# what was acknowledged but not yet settled is produced again after a crash.
_SETTLE_AFTER_S = 0.05


@dataclass(slots=True)
class _Entry:
    """A spooled record the drain holds in memory: in flight, waiting to retry, or a suspect."""

    seq: int
    rec: DlqRecord
    size: int
    attempts: int = 0
    solo: bool = False  # its last produce was alone in its batch
    sent_ns: int = 0    # when it was last handed to the producer (for the batch span)

    def __lt__(self, other: _Entry) -> bool:  # heap tie-break
        return self.seq < other.seq


@dataclass(slots=True)
class _TaskCount:
    pending: int = 0
    acked: int = 0
    rejected: int = 0
    last_error: str = ""


class DlqPipeline:
    """Implements `core.ports.DeadLetterSink`: spool, drain, produce, acknowledge."""

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        spool_dir: str = "",
        spool_enable: bool = True,
        max_bytes: int = 512 * 1024 * 1024,
        max_records: int = 2_000_000,
        linger_ms: int = 20,
        batch_size: int = 1_000_000,
        producer_overrides: Mapping[str, Any] | None = None,
        clock: Clock | None = None,
        rng: RandomSource | None = None,
        on_ack: OnAck | None = None,
        read_chunk: int = 5_000,
        max_inflight_records: int = 20_000,
        max_inflight_bytes: int = 512 * 1024,
        handoff_bytes: int = 16 * 1024 * 1024,
        delete_batch: int = 1_000,
        retry_backoff_ms: int = 100,
        retry_backoff_max_ms: int = 5_000,
        producer_factory: Callable[[dict[str, Any]], Any] = Producer,
        spool_group: str = "",
    ) -> None:
        if max_bytes < 1:
            raise ConfigError("spool.max.bytes", f"must be >= 1, got {max_bytes}")
        if max_records < 1:
            raise ConfigError("spool.max.records", f"must be >= 1, got {max_records}")
        self._config = producer_config(bootstrap_servers, linger_ms=linger_ms,
                                       batch_size=batch_size, overrides=producer_overrides)
        self.spool_enable = spool_enable
        self.spool_dir = (spool_dir or default_spool_dir()) if spool_enable else ""
        self._max_bytes = max_bytes
        self._max_records = max_records
        self._spool_group = spool_group
        self._clock: Clock = clock or SystemClock()
        self._on_ack = on_ack
        # set by the server when telemetry is on: one span per acknowledged batch
        self.tracer = None
        self._chunk = max(1, read_chunk)
        self._max_inflight = max(1, max_inflight_records)
        self._max_inflight_bytes = max(1, max_inflight_bytes)
        self._handoff_max = max(1, handoff_bytes)
        self._delete_batch = max(1, delete_batch)
        self._backoff_s = retry_backoff_ms / 1000.0
        self._backoff_max_s = retry_backoff_max_ms / 1000.0
        self._random: RandomSource = rng or random.Random()
        self._producer = KafkaDlqProducer(self._config,
                                          factory=producer_factory)
        self._store: RecordStore | None = None
        self._thread: threading.Thread | None = None

        # shared with submitters and waiters, under _lock
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._tasks: collections.OrderedDict[str, _TaskCount] = collections.OrderedDict()
        self._recovered_upto = 0  # rows up to this seq were spooled by an earlier process
        self._followers: dict[int, list[str]] = {}  # seq -> other task keys waiting on it
        self._acked_set: set[int] = set()
        self._rejected_pending: dict[int, str] = {}
        self._commits = 0
        self._flush_waiters = 0
        self._done_through = 0
        self._closing = False
        self._closed = False

        # the in-memory hand-off from the spool's writer to the drain, under _hlock
        self._hlock = threading.Lock()
        self._handoff: collections.deque[_Entry] = collections.deque()
        self._handoff_bytes = 0
        self._overflow = True   # read the spool instead (at start: recovered rows)
        self._skipped_upto = 0  # highest seq the hand-off refused (overflow): read from SQLite
        self._floor = 0         # seqs up to here the drain already read from SQLite

        # drain-thread state
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._cursor = 0
        self._read_commits = -1
        self._inflight: dict[int, _Entry] = {}
        self._retry: list[tuple[float, _Entry]] = []
        self._suspects: collections.deque[_Entry] = collections.deque()
        self._probe: int | None = None
        self._held_bytes = 0
        self._acked_pending: list[int] = []
        self._first_ack_t = 0.0
        self._rejects: list[tuple[int, str]] = []
        self._last_fail_log: dict[int, float] = {}
        self._written_since_trim = 0
        self._trim_at = 0.0
        self._avg_size = 1024  # of the rows read from the spool: sizes the next read

        # counters (written by the drain thread)
        self._c_requests = 0
        self._c_failures = 0
        self._c_written = 0
        self._c_retries = 0
        self._c_rejected = 0
        self._c_rebuilds = 0
        self._c_possible_dups = 0
        self._c_backpressure = 0
        self._c_overflows = 0    # times the in-memory hand-off was full
        self._c_spool_reads = 0  # records read back from the spool
        self._last_error = ""

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> DlqPipeline:
        """Open the spool (recovering what it holds) and start the drain worker."""
        with self._lock:
            if self._thread is not None:
                return self
            if self._closed:
                raise DlqError("the DLQ pipeline was shut down; build a new one")
        if self.spool_enable:
            self._store = Spool(self.spool_dir, max_bytes=self._max_bytes,
                                max_records=self._max_records, group=self._spool_group)
        else:
            self._store = MemoryQueue(max_bytes=self._max_bytes, max_records=self._max_records)
        self._recovered_upto = self._skipped_upto = self._store.last_seq()
        self._thread = threading.Thread(target=self._run, name="spillway-dlq-drain", daemon=True)
        self._thread.start()
        return self

    def submit(self, records: Sequence[DlqRecord]) -> None:
        """Return once every record is durable in the spool (group-committed); with
        spool.enable=false, once it is in the in-memory queue. Raises BackpressureError when the
        spool is at its high-water mark (none of `records` is then stored)."""
        if not records:
            return
        store = self._store
        if store is None:
            raise DlqError("DlqPipeline.start() was not called")
        if self._closing:
            raise DlqError("the DLQ pipeline is shutting down and accepts no more records")
        for rec in records:
            if not rec.topic:
                raise DlqError(f"DLQ record {rec.record_id!r} of job {rec.job!r} has no topic "
                               f"(errors.deadletterqueue.topic.name is empty)")
        keys = [rec.task_key for rec in records]

        def on_commit(placed: Sequence[Placed]) -> None:
            self._register(keys, placed)
            self._hand_off(records, placed)

        try:
            store.append(records, on_commit)
        except BackpressureError:
            self._c_backpressure += 1
            raise
        self._wake.set()

    def _task(self, tk: str) -> _TaskCount:
        t = self._tasks.get(tk)
        if t is None:
            t = self._tasks[tk] = _TaskCount()
        else:
            self._tasks.move_to_end(tk)
        return t

    def _register(self, keys: Sequence[str], placed: Sequence[Placed]) -> None:
        """Runs right after the commit, before any delete can run.

        A row counts for the task stored on it (its owner): the drain settles the owner's count
        when the row is acknowledged or rejected, whether that happens before or after this
        registration (the count may dip below zero meanwhile). A record that was already spooled
        under another task, or by an earlier process, is followed by seq: it is then unread, in
        the drain's hands, acknowledged-not-yet-deleted or rejected-not-yet-moved.
        """
        all_fresh = all(p.fresh for p in placed)
        with self._cv:
            if all_fresh:  # the usual case: count per task, not per record
                for tk, n in collections.Counter(keys).items():
                    self._task(tk).pending += n
            else:
                for tk, (seq, owner, fresh, _) in zip(keys, placed, strict=True):
                    t = self._task(tk)
                    if fresh:
                        t.pending += 1
                    elif owner == tk and seq > self._recovered_upto:
                        continue  # the same task reported it again: already counted
                    elif seq in self._acked_set:
                        t.acked += 1
                    elif seq in self._rejected_pending:
                        t.rejected += 1
                        t.last_error = self._rejected_pending[seq]
                    else:
                        self._followers.setdefault(seq, []).append(tk)
                        t.pending += 1
            self._commits += 1
            self._evict()
        self._wake.set()

    def _hand_off(self, records: Sequence[DlqRecord], placed: Sequence[Placed]) -> None:
        """Runs in the spool's writer right after the commit (and `_register`), in seq order:
        give the new rows to the drain from memory, so that it need not read back what was just
        written. When the hand-off is full (Kafka is behind or gone) the rows are left to the
        drain to read from the spool, and so is every later row until it has caught up."""
        entries = [_Entry(p.seq, rec, p.size) for rec, p in zip(records, placed, strict=True)
                   if p.fresh]
        if not entries:
            return
        size = sum(e.size for e in entries)
        with self._hlock:
            if not self._overflow and self._handoff_bytes + size > self._handoff_max:
                # the drain is behind (Kafka slow or gone): let go of what waits here too, the
                # drain reads it back from the spool when its turn comes
                self._overflow = True
                self._c_overflows += 1
                if self._handoff:
                    self._skipped_upto = max(self._skipped_upto, self._handoff[-1].seq)
                    self._handoff.clear()
                    self._handoff_bytes = 0
            if self._overflow:
                self._skipped_upto = max(self._skipped_upto, entries[-1].seq)
                return
            floor = self._floor
            if entries[0].seq <= floor:  # already read from the spool
                entries = [e for e in entries if e.seq > floor]
                size = sum(e.size for e in entries)
            self._handoff.extend(entries)
            self._handoff_bytes += size
        self._wake.set()

    def _evict(self) -> None:
        while len(self._tasks) > _TASKS_KEPT:
            first = next(iter(self._tasks.values()))
            if first.pending:
                break
            self._tasks.popitem(last=False)

    def _settle(self, e: _Entry, *, acked: bool, reason: str = "") -> None:
        """Count an acknowledged or rejected row for its owner and followers (under _cv)."""
        keys = self._followers.pop(e.seq, [])
        if e.seq > self._recovered_upto:
            keys.append(e.rec.task_key)
        for tk in keys:
            t = self._task(tk)
            t.pending -= 1
            if acked:
                t.acked += 1
            else:
                t.rejected += 1
                t.last_error = reason

    def wait_task(self, task_key: str, timeout_s: float) -> int:
        """Block until every record submitted under `task_key` is acknowledged by Kafka; return
        how many were. FlushTimeoutError past `timeout_s`; DlqError when one was rejected."""
        deadline = self._clock.monotonic() + timeout_s
        self._wake.set()
        with self._cv:
            while True:
                t = self._tasks.get(task_key)
                if t is None:
                    return 0
                if t.rejected:
                    raise DlqError(
                        f"{t.rejected} DLQ record(s) of task {task_key} can never be written to "
                        f"Kafka ({t.last_error}); they are kept in the spool's rejected table "
                        f"({t.acked} acknowledged, {t.pending} pending)")
                if t.pending <= 0:
                    return t.acked
                if self._closed:
                    raise DlqError(f"the DLQ pipeline shut down with {t.pending} record(s) of "
                                   f"task {task_key} not yet acknowledged; they stay spooled")
                remaining = deadline - self._clock.monotonic()
                if remaining <= 0:
                    raise FlushTimeoutError(
                        f"{t.pending} DLQ record(s) of task {task_key} not acknowledged by Kafka "
                        f"within {timeout_s:g}s ({t.acked} were); they stay spooled and will be "
                        f"delivered later" + (f"; last error: {self._last_error}"
                                              if self._last_error else ""))
                self._cv.wait(min(remaining, 0.1))

    def wait_run(self, prefix: str, timeout_s: float) -> int:
        """Wait (up to `timeout_s`) until no DLQ record of a task whose key starts with
        `prefix` (one job run: ``run_key + "/"``) is pending; return how many still are.
        Pending records past the deadline stay spooled and are delivered later."""
        deadline = self._clock.monotonic() + timeout_s
        self._wake.set()
        with self._cv:
            while True:
                pending = sum(t.pending for k, t in self._tasks.items()
                              if t.pending > 0 and k.startswith(prefix))
                remaining = deadline - self._clock.monotonic()
                if not pending or remaining <= 0 or self._closed:
                    return pending
                self._cv.wait(min(remaining, 0.1))

    def force_flush(self, timeout: float = 30.0) -> bool:
        """Wait until every record submitted before this call is acknowledged (or rejected);
        False on timeout."""
        store = self._store
        if store is None or self._thread is None:
            return True
        target = store.last_seq()
        deadline = self._clock.monotonic() + timeout
        with self._cv:
            self._flush_waiters += 1
            try:
                while self._done_through < target:
                    remaining = deadline - self._clock.monotonic()
                    if remaining <= 0 or not self._thread.is_alive():
                        return False
                    self._wake.set()
                    self._cv.wait(min(remaining, 0.05))
                return True
            finally:
                self._flush_waiters -= 1

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stop accepting, flush what can be flushed within `timeout`, stop the worker, close
        the producer (without waiting past the deadline) and the spool. What Kafka did not
        acknowledge stays in the spool for the next start. True when everything was flushed."""
        if self._thread is None or self._store is None:
            with self._cv:
                self._closing = self._closed = True
            return True
        with self._lock:
            if self._closed:
                return True
            self._closing = True
        deadline = self._clock.monotonic() + timeout
        flushed = self.force_flush(timeout)
        self._stop.set()
        self._wake.set()
        self._thread.join(max(2.0, deadline - self._clock.monotonic()))
        if self._thread.is_alive():  # pragma: no cover - the loop's waits are all bounded
            log.error("DLQ drain worker did not stop; closing anyway")
        else:
            self._producer.close(max(0.0, deadline - self._clock.monotonic()))
            self._handle_reports()
            self._commit_acks(force=True)
        left = self._store.depth()
        if left:
            if self._store.durable:
                log.warning("DLQ pipeline stopped with %d records not yet acknowledged by Kafka; "
                            "they stay in the spool %s and are drained at the next start", left,
                            self.spool_dir)
        self._store.close()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        return flushed and left == 0

    # -- status ---------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        store = self._store
        depth = store.depth() if store else 0
        return {
            "deadletterqueue-produce-requests": float(self._c_requests),
            "deadletterqueue-produce-failures": float(self._c_failures),
            "dlq-records-written": float(self._c_written),
            "spool-depth": float(depth),
            "spool-bytes": float(store.bytes() if store else 0),
            "spool-high-water": 1.0 if store and store.high_water() else 0.0,
            "write-retries": float(self._c_retries),
            "write-successes": float(self._c_written),
            "write-failures": float(self._c_rejected),
            "rejected-records": float(store.rejected_count() if store else 0),
            "in-flight-records": float(len(self._inflight)),
            "producer-rebuilds": float(self._c_rebuilds),
            "possible-duplicates": float(self._c_possible_dups),
            "backpressure-rejections": float(self._c_backpressure),
            "spool-reads": float(self._c_spool_reads),
            "handoff-overflows": float(self._c_overflows),
        }

    def last_error(self) -> str:
        return self._last_error

    @property
    def store(self) -> RecordStore | None:
        return self._store

    # -- the drain worker -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._wake.clear()
                idle_for = self._step()
                if idle_for > 0:
                    self._wake.wait(idle_for)
            except Exception:
                log.exception("DLQ drain worker error; continuing")
                self._stop.wait(0.5)

    def _step(self) -> float:
        """One round; returns how long to sleep (0: go on at once)."""
        assert self._store is not None
        now = self._clock.monotonic()
        if self._producer.fatal_error is not None:
            self._rebuild(str(self._producer.fatal_error))
        produced = False
        if self._suspects:
            produced = self._probe_next()
        else:
            while self._retry and self._retry[0][0] <= now:
                _, e = heapq.heappop(self._retry)
                if not self._produce(e):
                    break
                produced = True
            produced = self._read_more() or produced
        more_to_read = self._more_to_read()
        self._producer.poll(0 if produced or more_to_read else
                            (0.05 if self._inflight else 0))
        self._handle_reports()
        self._commit_acks(force=self._flush_waiters > 0 or self._stop.is_set())
        if self._flush_waiters:
            self._update_done_through()
        if self._inflight or produced or more_to_read or self._suspects:
            return 0.0  # (rows left over after a failed delete or reject wait for the next wake)
        if self._more_to_read():
            # the window was full when this round began and its reports came back during
            # the poll above: go on reading at once instead of idling a second per window
            return 0.0
        if self._retry:
            return max(0.0, min(1.0, self._retry[0][0] - self._clock.monotonic()))
        self._trim_when_idle()
        return 1.0

    def _more_to_read(self) -> bool:
        return self._room() > 0 and (
            bool(self._handoff) or (self._overflow and self._read_commits != self._commits))

    def _trim_when_idle(self) -> None:
        """Once a large backlog has drained and the drain has been idle for a second, hand the
        freed heap back to the OS (the spool already did when it emptied; this catches what
        was freed after that: reports, librdkafka buffers)."""
        assert self._store is not None
        if self._written_since_trim < _TRIM_AFTER_RECORDS or self._acked_pending:
            return
        now = self._clock.monotonic()
        if self._store.depth() or self._handoff:
            self._trim_at = 0.0
        elif not self._trim_at:
            self._trim_at = now + 1.0
        elif now >= self._trim_at:
            self._trim_at = 0.0
            self._written_since_trim = 0
            release_memory()
            log.debug("DLQ drain idle after a backlog: freed heap handed back to the OS")

    def _room(self) -> int:
        held = len(self._inflight) + len(self._retry) + len(self._suspects)
        held += len(self._acked_pending)
        if self._held_bytes >= self._max_inflight_bytes:
            return 0
        return self._max_inflight - held

    def _read_more(self) -> bool:
        """Take new rows: from the in-memory hand-off, else (after a restart, or once the
        hand-off overflowed) from the spool."""
        assert self._store is not None
        room = self._room()
        budget = self._max_inflight_bytes - self._held_bytes
        if room <= 0 or budget <= 0:
            return False
        limit = min(self._chunk, room)
        last = self._store.last_seq()  # every row up to it has been handed off or skipped
        taken: list[_Entry] = []
        with self._hlock:
            handoff = self._handoff
            while handoff and len(taken) < limit and budget > 0:
                e = handoff.popleft()
                budget -= e.size
                taken.append(e)
            self._handoff_bytes -= sum(e.size for e in taken)
            from_spool = not handoff and self._overflow
            if not handoff and not self._overflow and not taken:
                self._cursor = max(self._cursor, last)  # rows up to `last` all taken
        if taken:
            self._cursor = taken[-1].seq
            return self._produce_new(taken)
        if from_spool:
            return self._read_spool(limit, budget)
        return False

    def _read_spool(self, limit: int, budget: int) -> bool:
        assert self._store is not None
        with self._lock:
            commits = self._commits
        if commits == self._read_commits:
            return False
        # as many rows as the byte budget allows (by the average size read so far); rather
        # than many small reads, wait until a quarter of the window is free again
        fit = self._max_inflight_bytes // self._avg_size + 1
        limit = min(limit, budget // self._avg_size + 1)
        if self._inflight and limit < min(self._chunk, self._max_inflight, fit) // 4:
            return False
        last = self._store.last_seq()  # committed before it was published
        rows = self._store.read_batch(self._cursor, limit)
        short = len(rows) < limit
        if short:
            self._read_commits = commits
        entries = [_Entry(row.seq, row.record, row.size) for row in rows]
        self._c_spool_reads += len(entries)
        if entries:
            self._cursor = entries[-1].seq
            self._avg_size = max(1, sum(e.size for e in entries) // len(entries))
        if short:
            # read to the end: a seq up to `last` that is not there never will be (an ignored
            # duplicate can use one up), so the cursor may pass it
            self._cursor = max(self._cursor, last)
            with self._hlock:
                if not self._handoff and self._skipped_upto <= self._cursor:
                    self._overflow = False  # caught up: back to the in-memory hand-off
                    self._floor = self._cursor
        return self._produce_new(entries)

    def _produce_new(self, entries: list[_Entry]) -> bool:
        """Hand new entries to librdkafka in one go; when its queue stays full, the rest is
        kept for later, in order."""
        if not entries:
            return False
        sent_ns = time.time_ns()
        inflight = self._inflight
        producer = self._producer
        i, total = 0, len(entries)
        while i < total:
            batch = entries[i:] if i else entries
            n, refused = producer.produce_many([(e.seq, e.rec) for e in batch], max_wait_s=0.5)
            for e in batch[:n]:
                e.sent_ns = sent_ns
                inflight[e.seq] = e
            self._held_bytes += sum(e.size for e in batch[:n])
            self._c_requests += n
            i += n
            if refused is not None:  # refused synchronously (e.g. too large): filed alone
                e = entries[i]
                self._held_bytes += e.size
                self._c_requests += 1
                self._on_failure(e, refused.failure, refused_alone=True)
                i += 1
            elif i < total:  # librdkafka full
                now = self._clock.monotonic()
                for r in entries[i:]:
                    self._held_bytes += r.size
                    heapq.heappush(self._retry, (now, r))
                return i > 0
        return True

    def _produce(self, e: _Entry, *, solo: bool = False) -> bool:
        """Hand one entry to librdkafka; False when its queue stays full (entry kept)."""
        e.solo = solo
        e.sent_ns = time.time_ns()
        try:
            self._producer.produce(e.rec, e.seq, max_wait_s=0.5, poll=False)
        except BufferError:
            heapq.heappush(self._retry, (self._clock.monotonic(), e))
            return False
        except ProduceRefused as refused:
            self._c_requests += 1
            if e.attempts:
                self._c_retries += 1
            self._on_failure(e, refused.failure, refused_alone=True)
            return True
        self._c_requests += 1
        if e.attempts:
            self._c_retries += 1
        self._inflight[e.seq] = e
        return True

    def _probe_next(self) -> bool:
        """Produce one suspect alone: nothing else queued in librdkafka, nothing else sent."""
        if self._probe is not None or self._inflight or self._producer.outstanding():
            return False
        e = self._suspects.popleft()
        self._probe = e.seq
        if not self._produce(e, solo=True):
            self._probe = None
            return False
        if e.seq not in self._inflight:  # refused synchronously: already re-filed
            self._probe = None
        else:
            self._producer.flush(0)  # send it now, without waiting for linger.ms
        return True

    def _handle_reports(self) -> None:
        acked_seqs, acked_partitions, failed = self._producer.take_reports()
        if not acked_seqs and not failed:
            return
        inflight, probe = self._inflight, self._probe
        for seq, failure in failed:
            e = inflight.pop(seq, None)
            if e is None:
                continue
            if seq == probe:
                self._probe = probe = None
            self._on_failure(e, failure, refused_alone=e.solo)
        acked: list[_Entry] = []
        partitions: list[int] = []
        for seq, partition in zip(acked_seqs, acked_partitions, strict=True):
            e = inflight.pop(seq, None)
            if e is None:
                continue
            if seq == probe:
                self._probe = probe = None
            acked.append(e)
            partitions.append(partition)
        if not acked:
            return
        if self.tracer is not None:
            record_batch_spans(self.tracer, acked, partitions)
        per_job: collections.Counter[str] = collections.Counter()
        per_task: collections.Counter[str] = collections.Counter()
        with self._cv:
            self._acked_set.update(e.seq for e in acked)
            followers, upto = self._followers, self._recovered_upto
            for e in acked:
                per_job[e.rec.job] += 1
                if followers and e.seq in followers:
                    self._settle(e, acked=True)
                elif e.seq > upto:  # the owner's count, settled per task below
                    per_task[e.rec.task_key] += 1
            for tk, n in per_task.items():
                t = self._task(tk)
                t.pending -= n
                t.acked += n
            self._evict()
            self._cv.notify_all()
        for e in acked:
            self._held_bytes -= e.size
        if not self._acked_pending:
            self._first_ack_t = self._clock.monotonic()
        self._acked_pending.extend(e.seq for e in acked)
        self._c_written += len(acked)
        self._written_since_trim += len(acked)
        if self._on_ack is not None:
            for job, n in per_job.items():
                try:
                    self._on_ack(job, n)
                except Exception:
                    log.exception("DLQ on_ack hook failed")

    def _on_failure(self, e: _Entry, f: DeliveryFailure, *, refused_alone: bool) -> None:
        """File a failed entry: retry heap, suspects, or the rejected table."""
        self._c_failures += 1
        self._last_error = str(f)
        if f.possibly_persisted:
            self._c_possible_dups += 1
        now = self._clock.monotonic()
        if f.outcome is Outcome.REJECT:
            if refused_alone:
                self._reject(e, f)
            else:
                self._suspects.append(e)
            return
        if f.outcome is Outcome.REBUILD:
            self._producer.fatal_error = self._producer.fatal_error or f
            heapq.heappush(self._retry, (now, e))
        else:
            e.attempts += 1
            delay = min(self._backoff_max_s, self._backoff_s * (2 ** min(e.attempts - 1, 20)))
            heapq.heappush(self._retry, (now + delay * (0.5 + self._random.random() / 2), e))
        last = self._last_fail_log.get(f.code, 0.0)
        if now - last >= 10.0:
            self._last_fail_log[f.code] = now
            log.warning("DLQ record %s of job %s not written (%s); retrying (attempt %d)",
                        e.rec.record_id, e.rec.job, f, e.attempts)

    def _reject(self, e: _Entry, f: DeliveryFailure) -> None:
        reason = f"{f.name}: {f.message}"
        with self._cv:
            self._rejected_pending[e.seq] = reason
            self._settle(e, acked=False, reason=reason)
            self._cv.notify_all()
        self._rejects.append((e.seq, reason))
        self._held_bytes -= e.size
        self._c_rejected += 1
        log.error("DLQ record %s of job %s (topic %s) can never be written to Kafka (%s): moved to "
                  "the spool's rejected table, not retried", e.rec.record_id, e.rec.job,
                  e.rec.topic, f)

    def _commit_acks(self, *, force: bool) -> None:
        assert self._store is not None
        if self._rejects:
            rejects, self._rejects = self._rejects, []
            try:
                self._store.reject(rejects, self._clock.wall_ms())
            except DlqError:
                log.exception("moving rejected DLQ records failed; will try again")
                self._rejects = rejects + self._rejects
            else:
                with self._lock:
                    for seq, _ in rejects:
                        self._rejected_pending.pop(seq, None)
        if not self._acked_pending:
            return
        if not (force or len(self._acked_pending) >= self._delete_batch
                or not self._inflight
                or self._clock.monotonic() - self._first_ack_t >= _SETTLE_AFTER_S):
            return
        seqs, self._acked_pending = self._acked_pending, []
        try:
            self._store.delete(seqs)
        except DlqError:
            log.exception("deleting acknowledged DLQ records from the spool failed; will retry")
            self._acked_pending = seqs + self._acked_pending
            return
        with self._lock:
            self._acked_set.difference_update(seqs)

    def _update_done_through(self) -> None:
        # Everything at or below the cursor that the drain no longer holds is acknowledged or
        # rejected; rows past the cursor are not read yet.
        low = self._cursor + 1
        if self._inflight:
            low = min(low, min(self._inflight))
        if self._retry:
            low = min(low, min(e.seq for _, e in self._retry))
        if self._suspects:
            low = min(low, min(e.seq for e in self._suspects))
        with self._cv:
            self._done_through = low - 1
            self._cv.notify_all()

    def _rebuild(self, reason: str) -> None:
        log.warning("rebuilding the DLQ producer (%s); re-producing %d records in flight", reason,
                    len(self._inflight))
        self._handle_reports()
        self._producer.rebuild()
        self._c_rebuilds += 1
        now = self._clock.monotonic()
        for e in self._inflight.values():
            heapq.heappush(self._retry, (now, e))
        self._inflight.clear()
        self._probe = None
