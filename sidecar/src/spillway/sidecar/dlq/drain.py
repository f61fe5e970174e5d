"""The DLQ pipeline's drain worker: one thread's rounds of reading, producing and settling.

Each round (`_step`) takes the records the spool's writer handed over in memory, or reads the
spool when that hand-off overflowed or after a restart (up to ``max_inflight_records`` /
``max_inflight_bytes`` held); hands librdkafka one produce request's worth of them at a time,
only once it has reported on the last (`_send`); serves delivery reports (`_handle_reports`):
an acknowledged record is settled in the spool in batches (`_commit_acks`), a failed one is
retried, produced alone, rejected or makes the producer be rebuilt by its category
(`_on_failure`, see `producer.classify`).

One request at a time: librdkafka's idempotent producer sends a partition's next request only
once the last is answered (it counts records in flight against its limit of five requests), and
while records it could send wait for that, its broker thread polls without sleeping: 5-8 µs of
CPU a dead-lettered record, against about 2 when it holds nothing meanwhile (docs/design/
failure-path.md, round eleven). So the records wait in the drain instead, and it gathers them
as librdkafka's linger would: the next request's worth is taken when a full one waits, a flush
barrier does, or ``linger.ms`` after the last; it waits in librdkafka behind the one in flight,
not yet due (handed over less than ``linger.ms`` ago), and once that one is answered the drain
has it sent at once (librdkafka's `flush()` ignores ``linger.ms`` while it runs).

`Drain` is one of the parts `pipeline.DlqPipeline` is composed of, built when the pipeline
starts: it owns its thread, the entries it holds (in flight, to retry, suspects) and its
counters, and is given the store it reads and settles, the producer, the hand-off it takes
committed records from (`handoff.Handoff`) and the per-task counts it settles
(`tasks.TaskCounts`).
"""

from __future__ import annotations

import collections
import heapq
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_
from typing import Any

from spillway.sidecar.runtime.memtune import release_memory

from ..core.model import DlqRecord
from ..core.ports import Clock, RandomSource
from ..errors import DlqError
from .handoff import Entry, Handoff, entries_of
from .producer import DeliveryFailure, KafkaDlqProducer, Outcome, ProduceRefused
from .store import RecordStore
from .tasks import TaskCounts
from .tracing import record_batch_spans

log = logging.getLogger("spillway.sidecar.dlq.pipeline")

_TRIM_AFTER_RECORDS = 10_000  # records drained before an idle drain gives memory back
# Acknowledged records are settled in the spool (one small transaction) at least this often:
# what was acknowledged but not yet settled is produced again after a crash.
SETTLE_AFTER_S = 0.05
# How long librdkafka's flush() is given to send a request's worth at once (it ignores
# linger.ms while it runs; its broker thread must wake meanwhile): the drain waits this long
# for that request's reports. Missed (a broker thread not scheduled in time), the request goes
# after linger.ms.
KICK_S = 0.01
# How long one poll waits for delivery reports while records are in flight: a barrier that
# comes meanwhile is seen by the next round (an idle round costs about 20 µs: 0.4% of a core
# while records wait on Kafka, through an outage too).
INFLIGHT_POLL_S = 0.005


_seq_of, _rec_of, _size_of = attrgetter("seq"), attrgetter("rec"), attrgetter("size")
OnAck = Callable[[str, int], None]


# What the drain hands the producer and holds until acknowledged (`producer.max.inflight.bytes`):
# a window a round trip is its top rate (1 MiB over a 25 ms acknowledgement: ~40 MB/s, ~95,000
# records of ~440 spooled bytes a second; 512 KiB held a sidecar below the rate it decides at,
# and its backlog was read back from SQLite), and about what a crash produces twice.
MAX_INFLIGHT_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class DrainSettings:
    """How much the drain reads and holds at once, settles at once, and how it backs off."""

    read_chunk: int = 5_000
    max_inflight_records: int = 20_000
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES
    delete_batch: int = 1_000
    retry_backoff_ms: int = 100
    retry_backoff_max_ms: int = 5_000
    linger_ms: float = 20


class Pending:
    """Entries taken (from the hand-off or the spool) and not yet handed to librdkafka, in seq
    order. Their tokens and records are kept as the lists the producer reads from an index:
    handing a request's worth of a large backlog over copies nothing."""

    __slots__ = ("entries", "seqs", "recs", "at")

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.seqs: list[int] = []
        self.recs: list[DlqRecord] = []
        self.at = 0   # the first not handed over

    def __len__(self) -> int:
        return len(self.entries) - self.at

    def extend(self, entries: list[Entry]) -> None:
        if self.at:   # what was handed over is let go of before more is added
            del self.entries[:self.at], self.seqs[:self.at], self.recs[:self.at]
            self.at = 0
        self.entries += entries
        self.seqs += map(_seq_of, entries)
        self.recs += map(_rec_of, entries)

    def first_seq(self) -> int:
        return self.entries[self.at].seq

    def handed(self, upto: int) -> list[Entry]:
        """Those up to index `upto` are handed over: returns them."""
        done = self.entries[self.at:upto]
        if upto >= len(self.entries):
            self.entries, self.seqs, self.recs, self.at = [], [], [], 0
        else:
            self.at = upto
        return done


class Drain:
    """The drain worker: one thread's rounds of reading, producing and settling."""

    def __init__(self, store: RecordStore, producer: KafkaDlqProducer, counts: TaskCounts,
                 handoff: Handoff, settings: DrainSettings, *, clock: Clock, rng: RandomSource,
                 on_ack: OnAck | None = None, tracer: Any = None,
                 traced: Callable[[], bool] = lambda: True) -> None:
        self._store = store
        self._producer = producer
        self._counts = counts
        self._handoff = handoff
        self._clock = clock
        self._random = rng
        self._on_ack = on_ack
        # one span per acknowledged batch, while `traced()` says they are exported (the spans'
        # links cost a little per record)
        self._tracer = tracer
        self._traced = traced
        self._chunk = max(1, settings.read_chunk)
        self._max_inflight = max(1, settings.max_inflight_records)
        self._max_inflight_bytes = max(1, settings.max_inflight_bytes)
        self._delete_batch = max(1, settings.delete_batch)
        self._backoff_s = settings.retry_backoff_ms / 1000.0
        self._backoff_max_s = settings.retry_backoff_max_ms / 1000.0
        self._linger_s = max(0, settings.linger_ms) / 1000.0

        self._wake = threading.Event()
        self.wake = self._wake.set   # a new record, a waiter: go on at once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spillway-dlq-drain",
                                        daemon=True)
        self._cursor = 0
        self._inflight: dict[int, Entry] = {}
        # taken, not yet handed to librdkafka (a request's worth is handed over at a time)
        self._pending = Pending()
        self._sent_t = -1e9   # when the last request's worth was handed over
        self._queued = 0      # records of the last request's worth, until it is sent
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

        self.last_error = ""
        self._c_requests = 0
        self._c_failures = 0
        self._c_written = 0
        self._c_retries = 0
        self._c_rejected = 0
        self._c_rebuilds = 0
        self._c_possible_dups = 0
        self._c_spool_reads = 0  # records read back from the spool

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, deadline: float) -> None:
        """Stop the rounds, close the producer without waiting past `deadline` (monotonic),
        and settle what it acknowledged meanwhile."""
        self._stop.set()
        self._wake.set()
        self._thread.join(max(2.0, deadline - self._clock.monotonic()))
        if self._thread.is_alive():  # pragma: no cover - the loop's waits are all bounded
            log.error("DLQ drain worker did not stop; closing anyway")
        else:
            self._producer.close(max(0.0, deadline - self._clock.monotonic()))
            self._handle_reports()
            self._commit_acks(force=True)

    def stats(self) -> dict[str, float]:
        """Its counters, as `DlqPipeline.stats` names them."""
        return {
            "deadletterqueue-produce-requests": float(self._c_requests),
            "deadletterqueue-produce-failures": float(self._c_failures),
            "dlq-records-written": float(self._c_written),
            "write-retries": float(self._c_retries),
            "write-successes": float(self._c_written),
            "write-failures": float(self._c_rejected),
            "in-flight-records": float(len(self._inflight)),
            "producer-rebuilds": float(self._c_rebuilds),
            "possible-duplicates": float(self._c_possible_dups),
            "spool-reads": float(self._c_spool_reads),
        }

    # -- rounds ---------------------------------------------------------------------------

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
        now = self._clock.monotonic()
        if self._producer.fatal_error is not None:
            self._rebuild(str(self._producer.fatal_error))
        produced = False
        counts = self._counts
        barrier = counts.flush_waiters > 0 or counts.task_waiters > 0
        if not self._inflight:   # librdkafka has reported on everything handed over
            if self._suspects:
                produced = self._probe_next()
            else:
                # retries due within linger.ms go together, as librdkafka's linger would send
                # them (they are due microseconds apart after a failed request)
                horizon = now + self._linger_s
                while self._retry and self._retry[0][0] <= horizon:
                    _, e = heapq.heappop(self._retry)
                    if not self._produce(e):
                        break
                    produced = True
                if self._due(now, barrier):
                    produced = self._send(now) > 0 or produced
            if produced:   # sent at once, below
                self._queued = len(self._inflight)
        elif not self._suspects and not self._queued and self._due(now, barrier):
            # the next request's worth waits in librdkafka while the last is answered (for
            # linger.ms: past it, librdkafka would poll for a chance to send it)
            self._queued = self._send(now)
            produced = self._queued > 0
        if self._queued and len(self._inflight) <= self._queued:
            # all before it is answered: it goes now (librdkafka's flush() sends without
            # waiting for linger.ms; given this long to, serving delivery reports meanwhile)
            self._queued = 0
            self._producer.flush(KICK_S)
        else:
            # returns at the first delivery report
            self._producer.poll(INFLIGHT_POLL_S if self._inflight and not produced else 0)
        self._handle_reports()
        flushing = counts.flush_waiters > 0
        self._commit_acks(force=barrier or self._stop.is_set())
        if flushing:
            self._update_done_through()
        if self._inflight or self._suspects:
            return 0.0  # (rows left over after a failed delete or reject wait for the next wake)
        if self._pending or self._more_to_read():
            # the reports came back during the wait above: the next request's worth goes now,
            # or once linger.ms has passed since the last (woken early by a barrier)
            now = self._clock.monotonic()
            return 0.0 if self._due(now, barrier) else \
                max(0.001, self._sent_t + self._linger_s - now)
        if self._cursor < self._handoff.skipped_upto and self._room() > 0:
            # skipped rows whose commit is not published yet (the writer wakes the drain
            # before it publishes): look again shortly, not in a second
            return 0.005
        if self._retry:
            return max(0.0, min(1.0, self._retry[0][0] - self._clock.monotonic()))
        self._trim_when_idle()
        return 1.0

    def _due(self, now: float, barrier: bool) -> bool:
        """Whether the next request's worth goes now: a barrier waits, the drain stops, a full
        request waits (the last was cut by its bound, or the spool holds a backlog), or
        linger.ms has passed since the last."""
        return (barrier or bool(self._pending) or self._stop.is_set()
                or self._cursor < self._handoff.skipped_upto
                or now - self._sent_t >= self._linger_s)

    def _send(self, now: float) -> int:
        """Take what is waiting (as the window allows) and hand librdkafka one request's worth
        of it, the rest kept in order for the next; returns how many it took."""
        self._pending.extend(self._read_more())
        if not self._pending:
            return 0
        self._sent_t = now
        return self._produce_new()

    def _more_to_read(self) -> bool:
        room = self._room()
        if room <= 0:
            return False
        if self._cursor < self._handoff.skipped_upto:
            return self._spool_readable(room, self._store.last_seq()) > 0
        return self._handoff.waiting()

    def _spool_readable(self, room: int, last: int) -> int:
        """How many skipped rows to read from the spool now (0: none published yet, `last`
        being the last published seq, or the window too full to be worth a read)."""
        if last <= self._cursor:
            return 0
        # as many rows as the byte budget allows (by the average size read so far); rather
        # than many small reads, wait until a quarter of the window is free again
        budget = self._max_inflight_bytes - self._held_bytes
        limit = min(self._chunk, room, budget // self._avg_size + 1)
        fit = self._max_inflight_bytes // self._avg_size + 1
        if self._inflight and limit < min(self._chunk, self._max_inflight, fit) // 4:
            return 0
        return limit

    def _trim_when_idle(self) -> None:
        """Once a large backlog has drained and the drain has been idle for a second, hand the
        freed heap back to the OS (the spool already did when it emptied; this catches what
        was freed after that: reports, librdkafka buffers)."""
        if self._written_since_trim < _TRIM_AFTER_RECORDS or self._acked_pending:
            return
        now = self._clock.monotonic()
        if self._store.depth() or self._handoff.waiting():
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
        held += len(self._acked_pending) + len(self._pending)
        if self._held_bytes >= self._max_inflight_bytes:
            return 0
        return self._max_inflight - held

    def _read_more(self) -> list[Entry]:
        """Take new rows: those the hand-off skipped (it was full, or they were recovered at
        start) from the spool, in seq order, then the ones handed over in memory."""
        room = self._room()
        budget = self._max_inflight_bytes - self._held_bytes
        if room <= 0 or budget <= 0:
            return []
        last = self._store.last_seq()  # every row up to it has been handed off or skipped
        taken, skipped, none_left = self._handoff.take(self._cursor, min(self._chunk, room),
                                                       budget)
        if none_left:
            self._cursor = max(self._cursor, last)  # rows up to `last` all taken
        if taken:
            self._cursor = taken[-1].seq
            self._held_bytes += sum(map(_size_of, taken))
            return taken
        if self._cursor < skipped:
            return self._read_spool(skipped, last)
        return []

    def _read_spool(self, skipped: int, last: int) -> list[Entry]:
        """Read skipped rows (seq <= `skipped`) from the spool, `last` being the last
        published seq. The hand-off hands over only rows past `skipped`, so nothing is taken
        twice; once the drain has read up to it, it goes back to the hand-off, whose rows are
        the next ones in seq order."""
        limit = self._spool_readable(self._room(), last)
        if limit <= 0:
            return []
        upto = min(skipped, last)  # skipped rows are committed, published once their hooks ran
        seqs, records, sizes = self._store.read_columns(self._cursor, limit, upto)
        entries = entries_of(seqs, records, sizes)
        self._c_spool_reads += len(entries)
        if entries:
            self._cursor = seqs[-1]
            self._avg_size = max(1, sum(sizes) // len(entries))
        if len(entries) < limit:
            # read to `upto`: a seq up to it that is not there never will be (an ignored
            # duplicate can use one up, a settled record is left out), so the cursor may pass it
            self._cursor = max(self._cursor, upto)
            # caught up: the hand-off takes the next commits again, and the rows skipped
            # meanwhile (after `upto`) are read in the next round
            self._handoff.caught_up()
        self._held_bytes += sum(sizes[:len(entries)])
        return entries

    def _produce_new(self) -> int:
        """Hand librdkafka one request's worth of the pending entries, in order (fewer when
        its queue stays full), the rest staying pending; returns how many it took."""
        pending = self._pending
        traced = self._tracer is not None and self._traced()
        sent_ns = time.time_ns()
        producer = self._producer
        seqs, recs, at = pending.seqs, pending.recs, pending.at
        if len(seqs) - at > producer.request_records:   # librdkafka's batch.num.messages
            end = at + producer.request_records
            seqs, recs, at = seqs[at:end], recs[at:end], 0
        n, refused = producer.produce_many(seqs, recs, start=at, max_wait_s=0.5,
                                           partitions=traced,
                                           max_bytes=producer.request_bytes)
        sent = pending.handed(pending.at + n - at)
        self._inflight.update(zip(map(_seq_of, sent), sent))
        if traced:   # the start of the records' batch span
            for e in sent:
                e.sent_ns = sent_ns
        self._c_requests += len(sent)
        if refused is not None:  # refused synchronously (e.g. too large): filed alone
            e = pending.handed(pending.at + 1)[0]
            self._c_requests += 1
            self._on_failure(e, refused.failure, refused_alone=True)
        return len(sent)

    def _produce(self, e: Entry, *, solo: bool = False) -> bool:
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
        """Produce one suspect alone: nothing else queued in librdkafka, nothing else sent (the
        caller has it sent at once, as any request's worth)."""
        if self._probe is not None or self._producer.outstanding():
            return False
        e = self._suspects.popleft()
        self._probe = e.seq
        if not self._produce(e, solo=True):
            self._probe = None
            return False
        if e.seq not in self._inflight:  # refused synchronously: already re-filed
            self._probe = None
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
        if not acked_seqs:
            return
        # batch operations, no Python step per record (the common case: every report is for
        # a record in flight, none is followed by another task, none was recovered)
        acked = list(map(inflight.pop, acked_seqs, repeat(None)))
        if any(map(is_, acked, repeat(None))):   # reports of a rebuilt producer: dropped
            keep = [k for k, e in enumerate(acked) if e is not None]
            acked = [acked[k] for k in keep]
            acked_seqs = [acked_seqs[k] for k in keep]
            acked_partitions = [acked_partitions[k] for k in keep]
            if not acked:
                return
        if probe is not None and probe in acked_seqs:
            self._probe = None
        if self._tracer is not None and self._traced():
            record_batch_spans(self._tracer, acked, acked_partitions)
        per_job = self._counts.acked(acked, acked_seqs)
        self._held_bytes -= sum(map(_size_of, acked))
        if not self._acked_pending:
            self._first_ack_t = self._clock.monotonic()
        self._acked_pending += acked_seqs
        self._c_written += len(acked)
        self._written_since_trim += len(acked)
        if self._on_ack is not None:
            for job, n in per_job.items():
                try:
                    self._on_ack(job, n)
                except Exception:
                    log.exception("DLQ on_ack hook failed")

    def _on_failure(self, e: Entry, f: DeliveryFailure, *, refused_alone: bool) -> None:
        """File a failed entry: retry heap, suspects, or the rejected table."""
        self._c_failures += 1
        self.last_error = str(f)
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

    def _reject(self, e: Entry, f: DeliveryFailure) -> None:
        reason = f"{f.name}: {f.message}"
        self._counts.rejected(e, reason)
        self._rejects.append((e.seq, reason))
        self._held_bytes -= e.size
        self._c_rejected += 1
        log.error("DLQ record %s of job %s (topic %s) can never be written to Kafka (%s): moved to "
                  "the spool's rejected table, not retried", e.rec.record_id, e.rec.job,
                  e.rec.topic, f)

    def _commit_acks(self, *, force: bool) -> None:
        if self._rejects:
            rejects, self._rejects = self._rejects, []
            try:
                self._store.reject(rejects, self._clock.wall_ms())
            except DlqError:
                log.exception("moving rejected DLQ records failed; will try again")
                self._rejects = rejects + self._rejects
            else:
                self._counts.moved(rejects)
        if not self._acked_pending:
            self._counts.all_settled()   # every acknowledgement is settled
            return
        if not (force or len(self._acked_pending) >= self._delete_batch
                or not (self._inflight or self._pending or self._handoff.waiting())
                or self._clock.monotonic() - self._first_ack_t >= SETTLE_AFTER_S):
            return
        seqs, self._acked_pending = self._acked_pending, []
        gen = self._counts.ack_gen   # every acknowledgement up to it is in seqs (this thread's)
        try:
            self._store.delete(seqs)
        except DlqError:
            log.exception("deleting acknowledged DLQ records from the spool failed; will retry")
            self._acked_pending = seqs + self._acked_pending
            return
        self._counts.settled(seqs, gen)   # flush barriers wait for their records to be settled

    def _update_done_through(self) -> None:
        # Everything at or below the cursor that the drain no longer holds is acknowledged or
        # rejected; rows past the cursor are not read yet.
        low = self._cursor + 1
        if self._inflight:
            low = min(low, min(self._inflight))
        if self._pending:
            low = min(low, self._pending.first_seq())
        if self._retry:
            low = min(low, min(e.seq for _, e in self._retry))
        if self._suspects:
            low = min(low, min(e.seq for e in self._suspects))
        self._counts.set_done_through(low - 1)

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
        self._queued = 0
        self._probe = None
