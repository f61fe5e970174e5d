"""``errors.record.timeout.ms`` in a task attempt that runs its records in the worker itself.

A record that hangs may hang in C code that holds the GIL (a regular expression, a library
call without a timeout): no thread of the worker can stop it, and no signal handler written in
Python runs. So the limit is kept by a *watchdog process*, started once per Python worker the
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
import subprocess
import sys
import tempfile
import time
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
        # a file the watchdog maps too (it is a new program: an anonymous page would not reach it)
        self._file = _board_file()
        self.page = mmap.mmap(self._file.fileno(), 4096, flags=mmap.MAP_SHARED)
        self.board = memoryview(self.page).cast("q")
        self.pid = 0
        self._proc: subprocess.Popen | None = None

    def _start(self) -> None:
        # A new interpreter, not a fork: a fork of a worker whose gRPC threads run inherits
        # gRPC's at-fork state, which killed the watchdog (seen in CI), leaving records unwatched.
        fd = self._file.fileno()
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _program(), str(fd), str(self.owner)],
            pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self.pid = self._proc.pid

    def _running(self) -> bool:
        """Whether the watchdog still runs (it dies with the thread that started it, and that
        thread may have ended); reaps it when it does not."""
        return self._proc is not None and self._proc.poll() is None

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
    """Die with the worker (the kernel's parent-death signal, and a check for a worker that
    died before it was set)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - no prctl: the getppid check stays
        pass
    if os.getppid() != worker:
        os._exit(0)


def _board_file():
    """The board's backing file: in memory (memfd) where Linux has it, else a temporary file."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("spillway-watchdog")   # close-on-exec: only the watchdog gets it
        f = os.fdopen(fd, "w+b")
    else:  # pragma: no cover - not Linux
        f = tempfile.TemporaryFile()
    f.truncate(4096)
    return f


_source: str | None = None


def _program() -> str:
    """This module's source, run by the watchdog's interpreter as its program (found through
    the module's loader, so a zipped package works too)."""
    global _source
    if _source is None:
        import inspect

        _source = inspect.getsource(sys.modules[__name__])
    return _source


def _main(argv: list[str]) -> None:
    """The watchdog process: map the board (fd ``argv[1]``), watch worker ``argv[2]``."""
    fd, worker = int(argv[1]), int(argv[2])
    page = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED)
    os.close(fd)   # the mapping stays
    _watch(memoryview(page).cast("q"), page, worker)


_watchdog: Watchdog | None = None


def watchdog() -> Watchdog:
    """This process's watchdog (a forked child, e.g. a guard's helper, gets none of its
    parent's)."""
    global _watchdog
    if _watchdog is None or _watchdog.owner != os.getpid():
        _watchdog = Watchdog()
    return _watchdog


if __name__ == "__main__":   # the watchdog's own interpreter (`Watchdog._start`)
    try:
        _main(sys.argv)
    finally:
        os._exit(0)
