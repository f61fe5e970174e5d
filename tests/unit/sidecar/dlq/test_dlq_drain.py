"""The drain's bookkeeping with a fake librdkafka producer (the `producer_factory` seam): which
task barrier waits for which record, records reported twice, recovered rows, rejections, and the
error table."""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import KafkaError
from spillway.sidecar.core.model import DlqRecord
from spillway.sidecar.dlq import DlqPipeline, Outcome, Spool, classify
from spillway.sidecar.dlq.drain import Drain
from spillway.sidecar.errors import DlqError, FlushTimeoutError


class FakeProducer:
    """Accepts produce(); delivers on poll() while `open` is set, with `errors[value]` (a list of
    codes consumed one per attempt) or success."""

    def __init__(self, conf: dict) -> None:
        self.conf = conf
        self.open = threading.Event()
        self.open.set()
        self.queue: list[tuple[bytes, object]] = []
        self.errors: dict[bytes, list[int]] = {}
        self.delivered: list[bytes] = []
        self.per_poll: int | None = None   # at most this many deliveries per poll (a slow Kafka)

    # confluent-kafka's signature, which the pipeline calls by position
    def produce(self, topic, value=None, key=None, partition=-1, callback=None,
                on_delivery=None, timestamp=0, headers=None):
        assert partition == -1 and timestamp == 0 and on_delivery is None
        assert headers is None or type(headers) is list
        self.queue.append((value, callback))

    def poll(self, timeout=0):
        if not self.open.is_set():
            self.open.wait(min(timeout, 0.05))
            return 0
        n = len(self.queue) if self.per_poll is None else self.per_poll
        queue, self.queue = self.queue[:n], self.queue[n:]
        if self.per_poll is not None:
            time.sleep(0.001)
        for value, cb in queue:
            codes = self.errors.get(value)
            if codes:
                cb(KafkaError(codes.pop(0)), None)
            else:
                self.delivered.append(value)
                cb(None, None)
        return len(queue)

    def flush(self, timeout=0):
        self.poll(timeout)
        return len(self.queue)

    def purge(self, **kw):
        self.queue.clear()

    def close(self):
        return True

    def __len__(self):
        return len(self.queue)


@pytest.fixture
def fake():
    made: list[FakeProducer] = []

    def factory(conf: dict) -> FakeProducer:
        p = FakeProducer(conf)
        if made:  # a rebuilt producer inherits the script
            p.errors = made[-1].errors
            p.delivered = made[-1].delivered
        made.append(p)
        return p

    factory.made = made  # type: ignore[attr-defined]
    return factory


@pytest.fixture
def pipeline(fake, tmp_path):
    started: list[DlqPipeline] = []

    def make(**kw) -> DlqPipeline:
        p = DlqPipeline("fake:9092", spool_dir=str(tmp_path), producer_factory=fake,
                        retry_backoff_ms=1, retry_backoff_max_ms=5, **kw).start()
        started.append(p)
        return p

    yield make
    for p in started:
        p.shutdown(1.0)


def rec(rid: str, tk: str) -> DlqRecord:
    return DlqRecord(topic="dlq.t", key=None, value=rid.encode(), headers=(), record_id=rid,
                     job="job", task_key=tk)


def test_the_producer_is_built_lazily_and_idempotent(fake, pipeline):
    p = pipeline()
    assert fake.made == []
    p.submit([rec("a", "t1")])
    assert p.wait_task("t1", 5) == 1
    (prod,) = fake.made
    assert prod.conf["enable.idempotence"] is True and prod.conf["acks"] == "all"
    assert prod.conf["allow.auto.create.topics"] is False


def test_a_record_reported_again_by_another_attempt_is_waited_for_by_both(fake, pipeline):
    p = pipeline()
    p.submit([rec("warm", "t0")])
    assert p.wait_task("t0", 5) == 1
    prod = fake.made[0]
    prod.open.clear()  # Kafka holds its acknowledgements
    p.submit([rec("a", "t1"), rec("b", "t1")])
    p.submit([rec("b", "t2")])  # a retried task attempt reports b again
    with pytest.raises(FlushTimeoutError):
        p.wait_task("t2", 0.2)
    prod.open.set()
    assert p.wait_task("t1", 5) == 2
    assert p.wait_task("t2", 5) == 1
    assert prod.delivered.count(b"b") == 1  # spooled and produced once


def test_the_same_task_reporting_a_record_twice_does_not_hang_its_barrier(fake, pipeline):
    p = pipeline()
    p.submit([rec("warm", "t0")])
    assert p.wait_task("t0", 5) == 1
    fake.made[0].open.clear()  # still spooled when reported again
    p.submit([rec("a", "t1"), rec("a", "t1")])
    p.submit([rec("a", "t1")])
    fake.made[0].open.set()
    assert p.wait_task("t1", 5) == 1
    assert fake.made[0].delivered.count(b"a") == 1
    # the ignored duplicate used up a seq: flushing must not wait for a row that never exists
    # (waiting for it would use up the whole timeout: 10 s, then False; a busy machine's
    # scheduling fits well within half of it)
    t0 = time.monotonic()
    assert p.force_flush(10)
    assert time.monotonic() - t0 < 5


def test_rows_recovered_from_an_earlier_process_drain_and_can_be_waited_for(fake, tmp_path):
    old = Spool(str(tmp_path), max_bytes=1_000_000, max_records=1_000)
    old.append([rec("x", "dead-task"), rec("y", "dead-task")])
    old.close()
    p = DlqPipeline("fake:9092", spool_dir=str(tmp_path), producer_factory=fake)
    fake_open = threading.Event()

    def held(conf):
        prod = fake(conf)
        prod.open = fake_open
        return prod

    p._producer._factory = held  # hold acknowledgements until the new task has reported
    p.start()
    try:
        p.submit([rec("y", "new-task"), rec("z", "new-task")])  # y: already spooled
        fake_open.set()
        assert p.wait_task("new-task", 5) == 2
        assert p.force_flush(5)
        assert p.wait_task("dead-task", 0) == 0  # an earlier process's task is not tracked
        assert sorted(fake.made[0].delivered) == [b"x", b"y", b"z"]
    finally:
        p.shutdown(1.0)


def test_a_rejected_record_fails_its_barrier_and_is_never_produced_again(fake, pipeline):
    p = pipeline()
    p.submit([rec("warm", "t0")])
    p.wait_task("t0", 5)
    fake.made[0].errors[b"bad"] = [KafkaError.MSG_SIZE_TOO_LARGE] * 5
    p.submit([rec("ok", "t1"), rec("bad", "t1")])
    with pytest.raises(DlqError, match="1 DLQ record\\(s\\) of task t1 can never be written to "
                                       "Kafka \\(MSG_SIZE_TOO_LARGE"):
        p.wait_task("t1", 5)
    assert p.force_flush(5)
    # one failure in the batch, one alone: then set aside (3 scripted errors remain unused)
    assert fake.made[0].errors[b"bad"] == [KafkaError.MSG_SIZE_TOO_LARGE] * 3
    stats = p.stats()
    assert stats["rejected-records"] == 1 and stats["write-failures"] == 1
    assert stats["deadletterqueue-produce-failures"] == 2


def test_retriable_failures_are_retried_and_counted(fake, pipeline):
    p = pipeline()
    p.submit([rec("warm", "t0")])
    p.wait_task("t0", 5)
    fake.made[0].errors[b"a"] = [KafkaError._MSG_TIMED_OUT, KafkaError.NOT_LEADER_FOR_PARTITION]
    p.submit([rec("a", "t1")])
    assert p.wait_task("t1", 5) == 1
    stats = p.stats()
    assert stats["write-retries"] == 2
    assert stats["deadletterqueue-produce-failures"] == 2
    assert stats["possible-duplicates"] == 1  # the timeout may have been written


def test_a_fatal_delivery_error_rebuilds_the_producer(fake, pipeline):
    p = pipeline()
    p.submit([rec("warm", "t0")])
    p.wait_task("t0", 5)
    fake.made[0].errors[b"a"] = [KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER]
    p.submit([rec("a", "t1")])
    assert p.wait_task("t1", 5) == 1
    assert len(fake.made) == 2
    assert p.stats()["producer-rebuilds"] == 1


def test_on_ack_reports_per_job(fake, pipeline):
    seen: list[tuple[str, int]] = []
    p = pipeline(on_ack=lambda job, n: seen.append((job, n)))
    p.submit([rec("a", "t1"), rec("b", "t1")])
    p.wait_task("t1", 5)
    assert sum(n for job, n in seen if job == "job") == 2


def test_submit_after_shutdown_is_refused(fake, pipeline):
    p = pipeline()
    p.shutdown(1.0)
    with pytest.raises(DlqError, match="shutting down"):
        p.submit([rec("a", "t1")])


@pytest.mark.parametrize("code,outcome,category,persisted", [
    (KafkaError.MSG_SIZE_TOO_LARGE, Outcome.REJECT, "invalid-configuration", False),
    (KafkaError.INVALID_RECORD, Outcome.REJECT, "invalid-configuration", False),
    (KafkaError._MSG_TIMED_OUT, Outcome.RETRY, "retriable", True),
    (KafkaError.NOT_ENOUGH_REPLICAS, Outcome.RETRY, "retriable", False),
    (KafkaError.NOT_LEADER_FOR_PARTITION, Outcome.RETRY, "refresh-retriable", False),
    (KafkaError.UNKNOWN_TOPIC_OR_PART, Outcome.RETRY, "refresh-retriable", False),
    (KafkaError.TOPIC_AUTHORIZATION_FAILED, Outcome.RETRY, "invalid-configuration", False),
    (KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, Outcome.REBUILD, "application-recoverable", False),
    (KafkaError._FATAL, Outcome.REBUILD, "application-recoverable", True),
])
def test_classification_table(code, outcome, category, persisted):
    f = classify(KafkaError(code))
    assert (f.outcome, f.category, f.possibly_persisted) == (outcome, category, persisted)


def test_fatal_flag_wins_over_the_code():
    f = classify(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, fatal=True))
    assert f.outcome is Outcome.REBUILD
    f = classify(KafkaError(KafkaError.INVALID_MSG, txn_requires_abort=True))
    assert (f.outcome, f.category) == (Outcome.REBUILD, "abortable")


def test_committed_records_reach_the_producer_from_memory_without_reading_the_spool(
        fake, pipeline):
    p = pipeline()
    # at start the drain reads the spool (recovered rows) until it has caught up once: a
    # record committed before that first read comes from the spool, rightly; so warm up first
    p.submit([rec("warm", "t0")])
    assert p.wait_task("t0", 5) == 1
    _wait_for(lambda: not p._handoff._overflow)
    before = p.stats()["spool-reads"]
    for i in range(0, 300, 50):
        p.submit([rec(f"r{j}", "t1") for j in range(i, i + 50)])
    assert p.wait_task("t1", 5) == 300
    assert [v for v in fake.made[0].delivered if v != b"warm"] == [
        f"r{j}".encode() for j in range(300)]
    stats = p.stats()
    assert stats["spool-reads"] == before and stats["handoff-overflows"] == 0
    _wait_for(lambda: p.stats()["spool-depth"] == 0)  # acknowledged rows are deleted


# a durable spool's commits wait as spooled bytes (bounded by bytes); without a spool they
# wait as objects (bounded by records too)
@pytest.mark.parametrize("bound", [{"handoff_bytes": 2_000},
                                   {"handoff_records": 30, "spool_enable": False}],
                         ids=["bytes", "records"])
def test_a_full_hand_off_falls_back_to_the_spool_in_order_then_resumes(fake, pipeline, bound):
    p = pipeline(max_inflight_bytes=3_000, **bound)
    p.submit([rec("warm", "t0")])
    assert p.wait_task("t0", 5) == 1
    prod = fake.made[0]
    prod.open.clear()  # Kafka stops acknowledging: in flight fills, then the hand-off
    p.submit([rec(f"r{j:03d}", "t1") for j in range(20)])
    # the drain takes the first ones from memory before the flood (on a loaded machine it may
    # not run between the submits below, and the overflow would then let go of all of them)
    _wait_for(lambda: p.stats()["in-flight-records"] > 0)
    for i in range(20, 400, 20):
        p.submit([rec(f"r{j:03d}", "t1") for j in range(i, i + 20)])
    assert p.stats()["handoff-overflows"] >= 1
    prod.open.set()
    assert p.wait_task("t1", 5) == 400
    assert p.force_flush(5)
    delivered = [v for v in prod.delivered if v != b"warm"]
    assert sorted(delivered) == [f"r{j:03d}".encode() for j in range(400)]  # no loss, no dup
    assert delivered == sorted(delivered)  # in seq order
    reads = p.stats()["spool-reads"]
    assert 0 < reads < 400
    # caught up: new records come from memory again
    p.submit([rec("after", "t2")])
    assert p.wait_task("t2", 5) == 1
    assert p.stats()["spool-reads"] == reads
    _wait_for(lambda: p.stats()["spool-depth"] == 0)


def test_the_hand_off_resumes_though_a_commit_lands_during_every_read_back(fake, pipeline):
    # A drain that has read the spool to its end takes the next commits from memory again,
    # even when a new commit lands while it reads (a steady load): it used to wait for a read
    # with no commit at all meanwhile, and until then read every later record back from SQLite.
    p = pipeline(max_inflight_bytes=3_000, handoff_bytes=2_000)
    p.submit([rec("warm", "t0")])
    assert p.wait_task("t0", 5) == 1
    prod = fake.made[0]
    prod.open.clear()
    for i in range(0, 200, 20):
        p.submit([rec(f"a{j:03d}", "t1") for j in range(i, i + 20)])
    assert p.stats()["handoff-overflows"] >= 1
    store = p._store
    read_batch = store.read_batch
    raced = [0]

    def read_while_committing(*args, **kw):
        rows = read_batch(*args, **kw)
        if raced[0] < 100:   # a writer commits while the drain reads
            raced[0] += 1
            p.submit([rec(f"b{raced[0]:03d}", "t2")])
        return rows

    store.read_batch = read_while_committing
    prod.open.set()
    assert p.wait_task("t1", 5) == 200
    for i in range(100):    # what the racing commits did not send, to a known end
        p.submit([rec(f"c{i:03d}", "t3")])
    assert p.wait_task("t3", 5) == 100
    store.read_batch = read_batch
    assert p.force_flush(5)
    assert p.wait_task("t2", 5) == raced[0]
    delivered = [v for v in prod.delivered if v != b"warm"]
    assert len(delivered) == len(set(delivered))   # none twice
    assert set(delivered) >= {f"a{j:03d}".encode() for j in range(200)} | {
        f"c{i:03d}".encode() for i in range(100)}
    # read back: what overflowed (at most 200) and a commit or two that raced the last reads;
    # not the 100 records committed after it had caught up
    assert p.stats()["spool-reads"] <= 205


def test_skipped_rows_not_yet_published_are_looked_for_again_shortly(fake, pipeline):
    # The writer wakes the drain from its commit hook, before it publishes the commit's last
    # seq: a drain that ran in between finds skipped rows it cannot read yet, and must look
    # again in milliseconds rather than idle for a second.
    p = pipeline()
    p.submit([rec("warm", "t0")])
    assert p.wait_task("t0", 5) == 1
    drain = p._drain
    drain._stop.set()
    drain._wake.set()
    drain._thread.join(5)   # the rounds are run by hand below
    last = p._store.last_seq()
    p._handoff.skipped_upto = last + 3  # skipped by a commit whose seq is not published yet
    assert drain._step() == pytest.approx(0.005)
    p._handoff.skipped_upto = last      # nothing skipped left: idle
    assert drain._step() == 1.0


def _wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_a_reject_inside_a_batch_settles_only_that_record(fake, pipeline):
    p = pipeline()
    p.submit([rec("warm", "t0")])
    p.wait_task("t0", 5)
    fake.made[0].errors[b"bad"] = [KafkaError.INVALID_RECORD] * 2
    p.submit([rec("a", "t1"), rec("bad", "t1"), rec("b", "t1")])
    with pytest.raises(DlqError, match="INVALID_RECORD"):
        p.wait_task("t1", 5)
    assert p.force_flush(5)
    assert sorted(v for v in fake.made[0].delivered if v != b"warm") == [b"a", b"b"]
    _wait_for(lambda: p.stats()["spool-depth"] == 0)  # the batch row is gone
    assert p.stats()["rejected-records"] == 1
    assert [r.record.record_id for r in p.store.rejected()] == ["bad"]


def test_a_backlog_read_back_from_the_spool_never_idles_between_windows(tmp_path, monkeypatch):
    # A window's reports can all come back inside the round that filled it; the drain must
    # then read on, not idle a second per window (a 1M-record outage took ~50 min to drain).
    old = Spool(str(tmp_path), max_bytes=10_000_000, max_records=10_000)
    old.append([rec(f"r{i}", "dead-task") for i in range(300)])
    old.close()

    class Lagging(FakeProducer):
        """Delivers a record at the second poll after its produce(), as a real broker's
        acknowledgements arrive a round after the window was sent."""

        def __init__(self, conf: dict) -> None:
            super().__init__(conf)
            self.waiting: list = []

        def poll(self, timeout=0):
            fresh, self.queue = self.queue, self.waiting
            self.waiting = fresh
            return super().poll(timeout)

        def __len__(self):
            return len(self.queue) + len(self.waiting)

    made: list[Lagging] = []

    def lagging(conf: dict) -> Lagging:
        made.append(Lagging(conf))
        return made[-1]

    p = DlqPipeline("fake:9092", spool_dir=str(tmp_path), producer_factory=lagging,
                    max_inflight_records=10)
    idled_with_backlog: list[int] = []
    step = Drain._step

    def watched(drain: Drain) -> float:
        pause = step(drain)
        if pause >= 1.0 and p.store is not None and p.store.depth():
            idled_with_backlog.append(p.store.depth())
        return pause

    monkeypatch.setattr(Drain, "_step", watched)   # the drain is built at start()
    p.start()
    try:
        _wait_for(lambda: p.store is not None and p.store.depth() == 0, 60.0)
        assert idled_with_backlog == []
        assert sorted(made[0].delivered) == sorted(f"r{i}".encode() for i in range(300))
    finally:
        p.shutdown(1.0)


def test_a_flush_barrier_returns_only_once_its_records_are_settled_in_the_spool(fake, pipeline):
    """A sidecar killed right after a task's flush returned must not produce its records again
    after a restart: the barrier waits for the acknowledgements to be settled, not only
    received (the e2e kill -9 test saw every record twice when the kill won that race)."""
    p = pipeline()
    p.submit([rec("warm", "t0")])
    assert p.wait_task("t0", 5) == 1
    store = p._store
    real_delete = store.delete
    release = threading.Event()
    deleting = threading.Event()

    def slow_delete(seqs):
        deleting.set()
        release.wait(5)
        return real_delete(seqs)

    store.delete = slow_delete
    p.submit([rec(f"r{i}", "t1") for i in range(20)])
    done: list[int] = []
    waiter = threading.Thread(target=lambda: done.append(p.wait_task("t1", 5)))
    waiter.start()
    assert deleting.wait(5)                 # acknowledged by Kafka, settling held back
    time.sleep(0.2)
    assert done == []                       # so the barrier has not returned
    release.set()
    waiter.join(5)
    assert done == [20]
    assert p.stats()["spool-depth"] == 0    # settled when it returned


def test_a_waiting_flush_barrier_has_the_drain_send_what_lingers(tmp_path):
    """librdkafka holds records for linger.ms; a task's flush barrier should not wait for it:
    while one waits, the drain calls the producer's flush(), which sends them at once. This
    fake delivers only inside flush(), as a producer whose linger never ends would."""

    class Lingering(FakeProducer):
        flushes = 0

        def poll(self, timeout=0):
            time.sleep(min(timeout, 0.01))
            return 0

        def flush(self, timeout=0):
            Lingering.flushes += 1
            return FakeProducer.poll(self, timeout) and len(self.queue)

    p = DlqPipeline("fake:9092", spool_dir=str(tmp_path), producer_factory=Lingering).start()
    try:
        p.submit([rec(f"r{i}", "t1") for i in range(10)])
        assert p.wait_task("t1", 5) == 10      # never delivered without the barrier's flush()
        assert Lingering.flushes >= 1 and p.stats()["spool-depth"] == 0
    finally:
        p.shutdown(1.0)


def test_an_ended_runs_settled_task_counts_are_forgotten_and_wait_run_sees_only_its_run(
        fake, pipeline):
    p = pipeline()
    p.submit([rec("a", "job/r1/1.0.0/7"), rec("b", "job/r1/1.1.0/8")])
    p.submit([rec("c", "job/r10/1.0.0/9")])  # a run whose key starts like r1's
    assert p.wait_task("job/r1/1.0.0/7", 5) == 1 and p.wait_task("job/r10/1.0.0/9", 5) == 1
    fake.made[0].open.clear()  # Kafka holds r10's next record
    p.submit([rec("d", "job/r10/1.0.0/10")])
    assert p.wait_run("job/r1/", 0.2) == 0
    assert p.wait_run("job/r10/", 0.2) == 1
    p.forget_run("job/r1/")
    p.forget_run("job/r10/")  # one task still pending: it keeps its count
    assert p.wait_task("job/r1/1.0.0/7", 1) == 0  # forgotten
    assert p.wait_task("job/r10/1.0.0/9", 1) == 0
    assert set(p._counts._tasks) == {"job/r10/1.0.0/10"}
    assert set(p._counts._run_tasks) == {"job/r10/"}
    fake.made[0].open.set()
    assert p.wait_task("job/r10/1.0.0/10", 5) == 1
    p.forget_run("job/r10/")
    assert not p._counts._tasks and not p._counts._run_tasks


def test_evicted_task_counts_leave_the_run_index_too(fake, pipeline, monkeypatch):
    import spillway.sidecar.dlq.tasks as tasks_mod
    monkeypatch.setattr(tasks_mod, "_TASKS_KEPT", 2)
    p = pipeline()
    for i in range(5):
        p.submit([rec(f"r{i}", f"job/run{i}/1.0.0/{i}")])
        assert p.wait_task(f"job/run{i}/1.0.0/{i}", 5) == 1
    p.submit([rec("x", "job/run9/1.0.0/9")])  # the next registration evicts the oldest
    assert len(p._counts._tasks) == 2
    assert set(p._counts._run_tasks) == {"job/run4/", "job/run9/"}


def test_a_delivery_report_asks_its_partition_only_when_the_batch_spans_need_it():
    from spillway.sidecar.dlq.producer import KafkaDlqProducer, producer_config

    asked = []

    class Msg:
        def partition(self):
            asked.append(1)
            return 3

    class Placing(FakeProducer):
        def poll(self, timeout=0):
            queue, self.queue = self.queue, []
            for _, cb in queue:
                cb(None, Msg())
            return len(queue)

    prod = KafkaDlqProducer(producer_config("fake:9092", linger_ms=5, batch_size=1000),
                            factory=Placing)
    assert prod.produce_many([1, 2], [rec("a", "t"), rec("b", "t")], partitions=False) \
        == (2, None)
    prod.poll(0)
    assert prod.take_reports() == ([1, 2], [-1, -1], []) and not asked
    prod.produce_many([3], [rec("c", "t")])   # (the drain asks while spans are exported)
    prod.poll(0)
    assert prod.take_reports() == ([3], [3], []) and asked == [1]


def test_the_drain_hands_librdkafka_one_requests_worth_and_queues_one_more_at_most(tmp_path):
    """librdkafka's idempotent producer sends a partition's next request only once the last is
    answered, and polls without sleeping while records it could send wait: the drain hands it a
    request's worth (batch.size) at a time, with at most the next one waiting behind it."""
    most = [0]

    class Holding(FakeProducer):
        def produce(self, *args, **kw):
            super().produce(*args, **kw)
            most[0] = max(most[0], len(self.queue))

    made: list[Holding] = []

    def factory(conf: dict) -> Holding:
        made.append(Holding(conf))
        made[-1].open.clear()   # Kafka answers nothing until the test says so
        return made[-1]

    # request_bounds: 10,000 - 4,096 bytes a request; a 1,000-byte record is 1,056 of them (its
    # value, the 36 bytes librdkafka's bound adds, and its header's 10 + 10 + 0): 5 a request
    p = DlqPipeline("fake:9092", spool_dir=str(tmp_path), producer_factory=factory,
                    producer_overrides={"batch.size": 10_000}).start()
    try:
        p.submit([DlqRecord(topic="dlq.t", key=None, value=b"v" * 1000,
                            headers=(("spillway.x", None),), record_id=f"r{i}", job="job",
                            task_key="t1") for i in range(40)])
        deadline = time.monotonic() + 5
        while most[0] < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)   # the drain goes round while nothing is answered: nothing more handed
        assert most[0] == 10 and len(made[-1].queue) == 10
        made[-1].open.set()
        assert p.wait_task("t1", 5) == 40
        assert most[0] == 10 and sorted(made[-1].delivered) == [b"v" * 1000] * 40
    finally:
        p.shutdown(1.0)


def test_pending_entries_are_handed_over_from_an_index_and_let_go_of_once_handed():
    from spillway.sidecar.dlq.drain import Pending
    from spillway.sidecar.dlq.handoff import Entry

    entries = [Entry(seq, rec(f"r{seq}", "t"), 10) for seq in range(1, 6)]
    p = Pending()
    p.extend(entries[:3])
    assert len(p) == 3 and p.first_seq() == 1 and p.seqs == [1, 2, 3]
    assert p.handed(2) == entries[:2] and len(p) == 1 and p.first_seq() == 3
    p.extend(entries[3:])   # what was handed over is let go of first
    assert p.seqs == [3, 4, 5] and p.recs == [e.rec for e in entries[2:]] and p.at == 0
    assert p.handed(3) == entries[2:] and len(p) == 0 and p.entries == [] and p.seqs == []


@pytest.mark.parametrize("conf, bounds", [
    ({}, (1_000_000 - 4096, 10_000)),
    ({"batch.size": 200_000, "batch.num.messages": "500"}, (200_000 - 4096, 500)),
    ({"batch.size": 5_000_000, "message.max.bytes": 2_000_000}, (2_000_000 - 4096, 10_000)),
    ({"batch.size": "not a number"}, (1_000_000 - 4096, 10_000)),
    ({"batch.size": 100}, (1, 10_000)),
])
def test_one_produce_requests_worth_follows_librdkafkas_settings(conf, bounds):
    from spillway.sidecar.dlq.producer import request_bounds
    assert request_bounds(conf) == bounds


@pytest.mark.parametrize("conf, ms", [
    ({}, 5.0), ({"linger.ms": 20}, 20.0), ({"queue.buffering.max.ms": "7"}, 7.0),
    ({"linger.ms": 20, "queue.buffering.max.ms": 3}, 3.0),   # an alias: the last set wins
    ({"linger.ms": "soon"}, 5.0),
])
def test_the_drains_linger_is_the_producers(conf, ms):
    from spillway.sidecar.dlq.producer import linger_of
    assert linger_of(conf) == ms


def test_a_records_bound_in_a_request_counts_its_key_value_and_headers():
    from spillway.sidecar.dlq.producer import wire_size
    r = DlqRecord(topic="t", key="ké", value=b"v" * 100,
                  headers=(("a", b"xy"), ("b", None), ("c", "é")), record_id="r", job="j",
                  task_key="t")
    assert wire_size(r) == 36 + 3 + 100 + (10 + 1 + 2) + (10 + 1) + (10 + 1 + 2)
