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
bounds) *and* the report whose refusal started the state would fit; then health is SERVING
again. The second condition keeps health truthful when reports are large next to the spool: a
report refused while the spool is already below the low-water mark (it holds 60 %, the report
needs 50 %) would otherwise clear the state at once, and health would say SERVING while the same
report is refused again. Refused records are counted (``records-refused``; the job's
``records_refused``), never decided, never counted as failures or skips.

A report that could not be admitted even into an empty spool (more records than
``spool.max.records``, or more bytes than ``spool.max.bytes``) is not backpressure: waiting
never helps. It raises ReportTooLargeError (FAILED_PRECONDITION), naming the property and
asking for smaller reports (the spillway client splits it in halves and sends them again); it
starts no refusing state and leaves health alone.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import NoReturn

from spillway.sidecar.errors import BackpressureError, ReportTooLargeError

log = logging.getLogger("spillway.sidecar.service.admission")

# What a DLQ record can add beyond the failed record itself: the spillway / KIP context header
# names and the job's constants (measured ~600 bytes with every context header on).
PER_RECORD_OVERHEAD_BYTES = 1024


@dataclass
class Admission:
    store: object            # the pipeline's store: depth(), bytes(), rejected_count(), max_*
    low_water_percent: int = 80
    refused_records: int = 0
    refusals: int = 0
    oversized_reports: int = 0  # never admissible: answered FAILED_PRECONDITION (split it)
    _refusing: bool = False
    _need: tuple[int, int] = (0, 0)  # (records, bytes) of the report that started refusing
    _reserved_records: int = 0
    _reserved_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _held(self) -> tuple[int, int]:
        s = self.store
        return s.depth() + s.rejected_count(), s.bytes()

    def refusing(self) -> bool:
        """True while reports are refused (health NOT_SERVING); clears once the spool is below
        the low-water mark and the report whose refusal started it would fit."""
        with self._lock:
            return self._refusing_locked()

    def _refusing_locked(self) -> bool:
        if not self._refusing:
            return False
        held, size = self._held()
        s = self.store
        held += self._reserved_records
        size += self._reserved_bytes
        need_n, need_bytes = self._need
        if held * 100 < s.max_records * self.low_water_percent and \
                size * 100 < s.max_bytes * self.low_water_percent and \
                held + need_n <= s.max_records and size + need_bytes <= s.max_bytes:
            self._refusing = False
        return self._refusing

    def _start_refusing(self, n: int, size: int) -> None:
        self._refusing = True
        self._need = (n, size)

    def admit(self, n: int, estimate_bytes: int) -> tuple[int, int]:
        """Reserve room for ``n`` records of at most ``estimate_bytes`` (plus the per-record
        overhead); raise BackpressureError (nothing reserved) when they may not fit now, and
        ReportTooLargeError when they could not fit even an empty spool. Returns the
        reservation to hand to `release`."""
        size = estimate_bytes + n * PER_RECORD_OVERHEAD_BYTES
        s = self.store
        if n > s.max_records or size > s.max_bytes:
            self._too_large(n, size)
        with self._lock:
            held, held_bytes = self._held()
            if self._refusing_locked():
                need_n, need_bytes = self._need
                reason = (f"the sidecar is refusing reports until its DLQ spool falls below "
                          f"{self.low_water_percent}% of spool.max.records={s.max_records} and "
                          f"spool.max.bytes={s.max_bytes} (spool.low.water.percent) with room "
                          f"for the refused report ({need_n} records, up to {need_bytes} "
                          f"bytes); it holds {held} records / {held_bytes} bytes")
            elif (held + self._reserved_records + n > s.max_records
                  or held_bytes + self._reserved_bytes + size > s.max_bytes):
                self._start_refusing(n, size)
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

    def _too_large(self, n: int, size: int) -> NoReturn:
        s = self.store
        if n > s.max_records:
            what = f"{n} records, more than spool.max.records={s.max_records}"
        else:
            what = (f"up to {size} bytes once spooled ({PER_RECORD_OVERHEAD_BYTES} bytes per "
                    f"record for the DLQ context included), more than "
                    f"spool.max.bytes={s.max_bytes}")
        with self._lock:
            self.oversized_reports += 1
        log.info("a report of %d records can never fit in the DLQ spool (%s); answered "
                 "FAILED_PRECONDITION so the client splits it", n, what)
        raise ReportTooLargeError(
            f"this report can never fit in the sidecar's DLQ spool, not even an empty one: {what}."
            f" Split it into smaller reports (the spillway client does so itself) or raise the "
            f"sidecar's spool.max.bytes / spool.max.records; retrying it unchanged never helps")

    def release(self, reservation: tuple[int, int]) -> None:
        n, size = reservation
        with self._lock:
            self._reserved_records -= n
            self._reserved_bytes -= size

    def refused_after_admission(self, n: int) -> None:
        """The spool refused records this gate had admitted (its estimate was short)."""
        with self._lock:
            self._start_refusing(n, 0)
            self.refused_records += n
            self.refusals += 1
