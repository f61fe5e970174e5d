"""Backpressure admission: refusal before deciding, reservations, the low-water mark."""

from __future__ import annotations

import pytest
from spillway.sidecar.errors import BackpressureError, ReportTooLargeError
from spillway.sidecar.service.admission import PER_RECORD_OVERHEAD_BYTES, Admission


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
    store.size = PER_RECORD_OVERHEAD_BYTES  # 9 records of 1 byte would fit; their overhead not
    gate = Admission(store)
    with pytest.raises(BackpressureError, match="spool.max.bytes"):
        gate.admit(9, 1)


def test_refused_below_the_low_water_mark_keeps_refusing_until_the_report_fits():
    """A large report refused while the spool already holds less than the low-water mark: the
    state (health NOT_SERVING) holds until that report would be admitted."""
    unit = 1000 + PER_RECORD_OVERHEAD_BYTES
    store = Store(max_bytes=10 * unit)
    gate = Admission(store, low_water_percent=80)
    store.size = 6 * unit      # 60 %: below the low-water mark already
    with pytest.raises(BackpressureError, match="high-water"):
        gate.admit(5, 5 * 1000)
    assert gate.refusing()     # was: cleared at once, health SERVING while refusing
    with pytest.raises(BackpressureError, match="spool.low.water.percent"):
        gate.admit(1, 10)
    store.size = 5 * unit + 1  # below 80 %, but the 5-record report would still not fit
    assert gate.refusing()
    store.size = 5 * unit
    assert not gate.refusing()
    gate.release(gate.admit(5, 5 * 1000))


def test_a_report_larger_than_the_whole_spool_is_not_backpressure():
    store = Store(max_records=100, max_bytes=10 * PER_RECORD_OVERHEAD_BYTES)
    gate = Admission(store)
    with pytest.raises(ReportTooLargeError) as err:
        gate.admit(2, 9 * PER_RECORD_OVERHEAD_BYTES)   # past spool.max.bytes even when empty
    assert not isinstance(err.value, BackpressureError)
    assert "spool.max.bytes=10240" in str(err.value) and "Split it" in str(err.value)
    with pytest.raises(ReportTooLargeError, match="101 records, more than spool.max.records"):
        gate.admit(101, 0)
    # neither refused nor refusing: health stays SERVING, the halves are admitted
    assert not gate.refusing() and (gate.refused_records, gate.refusals) == (0, 0)
    assert gate.oversized_reports == 2
    gate.release(gate.admit(1, 4 * PER_RECORD_OVERHEAD_BYTES))

