"""Backpressure admission: a report is refused before it is decided, never after.

The spool refuses a batch that would pass ``spool.max.records`` / ``spool.max.bytes``. Refusing
only there would come too late: the policy engine would already have counted the report's
records (skipped, retried, tolerance) for records the executor will send again. So the sidecar
asks `Admission.admit` first, with an upper estimate of what the report can add to the spool,
and *reserves* that room until the report's records are spooled (`release`): two concurrent
reports cannot both be admitted into the last free room, and the spool's own bound is then not
reached by an admitted report.

A refusal starts the *refusing* state: health turns NOT_SERVING and every report is refused at
once until the spool falls below its low-water mark (``spool.low.water.percent`` of both
bounds); then health is SERVING again. Refused records are counted (``records-refused``; the
job's ``records_refused``), never decided, never counted as failures or skips.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .errors import BackpressureError

# What a DLQ record can add beyond the failed record itself: the spillway / KIP context header
# names and the job's constants (measured ~600 bytes with every context header on).
PER_RECORD_OVERHEAD_BYTES = 1024


@dataclass
class Admission:
    store: object            # the pipeline's store: depth(), bytes(), rejected_count(), max_*
    low_water_percent: int = 80
    refused_records: int = 0
    refusals: int = 0
    _refusing: bool = False
    _reserved_records: int = 0
    _reserved_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _held(self) -> tuple[int, int]:
        s = self.store
        return s.depth() + s.rejected_count(), s.bytes()

    def refusing(self) -> bool:
        """True while reports are refused; clears once below the low-water mark."""
        with self._lock:
            return self._refusing_locked()

    def _refusing_locked(self) -> bool:
        if not self._refusing:
            return False
        held, size = self._held()
        s = self.store
        if (held + self._reserved_records) * 100 < s.max_records * self.low_water_percent and \
                (size + self._reserved_bytes) * 100 < s.max_bytes * self.low_water_percent:
            self._refusing = False
        return self._refusing

    def admit(self, n: int, estimate_bytes: int) -> tuple[int, int]:
        """Reserve room for ``n`` records of at most ``estimate_bytes`` (plus the per-record
        overhead); raise BackpressureError (nothing reserved) when they may not fit. Returns the
        reservation to hand to `release`."""
        size = estimate_bytes + n * PER_RECORD_OVERHEAD_BYTES
        s = self.store
        with self._lock:
            held, held_bytes = self._held()
            if self._refusing_locked():
                reason = (f"the sidecar is refusing reports until its DLQ spool falls below "
                          f"{self.low_water_percent}% of spool.max.records={s.max_records} and "
                          f"spool.max.bytes={s.max_bytes} (spool.low.water.percent); it holds "
                          f"{held} records / {held_bytes} bytes")
            elif (held + self._reserved_records + n > s.max_records
                  or held_bytes + self._reserved_bytes + size > s.max_bytes):
                self._refusing = True
                reason = (f"DLQ spool at its high-water mark: holds {held} records / "
                          f"{held_bytes} bytes, {n} more records (up to {size} bytes) would "
                          f"pass spool.max.records={s.max_records} or "
                          f"spool.max.bytes={s.max_bytes}")
            else:
                self._reserved_records += n
                self._reserved_bytes += size
                return n, size
            self.refused_records += n
            self.refusals += 1
        raise BackpressureError(f"{reason}; retry later (Kafka is behind or unreachable)")

    def release(self, reservation: tuple[int, int]) -> None:
        n, size = reservation
        with self._lock:
            self._reserved_records -= n
            self._reserved_bytes -= size

    def refused_after_admission(self, n: int) -> None:
        """The spool refused records this gate had admitted (its estimate was short)."""
        with self._lock:
            self._refusing = True
            self.refused_records += n
            self.refusals += 1
