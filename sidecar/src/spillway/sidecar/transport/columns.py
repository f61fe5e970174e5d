"""Columnar reports (ReportFailuresRequest.columns): protobuf <-> core values, the sidecar's end.

An executor that learnt at registration that this sidecar takes columns sends a report's records
as a RecordColumns: each way of failing once (stage, function, payload kind, exception with its
stack trace) and every per-record value in a list or a packed little-endian column. Here each
record becomes a `ColumnRecord`, a view over the decoded columns that reads like a
`model.FailedRecord`; the records of one way of failing share one converted stage and exception
value, so classification and the DLQ builder see each distinct exception once. Bounds are
`validate.report_failures`'; with ``verdict_columns`` the answer goes back as a TallyVerdicts
(`verdict_columns`), one byte of action, category and flags per record and each distinct
reason once.
"""

from __future__ import annotations

from itertools import accumulate
from operator import itemgetter

from spillway.client.columns import NO_KEY, NO_TIMESTAMP, NO_VALUE, unpack_le
from spillway.sidecar.core import model as m
from spillway.sidecar.core import slots
from spillway.sidecar.transport import convert
from spillway.sidecar.transport.tally import encode_streaks
from spillway.v1 import sidecar_pb2 as pb

# a way of failing: (stage, exception, function name, payload kind), shared by the records
# that failed alike; a record's row: (index, record id, key, value, headers, trace)
_Kind = tuple[m.StageRef, m.ExceptionInfo, str, str]
_Row = tuple[int, str, "bytes | None", "bytes | None", "tuple[m.Header, ...]", "tuple[str, str]"]
_NO_TRACE = ("", "")   # a record without a trace context (`ColumnRecord.trace`)


class _Columns:
    """One report's per-record columns, decoded once and shared by its records."""

    __slots__ = ("keys", "values", "absent", "topics", "topic_ix", "partitions", "offsets",
                 "timestamps", "attempts", "traces", "trace_ix", "headers", "header_ends")

    def __init__(self, c: pb.RecordColumns) -> None:
        self.keys = list(c.keys)
        self.values = list(c.values)
        self.absent = c.absent
        self.topics = list(c.topics)
        self.topic_ix = unpack_le("I", c.topic_index) if c.topic_index else None
        self.partitions = unpack_le("i", c.partitions) if c.topic_index else None
        self.offsets = unpack_le("q", c.offsets) if c.topic_index else None
        self.timestamps = unpack_le("q", c.timestamps_ms) if c.timestamps_ms else None
        self.attempts = unpack_le("I", c.attempts) if c.attempts else None
        states = list(c.tracestates)
        parents = list(c.traceparents)
        self.traces = list(zip(parents, states or [""] * len(parents), strict=True))
        self.trace_ix = unpack_le("I", c.trace_index) if c.trace_index else None
        self.headers = c.headers
        self.header_ends = (list(accumulate(unpack_le("I", c.header_counts)))
                            if c.header_counts else None)


class ColumnRecord(convert.RecordView):
    """A reported record as the core reads it (`model.FailedRecord`'s fields) over its report's
    columns. Treat it as a value; `to_model()` gives the plain dataclass."""

    # key, value, headers and trace are plain slots, set from the columns when the views are
    # made: the payload digests and the DLQ builder read them for every record (a property
    # each was a Python call per read)
    __slots__ = ("record_id", "stage", "exception", "function_name", "payload", "_c", "_i",
                 "key", "value", "headers", "trace")
    tag = -1  # its payload digest is computed from key and value (`JobState.tag_of`)

    def __init__(self, kind: _Kind, cols: _Columns, row: _Row) -> None:
        # two tuples unpacked: as cheap per record as positional arguments, and the way of
        # failing (`kind`) is one value shared by every record that failed alike
        self.stage, self.exception, self.function_name, self.payload = kind
        self._c = cols
        # the records of one trace share their trace tuple (the column's entry)
        self._i, self.record_id, self.key, self.value, self.headers, self.trace = row

    @property
    def source(self) -> m.SourceCoordinates | None:
        c, i = self._c, self._i
        if c.topic_ix is None or not c.topic_ix[i]:
            return None
        return m.SourceCoordinates(c.topics[c.topic_ix[i] - 1], c.partitions[i], c.offsets[i])

    @property
    def timestamp_ms(self) -> int | None:
        c, i = self._c, self._i
        if c.timestamps is None or (c.absent and c.absent[i] & NO_TIMESTAMP):
            return None
        return c.timestamps[i]

    @property
    def attempt(self) -> int:
        c = self._c
        a = c.attempts[self._i] if c.attempts is not None else 1
        return a if a > 1 else 1

    @property
    def traceparent(self) -> str:
        return self.trace[0]

    @property
    def tracestate(self) -> str:
        return self.trace[1]


def _sample(v: dict) -> ColumnRecord:
    return ColumnRecord((v["stage"], v["exception"], v["function_name"], v["payload"]), v["_c"],
                        (v["_i"], v["record_id"], v["key"], v["value"], v["headers"], v["trace"]))


# A report's views made column-wise in C (`core.slots`): its records failing one way, or
# several (each record's way of failing a column too)
_PER_ROW = ("record_id", "_i", "key", "value", "headers", "trace")
_KIND = ("stage", "exception", "function_name", "payload")
_SAMPLE = {"record_id": "r", "_i": 0, "key": b"k", "value": None, "headers": (("h", None),),
           "trace": _NO_TRACE, "stage": m.StageRef(m.Stage.TRANSFORMATION),
           "exception": m.ExceptionInfo("builtins.ValueError", message="m"),
           "function_name": "f", "payload": m.PAYLOAD_SOURCE, "_c": _Columns(pb.RecordColumns())}
_ONE_KIND = slots.Maker(ColumnRecord, _PER_ROW, (*_KIND, "_c"), _sample, _SAMPLE)
_KINDS = slots.Maker(ColumnRecord, (*_PER_ROW, *_KIND), ("_c",), _sample, _SAMPLE)


def _headers(cols: _Columns, n: int) -> list[tuple[m.Header, ...]]:
    """Each record's original headers (none sent: every record's is empty)."""
    ends = cols.header_ends
    if ends is None:
        return [()] * n
    hs = cols.headers
    return [tuple((h.key, h.value if h.HasField("value") else None) for h in hs[start:end])
            for start, end in zip([0, *ends[:-1]], ends)]


def _traces(cols: _Columns, n: int) -> list[tuple[str, str]]:
    """Each record's (traceparent, tracestate): the column's dictionary entry, shared."""
    ix = cols.trace_ix
    if ix is None:
        return [_NO_TRACE] * n
    traces = cols.traces
    return [traces[i - 1] if i else _NO_TRACE for i in ix]


def records(c: pb.RecordColumns) -> list[ColumnRecord]:
    """A columnar report's records, in order (ValueError naming the first invalid field; the
    columns' shapes were checked by `validate.report_failures`)."""
    kinds = []
    for k, kind in enumerate(c.kinds):
        where = f"columns.kinds[{k}]"
        if not kind.HasField("exception"):
            raise ValueError(f"{where}.exception: required")
        payload = m.PAYLOAD_SOURCE if kind.payload == pb.PAYLOAD_SOURCE else \
            m.PAYLOAD_STAGE_INPUT
        kinds.append((convert.stage_ref(kind.stage, kind.custom_stage, where),
                      convert.exception_value(kind.exception, where), kind.function_name,
                      payload))
    ids = c.record_ids
    if not ids:
        return []
    cols = _Columns(c)
    n = len(ids)
    keys = cols.keys or [None] * n
    values = cols.values or [None] * n
    if cols.absent:   # a record sent without its key or value (not an empty one)
        absent = cols.absent
        keys = [None if a & NO_KEY else k for k, a in zip(keys, absent)]
        values = [None if a & NO_VALUE else v for v, a in zip(values, absent)]
    if (_KINDS if c.kind_index else _ONE_KIND).native():   # made column-wise, in C
        columns = [list(ids), list(range(n)), keys, values, _headers(cols, n),
                   _traces(cols, n)]
        if not c.kind_index:
            return _ONE_KIND.make(columns, (*kinds[0], cols))
        per = [kinds[k] for k in unpack_le("I", c.kind_index)]
        return _KINDS.make(columns + [list(map(itemgetter(j), per)) for j in range(4)], (cols,))
    rows = zip(range(n), ids, keys, values, _headers(cols, n), _traces(cols, n))
    if not c.kind_index:
        kind = kinds[0]
        return [ColumnRecord(kind, cols, row) for row in rows]
    ix = unpack_le("I", c.kind_index)
    return [ColumnRecord(kinds[ix[row[0]]], cols, row) for row in rows]


def as_messages(recs) -> list[pb.FailedRecord]:
    """Columnar records as FailedRecord messages: for a whole report passed on to a home
    (ReportFailures.decide_only), which may predate columns."""
    stage_pb = convert.STAGE_TO_PB
    out = []
    for r in recs:
        msg = pb.FailedRecord(record_id=r.record_id, stage=stage_pb[r.stage.stage],
                              custom_stage=r.stage.custom, function_name=r.function_name,
                              attempt=r.attempt, traceparent=r.traceparent,
                              tracestate=r.tracestate,
                              payload=(pb.PAYLOAD_SOURCE if r.payload == m.PAYLOAD_SOURCE
                                       else pb.PAYLOAD_STAGE_INPUT),
                              exception=convert.exception_pb(r.exception,
                                                                 stack_trace=True))
        src = r.source
        if src is not None:
            msg.source.topic, msg.source.partition, msg.source.offset = (
                src.topic, src.partition, src.offset)
        for k, v in r.headers:
            msg.headers.add(key=k, value=v) if v is not None else msg.headers.add(key=k)
        if (key := r.key) is not None:
            msg.key = key
        if (value := r.value) is not None:
            msg.value = value
        if (ts := r.timestamp_ms) is not None:
            msg.timestamp_ms = ts
        out.append(msg)
    return out


def verdict_columns(answers) -> pb.TallyVerdicts:
    """The answer to a report sent with ``verdict_columns``: `((verdict, dead_letter), n)`
    spans as columns (no classification rules: those are the home protocol's)."""
    return encode_streaks([((v, dead_letter, False, None), n) for (v, dead_letter), n in answers],
                        rules=False)


__all__ = ["ColumnRecord", "as_messages", "records", "verdict_columns"]
