"""Where accepted DLQ records wait for Kafka: the interface the drain uses (`RecordStore`) and
the values it passes. Two implementations: `spool.Spool` (SQLite, durable) and
`memqueue.MemoryQueue` (in memory, for ``spool.enable=false``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from operator import attrgetter
from typing import NamedTuple, Protocol, overload

from ..core.dlq_record import Streak
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


# Placed((seq, owner, fresh, size)) without the named tuple's Python-level __new__
_new_placed = partial(tuple.__new__, Placed)


class FreshRun(Sequence[Placed]):
    """The placements of a request whose records were all new, as columns (seqs, owners,
    sizes): the usual commit makes no `Placed` per record (one per record cost the spool's
    writer about as much as encoding them); one is made only when asked for by index.
    ``segments``: the records as the spool stored them (`codec.encode_segments`), in seq order,
    when the store encodes them (the hand-off keeps them so, not as objects)."""

    __slots__ = ("seqs", "owners", "sizes", "segments")
    fresh = True

    def __init__(self, seqs: list[int], owners: list[str], sizes: list[int],
                 segments: list[tuple[bytes, int]] | None = None) -> None:
        self.seqs, self.owners, self.sizes = seqs, owners, sizes
        self.segments = segments

    def __len__(self) -> int:
        return len(self.seqs)

    @overload
    def __getitem__(self, i: int) -> Placed: ...
    @overload
    def __getitem__(self, i: slice) -> list[Placed]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(map(_new_placed, zip(self.seqs[i], self.owners[i], repeat(True),
                                             self.sizes[i])))
        return Placed(self.seqs[i], self.owners[i], True, self.sizes[i])

    def __iter__(self) -> Iterator[Placed]:
        return map(_new_placed, zip(self.seqs, self.owners, repeat(True), self.sizes))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"FreshRun({list(self)!r})"


OnCommit = Callable[[Sequence[Placed]], None]
DedupKey = tuple[str, str, int]


def dedup_key(rec: DlqRecord) -> DedupKey:
    """What makes two DLQ records the same record: job, record id and payload (two records
    under one id are two records: core.policy, record identity). Process-local (str hash)."""
    return (rec.job, rec.record_id, hash((rec.key, rec.value)))


_job_of, _id_of, _payload_of = attrgetter("job"), attrgetter("record_id"), attrgetter("key",
                                                                                    "value")


def dedup_keys(records: Sequence[DlqRecord]) -> list[DedupKey]:
    """`dedup_key` of each record, in order, without a Python call per record."""
    return list(zip(map(_job_of, records), map(_id_of, records),
                    map(hash, map(_payload_of, records))))


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

    def append(self, records: Sequence[DlqRecord], on_commit: OnCommit | None = None, *,
               streaks: Sequence[Streak] = ()) -> list[int]: ...
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
