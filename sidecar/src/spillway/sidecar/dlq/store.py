"""Where accepted DLQ records wait for Kafka: the interface the drain uses (`RecordStore`) and
the values it passes. Two implementations: `spool.Spool` (SQLite, durable) and
`memqueue.MemoryQueue` (in memory, for ``spool.enable=false``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from ..core.model import DlqRecord
from ..errors import BackpressureError


class Placed(NamedTuple):
    """Where an appended record went: its seq, the task_key stored with it, whether
    this append created the row (False: the record was already spooled), and the bytes the
    record accounts for against ``spool.max.bytes``."""

    seq: int
    owner: str
    fresh: bool
    size: int = 0


OnCommit = Callable[[Sequence[Placed]], None]
DedupKey = tuple[str, str, int]


def dedup_key(rec: DlqRecord) -> DedupKey:
    """What makes two DLQ records the same record: job, record id and payload (two records
    under one id are two records: core.policy, record identity). Process-local (str hash)."""
    return (rec.job, rec.record_id, hash((rec.key, rec.value)))


@dataclass(frozen=True, slots=True)
class SpooledRecord:
    seq: int
    record: DlqRecord
    size: int


@dataclass(frozen=True, slots=True)
class RejectedRecord:
    seq: int
    record: DlqRecord
    error: str
    rejected_ms: int


class RecordStore(Protocol):
    """What the drain needs from where accepted records wait for Kafka (Spool or MemoryQueue)."""

    durable: bool
    max_records: int
    max_bytes: int

    def append(self, records: Sequence[DlqRecord], on_commit: OnCommit | None = None
               ) -> list[int]: ...
    def read_batch(self, after_seq: int, limit: int, upto: int | None = None
                   ) -> list[SpooledRecord]: ...
    def read_columns(self, after_seq: int, limit: int, upto: int | None = None
                     ) -> tuple[list[int], list[DlqRecord], list[int]]: ...
    def delete(self, seqs: Sequence[int]) -> int: ...
    def reject(self, items: Sequence[tuple[int, str]], now_ms: int) -> int: ...
    def last_seq(self) -> int: ...
    def depth(self) -> int: ...
    def bytes(self) -> int: ...
    def rejected_count(self) -> int: ...
    def high_water(self) -> bool: ...
    def close(self) -> None: ...


def backpressure_error(n: int, size: int, held_records: int, held_bytes: int, max_records: int,
                  max_bytes: int) -> BackpressureError:
    if n > max_records or size > max_bytes:
        return BackpressureError(
            f"a batch of {n} DLQ records ({size} bytes) can never fit in the spool "
            f"(spool.max.records={max_records}, spool.max.bytes={max_bytes}): submit smaller "
            f"batches or raise the limits")
    return BackpressureError(
        f"DLQ spool at its high-water mark: holds {held_records} records / {held_bytes} bytes, "
        f"{n} more records / {size} bytes would pass spool.max.records={max_records} or "
        f"spool.max.bytes={max_bytes}; retry later (Kafka is behind or unreachable)")
