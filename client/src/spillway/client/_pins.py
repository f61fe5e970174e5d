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

import threading
from collections import OrderedDict

from ._channel import SCHEMES

MAX_PINS = 10_000

_lock = threading.Lock()
_pins: OrderedDict[tuple[str, str, str], str] = OrderedDict()


def pinned_target(target: str, port: int) -> str:
    """``target`` with its port replaced ('' when it is not host:port: a Unix socket, a
    scheme the resolver expands)."""
    if not port or "://" in target or target.startswith(SCHEMES):
        return ""
    host, sep, _ = target.rpartition(":")
    return f"{host}:{int(port)}" if sep and host else ""


def pin(target: str, job: str, run_id: str, port: int) -> None:
    where = pinned_target(target, port)
    key = (target, job, run_id)
    with _lock:
        if not where:
            _pins.pop(key, None)
            return
        _pins[key] = where
        _pins.move_to_end(key)
        while len(_pins) > MAX_PINS:
            _pins.popitem(last=False)


def lookup(target: str, job: str, run_id: str) -> str:
    """The run's pinned target, else ``target``."""
    if not run_id:
        return target
    with _lock:
        return _pins.get((target, job, run_id), target)


def forget(target: str, job: str, run_id: str) -> None:
    with _lock:
        _pins.pop((target, job, run_id), None)
