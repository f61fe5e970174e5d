"""A broker outage (Tansu frozen with SIGSTOP, its data kept) during a burst: submit() keeps
answering from the spool, barriers answer after the outage or fail at their deadline, retries are
counted, and once the broker is back every record lands."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from spillway.sidecar.core.model import DlqRecord
from spillway.sidecar.dlq import DlqPipeline
from spillway.sidecar.errors import FlushTimeoutError
from spillway.sidecar.runtime.embedded import EmbeddedBroker
from support.kafka import create_topic, read_all

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OUTAGE_S = 10.5


@pytest.fixture
def own_broker(tmp_path):
    b = EmbeddedBroker(log_path=str(tmp_path / "tansu.log")).start()
    yield b
    b.resume()
    b.stop()


def batch(topic: str, start: int, n: int, tk: str) -> list[DlqRecord]:
    return [DlqRecord(topic=topic, key=None, value=b"y" * 200,
                      headers=(("spillway.record.id", str(i).encode()),), record_id=str(i),
                      job="outage", task_key=tk) for i in range(start, start + n)]


def test_broker_paused_during_a_burst(own_broker, tmp_path):
    bootstrap = own_broker.bootstrap_servers
    topic = "dlq.outage"
    create_topic(bootstrap, topic)
    p = DlqPipeline(bootstrap, spool_dir=str(tmp_path / "spool"),
                    producer_overrides={"message.timeout.ms": "2000"},
                    retry_backoff_max_ms=1000).start()
    try:
        total, size = 0, 200
        for _ in range(20):  # before the outage
            p.submit(batch(topic, total, size, "outage/0.0.0/1"))
            total += size
        assert p.wait_task("outage/0.0.0/1", 30) == total

        own_broker.pause()
        paused_at = time.monotonic()
        during_start = total
        for _ in range(50):  # the burst goes on: the spool takes it
            p.submit(batch(topic, total, size, "outage/0.0.0/2"))
            total += size
        # every submit returned while Kafka could acknowledge none of the burst: submit() answers
        # from the spool, it never waits for the broker (a count, not a clock: no flake on a
        # loaded machine)
        burst = p.stats()
        assert burst["spool-depth"] >= total - during_start
        long_wait: dict[str, object] = {}

        def waiter() -> None:
            try:
                long_wait["acked"] = p.wait_task("outage/0.0.0/2", 60)
            except Exception as exc:  # pragma: no cover - reported by the assertion below
                long_wait["error"] = exc
            long_wait["at"] = time.monotonic()

        t = threading.Thread(target=waiter)
        t.start()
        t0 = time.monotonic()
        with pytest.raises(FlushTimeoutError, match="not acknowledged by Kafka within 3s"):
            p.wait_task("outage/0.0.0/2", 3.0)
        # fails at its deadline, not before; never waits for the broker (which stays paused
        # until this thread resumes it: a wait past the deadline would hang the test; the upper
        # bound only leaves room for a busy machine's scheduling)
        assert 3.0 <= time.monotonic() - t0 < 3.0 + 5.0

        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - paused_at)))
        during = p.stats()
        assert during["spool-depth"] >= total - during_start
        assert during["deadletterqueue-produce-failures"] > 0
        assert during["write-retries"] > 0
        own_broker.resume()
        resumed_at = time.monotonic()

        t.join(60)
        assert long_wait.get("acked") == total - during_start, long_wait
        assert long_wait["at"] >= resumed_at  # answered after the outage, not before
        assert p.force_flush(60)
        stats = p.stats()
    finally:
        p.shutdown(10)

    seen = Counter(int(dict(m.headers())["spillway.record.id"])
                   for m in read_all(bootstrap, topic, idle_s=2.0))
    assert set(seen) == set(range(total))  # zero lost
    duplicates = sum(n - 1 for n in seen.values())
    assert duplicates <= stats["possible-duplicates"]
    assert stats["dlq-records-written"] >= total
    assert stats["spool-depth"] == 0
    print(f"\n{total} records, outage {OUTAGE_S}s: produce failures "
          f"{stats['deadletterqueue-produce-failures']:.0f}, retries "
          f"{stats['write-retries']:.0f}, duplicates {duplicates}, "
          f"recovered {time.monotonic() - resumed_at:.1f}s after resume; {stats}")
