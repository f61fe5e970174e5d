"""CPython's cyclic garbage collector while spillway's wrappers run partitions in a worker.

A Spark Python worker holds pyspark, pyarrow, pandas, gRPC and protobuf: several hundred
thousand objects that the collector walks whenever its oldest generation is due. A wrapper's
partition keeps many young objects alive for a while (an Arrow batch's Rows while the function
goes through them, failed records while their report waits), and with CPython's thresholds (a
young collection every 700 container allocations) that makes the oldest generation due over and
over: measured in a worker, Spark's Kafka source rows took 4.7-5.2 µs each to convert with the
default thresholds and 1.6-1.9 µs with a young collection every 5,000 or 20,000 allocations.

So while at least one wrapper runs a partition (or a UDF a task) in this process, the young
generation is collected every ``threshold`` container allocations; the older generations keep
their own thresholds, and the process's settings come back when the last one ends. Cyclic
garbage is still collected, a little later; reference counting frees the rest at once. A
collector the process disabled, or one whose young threshold is already as high, is left as it
is (so is one changed meanwhile: it is not set back).
"""

from __future__ import annotations

import gc
import os
import threading

#: Container allocations between young collections while a wrapper runs (CPython: 700); the
#: sidecar uses the same (`spillway.sidecar.runtime.gctune`).
YOUNG_THRESHOLD = 20_000


class _Scope:
    """The wrappers running in this process, and the thresholds to restore after the last."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.active = 0
        self.saved: tuple[int, ...] | None = None
        self.set_to: int = 0

    def enter(self, threshold: int) -> None:
        with self.lock:
            if self.pid != os.getpid():  # a fork of a worker: the parent's wrappers are not ours
                self.pid, self.active, self.saved = os.getpid(), 0, None
            self.active += 1
            if self.active > 1 or threshold <= 0 or not gc.isenabled():
                return
            current = gc.get_threshold()
            if current[0] < threshold:
                self.saved, self.set_to = current, threshold
                gc.set_threshold(threshold, *current[1:])

    def leave(self) -> None:
        with self.lock:
            if self.pid != os.getpid() or self.active == 0:
                return
            self.active -= 1
            if self.active == 0 and self.saved is not None:
                if gc.get_threshold()[0] == self.set_to:
                    gc.set_threshold(*self.saved)
                self.saved = None


_scope = _Scope()


def wrapper_started(threshold: int) -> None:
    """A wrapper's partition (or a UDF's task) starts in this process: young collections every
    ``threshold`` allocations until the last one ends (0: the collector is left alone)."""
    _scope.enter(threshold)


def wrapper_ended() -> None:
    """That partition or task ended (once per `wrapper_started`)."""
    _scope.leave()
