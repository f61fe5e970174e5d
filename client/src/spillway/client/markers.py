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
    └── DataError                       data: a poison record, never retried; tolerance decides
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


def marker_category_name(exc: BaseException) -> str | None:
    """The category name when ``exc`` is (or derives from) a marker, else None."""
    return exc.category if isinstance(exc, SpillwayMarker) and exc.category else None
