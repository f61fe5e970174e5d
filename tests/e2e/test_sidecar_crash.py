"""kill -9 of the sidecar process itself (`spillway serve`) twice during a burst of 100,000
dead-lettered records reported over gRPC by 8 concurrent callers; restarts over the same spool
deliver everything the sidecar had acknowledged (a SKIP verdict with dead_lettered=true), and
replay little that Kafka already had (docs/DLQ.md states the bound and the measured figure)."""

from __future__ import annotations

import pytest
from spillway.sidecar.dlq.drain import MAX_INFLIGHT_BYTES
from support.sidecar_crash import run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KILLS = 2
# Per kill, what may be written twice: the records in flight (producer.max.inflight.bytes,
# MAX_INFLIGHT_BYTES by default; these records take ~340 bytes spooled, a report being one
# marshalled segment whose records share their reason's bytes, so 330 is the divisor) and the
# acknowledged records not yet settled in the spool (at most 1,000: the drain's delete_batch).
BOUND_PER_KILL = MAX_INFLIGHT_BYTES // 330 + 1_000


def test_kill_9_of_the_sidecar_loses_nothing_and_replays_at_most_the_in_flight_window(
        broker, tmp_path, topic_name):
    result = run(broker.bootstrap_servers, topic_name, str(tmp_path / "spool"),
                 total=100_000, kills=KILLS)
    assert len(result.killed_at) == KILLS
    assert all(0 < k < result.total for k in result.killed_at)   # killed mid-burst each time
    assert result.lost == 0
    assert result.duplicates <= KILLS * BOUND_PER_KILL, result
    print(f"\n{result}: {result.per_100k:.0f} duplicates per 100k records")
