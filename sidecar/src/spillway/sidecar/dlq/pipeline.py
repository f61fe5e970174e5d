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

Drain worker: one thread, woken by an Event. The spool's writer hands it each commit from
memory (`handoff.Handoff`: ``handoff_records``, 16,384, as objects; past them, as the spool
stored them, ``handoff_bytes``, 32 MiB: a burst of 100,000 failed records fits): nothing just
written is read back. When that hand-off is full (Kafka behind or gone), and after a restart,
the drain reads the spool instead, in seq order and in chunks (``read_chunk``), until it has
read to the spool's end once (the rows committed meanwhile are read next, the later ones handed
over again), so that a million spooled records never sit in memory (at most
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

Composed of parts that each own their state, built once the spool is open (`start`): the
store (`spool.Spool` or `memqueue.MemoryQueue`), the per-task counts (`tasks.TaskCounts`), the
in-memory hand-off (`handoff.Handoff`) and the drain worker (`drain.Drain`), which is given the
other three and the producer.

Lock order: the spool's writer calls `TaskCounts.register` and `Handoff.give` under the spool's
write lock; neither calls the store while holding its own lock.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any

from ..core.dlq_record import Streak
from ..core.model import DlqRecord
from ..core.ports import Clock, RandomSource, SystemClock
from ..errors import BackpressureError, ConfigError, DlqError
from .drain import MAX_INFLIGHT_BYTES, Drain, DrainSettings, OnAck
from .handoff import Handoff
from .memqueue import MemoryQueue
from .producer import KafkaDlqProducer, linger_of, producer_config
from .schema import default_spool_dir
from .spool import Spool
from .store import FreshRun, Placed, RecordStore
from .tasks import TaskCounts

log = logging.getLogger(__name__)

_FRESH = itemgetter(2)   # of a Placed


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
        max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
        handoff_bytes: int = 32 * 1024 * 1024,
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
        self._random: RandomSource = rng or random.Random()
        self._on_ack = on_ack
        # set by the server when telemetry is on, before `start()`: one span per acknowledged
        # batch, while `traced()` says they are exported (the spans' links cost a little per
        # record)
        self.tracer = None
        self.traced: Callable[[], bool] = lambda: True
        self._settings = DrainSettings(
            read_chunk=read_chunk, max_inflight_records=max_inflight_records,
            max_inflight_bytes=max_inflight_bytes, delete_batch=delete_batch,
            retry_backoff_ms=retry_backoff_ms, retry_backoff_max_ms=retry_backoff_max_ms,
            linger_ms=linger_of(self._config))
        self._handoff_bytes = handoff_bytes
        self._handoff_records = handoff_records
        self._producer = KafkaDlqProducer(self._config, factory=producer_factory)
        # its parts, once started
        self._store: RecordStore | None = None
        self._counts: TaskCounts | None = None
        self._handoff: Handoff | None = None
        self._drain: Drain | None = None

        self._lock = threading.Lock()   # the lifecycle
        self._closing = False
        self._closed = False
        self._c_backpressure = 0

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> DlqPipeline:
        """Open the spool (recovering what it holds) and start the drain worker."""
        with self._lock:
            if self._drain is not None:
                return self
            if self._closed:
                raise DlqError("the DLQ pipeline was shut down; build a new one")
        if self.spool_enable:
            store: RecordStore = Spool(self.spool_dir, max_bytes=self._max_bytes,
                                       max_records=self._max_records, group=self._spool_group)
        else:
            store = MemoryQueue(max_bytes=self._max_bytes, max_records=self._max_records)
        recovered = store.last_seq()   # rows up to it were spooled by an earlier process
        counts = TaskCounts(self._clock, recovered_upto=recovered)
        handoff = Handoff(max_bytes=self._handoff_bytes, max_records=self._handoff_records,
                          skipped_upto=recovered)
        drain = Drain(store, self._producer, counts, handoff, self._settings, clock=self._clock,
                      rng=self._random, on_ack=self._on_ack, tracer=self.tracer,
                      traced=self.traced)
        self._store, self._counts, self._handoff = store, counts, handoff
        self._drain = drain
        drain.start()
        return self

    def submit(self, records: Sequence[DlqRecord], *, release: int = 0,
               segments: list | None = None, streaks: Sequence[Streak] = ()) -> None:
        """Return once every record is durable in the spool (group-committed); with
        spool.enable=false, once it is in the in-memory queue. Raises BackpressureError when the
        spool is at its high-water mark (none of `records` is then stored). ``release``: the
        held row (`hold`) `records` are confirmed from (no records: the row is discarded);
        ``segments``: their encoding, from `hold`; ``streaks``: how they were built
        (`core.dlq_record.Streak`: a durable spool stores those records as columns)."""
        if not records and not release:
            return
        store, drain = self._store, self._drain
        if store is None or drain is None:
            raise DlqError("DlqPipeline.start() was not called")
        if self._closing:
            raise DlqError("the DLQ pipeline is shutting down and accepts no more records")
        for rec in records:
            if not rec.topic:
                raise DlqError(f"DLQ record {rec.record_id!r} of job {rec.job!r} has no topic "
                               f"(errors.deadletterqueue.topic.name is empty)")
        keys = [rec.task_key for rec in records]
        register, give, wake = self._counts.register, self._handoff.give, drain.wake

        def on_commit(placed: Sequence[Placed]) -> None:
            # the usual case: every record new (the spool's FreshRun: columns)
            fresh = type(placed) is FreshRun or all(map(_FRESH, placed))
            register(keys, placed, fresh)
            give(records, placed, fresh)
            wake()

        try:
            if release:
                store.append(records, on_commit, release=release, segments=segments,
                             streaks=streaks)
            else:
                store.append(records, on_commit, streaks=streaks)
        except BackpressureError:
            self._c_backpressure += 1
            raise
        wake()

    @property
    def holds(self) -> bool:
        """Whether records can be held for a home's confirmation (a durable spool)."""
        return isinstance(self._store, Spool)

    def hold(self, records: Sequence[DlqRecord], run: str, meta: bytes,
             streaks: Sequence[Streak] = ()) -> tuple[int, list]:
        """Hold `records` in the spool until `submit(..., release=...)` (`held.py`); returns
        the held row's id and the records' segments. BackpressureError past the bounds."""
        store = self._store
        if not isinstance(store, Spool):
            raise DlqError("records can be held only in a durable spool (spool.enable=true)")
        if self._closing:
            raise DlqError("the DLQ pipeline is shutting down and accepts no more records")
        try:
            return store.hold(records, run, meta, streaks)
        except BackpressureError:
            self._c_backpressure += 1
            raise

    def forget_run(self, prefix: str) -> None:
        """Drop the counts of an ended run's settled tasks (`prefix`: ``run_key + "/"``). A
        task with records still pending keeps its count until they settle; its FlushTask can
        no longer come (the run is gone), so it leaves with the usual eviction."""
        if self._counts is not None:
            self._counts.forget_run(prefix)

    def wait_task(self, task_key: str, timeout_s: float) -> int:
        """Block until every record submitted under `task_key` is acknowledged by Kafka and that
        is settled in the spool (a sidecar killed after this returned does not produce them
        again); return how many were. FlushTimeoutError past `timeout_s`; DlqError when one was
        rejected."""
        counts, drain = self._counts, self._drain
        if counts is None or drain is None:
            return 0
        drain.wake()
        return counts.wait_task(task_key, timeout_s, self.last_error)

    def wait_run(self, prefix: str, timeout_s: float) -> int:
        """Wait (up to `timeout_s`) until no DLQ record of a task whose key starts with
        `prefix` (one job run: ``run_key + "/"``) is pending; return how many still are.
        Pending records past the deadline stay spooled and are delivered later."""
        counts, drain = self._counts, self._drain
        if counts is None or drain is None:
            return 0
        drain.wake()
        return counts.wait_run(prefix, timeout_s)

    def force_flush(self, timeout: float = 30.0) -> bool:
        """Wait until every record submitted before this call is acknowledged (or rejected);
        False on timeout."""
        store, counts, drain = self._store, self._counts, self._drain
        if store is None or counts is None or drain is None:
            return True
        return counts.wait_done(store.last_seq(), timeout, drain.alive, drain.wake)

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stop accepting, flush what can be flushed within `timeout`, stop the worker, close
        the producer (without waiting past the deadline) and the spool. What Kafka did not
        acknowledge stays in the spool for the next start. True when everything was flushed."""
        store, counts, drain = self._store, self._counts, self._drain
        if store is None or counts is None or drain is None:
            with self._lock:
                self._closing = self._closed = True
            return True
        with self._lock:
            if self._closed:
                return True
            self._closing = True
        deadline = self._clock.monotonic() + timeout
        flushed = self.force_flush(timeout)
        drain.stop(deadline)
        left = store.depth()
        if left:
            if store.durable:
                log.warning("DLQ pipeline stopped with %d records not yet acknowledged by Kafka; "
                            "they stay in the spool %s and are drained at the next start", left,
                            self.spool_dir)
        store.close()
        with self._lock:
            self._closed = True
        counts.close()
        return flushed and left == 0

    # -- status ---------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        store, drain, handoff = self._store, self._drain, self._handoff
        counters = drain.stats() if drain is not None else dict.fromkeys(_DRAIN_STATS, 0.0)
        return {
            "deadletterqueue-produce-requests": counters["deadletterqueue-produce-requests"],
            "deadletterqueue-produce-failures": counters["deadletterqueue-produce-failures"],
            "dlq-records-written": counters["dlq-records-written"],
            "spool-depth": float(store.depth() if store else 0),
            "spool-bytes": float(store.bytes() if store else 0),
            "spool-high-water": 1.0 if store and store.high_water() else 0.0,
            "write-retries": counters["write-retries"],
            "write-successes": counters["write-successes"],
            "write-failures": counters["write-failures"],
            "rejected-records": float(store.rejected_count() if store else 0),
            "in-flight-records": counters["in-flight-records"],
            "producer-rebuilds": counters["producer-rebuilds"],
            "possible-duplicates": counters["possible-duplicates"],
            "backpressure-rejections": float(self._c_backpressure),
            "spool-reads": counters["spool-reads"],
            "handoff-overflows": float(handoff.overflows if handoff else 0),
        }

    def last_error(self) -> str:
        return self._drain.last_error if self._drain is not None else ""

    @property
    def store(self) -> RecordStore | None:
        return self._store


_DRAIN_STATS = ("deadletterqueue-produce-requests", "deadletterqueue-produce-failures",
                "dlq-records-written", "write-retries", "write-successes", "write-failures",
                "in-flight-records", "producer-rebuilds", "possible-duplicates", "spool-reads")
