"""What the spool keeps in memory beside its tables: each batch row's state (`Row`) and the
counters its bounds are checked against (`SpoolState`), under one lock.

`spool.Spool` makes one `SpoolState` when it opens and hands it to the parts it is composed of
(`settle.Settlement`, `held.Holding`, `dedup.DedupWindow`); each changes it in its own
operations only, the counters and the rows under ``lock``.
"""

from __future__ import annotations

import threading


class Row:
    """What the spool keeps in memory per batch row: its record count, the records not yet
    settled (acknowledged or rejected), the bytes it holds, and, only once some but not all of
    its records are settled, one byte per record saying which."""

    __slots__ = ("total", "left", "size", "done")

    def __init__(self, total: int, left: int, size: int) -> None:
        self.total = total
        self.left = left
        self.size = size
        self.done: bytearray | None = None

    def pending(self, idx: int) -> bool:
        return idx < self.total and (self.done is None or not self.done[idx])


class SpoolState:
    """The spool's batch rows by id and its counters; ``lock`` guards both."""

    __slots__ = ("lock", "rows", "depth", "bytes", "peak_bytes", "rejected", "held",
                 "last_seq")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: dict[int, Row] = {}
        self.depth = 0        # records waiting for Kafka
        self.bytes = 0        # bytes held: batch rows not yet deleted, rejected and held records
        self.peak_bytes = 0   # the most held since the spool last emptied (settle.py)
        self.rejected = 0     # records in the rejected table
        self.held = 0         # records held for their homes' confirmation (held.py)
        self.last_seq = 0     # the highest seq published to readers (spool.py)

    def records(self) -> int:
        """Every record counted against ``spool.max.records`` (under ``lock``)."""
        return self.depth + self.rejected + self.held


__all__ = ["Row", "SpoolState"]
