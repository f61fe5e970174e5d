"""kill -9 of a process running the pipeline during a burst, then a restart over the same spool
directory: every record whose submit() returned is in the DLQ topic; duplicates are bounded by
what was in flight."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter

import pytest
from spillway.sidecar.dlq import DlqPipeline
from support.kafka import create_topic, read_all

pytestmark = pytest.mark.integration

MAX_INFLIGHT = 2_000  # produced-but-not-deleted records: the duplicate bound after a crash

WRITER = textwrap.dedent("""
    import sys, time
    from spillway.sidecar.core.model import DlqRecord
    from spillway.sidecar.dlq import DlqPipeline

    bootstrap, spool_dir, topic, total, batch, inflight = sys.argv[1:7]
    total, batch, inflight = int(total), int(batch), int(inflight)
    p = DlqPipeline(bootstrap, spool_dir=spool_dir, max_inflight_records=inflight,
                    delete_batch=inflight // 2, linger_ms=5).start()
    out = sys.stdout
    for start in range(0, total, batch):
        end = min(total, start + batch)
        p.submit([DlqRecord(topic=topic, key=None, value=b"x" * 100,
                            headers=(("spillway.record.id", str(i).encode()),),
                            record_id=str(i), job="crash", task_key="crash/0.0.0/1")
                  for i in range(start, end)])
        out.write(f"ACK {start} {end}\\n")
        out.flush()
    out.write("DONE\\n")
    out.flush()
    time.sleep(600)
""")


def crash_and_recover(bootstrap: str, topic: str, spool_dir: str, total: int, kill_after: int):
    create_topic(bootstrap, topic)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, bootstrap, spool_dir, topic, str(total), "100",
         str(MAX_INFLIGHT)], stdout=subprocess.PIPE, text=True)
    acked: set[int] = set()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("ACK"):
                _, a, b = line.split()
                acked.update(range(int(a), int(b)))
            if len(acked) >= kill_after or line.startswith("DONE"):
                break
        os.kill(proc.pid, signal.SIGKILL)  # mid-burst: submits and the drain both running
        for line in proc.stdout:  # lines fully written before the kill
            if line.startswith("ACK"):
                _, a, b = line.split()
                acked.update(range(int(a), int(b)))
    finally:
        proc.kill()
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    assert kill_after <= len(acked) < total  # killed during the burst

    p = DlqPipeline(bootstrap, spool_dir=spool_dir).start()
    try:
        recovered = p.store.recovered
        assert p.force_flush(120)
        assert p.stats()["spool-depth"] == 0
    finally:
        p.shutdown(10)
    msgs = read_all(bootstrap, topic, idle_s=1.5, timeout_s=180)
    seen = Counter(int(dict(m.headers())["spillway.record.id"]) for m in msgs)
    missing = acked - set(seen)
    assert not missing, f"{len(missing)} acknowledged records lost, e.g. {sorted(missing)[:5]}"
    duplicates = sum(n - 1 for n in seen.values())
    assert duplicates <= MAX_INFLIGHT
    return len(acked), recovered, duplicates


def test_kill_9_during_a_burst_loses_no_acknowledged_record(broker, topic_name, tmp_path):
    acked, recovered, duplicates = crash_and_recover(
        broker.bootstrap_servers, topic_name, str(tmp_path / "spool"), total=1_000_000,
        kill_after=8_000)
    assert acked >= 8_000


@pytest.mark.slow
def test_kill_9_during_a_burst_of_100k_records(broker, topic_name, tmp_path):
    t0 = time.monotonic()
    acked, recovered, duplicates = crash_and_recover(
        broker.bootstrap_servers, topic_name, str(tmp_path / "spool"), total=1_000_000,
        kill_after=100_000)
    print(f"\nacked before kill -9: {acked}, recovered from the spool: {recovered}, "
          f"duplicates: {duplicates}, {time.monotonic() - t0:.1f}s")
