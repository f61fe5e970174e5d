"""Marker exceptions user code may raise to tell the sidecar how to classify a failure.

Each maps to a KIP-1050 category (plus DATA for poison records); the report carries it as
``ExceptionInfo.marker_category`` and the sidecar uses it before its own rules. A marker may
wrap the real error: ``raise RetriableError("db busy", cause=exc)`` (or ``raise ... from exc``).

    SpillwayMarker
    ├── RetriableError                  retriable: wait and run the record again
    │   └── RefreshRetriableError       refresh-retriable: run the stage's refresh hook, then retry
    ├── AbortableError                  abortable: abort the partition attempt (Spark re-runs it)
    ├── ApplicationRecoverableError     application-recoverable
    ├── InvalidConfigurationError       invalid-configuration: fails the job at once
    ├── DataError                       data: a poison record, never retried; tolerance decides
    ├── WorkerCrashError                crash: the process running the record died on it
    └── RecordTimeoutError              timeout: the record outlasted errors.record.timeout.ms

The last two are what spillway reports for a record that killed its Python worker (a signal,
an exit, the OOM killer) or ran past ``errors.record.timeout.ms`` (docs/POLICY.md, "When a record
kills or hangs its worker"); decided like data errors unless a classification rule on their
class says otherwise.
"""

from __future__ import annotations

from typing import ClassVar


class SpillwayMarker(Exception):
    """Base of the marker exceptions; ``category`` is the KIP category name."""

    category: ClassVar[str] = ""

    def __init__(self, message: str = "", *, cause: BaseException | None = None) -> None:
        super().__init__(message)
        if cause is not None:
            self.__cause__ = cause


class RetriableError(SpillwayMarker):
    category = "retriable"


class RefreshRetriableError(RetriableError):
    category = "refresh-retriable"


class AbortableError(SpillwayMarker):
    category = "abortable"


class ApplicationRecoverableError(SpillwayMarker):
    category = "application-recoverable"


class InvalidConfigurationError(SpillwayMarker):
    category = "invalid-configuration"


class DataError(SpillwayMarker):
    category = "data"


class WorkerCrashError(SpillwayMarker):
    """The process running the record died while it ran (``signal``: the signal that killed it,
    ``exit_status``: its exit status otherwise; the message says which)."""

    category = "crash"

    def __init__(self, message: str = "", *, signal: int | None = None,
                 exit_status: int | None = None, cause: BaseException | None = None) -> None:
        super().__init__(message, cause=cause)
        self.signal, self.exit_status = signal, exit_status


class RecordTimeoutError(SpillwayMarker):
    """The record ran past ``errors.record.timeout.ms`` (``timeout_ms``) and was stopped."""

    category = "timeout"

    def __init__(self, message: str = "", *, timeout_ms: int = 0,
                 cause: BaseException | None = None) -> None:
        super().__init__(message, cause=cause)
        self.timeout_ms = timeout_ms


def marker_category_name(exc: BaseException) -> str | None:
    """The category name when ``exc`` is (or derives from) a marker, else None."""
    return exc.category if isinstance(exc, SpillwayMarker) and exc.category else None
