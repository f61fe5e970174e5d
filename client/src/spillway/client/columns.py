"""Failed records as columns: the executor's side of a columnar report (RecordColumns).

`failure()` takes `report.failed_record()`'s arguments but builds no protobuf message: a
`Failure` keeps the record's own values and a reference to its way of failing (stage, function,
payload and exception, formatted once and shared by every record that failed alike). It reads
like a FailedRecord (the same field names) and `to_pb()` makes one for a sidecar that takes no
columns. `encode()` turns one report's failures into a RecordColumns: each way of failing once,
every per-record value in a list or a packed column. `verdicts()` reads the answer's columns
back as `ColumnVerdict` values with pb.Verdict's field names.

A client sends columns only to a sidecar whose RegisterJobResponse said it takes them
(`note()` / `takes()`: process-wide, by target, job and run, bounded: `_runtable`).
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from opentelemetry.context import Context
from spillway.v1 import sidecar_pb2 as pb

from . import report
from ._runtable import RunTable
from ._stack import UNCACHED, frame_key, frame_signature
from .errors import SidecarProtocolError
from .markers import SpillwayMarker

_SWAP = sys.byteorder != "little"   # fixed-size columns are little-endian on the wire
NO_KEY, NO_VALUE, NO_TIMESTAMP = 1, 2, 4   # RecordColumns.absent
# TallyVerdicts.flags (the home protocol adds 16: logged by the home)
DEAD_LETTER, DEAD_LETTERED, JOB_FAILED, BUDGET_EXHAUSTED = 1, 2, 4, 8

# -- ways of failing ---------------------------------------------------------------------------

_MAX_KINDS = 4096
_kinds_lock = threading.Lock()
_exceptions: dict[tuple, tuple[tuple, pb.ExceptionInfo]] = {}
_NOT_ALIKE = (SpillwayMarker, *UNCACHED)   # described by more than class, message and frames


def _shared_exception(fields: dict[str, Any]) -> tuple[tuple, pb.ExceptionInfo]:
    """(key, message) of an exception's fields: records failing alike share one message and
    one key (never mutate them; a failure waiting for its report holds no tuples of its own)."""
    key = tuple((k, tuple(v) if type(v) is list else v) for k, v in fields.items())
    shared = _exceptions.get(key)
    if shared is None:
        shared = (key, pb.ExceptionInfo(**fields))
        with _kinds_lock:
            if len(_exceptions) >= _MAX_KINDS:
                _exceptions.clear()
            _exceptions[key] = shared
    return shared


# (class, message, frame signature) -> (code objects, key, message): an exception that carries
# nothing else (`report.hintless`: no hint attributes, no chain; no notes, not a marker, not a
# SyntaxError or group) describes exactly as the last one of its class that failed with the
# same message at the same place, so a failure like an earlier one formats nothing (its stack
# trace, the key's hash: 9 of 15 µs per failed record). The codes keep the signature's ids.
_alike: dict[tuple, tuple[tuple, tuple, pb.ExceptionInfo]] = {}
_ALIKE_MESSAGE_CHARS = 4096
# `_stack.frame_key`, or a C version equal where it is equal (`use_frame_key`)
_frame_key: Callable[[Any], Hashable] = frame_key


def use_frame_key(fn: Callable[[Any], Hashable] | None) -> None:
    """Compute failed records' frame signatures with ``fn``, whose keys must be equal exactly
    where `_stack.frame_key`'s tuples are (spillway.spark's C version, when built: the same
    values packed in bytes); None: the Python version again."""
    global _frame_key
    _frame_key = frame_key if fn is None else fn


def _exception_kind(exc: BaseException) -> tuple[tuple, pb.ExceptionInfo]:
    """`_shared_exception` of ``exc``'s fields, looked up without building them when an
    exception alike failed before."""
    tb = exc.__traceback__
    # (the table keeps a message whole: long ones go uncached)
    if tb is None or not report.hintless(exc) or isinstance(exc, _NOT_ALIKE) \
            or getattr(exc, "__notes__", None) is not None \
            or len(message := str(exc)) > _ALIKE_MESSAGE_CHARS:
        return _shared_exception(report.exception_fields(exc))
    alike = (type(exc), message, _frame_key(tb))
    hit = _alike.get(alike)
    if hit is not None:
        return hit[1], hit[2]
    codes = frame_signature(tb)[1]
    key, info = _shared_exception(report.exception_fields(exc))
    with _kinds_lock:
        if len(_alike) >= _MAX_KINDS:
            _alike.clear()
        _alike[alike] = (codes, key, info)
    return key, info


_kind_tuples: dict[tuple, tuple] = {}


def _shared_kind(kind: tuple) -> tuple:
    """One tuple per way of failing, shared by its failures (none of their own for the cyclic
    GC to look at while they wait for their report)."""
    with _kinds_lock:
        if len(_kind_tuples) >= _MAX_KINDS:
            _kind_tuples.clear()
        return _kind_tuples.setdefault(kind, kind)


# A class called with keywords gets them as a dict; its ``__init__`` called as a function gets
# them as they are (about 1 µs less for a `Failure`'s 15 values, built per failed record):
# `failure()` and `derive()` build their values so.
_new = object.__new__


class Failure:
    """One failed record, as `report.failed_record` would describe it, without a message."""

    __slots__ = ("record_id", "stage", "custom_stage", "function_name", "payload", "exception",
                 "kind", "source", "key", "value", "headers", "timestamp_ms", "attempt",
                 "traceparent", "tracestate")

    def __init__(self, record_id: str, *, stage: int, custom_stage: str, function_name: str,
                 payload: int, exception: pb.ExceptionInfo, kind: tuple,
                 source: tuple[str, int, int] | None, key: bytes | None, value: bytes | None,
                 headers: tuple, timestamp_ms: int | None, attempt: int, traceparent: str,
                 tracestate: str) -> None:
        """The values as given (`failure()` checks and converts them; ``kind`` is the key of
        the way of failing: records with one kind share stage, function, payload and
        exception in a report)."""
        self.record_id = record_id
        self.stage = stage
        self.custom_stage = custom_stage
        self.function_name = function_name
        self.payload = payload
        self.exception = exception
        self.kind = kind
        self.source = source
        self.key = key
        self.value = value
        self.headers = headers
        self.timestamp_ms = timestamp_ms
        self.attempt = attempt
        self.traceparent = traceparent
        self.tracestate = tracestate

    def derive(self, record_id: str, source: tuple[str, int, int] | None) -> Failure:
        """A record that failed as this one did, with its own id and source coordinates (the
        rest shared: a template's copies cost no formatting)."""
        f = _new(Failure)
        _init_failure(f, record_id, stage=self.stage, custom_stage=self.custom_stage,
                      function_name=self.function_name, payload=self.payload,
                      exception=self.exception, kind=self.kind, source=source, key=self.key,
                      value=self.value, headers=self.headers, timestamp_ms=self.timestamp_ms,
                      attempt=self.attempt, traceparent=self.traceparent,
                      tracestate=self.tracestate)
        return f

    def to_pb(self) -> pb.FailedRecord:
        """The FailedRecord message `report.failed_record` builds for the same arguments."""
        r = pb.FailedRecord(record_id=self.record_id, stage=self.stage,
                            custom_stage=self.custom_stage, function_name=self.function_name,
                            attempt=self.attempt, traceparent=self.traceparent,
                            tracestate=self.tracestate, payload=self.payload)
        r.exception.CopyFrom(self.exception)
        for k, v in self.headers:
            r.headers.add(key=k, value=v) if v is not None else r.headers.add(key=k)
        if self.source is not None:
            r.source.topic, r.source.partition, r.source.offset = self.source
        if self.key is not None:
            r.key = self.key
        if self.value is not None:
            r.value = self.value
        if self.timestamp_ms is not None:
            r.timestamp_ms = self.timestamp_ms
        return r

    def __repr__(self) -> str:
        return (f"Failure(record_id={self.record_id!r}, stage={self.stage}, "
                f"exception={self.exception.class_name!r}, attempt={self.attempt})")


_init_failure = Failure.__init__


def failure(record_id: str, stage: int | str, exc: BaseException, *, custom_stage: str = "",
            function_name: str = "", source: tuple[str, int, int] | None = None,
            key: bytes | str | None = None, value: bytes | str | None = None,
            headers: Iterable[tuple[str, bytes | str | None]] = (),
            timestamp_ms: int | None = None, attempt: int = 1, context: Context | None = None,
            payload: int | str | None = None) -> Failure:
    """`report.failed_record`'s record as a `Failure` (the same checks, the same fields).
    Built per failed record on the executors: the usual arguments (a stage value, bytes, an
    attempt number) take no checking call each."""
    if record_id and type(stage) is int and stage in _PLAIN_STAGES:
        stage_v = stage
    else:
        stage_v = report.checked_stage(record_id, stage, custom_stage)
    payload_v = pb.PAYLOAD_UNSPECIFIED if payload is None else report.payload_value(payload)
    exc_key, info = _exception_kind(exc)
    traceparent, tracestate = report.trace_context(context)
    if source is not None:
        topic, partition, offset = source
        source = (topic, int(partition), int(offset))
    as_bytes = report.as_bytes
    hs = tuple((k, as_bytes(v)) for k, v in headers) if headers else ()
    kind = (stage_v, custom_stage, function_name, payload_v, exc_key)
    kind = _kind_tuples.get(kind) or _shared_kind(kind)
    f = _new(Failure)
    _init_failure(f, record_id, stage=stage_v, custom_stage=custom_stage,
                  function_name=function_name, payload=payload_v, exception=info, kind=kind,
                  source=source,
                  key=key if key is None or type(key) is bytes else as_bytes(key),
                  value=value if value is None or type(value) is bytes else as_bytes(value),
                  headers=hs, timestamp_ms=None if timestamp_ms is None else int(timestamp_ms),
                  attempt=attempt if type(attempt) is int and attempt >= 1
                  else max(1, int(attempt)),
                  traceparent=traceparent, tracestate=tracestate)
    return f


_PLAIN_STAGES = frozenset(v for v in pb.Stage.values()
                          if v not in (pb.STAGE_UNSPECIFIED, pb.STAGE_CUSTOM))


# -- the report --------------------------------------------------------------------------------

def pack_le(values: array) -> bytes:
    """A packed column as the wire carries it (little-endian); the sidecar uses it too."""
    if _SWAP:
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def unpack_le(code: str, data: bytes) -> array:
    out = array(code, data)
    if _SWAP:
        out.byteswap()
    return out


def encode(failures: Sequence[Failure]) -> pb.RecordColumns:
    """One report's failures as columns, in order."""
    n = len(failures)
    ids: list[str] = []
    kinds: dict[tuple, int] = {}
    firsts: list[Failure] = []
    kind_ix = array("I", bytes(4 * n))
    keys: list[bytes] = []
    values: list[bytes] = []
    absent = bytearray(n)
    topics: dict[str, int] = {}
    topic_ix = partitions = offsets = timestamps = attempts = trace_ix = counts = None
    traces: dict[tuple[str, str], int] = {}
    headers: list[dict] = []
    any_absent = any_key = any_value = False
    for i, f in enumerate(failures):
        ids.append(f.record_id)
        ix = kinds.get(f.kind)
        if ix is None:
            ix = kinds[f.kind] = len(firsts)
            firsts.append(f)
        kind_ix[i] = ix
        k, v = f.key, f.value
        if k is None:
            absent[i] = NO_KEY
            any_absent = True
            keys.append(b"")
        else:
            any_key = True
            keys.append(k)
        if v is None:
            absent[i] |= NO_VALUE
            any_absent = True
            values.append(b"")
        else:
            any_value = True
            values.append(v)
        if f.timestamp_ms is None:
            absent[i] |= NO_TIMESTAMP
            any_absent = True
        else:
            if timestamps is None:
                timestamps = array("q", bytes(8 * n))
            timestamps[i] = f.timestamp_ms
        src = f.source
        if src is not None:
            if topic_ix is None:
                topic_ix, partitions, offsets = (array("I", bytes(4 * n)),
                                                 array("i", bytes(4 * n)),
                                                 array("q", bytes(8 * n)))
            topic_ix[i] = topics.setdefault(src[0], len(topics)) + 1
            partitions[i] = src[1]
            offsets[i] = src[2]
        if f.attempt != 1:
            if attempts is None:
                attempts = array("I", [1]) * n
            attempts[i] = f.attempt
        if f.traceparent:
            if trace_ix is None:
                trace_ix = array("I", bytes(4 * n))
            trace_ix[i] = traces.setdefault((f.traceparent, f.tracestate), len(traces)) + 1
        if f.headers:
            if counts is None:
                counts = array("I", bytes(4 * n))
            counts[i] = len(f.headers)
            headers += [{"key": hk, "value": hv} if hv is not None else {"key": hk}
                        for hk, hv in f.headers]
    out = pb.RecordColumns(
        record_ids=ids,
        kinds=[{"stage": f.stage, "custom_stage": f.custom_stage,
                "function_name": f.function_name, "exception": f.exception,
                "payload": f.payload} for f in firsts],
        kind_index=pack_le(kind_ix) if len(firsts) > 1 else b"",
        keys=keys if any_key else (), values=values if any_value else (),
        absent=bytes(absent) if any_absent else b"",
        topics=list(topics), headers=headers)
    if topic_ix is not None:
        out.topic_index, out.partitions, out.offsets = (pack_le(topic_ix), pack_le(partitions),
                                                        pack_le(offsets))
    if timestamps is not None:
        out.timestamps_ms = pack_le(timestamps)
    if attempts is not None:
        out.attempts = pack_le(attempts)
    if trace_ix is not None:
        out.trace_index = pack_le(trace_ix)
        out.traceparents.extend(p for p, _ in traces)
        if any(s for _, s in traces):
            out.tracestates.extend(s for _, s in traces)
    if counts is not None:
        out.header_counts = pack_le(counts)
    return out


# -- the answer --------------------------------------------------------------------------------

class ColumnVerdict:
    """One record's verdict from ReportFailuresResponse.columns (pb.Verdict's field names)."""

    __slots__ = ("record_id", "action", "category", "reason", "attempt", "retry_delay_ms",
                 "dead_letter", "dead_lettered", "job_failed", "retry_budget_exhausted")

    def __init__(self, record_id: str, action: int, category: int, reason: str, *,
                 attempt: int, retry_delay_ms: int, flags: int) -> None:
        self.record_id = record_id
        self.action = action
        self.category = category
        self.reason = reason
        self.attempt = attempt
        self.retry_delay_ms = retry_delay_ms
        self.dead_letter = bool(flags & DEAD_LETTER)
        self.dead_lettered = bool(flags & DEAD_LETTERED)
        self.job_failed = bool(flags & JOB_FAILED)
        self.retry_budget_exhausted = bool(flags & BUDGET_EXHAUSTED)

    def to_pb(self) -> pb.Verdict:
        return pb.Verdict(record_id=self.record_id, action=self.action, category=self.category,
                          reason=self.reason, attempt=self.attempt,
                          retry_delay_ms=self.retry_delay_ms, dead_letter=self.dead_letter,
                          dead_lettered=self.dead_lettered, job_failed=self.job_failed,
                          retry_budget_exhausted=self.retry_budget_exhausted)

    def __repr__(self) -> str:
        return (f"ColumnVerdict(record_id={self.record_id!r}, "
                f"action={pb.Action.Name(self.action)}, reason={self.reason!r})")


class VerdictColumns(Sequence):
    """A report's verdicts as the answer's columns hold them: ``actions`` (one per record, in
    order) read without a verdict object each, a `ColumnVerdict` built only for a record that
    is looked at (an all-SKIP answer, the usual one, is followed per report)."""

    __slots__ = ("actions", "_ids", "_categories", "_flags", "_attempts", "_reason_ix",
                 "_reasons", "_delays")

    def __init__(self, record_ids: Sequence[str], actions: Sequence[int], *,
                 categories: Sequence[int], flags: Sequence[int], attempts: array,
                 reason_ix: array, reasons: list[str], delays: array | None) -> None:
        self.actions = actions
        self._ids = record_ids
        self._categories = categories
        self._flags = flags
        self._attempts = attempts
        self._reason_ix = reason_ix
        self._reasons = reasons
        self._delays = delays

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        v = _new(ColumnVerdict)
        _init_verdict(v, self._ids[i], self.actions[i], self._categories[i],
                      self._reasons[self._reason_ix[i]], attempt=self._attempts[i],
                      retry_delay_ms=self._delays[i] if self._delays is not None else 0,
                      flags=self._flags[i])
        return v

    def __iter__(self):
        return map(self.__getitem__, range(len(self._ids)))

    def __add__(self, other: Sequence) -> list:   # `_split` joins the answers of two halves
        return [*self, *other]

    def __repr__(self) -> str:
        return f"VerdictColumns({list(self)!r})"


def verdicts(cols: pb.TallyVerdicts, record_ids: Sequence[str], where: str) -> VerdictColumns:
    """The verdicts of a report of ``record_ids``; SidecarProtocolError when the columns do
    not answer it (one entry per record, indexes inside their tables, known actions)."""
    n = len(record_ids)
    actions, categories, flags = cols.actions, cols.categories, cols.flags
    attempts = unpack_le("I", cols.attempts)
    reason_ix = unpack_le("I", cols.reason_index)
    delays = unpack_le("Q", cols.retry_delays_ms) if cols.retry_delays_ms else None
    reasons = list(cols.reasons)
    if (len(actions) != n or len(categories) != n or len(flags) != n or len(attempts) != n
            or len(reason_ix) != n or (delays is not None and len(delays) != n)
            or (n and (max(reason_ix) >= len(reasons)
                       or not set(actions) <= _ACTIONS))):
        raise SidecarProtocolError(
            f"ReportFailures on {where}: the verdict columns do not answer the {n} records "
            f"reported ({len(actions)} actions, {len(reasons)} reasons)")
    return VerdictColumns(record_ids, actions, categories=categories, flags=flags,
                          attempts=attempts, reason_ix=reason_ix, reasons=reasons, delays=delays)


_init_verdict = ColumnVerdict.__init__
_ACTIONS = frozenset((pb.ACTION_RETRY, pb.ACTION_SKIP, pb.ACTION_FAIL))

# -- which sidecars take columns ---------------------------------------------------------------

_takes = RunTable(10_000)


def note(target: str, job: str, run_id: str, takes_columns: bool) -> None:
    """What RegisterJob answered: this run's reports to ``target`` may go as columns."""
    if takes_columns:
        _takes.put((target, job, run_id), True)
    else:
        _takes.pop((target, job, run_id))


def takes(target: str, job: str, run_id: str) -> bool:
    return _takes.get((target, job, run_id), False)


def forget(target: str, job: str, run_id: str) -> None:
    _takes.pop((target, job, run_id))
