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
the spool (acknowledgements are settled within ``drain.SETTLE_AFTER_S`` or ``delete_batch``
records),
and a re-produce after a timeout that had in fact been written.

Seqs are per record (the spool's virtual seqs: batch row id * 2**16 + index), so ordering, the
per-task counts and read-back work per record; "deleting" a seq settles it in its batch row, and
the spool deletes the row once all of its records are settled.

``spool.enable=false``: records wait in a bounded in-memory queue instead, and `submit()` returns
once they are in it, i.e. handed to the pipeline's producer side. That mode is NOT crash-safe:
a crash, or a shutdown before Kafka acknowledged them, loses them (the loss is logged).

Drain worker: one thread, woken by an Event. The spool's writer hands it each committed record
from memory (``handoff_bytes``, 16 MiB, and ``handoff_records``, 16,384 records: a burst of
reports from 32 executors fits): nothing just written is read back. When that hand-off is
full (Kafka behind or gone), and after a restart, the drain reads the spool instead, in seq
order and in chunks (``read_chunk``), until it has read to the spool's end once (the rows
committed meanwhile are read next, the later ones handed over again), so that a million
spooled records never sit in memory (at most ``max_inflight_records`` / ``max_inflight_bytes`` do,
plus the hand-off). It hands many records to librdkafka before serving delivery reports (one
poll per batch, never one flush per record), settles acknowledged records in batches, gives
freed heap back to the OS once a large backlog has drained, and acts on failures by their
category (see `producer.classify`):

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
import logging
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any


from ..core.model import DlqRecord, task_run_prefix
from ..core.ports import Clock, RandomSource, SystemClock
from ..errors import BackpressureError, ConfigError, DlqError, FlushTimeoutError
from .drain import Drain, Entry
from .memqueue import MemoryQueue
from .producer import KafkaDlqProducer, producer_config
from .schema import default_spool_dir
from .spool import Spool
from .store import FreshRun, Placed, RecordStore

log = logging.getLogger(__name__)

OnAck = Callable[[str, int], None]
_SEQ, _FRESH, _SIZE = itemgetter(0), itemgetter(2), itemgetter(3)   # of a Placed
_TASKS_KEPT = 65_536  # finished task attempts whose counts wait_task can still report


@dataclass(slots=True)
class _TaskCount:
    pending: int = 0
    acked: int = 0
    rejected: int = 0
    last_error: str = ""
    ack_gen: int = 0  # the drain's acknowledgement round of its last acknowledged record


class DlqPipeline(Drain):
    """Implements `core.ports.DeadLetterSink`: spool, drain, produce, acknowledge (the drain
    worker's rounds are `drain.Drain`'s part)."""

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
        handoff_records: int = 16_384,
        delete_batch: int = 1_000,
        retry_backoff_ms: int = 100,
        retry_backoff_max_ms: int = 5_000,
        producer_factory: Callable[[dict[str, Any]], Any] | None = None,
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
        # set by the server when telemetry is on: one span per acknowledged batch, while
        # `traced()` says they are exported (the spans' links cost a little per record)
        self.tracer = None
        self.traced: Callable[[], bool] = lambda: True
        self._chunk = max(1, read_chunk)
        self._max_inflight = max(1, max_inflight_records)
        self._max_inflight_bytes = max(1, max_inflight_bytes)
        self._handoff_max = max(1, handoff_bytes)
        # records too: the bytes bound counts spooled bytes, and a record's objects in memory
        # take several times its share of a report's spooled bytes (which share header bytes)
        self._handoff_max_records = max(1, handoff_records)
        self._delete_batch = max(1, delete_batch)
        self._backoff_s = retry_backoff_ms / 1000.0
        self._backoff_max_s = retry_backoff_max_ms / 1000.0
        self._random: RandomSource = rng or random.Random()
        self._producer = KafkaDlqProducer(self._config, factory=producer_factory)
        self._store: RecordStore | None = None
        self._thread: threading.Thread | None = None

        # shared with submitters and waiters, under _lock
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._tasks: collections.OrderedDict[str, _TaskCount] = collections.OrderedDict()
        # run prefix -> its task keys in `_tasks`: wait_run and forget_run touch one run's tasks
        # only, and an ended run's counts go with it (they would otherwise stay until 65,536
        # later tasks pushed them out: long-lived small objects that pin heap pages)
        self._run_tasks: dict[str, dict[str, None]] = {}
        self._recovered_upto = 0  # rows up to this seq were spooled by an earlier process
        self._followers: dict[int, list[str]] = {}  # seq -> other task keys waiting on it
        self._acked_set: set[int] = set()
        self._rejected_pending: dict[int, str] = {}
        self._flush_waiters = 0
        # acknowledgement rounds (`Drain._handle_reports`) and the last one settled in the
        # store: a flush barrier returns once its task's records are settled, so that a crash
        # right after it does not produce them again
        self._ack_gen = 0
        self._settled_gen = 0
        self._done_through = 0
        self._closing = False
        self._closed = False

        # the in-memory hand-off from the spool's writer to the drain, under _hlock
        self._hlock = threading.Lock()
        # groups: [the fresh entries of one commit, in seq order, their bytes]
        self._handoff: collections.deque[list] = collections.deque()
        self._handoff_n = 0     # entries in it
        self._handoff_bytes = 0
        # rows up to this seq were not handed over (recovered at start, or the hand-off was
        # full): the drain reads them from the spool before it takes the hand-off's
        self._skipped_upto = 0
        # the hand-off was full: rows are skipped until the drain has read the spool to its
        # end once (then the seqs skipped stop growing, and it soon reaches them)
        self._overflow = False

        # drain-thread state
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._cursor = 0
        self._inflight: dict[int, Entry] = {}
        self._retry: list[tuple[float, Entry]] = []
        self._suspects: collections.deque[Entry] = collections.deque()
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

    def submit(self, records: Sequence[DlqRecord], *, release: int = 0,
               segments: list | None = None) -> None:
        """Return once every record is durable in the spool (group-committed); with
        spool.enable=false, once it is in the in-memory queue. Raises BackpressureError when the
        spool is at its high-water mark (none of `records` is then stored). ``release``: the
        held row (`hold`) `records` are confirmed from (no records: the row is discarded);
        ``segments``: their encoding, from `hold`."""
        if not records and not release:
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
            # the usual case: every record new (the spool's FreshRun: columns)
            fresh = type(placed) is FreshRun or all(map(_FRESH, placed))
            self._register(keys, placed, fresh)
            self._hand_off(records, placed, fresh)

        try:
            if release:
                store.append(records, on_commit, release=release, segments=segments)
            else:
                store.append(records, on_commit)
        except BackpressureError:
            self._c_backpressure += 1
            raise
        self._wake.set()

    @property
    def holds(self) -> bool:
        """Whether records can be held for a home's confirmation (a durable spool)."""
        return isinstance(self._store, Spool)

    def hold(self, records: Sequence[DlqRecord], run: str, meta: bytes) -> tuple[int, list]:
        """Hold `records` in the spool until `submit(..., release=...)` (`held.py`); returns
        the held row's id and the records' segments. BackpressureError past the bounds."""
        if not self.holds:
            raise DlqError("records can be held only in a durable spool (spool.enable=true)")
        if self._closing:
            raise DlqError("the DLQ pipeline is shutting down and accepts no more records")
        try:
            return self._store.hold(records, run, meta)
        except BackpressureError:
            self._c_backpressure += 1
            raise

    def _task(self, tk: str) -> _TaskCount:
        t = self._tasks.get(tk)
        if t is None:
            t = self._tasks[tk] = _TaskCount()
            self._run_tasks.setdefault(task_run_prefix(tk), {})[tk] = None
        else:
            self._tasks.move_to_end(tk)
        return t

    def _register(self, keys: Sequence[str], placed: Sequence[Placed],
                  all_fresh: bool) -> None:
        """Runs right after the commit, before any delete can run.

        A row counts for the task stored on it (its owner): the drain settles the owner's count
        when the row is acknowledged or rejected, whether that happens before or after this
        registration (the count may dip below zero meanwhile). A record that was already spooled
        under another task, or by an earlier process, is followed by seq: it is then unread, in
        the drain's hands, acknowledged-not-yet-deleted or rejected-not-yet-moved.
        """
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
                    elif seq in self._acked_set:   # acknowledged, its settling under way
                        t.acked += 1
                        t.ack_gen = self._ack_gen
                    elif seq in self._rejected_pending:
                        t.rejected += 1
                        t.last_error = self._rejected_pending[seq]
                    else:
                        self._followers.setdefault(seq, []).append(tk)
                        t.pending += 1
            self._evict()
        self._wake.set()

    def _hand_off(self, records: Sequence[DlqRecord], placed: Sequence[Placed],
                  all_fresh: bool) -> None:
        """Runs in the spool's writer right after the commit (and `_register`), in seq order:
        give the new rows to the drain from memory, so that it need not read back what was just
        written. When the hand-off is full (Kafka is behind or gone) the rows are left to the
        drain to read from the spool, and so is every later row until the drain has read the
        spool to its end once; the rows after that are handed over again."""
        if type(placed) is FreshRun:
            entries = list(map(Entry, placed.seqs, records, placed.sizes))
            size = sum(placed.sizes)
        elif all_fresh:
            entries = list(map(Entry, map(_SEQ, placed), records, map(_SIZE, placed)))
            size = sum(map(_SIZE, placed))
        else:
            entries = [Entry(p.seq, rec, p.size)
                       for rec, p in zip(records, placed, strict=True) if p.fresh]
            size = sum(e.size for e in entries)
        if not entries:
            return
        with self._hlock:
            if self._overflow:   # until the drain has read back what was skipped
                self._skipped_upto = entries[-1].seq
                return
            if (self._handoff_bytes + size > self._handoff_max
                    or self._handoff_n + len(entries) > self._handoff_max_records):
                # the drain is behind (Kafka slow or gone): let go of what waits here too, the
                # drain reads it back from the spool when its turn comes
                self._overflow = True
                self._c_overflows += 1
                self._skipped_upto = entries[-1].seq
                self._handoff.clear()
                self._handoff_n = self._handoff_bytes = 0
                return
            self._handoff.append([entries, size])
            self._handoff_n += len(entries)
            self._handoff_bytes += size
        self._wake.set()

    def _evict(self) -> None:
        while len(self._tasks) > _TASKS_KEPT:
            first = next(iter(self._tasks.values()))
            if first.pending:
                break
            self._unindex(self._tasks.popitem(last=False)[0])

    def _unindex(self, tk: str) -> None:
        run = task_run_prefix(tk)
        keys = self._run_tasks.get(run)
        if keys is not None:
            keys.pop(tk, None)
            if not keys:
                del self._run_tasks[run]

    def forget_run(self, prefix: str) -> None:
        """Drop the counts of an ended run's settled tasks (`prefix`: ``run_key + "/"``). A
        task with records still pending keeps its count until they settle; its FlushTask can
        no longer come (the run is gone), so it leaves with the usual eviction."""
        with self._cv:
            keys = self._run_tasks.get(prefix)
            if not keys:
                return
            for tk in list(keys):
                t = self._tasks.get(tk)
                if t is None or t.pending == 0:
                    self._tasks.pop(tk, None)
                    del keys[tk]
            if not keys:
                del self._run_tasks[prefix]

    def _settle(self, e: Entry, *, acked: bool, reason: str = "") -> None:
        """Count an acknowledged or rejected row for its owner and followers (under _cv)."""
        keys = self._followers.pop(e.seq, [])
        if e.seq > self._recovered_upto:
            keys.append(e.rec.task_key)
        for tk in keys:
            t = self._task(tk)
            t.pending -= 1
            if acked:
                t.acked += 1
                t.ack_gen = self._ack_gen
            else:
                t.rejected += 1
                t.last_error = reason

    def wait_task(self, task_key: str, timeout_s: float) -> int:
        """Block until every record submitted under `task_key` is acknowledged by Kafka and that
        is settled in the spool (a sidecar killed after this returned does not produce them
        again); return how many were. FlushTimeoutError past `timeout_s`; DlqError when one was
        rejected."""
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
                if t.pending <= 0 and (t.ack_gen <= self._settled_gen or self._closed):
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
                tasks = self._tasks
                pending = sum(t.pending for t in map(tasks.get, self._run_tasks.get(prefix, ()))
                              if t is not None and t.pending > 0)
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
