"""Wake-ups at a time, for the verdict loops of one worker process.

A loop with a partial report pending sends it once its oldest failure waited the linger. It
used to read the clock after every row to notice; that was about 0.1 µs a row, about 10 µs a
failed record when 1% of the rows fail (bench target 4). Instead the loop asks for a wake-up at
the deadline: one thread per process appends a token to the loop's inbox (the deque it checks
after every row anyway, for landed reports) when the time comes. A token that arrives when
nothing is due any more only costs the loop one look.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable

#: What the waker appends to an inbox.
WAKE = object()


class Waker:
    """One daemon thread (started at the first `at`) appending `WAKE` to inboxes at their
    times (``clock``: time.monotonic, the loops' clock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._due: list[tuple[float, int, deque]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None

    def at(self, when: float, inbox: deque) -> None:
        """Append `WAKE` to ``inbox`` once ``clock()`` reaches ``when``."""
        with self._cond:
            heapq.heappush(self._due, (when, next(self._seq), inbox))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="spillway-waker",
                                                daemon=True)
                self._thread.start()
            elif self._due[0][2] is inbox and self._due[0][0] == when:
                self._cond.notify()  # earlier than what the thread sleeps towards

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._due:
                    self._cond.wait()
                    continue
                delay = self._due[0][0] - self._clock()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                _, _, inbox = heapq.heappop(self._due)
                inbox.append(WAKE)
