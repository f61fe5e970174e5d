"""Ports: the small interfaces through which the pure core reaches the world."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .model import DlqRecord


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds, monotonic: for schedules and windows."""

    def wall_ms(self) -> int:
        """Milliseconds since the epoch: for timestamps written out."""


class RandomSource(Protocol):
    def random(self) -> float:
        """Uniform in [0, 1)."""


class DeadLetterSink(Protocol):
    """Where dead-lettered records go (the spool + Kafka pipeline in production)."""

    def submit(self, records: Sequence[DlqRecord]) -> None:
        """Return once every record is durable; raise BackpressureError when full."""

    def wait_task(self, task_key: str, timeout_s: float) -> int:
        """Block until every record submitted under task_key is acknowledged by Kafka.

        Returns how many were acknowledged; raises FlushTimeoutError past timeout_s.
        """


class ErrorLogger(Protocol):
    def log_error(self, fields: dict[str, object]) -> None:
        """One structured line per error (errors.log.enable)."""


class SystemClock:
    import time as _time

    def monotonic(self) -> float:
        return self._time.monotonic()

    def wall_ms(self) -> int:
        return self._time.time_ns() // 1_000_000
