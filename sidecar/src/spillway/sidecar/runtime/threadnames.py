"""Each of the sidecar's Python threads under its own name in the operating system.

Python keeps a thread's name to itself (before 3.14): `top -H`, `ps -L` and /proc show every
thread of the sidecar as "python", so an operator cannot tell the drain producing to Kafka from
the threads deciding reports or the spool's writer. `name_os_threads()` (once, when `spillway
serve` starts as its own command, before its threads) gives each thread started through
`threading` from then on its Python name as its OS name, without the ``spillway-`` prefix
(Linux keeps 15 bytes): ``dlq-drain``, ``spool-writer``, ``rpc_0``, ...
(docs/OBSERVABILITY.md). gRPC's and librdkafka's own threads already carry names
(``event_engine``, ``rdk:broker...``).

How: `threading.setprofile` runs a function in each new thread before its ``run()``; that
function names the thread and removes itself at its first event, so a thread pays it once and
nothing after. Linux only (/proc/self/task/<tid>/comm); elsewhere nothing is done.
"""

from __future__ import annotations

import os
import sys
import threading

_PREFIX = "spillway-"
_COMM_BYTES = 15


def os_name(name: str) -> str:
    """The OS name of a thread called `name`: without the common prefix, at most 15 bytes."""
    short = name.removeprefix(_PREFIX) or name
    return short.encode("utf-8")[:_COMM_BYTES].decode("utf-8", "ignore")


def _first_event(frame, event, arg) -> None:
    sys.setprofile(None)   # once: the thread runs unprofiled from here on
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(os_name(threading.current_thread().name))
    except OSError:
        pass   # (a thread left unnamed runs as well)


def name_os_threads() -> bool:
    """Name every thread `threading` starts from now on (see above); False where the OS
    offers no way (then nothing is installed)."""
    if not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/comm"):
        return False
    threading.setprofile(_first_event)
    return True


__all__ = ["name_os_threads", "os_name"]
