"""Which task attempts run their records guarded (`_guard`), from what earlier attempts of the
same task left on this node.

A Python worker that a record kills (a signal, ``os._exit``, the OOM killer, or the watchdog
past ``errors.record.timeout.ms``) runs no cleanup and tells nobody: Spark only sees the worker
gone and runs the task again, up to ``spark.task.maxFailures`` times. So every attempt of a
wrapped partition leaves a *crumb*, a small file named after its task and attempt, holding its
process id and start time: written when the attempt starts, removed when it succeeds, marked
ended when it fails in a way its process survives (a FAIL verdict, an unreachable sidecar).
Nothing is written per record.

An attempt after the first (``attemptNumber > 0``) reads the earlier attempts' crumbs:

- a crumb still marked running whose process is gone: that attempt died. This attempt runs
  every record of the partition guarded, each in a helper process, so that the record that
  kills (or hangs) is found, reported as a failure of category crash (or timeout) and decided
  by the policy, while every other record comes out once, from the helper;
- no crumb for some earlier attempt (it ran on another node, or the directory was cleared):
  read the same way, to be safe;
- otherwise (earlier attempts ended, or are still running: a speculative copy) it runs as the
  first did.

Two records that kill in one partition need no third attempt: the guarded attempt finds both.
Crumbs live in ``$SPILLWAY_CRUMB_DIR``, else ``<tmp>/spillway-crumbs-<uid>`` (mode 0700); crumbs
older than `STALE_S` (of runs that failed or workers that vanished) are removed once per
process.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._guard import Guard
from ._watchdog import watchdog

log = logging.getLogger("spillway.spark")

CRUMB_DIR_ENV = "SPILLWAY_CRUMB_DIR"
#: Crumbs older than this are removed (a task's attempts are minutes apart, not days).
STALE_S = 24 * 3600
_RUNNING, _ENDED, _TIMED_OUT = "running", "ended", "timeout"


def crumb_dir() -> str:
    configured = os.environ.get(CRUMB_DIR_ENV, "").strip()
    if configured:
        return configured
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"spillway-crumbs-{uid}")


def task_key(*parts: object) -> str:
    """A task's crumb name: a digest of what identifies its input (run, wrapper and its use,
    micro-batch, Spark stage, partition), the same for every attempt."""
    return hashlib.sha256(repr(parts).encode("utf-8", "backslashreplace")).hexdigest()[:32]


def process_start(pid: int) -> str:
    """The process's start time (Linux: clock ticks since boot), to tell a reused pid apart;
    "" where it cannot be read."""
    if pid == _own_start[0]:
        return _own_start[1]
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return ""
    fields = stat[stat.rfind(b")") + 2:].split()
    start = fields[19].decode() if len(fields) > 19 else ""
    if pid == os.getpid():
        _own_start[:] = [pid, start]   # read once per process (a crumb per task has it)
    return start


_own_start: list = [0, ""]


def alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not start or process_start(pid) in ("", start)


@dataclass(frozen=True)
class Earlier:
    """What the earlier attempts of a task left: ``died``, attempts whose process died while
    running; ``unknown``, attempts that left nothing here."""

    died: tuple[int, ...] = ()
    unknown: tuple[int, ...] = ()
    timed_out: tuple[int, ...] = ()   # those of ``died`` the watchdog stopped

    @property
    def at_risk(self) -> bool:
        return bool(self.died or self.unknown)

    def describe(self) -> str:
        parts = []
        crashed = [n for n in self.died if n not in self.timed_out]
        if crashed:
            parts.append(f"attempt(s) {', '.join(map(str, crashed))} died on this node")
        if self.timed_out:
            parts.append(f"attempt(s) {', '.join(map(str, self.timed_out))} stopped past "
                         f"errors.record.timeout.ms")
        if self.unknown:
            parts.append(f"attempt(s) {', '.join(map(str, self.unknown))} left no crumb here")
        return "; ".join(parts)


class Crumbs:
    """The node's crumb directory."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory or crumb_dir()
        self._ready = False

    def _path(self, key: str, attempt: int) -> str:
        return os.path.join(self.directory, f"{key}.{attempt}")

    def _prepare(self) -> None:
        if self._ready:
            return
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._prune()
        self._ready = True

    def _prune(self) -> None:
        cutoff = time.time() - STALE_S
        with contextlib.suppress(OSError), os.scandir(self.directory) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)

    def earlier(self, key: str, attempt: int) -> Earlier:
        """What attempts 0 .. ``attempt - 1`` of task ``key`` left here."""
        died, unknown, timed_out = [], [], []
        for n in range(attempt):
            try:
                with open(self._path(key, n)) as f:
                    state, pid, start = (f.read().split() + ["", "", ""])[:3]
            except OSError:
                unknown.append(n)
                continue
            if state in (_RUNNING, _TIMED_OUT) and pid.isdigit() and int(pid) != os.getpid() \
                    and not alive(int(pid), start):
                died.append(n)
                if state == _TIMED_OUT:
                    timed_out.append(n)
        return Earlier(tuple(died), tuple(unknown), tuple(timed_out))

    def begin(self, key: str, attempt: int) -> Crumb | None:
        """Leave this attempt's crumb; None (and a log line) where the directory is unusable:
        a later attempt then reads this one as unknown, and runs guarded."""
        try:
            self._prepare()
            crumb = Crumb(self, key, attempt)
            crumb.write(_RUNNING)
            return crumb
        except OSError as exc:
            log.warning("spillway: cannot leave a crumb in %s (%s): a retry of this task will "
                        "run its records guarded", self.directory, exc)
            return None


class Crumb:
    """One attempt's crumb."""

    def __init__(self, crumbs: Crumbs, key: str, attempt: int) -> None:
        self.crumbs, self.key, self.attempt = crumbs, key, attempt
        self.path = crumbs._path(key, attempt)  # noqa: SLF001 - its own directory's layout
        self.pid = os.getpid()

    def line(self, state: str) -> str:
        return f"{state} {self.pid} {process_start(self.pid)}\n"

    def write(self, state: str) -> None:
        with open(self.path, "w") as f:
            f.write(self.line(state))

    def end(self, ok: bool) -> None:
        """The attempt is over and its process lives: a success takes the task's crumbs away
        (no attempt of it comes after a success), a failure leaves "ended" for the next."""
        if self.pid != os.getpid():
            return  # a forked copy: the crumb is its parent's
        with contextlib.suppress(OSError):
            if not ok:
                self.write(_ENDED)
                return
            for n in range(self.attempt + 1):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.crumbs._path(self.key, n))  # noqa: SLF001


_crumbs: Crumbs | None = None


def crumbs() -> Crumbs:
    """This process's view of the node's crumb directory (its environment read once)."""
    global _crumbs
    if _crumbs is None or _crumbs.directory != crumb_dir():
        _crumbs = Crumbs()
    return _crumbs


class TaskIsolation:
    """One task attempt's isolation: its crumb; its guards when it runs guarded; else, with a
    record timeout, the worker's watchdog armed for it (`_watchdog`)."""

    def __init__(self, crumb: Crumb | None, earlier: Earlier, timeout_ms: int = 0,
                 label: str = "") -> None:
        self.crumb = crumb
        self.earlier = earlier
        self.guarded = earlier.at_risk
        self.timeout_ms = timeout_ms
        # records timed by the watchdog: a record timeout, not guarded, and a crumb to mark
        self.timed = bool(timeout_ms) and not self.guarded and crumb is not None
        self._guards: list[Guard] = []
        self._armed = False
        if self.guarded:
            log.warning("spillway: %s runs its records guarded, each in a helper process (%s)",
                        label or "this task attempt", earlier.describe())

    @property
    def wraps(self) -> bool:
        """Whether `wrap` changes a function (whose outputs must then be materialized where it
        runs: `_adapters.listed`, `batch_outputs`, `unvalued`)."""
        return self.guarded or self.timed

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` guarded when this attempt runs guarded (its result must be picklable), timed
        by the watchdog when it has a record timeout, else ``fn`` itself."""
        if self.guarded:
            guard = Guard(fn, timeout_ms=self.timeout_ms)
            self._guards.append(guard)
            return guard
        if self.timed:
            dog = watchdog()
            if not self._armed:
                assert self.crumb is not None
                dog.arm(self.crumb.path, self.crumb.line(_TIMED_OUT), self.timeout_ms)
                self._armed = True
            return dog.timed(fn)
        return fn

    def end(self, ok: bool) -> None:
        """The attempt is over (its process lives): stop the helpers, disarm the watchdog,
        leave the crumb's word."""
        guards, self._guards = self._guards, []
        for guard in guards:
            guard.close()
        if self._armed:
            self._armed = False
            watchdog().disarm()
        if self.crumb is not None:
            self.crumb.end(ok)


def begin_task(parts: tuple[Any, ...], attempt: int, timeout_ms: int = 0,
               label: str = "") -> TaskIsolation:
    """Attempt ``attempt`` of the task ``parts`` identify (see `task_key`) starts."""
    c = crumbs()
    key = task_key(*parts)
    earlier = c.earlier(key, attempt) if attempt > 0 else Earlier()
    return TaskIsolation(c.begin(key, attempt), earlier, timeout_ms, label)
