"""The DataFrame wrappers' Arrow-to-Row conversion (`spark/_arrow_rows.py`) gives exactly the
Rows pyspark's own converter gives (values, their types, field names), in every local time zone
and across its transitions; a type it does not cover, or a batch it cannot convert as pyspark
does, goes to pyspark's converter."""

from __future__ import annotations

import datetime as dt
import decimal
import os
import time

import pyarrow as pa
import pytest
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)
from spillway.spark._arrow_rows import RowsOf, local_datetimes, same
from spillway.spark._compat import arrow_conversions

pyspark_rows, _ = arrow_conversions()
convert = pyspark_rows.convert

HEADER = StructType([StructField("key", StringType()), StructField("value", BinaryType())])
KAFKA = StructType([
    StructField("key", BinaryType()), StructField("value", BinaryType()),
    StructField("topic", StringType()), StructField("partition", IntegerType()),
    StructField("offset", LongType()), StructField("timestamp", TimestampType()),
    StructField("timestampType", IntegerType()), StructField("headers", ArrayType(HEADER)),
])
KAFKA_ARROW = pa.schema([
    ("key", pa.binary()), ("value", pa.binary()), ("topic", pa.string()),
    ("partition", pa.int32()), ("offset", pa.int64()), ("timestamp", pa.timestamp("us", "UTC")),
    ("timestampType", pa.int32()),
    ("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
])

# zones with DST, half-hour and 45-minute offsets, a 30-minute DST, and no transitions at all
ZONES = ["UTC", "Europe/Paris", "America/St_Johns", "Asia/Kathmandu", "Australia/Lord_Howe",
         "America/Sao_Paulo"]


@pytest.fixture(params=ZONES)
def zone(request):
    """The process's local time zone (what `datetime.astimezone()` converts to) for a test."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = request.param
    time.tzset()
    yield request.param
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


def _micros(*moments: dt.datetime) -> list[int]:
    return [int((m - dt.datetime(1970, 1, 1)).total_seconds()) * 1_000_000 for m in moments]


def _instants() -> list[int]:
    """Microsecond instants around this century's transitions (every 7 minutes and 13 µs over
    the days of March, October and November they fall on), before 1970, and in the 1890s
    (local mean time, whose offsets are not whole minutes)."""
    out = []
    for year, month, day in ((2025, 3, 30), (2025, 10, 26), (2025, 3, 9), (2025, 11, 2),
                             (2025, 4, 6), (2025, 10, 5), (2018, 11, 4), (2019, 2, 17)):
        start = _micros(dt.datetime(year, month, day) - dt.timedelta(days=1))[0]
        out += [start + i * (7 * 60 * 1_000_000 + 13) for i in range(2 * 24 * 60 // 7)]
    out += _micros(dt.datetime(1969, 12, 31, 23, 59, 59), dt.datetime(1890, 6, 1, 12),
                   dt.datetime(1901, 12, 13, 20, 45, 52))
    out += [-1, 0, 1, 999_999, -999_999]
    return out


def _kafka_batch(micros: list[int]) -> pa.RecordBatch:
    n = len(micros)
    headers = [[] if i % 3 else [{"key": "h", "value": b"v"}, {"key": "n", "value": None}]
               for i in range(n)]
    return pa.RecordBatch.from_pydict({
        "key": [None if i % 5 == 0 else b"k%d" % i for i in range(n)],
        "value": [b"{\"order\": %d}" % i for i in range(n)],
        "topic": ["orders"] * n, "partition": [i % 4 for i in range(n)],
        "offset": list(range(n)),
        "timestamp": pa.array([None if i % 11 == 0 else m for i, m in enumerate(micros)],
                              pa.int64()).cast(pa.timestamp("us", "UTC")),
        "timestampType": [0] * n, "headers": headers}, schema=KAFKA_ARROW)


def _theirs(batch, schema):
    return convert(pa.Table.from_batches([batch]), schema)


def _all_same(mine, theirs) -> bool:
    return len(mine) == len(theirs) and all(same(a, b) for a, b in zip(mine, theirs))


def test_kafka_source_rows_equal_pysparks_in_every_zone_across_its_transitions(zone):
    batch = _kafka_batch(_instants())
    rows_of = RowsOf(KAFKA, convert)
    assert rows_of.converters is not None   # covered: converted here, not by the fallback
    assert _all_same(rows_of._rows(batch), _theirs(batch, KAFKA))
    assert _all_same(rows_of(batch), _theirs(batch, KAFKA))


def test_local_datetimes_equal_astimezone_in_every_zone(zone):
    micros = _instants()
    aware = pa.array(micros, pa.int64()).cast(pa.timestamp("us", "UTC")).to_pylist()
    assert local_datetimes(micros) == [v.astimezone().replace(tzinfo=None) for v in aware]


FLAT = StructType([
    StructField("b", BooleanType()), StructField("i8", ByteType()), StructField("i16", ShortType()),
    StructField("i32", IntegerType()), StructField("i64", LongType()),
    StructField("f32", FloatType()), StructField("f64", DoubleType()),
    StructField("s", StringType()), StructField("d", DateType()),
    StructField("dec", DecimalType(10, 2)), StructField("bin", BinaryType()),
    StructField("ntz", TimestampNTZType()), StructField("ints", ArrayType(LongType())),
    StructField("stamps", ArrayType(TimestampType())),
    StructField("nested", StructType([
        StructField("name", StringType()),
        StructField("inner", StructType([StructField("at", TimestampType()),
                                         StructField("tags", ArrayType(StringType()))]))])),
])


def _flat_batch() -> pa.RecordBatch:
    at = dt.datetime(2025, 3, 30, 1, 30, tzinfo=dt.timezone.utc)
    rows = [
        {"b": True, "i8": -8, "i16": 300, "i32": -5, "i64": 2**40, "f32": 1.5, "f64": float("nan"),
         "s": "é", "d": dt.date(2024, 2, 29), "dec": decimal.Decimal("12.34"), "bin": b"\x00",
         "ntz": dt.datetime(1890, 1, 1, 0, 0, 0, 7), "ints": [1, None, 3], "stamps": [at, None],
         "nested": {"name": "n", "inner": {"at": at, "tags": ["x"]}}},
        {"b": None, "i8": None, "i16": None, "i32": None, "i64": None, "f32": None, "f64": None,
         "s": None, "d": None, "dec": None, "bin": None, "ntz": None, "ints": None,
         "stamps": None, "nested": None},
        {"b": False, "i8": 0, "i16": 0, "i32": 0, "i64": 0, "f32": -0.0, "f64": 1e300, "s": "",
         "d": dt.date(1, 1, 1), "dec": decimal.Decimal("-0.01"), "bin": b"",
         "ntz": dt.datetime(9999, 12, 31, 23, 59, 59, 999999), "ints": [], "stamps": [],
         "nested": {"name": None, "inner": None}},
    ]
    schema = pa.schema([
        ("b", pa.bool_()), ("i8", pa.int8()), ("i16", pa.int16()), ("i32", pa.int32()),
        ("i64", pa.int64()), ("f32", pa.float32()), ("f64", pa.float64()), ("s", pa.string()),
        ("d", pa.date32()), ("dec", pa.decimal128(10, 2)), ("bin", pa.binary()),
        ("ntz", pa.timestamp("us")), ("ints", pa.list_(pa.int64())),
        ("stamps", pa.list_(pa.timestamp("us", "UTC"))),
        ("nested", pa.struct([("name", pa.string()), ("inner", pa.struct([
            ("at", pa.timestamp("us", "UTC")), ("tags", pa.list_(pa.string()))]))])),
    ])
    return pa.RecordBatch.from_pylist(rows, schema=schema)


def test_flat_and_nested_types_and_nulls_equal_pysparks(zone):
    batch = _flat_batch()
    rows_of = RowsOf(FLAT, convert)
    assert rows_of.converters is not None
    assert _all_same(rows_of._rows(batch), _theirs(batch, FLAT))


class Recording:
    """pyspark's converter, counting the rows it was asked to convert."""

    def __init__(self, differ: bool = False) -> None:
        self.rows, self.differ = 0, differ

    def __call__(self, table, schema):
        self.rows += table.num_rows
        rows = convert(table, schema)
        if self.differ:  # a PySpark whose converter gives something else
            return [r.__class__(*[str(v) for v in r]) for r in rows]
        return rows


def test_a_type_not_covered_leaves_the_batch_to_pysparks_converter():
    schema = StructType([StructField("m", MapType(StringType(), LongType()))])
    batch = pa.RecordBatch.from_pydict({"m": [[("a", 1)], None]},
                                       schema=pa.schema([("m", pa.map_(pa.string(), pa.int64()))]))
    fallback = Recording()
    rows_of = RowsOf(schema, fallback)
    assert rows_of.converters is None
    assert _all_same(rows_of(batch), _theirs(batch, schema))
    assert fallback.rows == 2


@pytest.mark.parametrize("arrow_type", [pa.timestamp("us"), pa.timestamp("ms", "UTC")],
                         ids=["no zone", "milliseconds"])
def test_a_timestamp_not_zoned_in_microseconds_goes_to_pysparks_converter(arrow_type):
    schema = StructType([StructField("t", TimestampType())])
    batch = pa.RecordBatch.from_pydict(
        {"t": pa.array([0, 1_700_000_000_000], pa.int64()).cast(arrow_type)},
        schema=pa.schema([("t", arrow_type)]))
    fallback = Recording()
    assert _all_same(RowsOf(schema, fallback)(batch), _theirs(batch, schema))
    assert fallback.rows == 2   # the whole batch (no check rows: it was not converted here)


def test_a_batch_pyspark_converts_otherwise_is_pysparks():
    """The first and last rows are compared (one-row conversions): a PySpark whose converter
    differs there converts the whole batch itself."""
    batch = _kafka_batch(_micros(dt.datetime(2025, 1, 1)) * 50)
    fallback = Recording(differ=True)
    rows = RowsOf(KAFKA, fallback)(batch)
    assert all(type(v) is str for v in rows[7])
    assert fallback.rows == 1 + 50   # the first row differed: the last was not checked


def test_a_batch_that_fails_here_is_pysparks_to_convert_or_refuse():
    """A local time past year 9999 raises in both: the error is pyspark's."""
    schema = StructType([StructField("t", TimestampType())])
    end = pa.array([253402300799_000_000], pa.int64()).cast(pa.timestamp("us", "UTC"))
    batch = pa.RecordBatch.from_pydict({"t": end}, schema=pa.schema([("t", end.type)]))
    before = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Tokyo"
    time.tzset()
    try:
        with pytest.raises(Exception) as theirs:
            _theirs(batch, schema)
        fallback = Recording()
        with pytest.raises(type(theirs.value)):
            RowsOf(schema, fallback)(batch)
        assert fallback.rows == 1
    finally:
        if before is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = before
        time.tzset()
