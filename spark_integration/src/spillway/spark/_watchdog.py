"""``errors.record.timeout.ms`` in a task attempt that runs its records in the worker itself.

A record that hangs may hang in C code that holds the GIL (a regular expression, a library
call without a timeout): no thread of the worker can stop it, and no signal handler written in
Python runs. So the limit is kept by a *watchdog process*, forked once per Python worker the
first time a wrapper with a record timeout runs in it, sharing one page of memory with the
worker (the *board*):

- the worker counts every record's start and end on the board (an odd count: a record is
  running): two stores per record, and only in jobs that set the property;
- the watchdog looks at the board every tenth of the limit; when the same record has been
  running for longer than the limit, it marks the task attempt's crumb (`_isolation`)
  ``timeout`` and kills the worker (SIGKILL: the only stop C code cannot refuse).

Spark then runs the task again, and that attempt, seeing its predecessor died, runs its records
guarded (`_guard`) under the same limit, where the record that hangs becomes a failure of
category timeout. Time spent between records (Spark reading input, writing output) is never
counted: only a record's own call.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import time
import warnings
from collections.abc import Callable
from typing import Any

_SEQ, _TIMEOUT_MS, _ARMED, _PATH_LEN, _LINE_LEN = 0, 1, 2, 3, 4   # int64 slots of the board
_PATH_AT, _PATH_MAX = 64, 3072 - 64          # where the crumb is
_LINE_AT, _LINE_MAX = 3072, 1024             # what it then says
_PR_SET_PDEATHSIG = 1
#: The watchdog looks at the board this often (a tenth of the limit, within these bounds).
MIN_TICK_S, MAX_TICK_S = 0.01, 0.5


class Watchdog:
    """This worker's watchdog: the board, and the process watching it."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.page = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)
        self.board = memoryview(self.page).cast("q")
        self.pid = 0

    def _start(self) -> None:
        with warnings.catch_warnings():  # 3.12+ warns on fork with threads: the child runs only
            warnings.simplefilter("ignore", DeprecationWarning)  # the loop below
            pid = os.fork()
        if pid == 0:
            try:
                _watch(self.board, self.page, self.owner)
            finally:
                os._exit(0)
        self.pid = pid

    def _running(self) -> bool:
        """Whether the watchdog still runs (it dies with the thread that forked it, and that
        thread may have ended); reaps it when it does not."""
        try:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return False
        return pid == 0

    def arm(self, crumb_path: str, timed_out: str, timeout_ms: int) -> None:
        """Watch this worker's records against ``timeout_ms``; past it, write ``timed_out`` to
        the file ``crumb_path`` (the attempt's crumb), then kill the worker."""
        if self.pid == 0 or not self._running():
            self._start()
        path = os.fsencode(crumb_path)[:_PATH_MAX]
        line = timed_out.encode()[:_LINE_MAX]
        self.page[_PATH_AT:_PATH_AT + len(path)] = path
        self.page[_LINE_AT:_LINE_AT + len(line)] = line
        b = self.board
        b[_PATH_LEN] = len(path)
        b[_LINE_LEN] = len(line)
        b[_TIMEOUT_MS] = timeout_ms
        b[_ARMED] += 1

    def disarm(self) -> None:
        b = self.board
        b[_ARMED] = max(0, b[_ARMED] - 1)

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, its calls counted on the board (an odd count while one runs)."""
        b = self.board

        def call(*args: Any) -> Any:
            s = b[_SEQ] + 1
            b[_SEQ] = s
            try:
                return fn(*args)
            finally:
                b[_SEQ] = s + 1

        return call


def _watch(board: memoryview, page: mmap.mmap, worker: int) -> None:
    """The watchdog's loop (in its own process): dies with the worker."""
    _die_with(worker)
    seen, since = -1, time.monotonic()
    while True:
        timeout_ms = board[_TIMEOUT_MS]
        time.sleep(min(MAX_TICK_S, max(MIN_TICK_S, timeout_ms / 10000.0)))
        if os.getppid() != worker:
            return
        seq, now = board[_SEQ], time.monotonic()
        if not board[_ARMED] or timeout_ms <= 0 or seq % 2 == 0:
            seen = -1
            continue
        if seq != seen:
            seen, since = seq, now
            continue
        if (now - since) * 1000 >= timeout_ms:
            path = bytes(page[_PATH_AT:_PATH_AT + board[_PATH_LEN]])
            with contextlib.suppress(OSError), open(path, "wb") as f:
                f.write(page[_LINE_AT:_LINE_AT + board[_LINE_LEN]])
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
            return


def _die_with(worker: int) -> None:
    """Close what the fork inherited (the worker's socket to Spark must close when the worker
    dies) and die with the worker."""
    os.closerange(3, _max_fd())
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - no prctl: the getppid check stays
        pass
    if os.getppid() != worker:
        os._exit(0)


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):  # pragma: no cover
        return 4096


_watchdog: Watchdog | None = None


def watchdog() -> Watchdog:
    """This process's watchdog (a forked child, e.g. a guard's helper, gets none of its
    parent's)."""
    global _watchdog
    if _watchdog is None or _watchdog.owner != os.getpid():
        _watchdog = Watchdog()
    return _watchdog
