"""Group calls: calls that arrive while one is in flight go together as the next one.

A node sidecar's reports of one run each need the run's home (TallyFailures). Sent one by one,
each pays a whole gRPC round trip and the home's per-call work; a `GroupCall` sends the first
at once and gathers the ones that arrive meanwhile into the next call (group commit, as the
spool commits its writes), so under load a call carries several reports and with one caller it
adds no wait. Each caller gets its own answer or the call's exception. Bounded: a call carries
at most `max_items` items and `max_weight` weight (the records); the rest wait for the next. A
caller whose deadline passes while it waits gives up before its item is sent; a call's deadline
is the shortest of those it carries.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class GroupCallTimeout(TimeoutError):
    """A caller's deadline passed while it waited for the call in flight: its item was never
    sent."""


class _Waiter(Generic[T, R]):
    __slots__ = ("item", "weight", "deadline", "done", "result", "error")

    def __init__(self, item: T, weight: int, timeout_s: float) -> None:
        self.item = item
        self.weight = weight
        self.deadline = time.monotonic() + timeout_s
        self.done = False
        self.result: R | None = None
        self.error: BaseException | None = None


class GroupCall(Generic[T, R]):
    """`call(item)` → `send([items...], timeout_s)[i]`, items of concurrent callers together."""

    def __init__(self, send: Callable[[Sequence[T], float], Sequence[R]], *,
                 max_items: int, max_weight: int) -> None:
        self._send = send
        self._max_items = max(1, max_items)
        self._max_weight = max(1, max_weight)
        self._cond = threading.Condition()
        self._queue: deque[_Waiter[T, R]] = deque()
        self._busy = False
        self.calls = 0      # calls sent, and items they carried (for tests and status)
        self.items = 0

    def call(self, item: T, *, weight: int = 1, timeout_s: float) -> R:
        """`item`'s answer; GroupCallTimeout if `timeout_s` passed before it could be sent
        (it was not), else the call's own exception."""
        me = _Waiter(item, weight, timeout_s)
        with self._cond:
            self._queue.append(me)
            while True:
                while self._busy and not me.done:
                    left = me.deadline - time.monotonic()
                    if left <= 0 and me in self._queue:
                        self._queue.remove(me)
                        raise GroupCallTimeout(
                            f"waited {timeout_s:.3g} s for the call in flight; not sent")
                    self._cond.wait(max(left, 0.001))
                if me.done:
                    break
                batch = self._take()
                self._busy = True
                self._cond.release()
                try:
                    self._run(batch)
                finally:
                    self._cond.acquire()
                    self._busy = False
                    self._cond.notify_all()
        if me.error is not None:
            raise me.error
        return me.result  # type: ignore[return-value]

    def _take(self) -> list[_Waiter[T, R]]:
        """The next call's items, oldest first (the first always, however heavy)."""
        batch = [self._queue.popleft()]
        weight = batch[0].weight
        q = self._queue
        while q and len(batch) < self._max_items and weight + q[0].weight <= self._max_weight:
            w = q.popleft()
            weight += w.weight
            batch.append(w)
        return batch

    def _run(self, batch: list[_Waiter[T, R]]) -> None:
        try:
            # the shortest deadline of those who wait for it, from now
            left = min(w.deadline for w in batch) - time.monotonic()
            results = self._send([w.item for w in batch], max(left, 0.001))
            if len(results) != len(batch):
                raise RuntimeError(f"a group call answered {len(results)} of {len(batch)}")
        except BaseException as exc:  # every caller of this call sees its failure
            for w in batch:
                w.error, w.done = exc, True
            return
        finally:
            self.calls += 1
            self.items += len(batch)
        for w, r in zip(batch, results, strict=True):
            w.result, w.done = r, True


__all__ = ["GroupCall", "GroupCallTimeout"]
