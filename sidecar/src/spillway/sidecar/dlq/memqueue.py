"""`MemoryQueue`: the spool's interface in memory, for ``spool.enable=false``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from ..core.dlq_record import Streak
from ..core.model import DlqRecord
from .codec import encode_headers, record_size
from .store import (
    DedupKey,
    OnCommit,
    Placed,
    RejectedRecord,
    SpooledRecord,
    backpressure_error,
    dedup_key,
)

log = logging.getLogger(__name__)


class MemoryQueue:
    """The spool's interface in memory, for ``spool.enable=false``: bounded the same way, but a
    crash or an unflushed shutdown loses what it holds."""

    durable = False

    def __init__(self, *, max_bytes: int, max_records: int) -> None:
        self.max_bytes = max_bytes
        self.max_records = max_records
        self._lock = threading.Lock()
        self._rows: dict[int, SpooledRecord] = {}
        self._index: dict[DedupKey, int] = {}
        self._rejected: dict[int, RejectedRecord] = {}
        self._bytes = 0
        self._last_seq = 0

    def append(self, records: Sequence[DlqRecord], on_commit: OnCommit | None = None, *,
               streaks: Sequence[Streak] = ()) -> list[int]:
        """``streaks`` (how `records` were built) are of no use to a queue that does not
        encode its records."""
        if not records:
            return []
        sized = []
        for rec in records:
            sized.append((rec, record_size(rec, encode_headers(rec.headers))))
        size = sum(s for _, s in sized)
        with self._lock:
            held = len(self._rows) + len(self._rejected)
            if held + len(sized) > self.max_records or self._bytes + size > self.max_bytes:
                raise backpressure_error(len(sized), size, held, self._bytes, self.max_records,
                                         self.max_bytes)
            placed = []
            for rec, s in sized:
                key = dedup_key(rec)
                seq = self._index.get(key)
                if seq is None:
                    self._last_seq += 1
                    seq = self._last_seq
                    self._rows[seq] = SpooledRecord(seq, rec, s)
                    self._index[key] = seq
                    self._bytes += s
                    placed.append(Placed(seq, rec.task_key, True, s))
                else:
                    placed.append(Placed(seq, self._rows[seq].record.task_key, False, s))
            if on_commit is not None:
                on_commit(placed)
        return [p.seq for p in placed]

    def read_batch(self, after_seq: int, limit: int, upto: int | None = None
                   ) -> list[SpooledRecord]:
        out: list[SpooledRecord] = []
        with self._lock:
            seq = after_seq + 1
            last = self._last_seq if upto is None else min(upto, self._last_seq)
            while seq <= last and len(out) < limit:
                row = self._rows.get(seq)
                if row is not None:
                    out.append(row)
                seq += 1
        return out

    def read_columns(self, after_seq: int, limit: int, upto: int | None = None
                     ) -> tuple[list[int], list[DlqRecord], list[int]]:
        rows = self.read_batch(after_seq, limit, upto)
        return ([r.seq for r in rows], [r.record for r in rows], [r.size for r in rows])

    def delete(self, seqs: Sequence[int]) -> int:
        n = 0
        with self._lock:
            for seq in seqs:
                row = self._rows.pop(seq, None)
                if row is not None:
                    self._index.pop(dedup_key(row.record), None)
                    self._bytes -= row.size
                    n += 1
        return n

    def reject(self, items: Sequence[tuple[int, str]], now_ms: int) -> int:
        n = 0
        with self._lock:
            for seq, error in items:
                row = self._rows.pop(seq, None)
                if row is not None:
                    self._index.pop(dedup_key(row.record), None)
                    self._rejected[seq] = RejectedRecord(seq, row.record, error, now_ms)
                    n += 1
        return n

    def rejected(self, limit: int = 100) -> list[RejectedRecord]:
        with self._lock:
            return [self._rejected[s] for s in sorted(self._rejected)[:limit]]

    def last_seq(self) -> int:
        with self._lock:
            return self._last_seq

    def depth(self) -> int:
        with self._lock:
            return len(self._rows)

    def bytes(self) -> int:
        with self._lock:
            return self._bytes

    def rejected_count(self) -> int:
        with self._lock:
            return len(self._rejected)

    def high_water(self) -> bool:
        with self._lock:
            return (len(self._rows) + len(self._rejected) >= self.max_records
                    or self._bytes >= self.max_bytes)

    def close(self) -> None:
        with self._lock:
            if self._rows:
                log.error("spool.enable=false: %d DLQ records were never acknowledged by Kafka "
                          "and are lost with this process", len(self._rows))
