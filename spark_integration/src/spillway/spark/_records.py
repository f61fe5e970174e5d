"""Record ids and record context (KIP-1033's ErrorHandlerContext) for failed rows. Pure.

Record ids are stable across Spark task attempts, because the sidecar keeps each record's retry
count, schedule and skip decision by id (docs/POLICY.md, Record identity):

- a row carrying the Kafka source columns (topic, partition, offset): ``topic/partition/offset``
  (the source record: the same in every stage that sees it);
- otherwise ``<STAGE>:<job>/<wrapper>#<use>[:b<micro-batch id>]:p<partition>:r<row index>``,
  the row's position in its Spark partition within one *use* of the wrapper: ``use`` numbers
  the wrapper calls made on the driver (`job.map_partitions(...)` twice, even with the same
  function, are two uses), and for a UDF, which is decorated once and used in many queries,
  adds the Spark stage it runs in (``<n>s<stage id>``). Task attempt ids are left out (they
  change on every attempt); the streaming micro-batch id is kept (partition numbers repeat in
  every micro-batch). Positions are stable when the partition's input order is (a source scan,
  a sorted or non-shuffled plan); pass ``record_id=`` otherwise.

An id is a claim, not a proof: the sidecar remembers a digest of each record's payload beside
its id, and a record reported under a known id with another payload is decided as a record of
its own (a collision, counted and logged), never dropped as a re-report.
"""

from __future__ import annotations

import base64
import binascii
import datetime as _dt
import decimal
import json
from collections.abc import Callable, Mapping
from operator import itemgetter
from typing import Any, NamedTuple

from pyspark.sql.types import Row
from spillway.client.dlq_ledger import H_REDRIVE_PAYLOAD
from spillway.v1 import sidecar_pb2 as pb

KAFKA_COORDINATES = ("topic", "partition", "offset")
#: The columns of Spark's Kafka source, in its order.
KAFKA_SOURCE_COLUMNS = ("key", "value", "topic", "partition", "offset", "timestamp",
                        "timestampType", "headers")


def positional_record_id(stage: str, job: str, wrapper: str, partition_id: int, row_index: int,
                         *, batch_id: int | str | None = None, use: str = "") -> str:
    return positional_prefix(stage, job, wrapper, partition_id, batch_id, use) + str(row_index)


def positional_prefix(stage: str, job: str, wrapper: str, partition_id: int,
                      batch_id: int | str | None = None, use: str = "") -> str:
    """`positional_record_id` without its row index (which follows the prefix's ``:r``)."""
    batch = f":b{batch_id}" if batch_id not in (None, "") else ""
    use = f"#{use}" if use else ""
    return f"{stage}:{job}/{wrapper}{use}{batch}:p{partition_id}:r"


def positional_ids(stage: str, job: str, wrapper: str, partition_id: int,
                   batch_id: int | str | None = None, use: str = "") -> Callable[[int], str]:
    """Row index -> `positional_record_id` of one partition of one wrapper use: the prefix is
    formatted once (formatting it per failed row was a tenth of the row's failure path)."""
    prefix = positional_prefix(stage, job, wrapper, partition_id, batch_id, use)
    return lambda row_index: prefix + str(row_index)


class RecordContext(NamedTuple):
    """What a FailedRecord says about the record itself. (A named tuple: built once per failed
    record, several times cheaper than a frozen dataclass, and as immutable.)"""

    record_id: str
    source: tuple[str, int, int] | None = None
    key: bytes | None = None
    value: bytes | None = None
    headers: tuple[tuple[str, bytes | None], ...] = ()
    timestamp_ms: int | None = None
    # "source": key/value are the Kafka columns of the row (the source record's own bytes only
    # in a deserialization stage: see `payload_for`); "stage-input": the row as JSON
    payload: str = "stage-input"


# Stages whose input is the source record as read: only there are the Kafka columns certainly
# the original bytes (a transformation may have replaced `value` and kept the coordinates).
_SOURCE_STAGES = frozenset((pb.STAGE_DESERIALIZATION, pb.STAGE_KEY_CONVERTER,
                            pb.STAGE_VALUE_CONVERTER, pb.STAGE_HEADER_CONVERTER))


def payload_for(stage: int, ctx: RecordContext) -> str:
    """What a dead letter's key/value are (`spillway.payload`): the source record only in a
    deserialization stage whose row carried the Kafka columns; else the stage's input. A row of
    `Job.reprocess` is a dead letter's key/value unchanged: it keeps that dead letter's kind."""
    if ctx.payload != "source":
        return "stage-input"
    if stage in _SOURCE_STAGES:
        return "source"
    for name, value in ctx.headers:
        if name == H_REDRIVE_PAYLOAD:
            return "source" if value == b"source" else "stage-input"
    return "stage-input"


def as_mapping(row: Any) -> Mapping[str, Any] | None:
    """A Row, dict or pandas Series as a mapping of column name to value (else None)."""
    cls = type(row)
    if cls is dict:
        return row
    if cls is Row:  # Row.asDict() without its method call and checks
        fields = row.__dict__.get("__fields__")
        if fields is not None:
            return dict(zip(fields, row))
    if isinstance(row, Mapping):
        return row
    as_dict = getattr(row, "asDict", None)  # pyspark.sql.Row
    if callable(as_dict):
        return as_dict()
    to_dict = getattr(row, "to_dict", None)  # pandas.Series
    if callable(to_dict) and not isinstance(row, type):
        try:
            out = to_dict()
        except TypeError:
            return None
        return out if isinstance(out, Mapping) else None
    return None


#: Types that are their own Python value: `_scalar` returns them as they are without asking for
#: an ``item`` method (a getattr that misses raises and swallows an AttributeError: costly per
#: field of every failed row).
_NATIVE = frozenset((str, int, float, bool, bytes, bytearray, type(None), _dt.datetime,
                     _dt.date, decimal.Decimal, list, tuple, dict))


def _scalar(value: Any) -> Any:
    if type(value) in _NATIVE:
        return value
    item = getattr(value, "item", None)  # numpy / pandas scalars
    if callable(item) and not isinstance(value, (bytes, str)):
        try:
            return item()
        except (TypeError, ValueError):
            return value
    return value


def _bytes(value: Any) -> bytes | None:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    return None


def timestamp_ms(value: Any) -> int | None:
    value = _scalar(value)
    if value is None:
        return None
    if isinstance(value, _dt.datetime):  # naive: local time, as pyspark's Row conversion gives
        return int(value.timestamp() * 1000)
    to_py = getattr(value, "to_pydatetime", None)  # pandas.Timestamp
    if callable(to_py):
        try:
            return int(to_py().timestamp() * 1000)
        except (TypeError, ValueError):
            return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def headers_of(value: Any) -> tuple[tuple[str, bytes | None], ...]:
    """Kafka headers (array<struct<key, value>> as Rows, dicts or pairs) as (key, bytes|None)."""
    if value is None:
        return ()
    out = []
    for h in value:
        m = as_mapping(h)
        if m is not None:
            k, v = m.get("key"), m.get("value")
        else:
            k, v = h
        if k is None:
            continue
        b = _bytes(v)
        out.append((str(k), b if b is not None else (v.encode() if isinstance(v, str) else None)))
    return tuple(out)


def _json_default(value: Any) -> Any:
    value = _scalar(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    m = as_mapping(value)
    if m is not None:
        return dict(m)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    tolist = getattr(value, "tolist", None)  # numpy arrays
    if callable(tolist):
        return tolist()
    return repr(value)


# one encoder for every row: json.dumps with these arguments builds the same one per call
_ROW_ENCODER = json.JSONEncoder(default=_json_default, separators=(",", ":"),
                                ensure_ascii=False)
_encode_row = _ROW_ENCODER.encode


def row_json(row: Any) -> bytes:
    """The row as compact JSON (bytes as base64, dates ISO-8601): the DLQ value of a row that
    did not come from Kafka."""
    cls = type(row)
    if cls is bytes:  # a JSON string of base64 text: nothing in it to escape
        return b'"%s"' % binascii.b2a_base64(row, newline=False)
    if cls is str:
        return _encode_row(row).encode("utf-8")
    if hasattr(row, "asDict"):
        payload = row.asDict(recursive=True)
    else:
        m = as_mapping(row)
        payload = {k: _scalar(v) for k, v in m.items()} if m is not None else row
    return _encode_row(payload).encode("utf-8")


VALUE_ROWS = (bytes, str)  # rows that are values, not mappings
_tuple_new = tuple.__new__


def value_context(record_id: str, row: bytes | str) -> RecordContext:
    """The context of a failed row that is a value (bytes or str), not a mapping: its id, the
    row as JSON. (Built per failed record: the tuple is made directly, without the named
    tuple's Python-level ``__new__``.)"""
    return _tuple_new(RecordContext, (record_id, None, None, row_json(row), (), None,
                                      "stage-input"))


_PLAN_NAMES = ("topic", "partition", "offset", "headers", "timestamp", "key", "value")
_ONE_MORE = (None,)   # a Row's columns and a None to read an absent column from (index -1)


class _RowPlan:
    """Where a Row's Kafka source columns are, by its field names: a batch's Rows share one
    list of names, so a failed row reads its columns by index instead of through a dict of
    all its fields (`as_mapping`). A name given twice is its last column, as in that dict.
    (Read from the Row as a plain tuple: Row's own ``__getitem__`` is Python code.)"""

    __slots__ = ("fields", "names", "pick", "has_kv")
    last: _RowPlan | None = None   # the plan of the last Rows seen (one worker: one thread)

    def __init__(self, fields: list[str]) -> None:
        self.fields = fields            # the names' list itself, and a copy to check it against
        self.names = list(fields)
        where = {name: i for i, name in enumerate(fields)}
        at = [where.get(n, -1) for n in _PLAN_NAMES]
        self.pick = itemgetter(*at)     # the columns of `_PLAN_NAMES`, from the row + (None,)
        self.has_kv = at[5] >= 0 or at[6] >= 0

    @classmethod
    def of(cls, fields: Any) -> _RowPlan | None:
        last = cls.last
        if last is not None and fields is last.fields and fields == last.names:
            return last
        if type(fields) is not list or not all(type(n) is str for n in fields):
            return None
        cls.last = plan = cls(fields)
        return plan


def context_of(row: Any, fallback_id: Callable[[], str],
               record_id: Callable[[Any], str] | None = None,
               source: Callable[[Any], Any] | None = None) -> RecordContext:
    """The context of a failed row: Kafka coordinates, original key/value/headers/timestamp when
    the row (or what ``source(row)`` returns) has the Kafka source columns; else a positional
    id and the row as JSON."""
    if source is None and type(row) in VALUE_ROWS:  # no columns: a positional id, the row as JSON
        rid = str(record_id(row)) if record_id is not None else ""
        return value_context(rid or fallback_id(), row)
    subject = source(row) if source is not None else row
    rid = str(record_id(row)) if record_id is not None else ""
    if type(subject) is Row and len(subject) == len(fields := subject.__dict__.get(
            "__fields__") or ()) and (plan := _RowPlan.of(fields)) is not None:
        columns, has_kv = plan.pick(tuple.__add__(subject, _ONE_MORE)), plan.has_kv
    else:
        m = as_mapping(subject)
        if m is None:
            return RecordContext(rid or fallback_id(), None, None, row_json(row), (), None)
        columns, has_kv = tuple(map(m.get, _PLAN_NAMES)), "value" in m or "key" in m
    return _kafka_context(row, rid, columns, has_kv, fallback_id)


def _kafka_context(row: Any, rid: str, columns: tuple, has_kv: bool,
                   fallback_id: Callable[[], str]) -> RecordContext:
    """`context_of` from the row's `_PLAN_NAMES` columns (None where absent); `has_kv`: whether
    it has a key or a value column. Values of native types are taken as they are, as `_scalar`
    would."""
    native = _NATIVE
    t, p, o, h, ts, k, v = columns
    if type(t) not in native:
        t = _scalar(t)
    if type(p) not in native:
        p = _scalar(p)
    if type(o) not in native:
        o = _scalar(o)
    if t is None or p is None or o is None:
        return RecordContext(rid or fallback_id(), None, None, row_json(row), (), None)
    coords = (str(t), int(p), int(o))
    rid = rid or f"{coords[0]}/{coords[1]}/{coords[2]}"
    headers = () if h is None or (type(h) is list and not h) else headers_of(h)
    if ts is not None:   # a datetime as `timestamp_ms` reads it, without its checks
        ts = int(ts.timestamp() * 1000) if type(ts) is _dt.datetime else timestamp_ms(ts)
    if has_kv:
        key = _bytes(k if type(k) in native else _scalar(k)) if k is not None else None
        value = _bytes(v if type(v) in native else _scalar(v)) if v is not None else None
        if (v is None or value is not None) and (k is None or key is not None):
            return _tuple_new(RecordContext, (rid, coords, key, value, headers, ts, "source"))
    return _tuple_new(RecordContext, (rid, coords, None, row_json(row), headers, ts,
                                      "stage-input"))
