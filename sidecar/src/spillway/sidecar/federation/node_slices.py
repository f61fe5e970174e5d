"""A node's slices of its runs' error budgets (docs/POLICY.md, "Budget slices";
`core/slices.py` is the home's side).

A report of a run with a sliceable limit waits for its home when the node holds no slice with
room for it, and asks for one with it (`ask`): the home's answer may carry a grant (`grant`).
Later reports spend the slice (`take`) and are answered provisionally (`confirm.py`), each held
report naming the slice it was answered under. A slice the node stops using (out of room for the
report at hand, or half its lease gone, measured from when it arrived) is *closed*: the next
call to the home for that run (a waiting report or a confirmation) says how many records were
answered under it, and the home frees the rest of its reservation. A close lost with a failed
call costs nothing but budget reserved until the lease runs out at the home.

Bounded: at most `MAX_HELD` slices per run (past it a grant is closed at once) and the closes
waiting to be sent per run (`MAX_CLOSED`; past it the oldest is forgotten and its reservation
ends with its lease).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

SLICE_WANT = 4_096   # errors a node asks for at a time (the home may grant fewer)
MAX_HELD = 8
MAX_CLOSED = 1_024


@dataclass(frozen=True, slots=True)
class SliceGrant:
    """A slice of a run's error budget its home granted a node: its id, how many errors, for
    how long (BudgetSlice on the wire)."""

    id: int
    size: int
    lease_ms: int


@dataclass(slots=True)
class _Slice:
    id: int
    left: int
    used: int
    until: float   # monotonic: half its lease after it arrived


class NodeSlices:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, list[_Slice]] = {}
        self._closed: dict[str, list[tuple[int, int]]] = {}
        self.granted = 0       # slices granted to this node (for the status page)
        self.answered = 0      # records answered under them

    def take(self, key: str, n: int) -> int:
        """A slice of run `key` with room for `n` errors, spent by them: its id (0: none, the
        report waits for the home)."""
        with self._lock:
            held = self._held.get(key)
            if not held:
                return 0
            now = time.monotonic()
            for s in list(held):
                if s.until <= now:
                    self._close(key, held, s)
                elif s.left >= n:
                    s.left -= n
                    s.used += n
                    self.answered += n
                    if not s.left:
                        self._close(key, held, s)
                    return s.id
            return 0

    def give_back(self, key: str, sid: int, n: int) -> None:
        """`n` errors `take` spent on a report that was not answered after all (the spool
        refused to hold it): back in their slice, or off its close's count."""
        with self._lock:
            self.answered -= n
            for s in self._held.get(key, ()):
                if s.id == sid:
                    s.left += n
                    s.used -= n
                    return
            closed = self._closed.get(key, [])
            for i, (cid, used) in enumerate(closed):
                if cid == sid:
                    closed[i] = (cid, max(used - n, 0))
                    return

    def ask(self, key: str, n: int) -> tuple[int, list[tuple[int, int]]]:
        """For a report of `n` records that waits for the home: the size to ask for and the
        slices to close (those without room for it: their rest goes back to the budget)."""
        with self._lock:
            held = self._held.get(key, [])
            now = time.monotonic()
            for s in list(held):
                if s.until <= now or s.left < n:
                    self._close(key, held, s)
            want = 0 if any(s.left >= n for s in held) else max(SLICE_WANT, n)
            return want, self._closed.pop(key, [])

    def closes(self, key: str) -> list[tuple[int, int]]:
        """The closes waiting to be sent with run `key`'s next call to its home (taken)."""
        with self._lock:
            return self._closed.pop(key, [])

    def grant(self, key: str, g: SliceGrant) -> None:
        """A slice the home granted (kept for half its lease)."""
        if not g.id or not g.size:
            return
        s = _Slice(g.id, g.size, 0, time.monotonic() + g.lease_ms / 2000)
        with self._lock:
            self.granted += 1
            held = self._held.setdefault(key, [])
            held.append(s)
            if len(held) > MAX_HELD:
                self._close(key, held, held[0])

    def forget(self, key: str) -> None:
        """The run ended here: its slices end with it at the home too."""
        with self._lock:
            self._held.pop(key, None)
            self._closed.pop(key, None)

    def holds(self, key: str) -> bool:
        with self._lock:
            return bool(self._held.get(key))

    def _close(self, key: str, held: list[_Slice], s: _Slice) -> None:
        held.remove(s)
        if not held:
            self._held.pop(key, None)
        closed = self._closed.setdefault(key, [])
        closed.append((s.id, s.used))
        if len(closed) > MAX_CLOSED:
            del closed[0]


__all__ = ["MAX_CLOSED", "MAX_HELD", "NodeSlices", "SLICE_WANT", "SliceGrant"]
