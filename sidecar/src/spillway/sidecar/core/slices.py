"""Budget slices (docs/POLICY.md, "Budget slices"): how the nodes of a run with an error limit
answer its reports without waiting for its home, and why the limit stays exact.

The home grants a node a *slice* of the run's free error budget (the limit, less the errors
counted, less what other slices still reserve). While it holds room in a slice, the node answers
a report of data errors provisionally (SKIP, dead-lettered; `provisional.py`) and confirms it
later, like a run without a limit. What keeps the limit exact is not the slice but the
confirmation: the home counts every record when it confirms it, in the order it learns of
them, exactly as if the report had waited, and a task's flush succeeds only once its reports
are confirmed. A record the home finds past the limit fails the run, and the task that holds it
fails at its flush. Slices only bound how far ahead of the home the nodes may run: their sizes
add up to no more than the free budget, so as long as no other report spends what a slice
reserves, nothing answered under one is ever failed. Near the limit the free budget is small,
slices shrink to one error, then none is granted and reports wait for the home again.

A slice ends when the node closes it (out of room: it says how many records it answered under
it), when its lease runs out (the node stops using it at half the lease, measured from when it
received it), or when the run ends. Pure: `SliceBook` is the home's table of a run's slices,
durable in the run's journal; `sliceable` says which runs can have them. Imports nothing of
the run's state (`jobstate` imports this): it is handed the values it reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .handlers import HandlerResponse, LoadedHandler
from .settings import JobSettings

MAX_SLICE = 65_536     # errors in one slice, whatever a node asks for
MAX_OPEN = 1_024       # slices reserving budget at once per run; past it no grant (reports wait)
DEFAULT_LEASE_MS = 30_000


def sliceable(settings: JobSettings, handler: LoadedHandler) -> bool:
    """Whether a run's limits can be sliced: the built-in CONTINUE handler, a DLQ topic and
    one job-wide limit on the number of errors, counted over the whole run (no window, no
    ratio, not per stage). Other limits depend on when and where an error is counted, so their
    reports wait for the home."""
    t = settings.tolerance
    return (handler.fixed is HandlerResponse.CONTINUE and settings.dlq.enabled
            and t.mode != "none" and t.max_errors >= 0 and t.max_ratio < 0
            and not t.window_ms and not t.per_stage)


@dataclass(slots=True)
class SliceAsk:
    """What one node's report says about slices (`TallyReport`): the slice its held records
    were answered under, slices it closed (id, records answered under each) and the size it
    asks for, with the id the new slice gets (chosen by the adapter: the core draws no random
    numbers). `granted`, `lease_ms`: the size granted and its lease, set by
    `SliceBook.settle`."""

    slice: int = 0
    closed: Sequence[tuple[int, int]] = ()
    want: int = 0
    new_id: int = 0
    granted: int = 0
    lease_ms: int = 0


class SliceBook:
    """A run's open slices at its home: id -> [size, records confirmed under it, records the
    node said it answered under it when it closed it (-1: open), lease end (wall ms)]."""

    def __init__(self, max_errors: int, lease_ms: int = DEFAULT_LEASE_MS) -> None:
        self.max_errors = max_errors
        self.lease_ms = lease_ms
        self.slices: dict[int, list[int]] = {}
        self.granted = 0       # slices granted, for the summary
        self.journal: list | None = None   # the run's journal: every change is appended

    def settle(self, ask: SliceAsk, n: int, *, errors: int, may_grant: bool,
               now_wall_ms: int) -> None:
        """A decided report's slice business, under the run's lock, after its `n` records
        were counted (`errors`: the run's errors now, them included, so that a grant sees
        them): its records spend their slice's reservation, the slices it closed end, and a
        slice it asked for is granted if the budget has room and ``may_grant`` (the run has
        not failed): `ask.granted`, `ask.lease_ms`."""
        if ask.slice:
            self.confirmed(ask.slice, n)
        for sid, used in ask.closed:
            self.close(sid, used)
        if ask.want and ask.new_id and may_grant:
            ask.granted = self.grant(ask.new_id, ask.want, errors, now_wall_ms, max(n, 1))
            ask.lease_ms = self.lease_ms

    def reserved(self, now_wall_ms: int) -> int:
        """Errors the open slices may still be answered for, after expiring ended leases."""
        self._expire(now_wall_ms)
        total = 0
        for size, confirmed, used, _ in self.slices.values():
            total += max((size if used < 0 else used) - confirmed, 0)
        return total

    def grant(self, sid: int, want: int, errors: int, now_wall_ms: int, least: int = 1) -> int:
        """The size of a new slice `sid` for a node asking for `want` errors, when the run has
        counted `errors`: a share of the free budget that leaves room for the others (half of
        it, split among the slices already open), at least one error while any is free; 0 when
        none is, or the share is under `least` (the asking report's size: a smaller slice
        would not answer a report like it)."""
        free = self.max_errors - errors - self.reserved(now_wall_ms)
        if want <= 0 or free <= 0 or len(self.slices) >= MAX_OPEN or sid in self.slices:
            return 0
        size = min(want, MAX_SLICE, max(free // (2 * (len(self.slices) + 1)), 1))
        if size < least:
            return 0
        self.slices[sid] = [size, 0, -1, now_wall_ms + self.lease_ms]
        self.granted += 1
        self._changed(sid)
        return size

    def confirmed(self, sid: int, n: int) -> None:
        """`n` records answered under `sid` were confirmed (counted now, or already)."""
        s = self.slices.get(sid)
        if s is None:
            return   # expired or closed and settled: its records are counted as any
        s[1] += n
        if s[2] >= 0 and s[1] >= s[2]:
            del self.slices[sid]
        self._changed(sid)

    def close(self, sid: int, used: int) -> None:
        """The node answers nothing more under `sid`; it answered `used` records under it."""
        s = self.slices.get(sid)
        if s is None:
            return
        s[2] = min(max(used, 0), s[0])
        if s[1] >= s[2]:
            del self.slices[sid]
        self._changed(sid)

    def _expire(self, now_wall_ms: int) -> None:
        for sid in [sid for sid, s in self.slices.items() if s[3] <= now_wall_ms]:
            del self.slices[sid]
            self._changed(sid)

    def _changed(self, sid: int) -> None:
        """Journal one slice as it is now (None: ended), not the whole table: a run may have
        a thousand open slices and each confirmation changes one."""
        if self.journal is not None:
            s = self.slices.get(sid)
            self.journal.append(("b", sid, list(s) if s is not None else None, self.granted))

    # --- durable state (`JobState.snapshot`, `JobState.replay`) -------------------------

    def redo(self, sid: int, slice_: list | None, granted: int) -> None:
        """Replay a journaled change (`_changed`)."""
        if slice_ is None:
            self.slices.pop(sid, None)
        else:
            self.slices[sid] = list(slice_)
        self.granted = granted

    def state(self) -> dict:
        return {"slices": {k: list(v) for k, v in self.slices.items()}, "granted": self.granted}

    def set_state(self, state: dict) -> None:
        self.slices = {int(k): list(v) for k, v in state["slices"].items()}
        self.granted = int(state.get("granted", 0))


__all__ = ["DEFAULT_LEASE_MS", "MAX_OPEN", "MAX_SLICE", "SliceAsk", "SliceBook", "sliceable"]
