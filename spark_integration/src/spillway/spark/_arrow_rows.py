"""Arrow record batches as pyspark Rows, equal to what pyspark's `ArrowTableToRowsConversion`
gives, built several times faster for the types Spark's Kafka source and flat tables carry.

Of pyspark's ~7 µs a row of the Kafka source schema, ~4.7 go to its timestamp column: pyarrow
builds a timezone-aware datetime per value, then `astimezone().replace(tzinfo=None)` makes it
local and naive. Here a timestamp column's microseconds become that naive local datetime
directly: the epoch, plus the value, plus the local UTC offset of the value's second, the offset
`datetime.astimezone()` takes (``time.localtime(second).tm_gmtoff``), looked up once per hour of
the batch's values (an hour whose first and last seconds differ in offset holds a transition:
its values are looked up one by one). Rows are built as pyspark's `_create_row` builds them.

A type not covered here (maps, UDTs, variants, intervals, structs with repeated field names, a
timestamp without a zone or not in microseconds) leaves the batch to pyspark's converter; so
does a batch whose first or last row differs from pyspark's own conversion of it (a PySpark
whose converter behaves otherwise), or one that fails here for any reason.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable
from typing import Any

_EPOCH = _dt.datetime(1970, 1, 1)
_timedelta = _dt.timedelta
_US_PER_S = 1_000_000
_US_PER_HOUR = 3_600 * _US_PER_S

# pyspark's types whose values pyarrow's to_pylist gives as pyspark gives them
_AS_IS = ("BooleanType", "ByteType", "ShortType", "IntegerType", "LongType", "FloatType",
          "DoubleType", "StringType", "DateType", "DecimalType", "BinaryType")


def _gmtoff_us(second: int) -> int:
    return time.localtime(second).tm_gmtoff * _US_PER_S


def local_datetimes(micros: list) -> list:
    """Microseconds since the epoch (or None) as naive local datetimes, equal to
    ``aware.astimezone().replace(tzinfo=None)`` of the aware datetime of each."""
    offsets: dict[int, int | None] = {}
    out: list = []
    append = out.append
    for v in micros:
        if v is None:
            append(None)
            continue
        hour = v // _US_PER_HOUR
        off = offsets.get(hour, -1)
        if off == -1:  # -1 us is no zone's offset (they are whole seconds)
            start = hour * 3_600
            first, last = _gmtoff_us(start), _gmtoff_us(start + 3_599)
            off = offsets[hour] = first if first == last else None
        if off is None:  # a transition inside this hour
            off = _gmtoff_us(v // _US_PER_S)
        append(_EPOCH + _timedelta(microseconds=v + off))
    return out


def _timestamp_micros(column: Any, zoned: bool) -> list | None:
    """A timestamp column's values as microseconds, or None when it is not in microseconds or
    not zoned as asked."""
    import pyarrow as pa

    t = column.type
    if not pa.types.is_timestamp(t) or t.unit != "us" or (t.tz is not None) != zoned:
        return None
    return column.cast(pa.int64()).to_pylist()


def _value_converter(dtype: Any) -> Callable[[Any], Any] | None | bool:
    """For a nested value as pyarrow's to_pylist gives it: a function giving pyspark's value;
    None when it is given as is; False when this type is not covered."""
    name = type(dtype).__name__
    if name in _AS_IS or name == "TimestampNTZType":
        return None
    if name == "TimestampType":
        return lambda v: None if v is None else v.astimezone().replace(tzinfo=None)
    if name == "ArrayType":
        inner = _value_converter(dtype.elementType)
        if inner is False:
            return False
        if inner is None:
            return None
        return lambda v: None if v is None else [inner(x) for x in v]
    if name == "StructType":
        names = dtype.names
        if len(set(names)) != len(names):
            return False
        convs = [_value_converter(f.dataType) for f in dtype.fields]
        if any(c is False for c in convs):
            return False
        from pyspark.sql.types import Row

        pairs = list(zip(names, convs))
        new = tuple.__new__

        def struct(v: Any) -> Any:
            if v is None:
                return None
            row = new(Row, [v.get(n) if c is None else c(v.get(n)) for n, c in pairs])
            row.__dict__["__fields__"] = names
            return row

        return struct
    return False


def _column_converter(field: Any) -> Callable[[Any], list] | None:
    """A function giving pyspark's values of a top-level column, or None when not covered."""
    name = type(field.dataType).__name__
    if name == "TimestampType":
        def zoned(col: Any) -> list:
            micros = _timestamp_micros(col, True)
            if micros is None:
                raise _NotCovered(field.name)
            return local_datetimes(micros)

        return zoned
    if name == "TimestampNTZType":
        def naive(col: Any) -> list:
            micros = _timestamp_micros(col, False)
            if micros is None:
                raise _NotCovered(field.name)
            return [None if v is None else _EPOCH + _timedelta(microseconds=v) for v in micros]

        return naive
    conv = _value_converter(field.dataType)
    if conv is False:
        return None
    if conv is None:
        return lambda col: col.to_pylist()
    return lambda col: [conv(v) for v in col.to_pylist()]


class _NotCovered(Exception):
    pass


class RowsOf:
    """Converts a schema's Arrow batches to Rows: here when every column is covered, else (and
    for a batch that fails or differs here) with pyspark's converter ``fallback(table,
    schema)``."""

    def __init__(self, schema: Any, fallback: Callable[[Any, Any], list]) -> None:
        self.schema = schema
        self.fallback = fallback
        self.fields = schema.fieldNames()
        convs = [_column_converter(f) for f in schema.fields]
        self.converters = None if any(c is None for c in convs) or not convs else convs

    def __call__(self, batch: Any) -> list:
        import pyarrow as pa

        if self.converters is not None and batch.num_columns == len(self.converters):
            try:
                rows = self._rows(batch)
            except Exception:  # noqa: BLE001 - pyspark's converter decides (and raises)
                rows = None
            if rows is not None and self._agrees(batch, rows):
                return rows
        return self.fallback(pa.Table.from_batches([batch]), self.schema)

    def _rows(self, batch: Any) -> list:
        from pyspark.sql.types import Row

        columns = [conv(batch.column(i)) for i, conv in enumerate(self.converters)]
        fields, new, out = self.fields, tuple.__new__, []
        append = out.append
        for values in zip(*columns):
            row = new(Row, values)
            row.__dict__["__fields__"] = fields
            append(row)
        return out

    def _agrees(self, batch: Any, rows: list) -> bool:
        """The batch's first and last rows equal pyspark's conversion of them, value types
        included."""
        import pyarrow as pa

        if not rows:
            return True
        for i in {0, len(rows) - 1}:
            theirs = self.fallback(pa.Table.from_batches([batch.slice(i, 1)]), self.schema)
            if len(theirs) != 1 or not same(rows[i], theirs[0]):
                return False
        return True


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (a Row's field names too)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        if len(a) != len(b) or getattr(a, "__fields__", None) != getattr(b, "__fields__", None):
            return False
        return all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b or (a != a and b != b)  # NaN
