"""The spool's dedup window: a record reported again (same job, record id and payload:
`store.dedup_key`) while it is still pending and among the last ``DEDUP_WINDOW`` records
spooled (recovered ones included) is stored once, and its caller told the seq it already has.

`DedupWindow` is one of the parts `spool.Spool` is composed of. It owns the window, in two
generations of at most ``DEDUP_WINDOW // 2`` records each (`dedup_key` -> (seq, task_key)),
filled from the newest recovered rows at open; it reads the spool's rows (`state.SpoolState`)
to tell whether a record it remembers is still pending, and plans where each record of a group
commit goes when some were seen before.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping, Sequence

from ..core.model import DlqRecord
from .codec import IDX_MASK, ROW_BITS, ROW_BYTES, ROW_RECORDS, decode_row, encode_segments
from .schema import BATCH_DATA
from .state import SpoolState
from .store import DedupKey, dedup_key

DEDUP_WINDOW = 65_536  # recent records a repeated report is matched against


class DedupWindow:
    """The spool's dedup window, over the spool's rows (to tell pending records)."""

    def __init__(self, state: SpoolState) -> None:
        self._rows = state.rows
        self._recent: dict[DedupKey, tuple[int, str]] = {}
        self._recent_old: dict[DedupKey, tuple[int, str]] = {}

    def fill(self, conn: sqlite3.Connection) -> None:
        """At open: put the newest recovered records in the window (at most half of it)."""
        room = DEDUP_WINDOW // 2
        window: list[tuple[DedupKey, tuple[int, str]]] = []
        cur = conn.execute(f"{BATCH_DATA} ORDER BY b.id DESC")
        for rid, ends, segs, data in cur:
            row = self._rows[rid]
            for i, rec in reversed(list(decode_row(rid, ends, segs, data, 0, row.done))):
                window.append((dedup_key(rec.record),
                               (rec.seq, rec.record.task_key)))
            if len(window) >= room:
                break
        cur.close()
        self._recent_old = dict(reversed(window))

    def all_new(self, keys: Sequence[DedupKey]) -> bool:
        """Whether no two of `keys` are alike and none is in the window (the usual commit)."""
        return (len(set(keys)) == len(keys) and self._recent.keys().isdisjoint(keys)
                and self._recent_old.keys().isdisjoint(keys))

    def remember(self, spooled: Mapping[DedupKey, tuple[int, str]]
                 | Iterable[tuple[DedupKey, tuple[int, str]]]) -> None:
        """Add records just spooled: key -> (seq, task_key); the older generation goes once the
        newer one is full."""
        recent = self._recent
        recent.update(spooled)
        if len(recent) >= DEDUP_WINDOW // 2:
            self._recent_old, self._recent = recent, {}

    def clear(self) -> None:
        """Nothing is pending (the spool is empty): the window can match nothing."""
        self._recent, self._recent_old = {}, {}

    def _spooled(self, key: DedupKey) -> tuple[int, str] | None:
        """(seq, task_key) of this record when it is in the dedup window and still pending."""
        hit = self._recent.get(key) or self._recent_old.get(key)
        if hit is not None:
            row = self._rows.get(hit[0] >> ROW_BITS)
            if row is not None and row.pending(hit[0] & IDX_MASK):
                return hit
        return None

    def plan(self, accepted: list
             ) -> tuple[list[list[tuple[bytes, int]]], list[list[tuple[int, int, str, bool]]]]:
        """Where each record goes when some were seen before: (row number in this group, index,
        task_key, True) for a new one; (-1, its seq, its task_key, False) for one still spooled,
        or (row number, index, task_key, False) for one repeated within this group. The new
        records of each row are encoded again, as that row's segments."""
        rows: list[list[DlqRecord]] = [[]]
        row_bytes = 0
        plans: list[list[tuple[int, int, str, bool]]] = []
        local: dict[DedupKey, tuple[int, int, str]] = {}
        for req in accepted:
            plan = []
            avg = req.size // req.n
            for rec in req.records:
                key = dedup_key(rec)
                hit = local.get(key)
                if hit is not None:
                    plan.append((hit[0], hit[1], hit[2], False))
                    continue
                old = self._spooled(key)
                if old is not None:
                    plan.append((-1, old[0], old[1], False))
                    continue
                cur = rows[-1]
                if len(cur) >= ROW_RECORDS or row_bytes >= ROW_BYTES:
                    cur = []
                    rows.append(cur)
                    row_bytes = 0
                local[key] = at = (len(rows) - 1, len(cur), rec.task_key)
                cur.append(rec)
                row_bytes += avg
                plan.append((*at, True))
            plans.append(plan)
        return [encode_segments(r) for r in rows if r], plans


__all__ = ["DEDUP_WINDOW", "DedupWindow"]
