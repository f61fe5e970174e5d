"""Backpressure admission: refusal before deciding, reservations, the low-water mark."""

from __future__ import annotations

import pytest

from spillway.sidecar.admission import PER_RECORD_OVERHEAD_BYTES, Admission
from spillway.sidecar.errors import BackpressureError


class Store:
    def __init__(self, max_records=10, max_bytes=10**9):
        self.max_records, self.max_bytes = max_records, max_bytes
        self.held, self.size = 0, 0

    def depth(self):
        return self.held

    def rejected_count(self):
        return 0

    def bytes(self):
        return self.size


def test_reservations_count_until_released():
    store = Store(max_records=10)
    gate = Admission(store)
    r1 = gate.admit(6, 100)
    with pytest.raises(BackpressureError, match="spool.max.records=10"):
        gate.admit(5, 100)  # 6 reserved + 5 > 10: two reports never share the last room
    assert (gate.refused_records, gate.refusals) == (5, 1)
    gate.release(r1)
    assert r1 == (6, 100 + 6 * PER_RECORD_OVERHEAD_BYTES)


def test_refusing_until_below_the_low_water_mark():
    store = Store(max_records=10)
    gate = Admission(store, low_water_percent=50)
    store.held = 8
    with pytest.raises(BackpressureError):
        gate.admit(3, 10)
    assert gate.refusing()
    with pytest.raises(BackpressureError, match="spool.low.water.percent"):
        gate.admit(1, 10)  # would fit, but the sidecar is still refusing
    store.held = 5         # not below 50 %
    assert gate.refusing()
    store.held = 4
    assert not gate.refusing()
    gate.release(gate.admit(1, 10))
    assert gate.refused_records == 4


def test_bytes_bound_uses_the_upper_estimate():
    store = Store(max_bytes=10 * PER_RECORD_OVERHEAD_BYTES)
    gate = Admission(store)
    with pytest.raises(BackpressureError, match="spool.max.bytes"):
        gate.admit(10, 1)
