"""Failed records for tests that drive a sidecar by hand, or its builder of DLQ records."""

from __future__ import annotations

from spillway.sidecar.core.model import FailedRecord
from spillway.v1 import sidecar_pb2 as pb


class SharedTrace(FailedRecord):
    """A record whose (traceparent, tracestate) tuple is shared with every record of the same
    trace, as a report's columns give them (`ColumnRecord.trace`): the DLQ record builder works
    a trace out once and reuses it (its streaks rely on it)."""

    __slots__ = ()
    _pairs: dict = {}

    @property
    def trace(self):
        pair = (self.traceparent, self.tracestate)
        return self._pairs.setdefault(pair, pair)


def value_errors(*ids: str) -> list[pb.FailedRecord]:
    """One transformation-stage ValueError record per id: key ``id``, value ``value of id``."""
    return [pb.FailedRecord(
        record_id=rid, stage=pb.STAGE_TRANSFORMATION, function_name="app.parse",
        key=rid.encode(), value=b"value of " + rid.encode(),
        exception=pb.ExceptionInfo(class_name="builtins.ValueError", message="bad",
                                   class_chain=["builtins.ValueError"])) for rid in ids]


def json_error(cls: str = "json.decoder.JSONDecodeError", msg: str = "Expecting value",
               **hints) -> pb.ExceptionInfo:
    """A data error as a Python executor reports it (class chain, message, a stack trace)."""
    return pb.ExceptionInfo(class_name=cls, class_chain=[cls, "builtins.ValueError",
                                                         "builtins.Exception"],
                            message=msg, stack_trace=f'File "app.py", line 3\n{cls}: {msg}',
                            **hints)
