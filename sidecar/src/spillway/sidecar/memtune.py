"""Which allocator `spillway serve` runs on, so that memory taken by a burst goes back after it.

CPython's small-object allocator (pymalloc) carves 1 MiB arenas into pools and hands an arena
back to the OS only once every object in it is gone. A DLQ burst (a Kafka outage read back from
the spool, a poison flood) allocates millions of short-lived objects interleaved with a few that
outlive it (a job's state, the producer's queues, caches); those few keep most arenas resident:
a sidecar that drained a 1,000,000-record outage stayed at 113 MB against 56 MB at rest (bench
target 7, issue 12). On glibc's malloc (`PYTHONMALLOC=malloc`) the same objects live in the C
heap, whose free pages `malloc_trim` (called when the drain goes idle, dlq/spool.py) returns
wherever they sit: 85 MB after the same drain.

The allocator is chosen when the interpreter starts, so `spillway serve` re-executes itself
once with PYTHONMALLOC=malloc. An operator's own PYTHONMALLOC (``pymalloc`` to keep CPython's
allocator) is left alone, as is every platform but glibc's, where malloc_trim does not exist.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger("spillway.sidecar")

ENV = "PYTHONMALLOC"
CHOICE = "malloc"


def _glibc() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return hasattr(ctypes.CDLL(None), "malloc_trim")
    except OSError:
        return False


def wanted(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether the process should re-execute on glibc's malloc: on glibc, when nobody chose an
    allocator yet."""
    return ENV not in environ and _glibc()


def allocator() -> str:
    """The allocator this interpreter runs on, as PYTHONMALLOC names it (for the start-up log)."""
    name = os.environ.get(ENV, "")
    return name or "pymalloc"


def reexec_on_system_malloc() -> None:
    """Replace this process with the same command line on glibc's malloc; returns only when
    that is not wanted or not possible (then pymalloc stays, with a debug line)."""
    if not wanted():
        return
    orig = list(getattr(sys, "orig_argv", []) or [])
    if not orig or not sys.executable:
        log.debug("allocator: the interpreter's command line is unknown, staying on pymalloc")
        return
    os.environ[ENV] = CHOICE  # also the loop guard: the new process sees it and goes on
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        # argv[0] as sys.executable: a bare "python" would be looked up on PATH again and
        # could leave the virtualenv
        os.execv(sys.executable, [sys.executable, *orig[1:]])
    except OSError as exc:  # pragma: no cover - the interpreter that runs us can run again
        del os.environ[ENV]
        log.warning("allocator: cannot re-execute on glibc's malloc (%s), staying on pymalloc",
                    exc)
