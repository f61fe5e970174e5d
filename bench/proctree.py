"""CPU used by a process tree over a span, exited processes included, read on a thread.

Reading a tree's counters only at both ends of a span misses what the tree's processes did
when they exit in between without their parent waiting for them: a PySpark daemon ignores
SIGCHLD, so the kernel reaps its workers and their CPU reaches nobody's cutime (a long-lived
worker that exits takes minutes of CPU out of the tree: a negative "CPU per row"), and a
process whose parent exited is re-parented out of the tree. So `TreeCpu` reads the tree every
``interval_s`` and keeps, per process (pid and start time: a pid may be reused), the first and
the last reading of its own CPU and of its waited-for children's:

    used = sum over processes of (last - first), own and reaped
           - for each process gone whose parent, still in the tree, waits for its children:
             the process's last reading (now in the parent's reaped CPU too)

A process that exits loses at most its last ``interval_s`` of CPU; one that starts and exits
between two readings counts only where its parent waits for it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_SIGCHLD_BIT = 1 << (17 - 1)   # SIGCHLD is 17 on Linux; SigIgn's bit n-1 is signal n

Key = tuple[int, int]          # (pid, start time in ticks since boot)


@dataclass
class Stat:
    """One reading of a process: its parent, start time, own and reaped CPU (ticks)."""

    ppid: int
    start: int
    own: int
    reaped: int


def parse_stat(text: str) -> Stat:
    """A `Stat` from the text of ``/proc/<pid>/stat`` (fields after the command name, which
    may hold spaces and parentheses: ppid 4, utime 14, stime 15, cutime 16, cstime 17,
    starttime 22)."""
    _, sep, rest = text.rpartition(")")
    f = rest.split()
    if not sep or len(f) < 20:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    return Stat(ppid=int(f[1]), start=int(f[19]), own=int(f[11]) + int(f[12]),
                reaped=int(f[13]) + int(f[14]))


def read_stat(pid: int) -> Stat | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            return parse_stat(fh.read())
    except (OSError, ValueError):
        return None


def ignores_sigchld(pid: int) -> bool:
    """Whether ``pid`` ignores SIGCHLD, so that the kernel reaps its children (their CPU then
    reaches no parent's counters)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) & _SIGCHLD_BIT)
    except (OSError, ValueError):
        pass
    return False


def all_pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


class Tally:
    """The pure bookkeeping of `TreeCpu`: readings in, ticks used out (tested with made-up
    readings in tests/unit/project/test_bench_harness.py)."""

    def __init__(self) -> None:
        self.first: dict[Key, Stat] = {}
        self.last: dict[Key, Stat] = {}
        self.members: set[Key] = set()
        self.double: int = 0        # last readings already in a waiting parent's reaped CPU

    def scan(self, roots: Iterable[int], stats: dict[int, Stat],
             ignores: Callable[[int], bool], *, baseline: bool = False) -> None:
        """One reading of every live process (``stats``); members are ``roots`` and whatever
        descends from a member. ``baseline``: the span's first reading (a process already
        running then counts from its counters at that moment; one that starts later, from 0).
        ``ignores(pid)``: whether that parent ignores SIGCHLD (its gone children's CPU is then
        nowhere else)."""
        keys = {pid: (pid, st.start) for pid, st in stats.items()}
        live: set[Key] = set()
        roots = set(roots)
        for pid in sorted(stats, key=lambda p: stats[p].start):   # parents before children
            st, key = stats[pid], keys[pid]
            parent = keys.get(st.ppid)
            if key in self.members or pid in roots or (parent is not None
                                                       and parent in self.members):
                self.members.add(key)
                live.add(key)
                if key not in self.first:
                    self.first[key] = st if baseline else Stat(st.ppid, st.start, 0, 0)
                self.last[key] = st
        for key in [k for k in self.last if k not in live]:
            st = self.last.pop(key)
            parent = keys.get(st.ppid)
            # gone: its parent, still here and waiting for children, has its CPU as reaped
            if parent is not None and parent in live and not ignores(st.ppid):
                self.double += st.own + st.reaped
            self.first[key] = Stat(st.ppid, st.start, self.first[key].own - st.own,
                                   self.first[key].reaped - st.reaped)   # keep its (- delta)

    def ticks(self) -> int:
        """Ticks used since the baseline by every member, live or gone."""
        total = -self.double
        for key, first in self.first.items():
            last = self.last.get(key)
            if last is None:        # gone: `first` holds -(its last - its first)
                total -= first.own + first.reaped
            else:
                total += (last.own - first.own) + (last.reaped - first.reaped)
        return total


class TreeCpu:
    """CPU seconds the processes under ``roots()`` use from `start` to `stop`, read every
    ``interval_s`` on a thread. ``pids()``: the processes to look at each time (default every
    process: re-parented ones are found; a narrower list is cheaper)."""

    def __init__(self, roots: Callable[[], Iterable[int]], *, interval_s: float = 0.2,
                 pids: Callable[[], Iterable[int]] = all_pids) -> None:
        self._roots, self._pids, self._interval = roots, pids, interval_s
        self._tally = Tally()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _read(self, baseline: bool = False) -> None:
        stats = {}
        for pid in self._pids():
            st = read_stat(pid)
            if st is not None:
                stats[pid] = st
        with self._lock:
            self._tally.scan(self._roots(), stats, ignores_sigchld, baseline=baseline)

    def start(self) -> TreeCpu:
        self._read(baseline=True)
        self._thread = threading.Thread(target=self._loop, name="bench-treecpu", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self._read()

    def stop(self) -> float:
        """CPU seconds used since `start` (the reading thread stops)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._read()
        with self._lock:
            return self._tally.ticks() / TICKS_PER_S
