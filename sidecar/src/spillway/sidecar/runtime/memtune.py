"""Which allocator `spillway serve` runs on, so that memory taken by a burst goes back after it.

CPython's small-object allocator (pymalloc) carves 1 MiB arenas into pools and hands an arena
back to the OS only once every object in it is gone. A DLQ burst (a Kafka outage read back from
the spool, a poison flood) allocates millions of short-lived objects interleaved with a few that
outlive it (a job's state, the producer's queues, caches); those few keep most arenas resident:
a sidecar that drained a 1,000,000-record outage stayed at 113 MB against 56 MB at rest (bench
target 7, issue 12). On glibc's malloc (`PYTHONMALLOC=malloc`) the same objects live in the C
heap, whose free pages `malloc_trim` returns wherever they sit: 85 MB after the same drain.

The allocator is chosen when the interpreter starts, so `spillway serve` re-executes itself
once with PYTHONMALLOC=malloc. An operator's own PYTHONMALLOC (``pymalloc`` to keep CPython's
allocator) is left alone, as is every platform but glibc's, where malloc_trim does not exist.

Freed heap goes back with `release_memory()`: when a drained spool empties (dlq/settle.py), when
the drain goes idle after a backlog (dlq/drain.py), and once job runs have ended and the
sidecar has been quiet for a moment (`Trimmer`: a run's state is many small objects, and an idle
process allocates nothing that would reuse their pages).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("spillway.sidecar")

ENV = "PYTHONMALLOC"
CHOICE = "malloc"


def _load_malloc_trim() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)`` (hands freed heap pages back to the OS), or None elsewhere."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return None
        fn = ctypes.CDLL(None).malloc_trim  # the process's own libc
    except (ValueError, OSError, AttributeError):  # not glibc: no malloc_trim
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return lambda: fn(0)


_malloc_trim = _load_malloc_trim()


def release_memory() -> None:
    """Collect cyclic garbage, then give freed heap memory back to the OS (malloc_trim: glibc
    only). Called once a backlog has drained: an idle process allocates nothing, so the
    collector (tuned to run rarely, gctune.py) would otherwise not run again, and cycles left
    by the burst would keep Python's arenas resident."""
    gc.collect()
    if _malloc_trim is not None:
        try:
            _malloc_trim()
        except Exception:  # pragma: no cover - never let housekeeping fail a drain
            log.debug("malloc_trim failed", exc_info=True)


_M_ARENA_MAX = -8  # glibc's mallopt parameter numbers
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 128 * 1024  # glibc's initial value, kept fixed


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Cap glibc's per-thread malloc arenas (default 8 per core). A sidecar's gRPC pool,
    librdkafka and SQLite threads otherwise each fragment their own arena, and memory freed
    after a drain stays resident in them. Also fix the mmap threshold at 128 KiB: glibc raises
    it (up to 32 MiB) each time an mmapped block is freed, after which the large buffers of a
    burst (request messages of 256 records, producer batches) come from the heap, fragment it
    and stay resident after the drain (bench target 7: 20 MB less after a 1M-record drain).
    Call before threads start; MALLOC_ARENA_MAX / MALLOC_MMAP_THRESHOLD_ in the environment
    win. Returns whether the arena cap was set."""
    if _malloc_trim is None:
        return False
    try:
        libc = ctypes.CDLL(None)
        if not os.environ.get("MALLOC_MMAP_THRESHOLD_"):
            libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        if os.environ.get("MALLOC_ARENA_MAX"):
            return False
        return bool(libc.mallopt(_M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        return False


def _glibc() -> bool:
    return sys.platform.startswith("linux") and _malloc_trim is not None


def wanted(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether the process should re-execute on glibc's malloc: on glibc, when nobody chose an
    allocator yet."""
    return ENV not in environ and _glibc()


def allocator() -> str:
    """The allocator this interpreter runs on, as PYTHONMALLOC names it (for the start-up log)."""
    name = os.environ.get(ENV, "")
    return name or "pymalloc"


class Trimmer:
    """Calls `release_memory()` once at least `threshold` units of state (ended job runs) were
    freed and nothing more was freed for `quiet_s`: a burst of EndJobs is trimmed once, after
    it, never per call. One daemon thread, started on first use; `freed()` is cheap."""

    def __init__(self, *, threshold: int = 100, quiet_s: float = 1.0,
                 release: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self.quiet_s = quiet_s
        self._release = release or release_memory
        self._clock = clock
        self._cond = threading.Condition()
        self._pending = 0
        self._last = 0.0
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.trims = 0

    def freed(self, units: int = 1) -> None:
        with self._cond:
            if self._stopped:
                return
            self._pending += units
            self._last = self._clock()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="spillway-trim",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and self._pending < self.threshold:
                    self._cond.wait()
                if self._stopped:
                    return
                wait = self._last + self.quiet_s - self._clock()
                if wait > 0:  # still freeing: trim after the burst
                    self._cond.wait(wait)
                    continue
                self._pending = 0
            try:
                self._release()
                self.trims += 1
                log.debug("job runs ended: freed heap handed back to the OS")
            except Exception:  # pragma: no cover - housekeeping never stops the sidecar
                log.debug("releasing memory failed", exc_info=True)
