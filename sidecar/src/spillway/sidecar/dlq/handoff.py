"""The in-memory hand-off from the spool's writer to the drain: each commit's new records, so
that the drain need not read back what was just written (`Handoff`); and the drain's `Entry`, a
spooled record it holds in memory.

Bounded (``handoff_bytes``, ``handoff_records``): when full (Kafka is behind or gone) the hand-off
lets go of what it holds and the drain reads those rows from the spool instead, and so every
later row until the drain has read the spool to its end once (`caught_up`); the rows after that
are handed over again. ``skipped_upto``: the rows up to this seq were not handed over (recovered
at start, or the hand-off was full), and the drain reads them from the spool before it takes the
hand-off's.
"""

from __future__ import annotations

import collections
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

from ..core import slots
from ..core.model import DlqRecord
from .codec import decode_segments
from .store import FreshRun, Placed

_SEQ, _SIZE = itemgetter(0), itemgetter(3)   # of a Placed


@dataclass(slots=True)
class Entry:
    """A spooled record the drain holds in memory: in flight, waiting to retry, or a suspect."""

    seq: int
    rec: DlqRecord
    size: int
    attempts: int = 0
    solo: bool = False  # its last produce was alone in its batch
    sent_ns: int = 0    # when it was last handed to the producer (for the batch span)

    def __lt__(self, other: Entry) -> bool:  # heap tie-break
        return self.seq < other.seq


# Entries made column-wise in C (`core.slots`): a commit's records each get one
_ENTRIES = slots.Maker(Entry, ("seq", "rec", "size"), ("attempts", "solo", "sent_ns"),
                       lambda v: Entry(**v), {"seq": 1, "rec": None, "size": 2, "attempts": 0,
                                              "solo": False, "sent_ns": 0})
_NEW = (0, False, 0)   # a new entry's attempts, solo and sent_ns


def entries_of(seqs: Sequence[int], records: Sequence[DlqRecord], sizes: Sequence[int]
               ) -> list[Entry]:
    """A new `Entry` per record, in order."""
    if _ENTRIES.native():
        return _ENTRIES.make((seqs if type(seqs) is list else list(seqs),
                              records if type(records) is list else list(records),
                              sizes if type(sizes) is list else list(sizes)), _NEW)
    return list(map(Entry, seqs, records, sizes))


class Handoff:
    """Committed records on their way from the spool's writer to the drain, in seq order.

    A commit's new records wait as entries (objects: the drain takes them as they are) while
    fewer than ``max_records`` do; past that, a commit whose records were all new waits as the
    spool stored it (its segments and seqs: about its spooled bytes in memory, no object per
    record) and is made into entries when the drain takes it (about 1 µs a record, a third of
    reading it back from SQLite), until ``max_bytes`` of spooled bytes wait. A store that does
    not encode its records (spool.enable=false) and a commit that also named spooled records
    (duplicates) have only the entries."""

    def __init__(self, *, max_bytes: int, max_records: int, skipped_upto: int) -> None:
        self._max_bytes = max(1, max_bytes)
        # entries too: the bytes bound counts spooled bytes, and a record's objects in memory
        # take several times its share of a report's spooled bytes (which share header bytes)
        self._max_records = max(1, max_records)
        self._lock = threading.Lock()
        # groups: [one commit's entries in seq order (None while packed), their bytes,
        #          (segments, seqs) while packed]
        self._groups: collections.deque[list] = collections.deque()
        self._n = 0       # entries (objects) in it
        self._bytes = 0
        # read by the drain without the lock (a stale value costs it one more round)
        self.skipped_upto = skipped_upto
        # the hand-off was full: rows are skipped until the drain has read the spool to its
        # end once (then the seqs skipped stop growing, and it soon reaches them)
        self._overflow = False
        self.overflows = 0    # times it was full

    def give(self, records: Sequence[DlqRecord], placed: Sequence[Placed],
             all_fresh: bool) -> None:
        """Runs in the spool's writer right after the commit, in seq order: the commit's new
        records, or, when the hand-off is full, a note that the drain must read them back."""
        packed = None
        entries: list[Entry] | None = None
        segments = placed.segments if type(placed) is FreshRun else None
        if segments is not None and self._n + len(placed) > self._max_records:
            # (`_n` read without the lock: a stale value only chooses the form)
            if not placed.seqs:
                return
            packed = _packed(placed)
            size = sum(len(blob) for blob, _ in segments)
            last, n = placed.seqs[-1], 0
        else:
            if type(placed) is FreshRun:
                entries = entries_of(placed.seqs, records, placed.sizes)
                size = sum(placed.sizes)
            elif all_fresh:
                entries = entries_of(list(map(_SEQ, placed)), records,
                                     list(map(_SIZE, placed)))
                size = sum(map(_SIZE, placed))
            else:
                entries = [Entry(p.seq, rec, p.size)
                           for rec, p in zip(records, placed, strict=True) if p.fresh]
                size = sum(e.size for e in entries)
            if not entries:
                return
            last, n = entries[-1].seq, len(entries)
        with self._lock:
            if self._overflow:   # until the drain has read back what was skipped
                self.skipped_upto = last
                return
            if packed is None and self._n + n > self._max_records and segments is not None:
                packed, entries, n = _packed(placed), None, 0
            if self._bytes + size > self._max_bytes or self._n + n > self._max_records:
                # the drain is behind (Kafka slow or gone): let go of what waits here too, the
                # drain reads it back from the spool when its turn comes
                self._overflow = True
                self.overflows += 1
                self.skipped_upto = last
                self._groups.clear()
                self._n = self._bytes = 0
                return
            self._groups.append([entries, size, packed])
            self._n += n
            self._bytes += size

    def waiting(self) -> bool:
        """Whether entries wait here (without the lock)."""
        return bool(self._groups)

    def take(self, cursor: int, limit: int, budget: int) -> tuple[list[Entry], int, bool]:
        """For a drain that has read up to seq `cursor`: up to `limit` entries, in order, while
        `budget` bytes are left (the last one may pass it), whole commits at once where they
        fit; none while rows up to ``skipped_upto`` are still to be read from the spool.
        Returns (the entries, ``skipped_upto``, whether nothing was here to take)."""
        parts: list = []   # entries, or a packed commit's (segments, seqs), in order
        count = 0
        with self._lock:
            skipped = self.skipped_upto
            if cursor < skipped:
                return [], skipped, False
            groups = self._groups
            while groups and count < limit and budget > 0:
                group = groups[0]      # [entries or None, their bytes, packed or None]
                entries, size, packed = group
                k = len(entries) if packed is None else len(packed[1])
                if k <= limit - count and size <= budget:
                    groups.popleft()
                    parts.append(entries if packed is None else packed)
                    if packed is None:
                        self._n -= k
                else:   # part of it: a packed commit is made into entries first
                    if packed is not None:
                        entries = group[0] = _unpack(*packed)
                        group[2] = None
                        self._n += len(entries)
                    k = size = 0
                    while k < len(entries) and count + k < limit and budget - size > 0:
                        size += entries[k].size
                        k += 1
                    parts.append(entries[:k])
                    del entries[:k]
                    group[1] -= size
                    if not entries:
                        groups.popleft()
                    self._n -= k
                count += k
                budget -= size
                self._bytes -= size
            none_left = not groups and not parts
        if len(parts) == 1 and type(parts[0]) is list:
            return parts[0], skipped, none_left
        taken: list[Entry] = []
        for part in parts:   # packed commits made into entries outside the lock
            taken += part if type(part) is list else _unpack(*part)
        return taken, skipped, none_left

    def caught_up(self) -> None:
        """The drain has read the spool to its end: take the next commits again."""
        with self._lock:
            self._overflow = False


def _packed(placed: FreshRun) -> tuple[list[tuple[bytes, int]], array]:
    """A commit of new records as the spool stored it: its segments and seqs."""
    return placed.segments, array("q", placed.seqs)


def _unpack(segments: list[tuple[bytes, int]], seqs: array) -> list[Entry]:
    records: list[DlqRecord] = []
    sizes: list[int] = []
    decode_segments(segments, records, sizes)
    return entries_of(seqs, records, sizes)


__all__ = ["Entry", "Handoff", "entries_of"]
