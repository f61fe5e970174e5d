"""CPU time of benchmark processes from their own counters (``/proc/<pid>/stat``: utime +
stime, every thread of the process), for figures in CPU per record.

`parse_stat_cpu`, `cpu_used`, `us_per_record`, `per_core_ceiling`, `thread_role` and
`roles_used` are pure (tested in tests/unit/project/test_bench_harness.py); `cpu_seconds`,
`snapshot` and `threads` read /proc.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def parse_stat_cpu(text: str, ticks_per_s: int = TICKS_PER_S) -> float:
    """utime + stime in seconds from the text of ``/proc/<pid>/stat``.

    The command name (field 2) is in parentheses and may itself hold spaces and parentheses,
    so the fields are counted after the last ``)``: state is field 3, utime 14, stime 15."""
    if ticks_per_s <= 0:
        raise ValueError(f"ticks_per_s: must be > 0, got {ticks_per_s}")
    _, sep, rest = text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 13:
        raise ValueError(f"not a /proc/<pid>/stat line (no utime/stime after the command "
                         f"name): {text[:80]!r}")
    try:
        return (int(fields[11]) + int(fields[12])) / ticks_per_s
    except ValueError as exc:
        raise ValueError(f"/proc/<pid>/stat: utime/stime are not integers: "
                         f"{fields[11]!r}, {fields[12]!r}") from exc


def cpu_seconds(pid: int) -> float:
    """CPU seconds ``pid`` has used so far (all its threads; not its children)."""
    with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
        return parse_stat_cpu(fh.read())


def snapshot(pids: Iterable[int]) -> dict[int, float]:
    """CPU seconds of each process now."""
    return {pid: cpu_seconds(pid) for pid in pids}


def cpu_used(before: Mapping[int, float], after: Mapping[int, float],
             pids: Iterable[int] | None = None) -> float:
    """CPU seconds the processes ``pids`` (default: all of ``before``) used between two
    snapshots. A process missing from ``after`` or whose counter went back (a restarted
    process under the same pid) is an error, not a silent zero."""
    total = 0.0
    for pid in (before if pids is None else pids):
        if pid not in before or pid not in after:
            raise ValueError(f"process {pid}: not in both CPU snapshots (did it exit?)")
        delta = after[pid] - before[pid]
        if delta < 0:
            raise ValueError(f"process {pid}: CPU counter went back ({before[pid]} -> "
                             f"{after[pid]} s): not the same process")
        total += delta
    return total


def us_per_record(cpu_s: float, records: int) -> float:
    """Microseconds of CPU per record."""
    if records <= 0:
        raise ValueError(f"records: must be > 0, got {records}")
    return cpu_s * 1e6 / records


def per_core_ceiling(us: float) -> float:
    """Records per second one core sustains at ``us`` µs of CPU per record (a process that
    runs on one core, as a GIL-bound Python sidecar does)."""
    if us <= 0:
        raise ValueError(f"us: CPU per record must be > 0 to project a ceiling, got {us}")
    return 1e6 / us


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (e.g. the processes of a `sidecar.processes`
    supervisor), from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return sorted(out)


_GRPC_THREADS = frozenset({"event_engine", "grpc_global_tim", "lifeguard"})


def thread_role(comm: str) -> str:
    """What a thread does, from its OS name (`spillway serve` names its threads:
    runtime/threadnames.py): a pool's numbered threads together (``rpc_0``, ``rpc_1`` ->
    ``rpc_N``), librdkafka's as ``librdkafka``, gRPC's own as ``gRPC``."""
    if comm.startswith("rdk:"):
        return "librdkafka"
    if comm in _GRPC_THREADS or comm.startswith("Thread-"):
        return "gRPC"   # (``Thread-N (_serve)``: its Python server loop)
    return re.sub(r"\d+", "N", comm)


def threads(pids: Iterable[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """Each live thread of the processes: (pid, tid) -> (its role, CPU seconds so far)."""
    out: dict[tuple[int, int], tuple[str, float]] = {}
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8",
                          errors="replace") as fh:
                    comm = fh.read().strip()
                with open(f"/proc/{pid}/task/{tid}/stat", encoding="utf-8",
                          errors="replace") as fh:
                    out[(pid, int(tid))] = (thread_role(comm), parse_stat_cpu(fh.read()))
            except OSError:   # it ended meanwhile
                continue
    return out


def roles_used(before: Mapping[tuple[int, int], tuple[str, float]],
               after: Mapping[tuple[int, int], tuple[str, float]]) -> dict[str, float]:
    """CPU seconds by thread role between two `threads` snapshots: a thread started
    meanwhile counts from zero; one that ended meanwhile is not in ``after`` and not counted
    (its last seconds are the difference to the processes' own totals)."""
    used: dict[str, float] = {}
    for key, (role, cpu) in after.items():
        delta = cpu - before.get(key, (role, 0.0))[1]
        if delta > 0:
            used[role] = used.get(role, 0.0) + delta
    return used
