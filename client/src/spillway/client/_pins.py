"""Which process of a sidecar a run's calls go to, when the sidecar is several processes behind
one address (its ``sidecar.processes``).

A new connection to such an address may land on any of its processes. RegisterJobResponse
names the process that answered (``process_port``, on the host the client dialled); this
process's later calls for that run go there, so that a task's flush barrier waits on the spool
that holds its records and a driver's EndJob reaches the run's home. Process-wide (a driver
builds a client per call), keyed by (target, job, run id), bounded: past `MAX_PINS` the oldest
pin is forgotten and that run's calls go to the shared address again.
"""

from __future__ import annotations

from ._channel import SCHEMES
from ._runtable import RunTable

MAX_PINS = 10_000

_pins = RunTable(MAX_PINS)


def pinned_target(target: str, port: int) -> str:
    """``target`` with its port replaced ('' when it is not host:port: a Unix socket, a
    scheme the resolver expands)."""
    if not port or "://" in target or target.startswith(SCHEMES):
        return ""
    host, sep, _ = target.rpartition(":")
    return f"{host}:{int(port)}" if sep and host else ""


def pin(target: str, job: str, run_id: str, port: int) -> None:
    where = pinned_target(target, port)
    if where:
        _pins.put((target, job, run_id), where)
    else:
        _pins.pop((target, job, run_id))


def lookup(target: str, job: str, run_id: str) -> str:
    """The run's pinned target, else ``target``."""
    return _pins.get((target, job, run_id), target) if run_id else target


def forget(target: str, job: str, run_id: str) -> None:
    _pins.pop((target, job, run_id))
