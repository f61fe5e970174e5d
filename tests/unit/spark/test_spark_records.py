"""Record ids and record context of failed rows (`spillway.spark._records`)."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from pyspark.sql import Row
from spillway.spark._records import (
    context_of,
    positional_ids,
    positional_record_id,
    row_json,
    timestamp_ms,
)


def _fallback():
    return "fallback-id"


def test_kafka_rows_are_identified_by_their_coordinates_and_keep_original_bytes():
    ts = dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.timezone.utc)
    row = Row(key=b"k1", value=b"\x00raw", topic="orders", partition=3, offset=42, timestamp=ts,
              timestampType=0, headers=[Row(key="h", value=b"v"), Row(key="n", value=None)],
              parsed=Row(id=1))
    ctx = context_of(row, _fallback)
    assert ctx.record_id == "orders/3/42"
    assert ctx.source == ("orders", 3, 42)
    assert (ctx.key, ctx.value) == (b"k1", b"\x00raw")
    assert ctx.headers == (("h", b"v"), ("n", None))
    assert ctx.timestamp_ms == int(ts.timestamp() * 1000)


def test_rows_without_kafka_columns_get_positional_ids_and_a_json_value():
    row = Row(id=7, name="x", raw=b"\x01\x02", when=dt.date(2024, 1, 2), nested=Row(a=1))
    ctx = context_of(row, _fallback)
    assert ctx.record_id == "fallback-id" and ctx.source is None and ctx.key is None
    assert json.loads(ctx.value) == {"id": 7, "name": "x", "raw": "AQI=", "when": "2024-01-02",
                                     "nested": {"a": 1}}


def test_user_record_id_and_source_function():
    row = Row(order_id="o-9", payload="{}")
    ctx = context_of(row, _fallback, record_id=lambda r: f"order:{r.order_id}",
                     source=lambda r: {"topic": "orders", "partition": 0, "offset": 9})
    assert ctx.record_id == "order:o-9" and ctx.source == ("orders", 0, 9)
    assert json.loads(ctx.value) == {"order_id": "o-9", "payload": "{}"}


def test_kafka_coordinates_without_bytes_fall_back_to_json_of_the_row():
    row = {"topic": "t", "partition": 0, "offset": 5, "value": {"already": "parsed"}}
    ctx = context_of(row, _fallback)
    assert ctx.record_id == "t/0/5" and json.loads(ctx.value)["value"] == {"already": "parsed"}


def test_pandas_and_numpy_values():
    pd = pytest.importorskip("pandas")
    np = pytest.importorskip("numpy")
    s = pd.Series({"topic": "t", "partition": np.int32(1), "offset": np.int64(2),
                   "key": None, "value": b"v", "timestamp": pd.Timestamp("2024-01-01T00:00:00Z"),
                   "headers": np.array([{"key": "h", "value": b"1"}], dtype=object)})
    ctx = context_of(s.to_dict(), _fallback)
    assert ctx.record_id == "t/1/2" and ctx.value == b"v" and ctx.key is None
    assert ctx.headers == (("h", b"1"),)
    assert ctx.timestamp_ms == 1704067200000
    assert json.loads(row_json({"n": np.float64(1.5), "a": np.array([1, 2])})) == {
        "n": 1.5, "a": [1, 2]}


def test_positional_ids_are_stable_and_carry_the_micro_batch():
    assert positional_record_id("TRANSFORMATION", "orders", "app.parse", 3, 17) == \
        "TRANSFORMATION:orders/app.parse:p3:r17"
    assert positional_record_id("TASK_PUT", "orders", "w", 0, 1, batch_id="12") == \
        "TASK_PUT:orders/w:b12:p0:r1"
    assert positional_record_id("TASK_PUT", "orders", "w", 0, 1, batch_id="12", use="2") == \
        "TASK_PUT:orders/w#2:b12:p0:r1"
    assert positional_record_id("TASK_PUT", "orders", "w", 0, 1, batch_id=0) == \
        "TASK_PUT:orders/w:b0:p0:r1"


@pytest.mark.parametrize("batch_id, use", [(None, ""), ("", "3"), ("7", ""), (0, "2")])
def test_a_partitions_id_factory_gives_each_rows_positional_id(batch_id, use):
    """The engine's id factory (`positional_ids`: the prefix formatted once) names each row as
    `positional_record_id` does."""
    ids = positional_ids("TRANSFORMATION", "orders", "app.parse", 5, batch_id, use)
    for i in (0, 1, 17, 10**9):
        assert ids(i) == positional_record_id("TRANSFORMATION", "orders", "app.parse", 5, i,
                                              batch_id=batch_id, use=use)


def test_timestamps():
    assert timestamp_ms(None) is None
    assert timestamp_ms(1700000000123) == 1700000000123
    aware = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
    assert timestamp_ms(aware) == 1704067200000


def test_row_json_matches_json_dumps_of_the_row():
    import base64
    import decimal

    from spillway.spark._records import _json_default, as_mapping
    from spillway.spark._records import _scalar as scalar

    def reference(row):
        m = as_mapping(row)
        payload = {k: scalar(v) for k, v in m.items()} if m is not None else row
        if hasattr(row, "asDict"):
            payload = row.asDict(recursive=True)
        return json.dumps(payload, default=_json_default, separators=(",", ":"),
                          ensure_ascii=False).encode("utf-8")

    rows = [b'{"order_id": 1, "amount": ', b"", b"\x00\xff" * 50, 'str "q" \\ é \n \x01', "",
            None, 1, 2.5, float("nan"), True, [1, "a", b"b"], (1, 2), bytearray(b"ba"), {1},
            {"a": 1, "b": b"x", "c": [1, (2, 3)], "d": dt.date(2020, 1, 2),
             "e": decimal.Decimal("1.10"), "f": {"g": "é"}},
            Row(id=1, value=b"abc", nested=Row(x=1, y=[Row(z="é")]),
                d=dt.datetime(2020, 1, 1, 1, 1))]
    for row in rows:
        assert row_json(row) == reference(row), row
    assert row_json(b"\x01\x02") == b'"' + base64.b64encode(b"\x01\x02") + b'"'


def test_pandas_checker_skips_only_columns_that_are_exactly_the_declared_type():
    np = pytest.importorskip("numpy")
    pd = pytest.importorskip("pandas")
    from pyspark.sql.types import DoubleType, LongType, StructField, StructType

    from spillway.spark._schema import OutputSchemaError, pandas_checker

    check = pandas_checker(StructType([StructField("id", LongType()),
                                       StructField("total", DoubleType())]), "TRANSFORMATION")
    good = pd.DataFrame({"id": np.arange(3), "total": [1.5, float("nan"), 2.0]})
    assert check(good) is good
    assert check(good) is good  # the exact dtypes are remembered: still checked the same
    loose = pd.DataFrame({"id": [1, None, 3], "total": [1, 2, 3]})  # float ids, int totals
    assert check(loose) is loose
    for bad in ({"id": ["x", "y"], "total": [1.0, 2.0]}, {"id": [1, 2], "total": ["a", "b"]}):
        with pytest.raises(OutputSchemaError, match="does not fit the declared type"):
            check(pd.DataFrame(bad))


def test_a_value_row_has_the_same_context_through_the_adapter_as_through_context_of():
    from spillway.spark._adapters import RowAdapter
    from spillway.spark._engine import Unit
    from spillway.spark._records import RecordContext, value_context

    ids = positional_ids("TRANSFORMATION", "job", "w", 3)
    for row in (b'{"order_id": 1, "amount": ', b"", "text \u00e9 \"q\"", ""):
        unit = Unit(row, 1, 7)
        expected = RecordContext(ids(7), None, None, row_json(row))
        got = RowAdapter(len, ids=ids).context(unit)
        assert got == expected and type(got) is RecordContext
        assert got.payload == "stage-input" and got.headers == () and got.timestamp_ms is None
        assert context_of(row, lambda: ids(7)) == expected
        assert value_context(ids(7), row) == expected
    # a record_id function or a source still goes through context_of
    by_id = RowAdapter(len, ids=ids, record_id=lambda r: "id-" + str(len(r)))
    assert by_id.context(Unit(b"abc", 1, 7)).record_id == "id-3"


def _mapped(row, fallback, record_id=None, source=None):
    """`context_of` through the mapping of the row's fields (the path for dicts and Series)."""
    subject = source(row) if source is not None else row
    return context_of(row, fallback, record_id, lambda _: dict(zip(subject.__fields__, subject)))


def _row(fields, values):
    r = tuple.__new__(Row, values)
    r.__dict__["__fields__"] = fields
    return r


KAFKA = ["key", "value", "topic", "partition", "offset", "timestamp", "timestampType", "headers"]
WHEN = dt.datetime(2026, 3, 29, 1, 30, 5, 123456)


@pytest.mark.parametrize("fields, values", [
    (KAFKA, [b"k", b"v", "orders", 3, 17, WHEN, 0, []]),
    (KAFKA, [None, b"v", "orders", 3, 17, None, 0, None]),
    (KAFKA, [b"k", None, "orders", 3, 17, WHEN, 0, [_row(["key", "value"], ["h", b"1"]),
                                                   _row(["key", "value"], ["g", None])]]),
    (KAFKA, ["text key", b"v", "orders", 3, 17, WHEN, 0, []]),          # not bytes: JSON
    (KAFKA, [b"k", bytearray(b"v"), "orders", 0, 0, WHEN, 0, []]),
    (KAFKA, [b"k", b"v", None, 3, 17, WHEN, 0, []]),                   # no coordinates
    (["topic", "partition", "offset", "id"], ["orders", 1, 2, 7]),     # no key, value
    (["value", "topic", "partition", "offset", "value"], [b"a", "t", 1, 2, b"b"]),  # twice
    (["topic", "partition", "offset", "timestamp"], ["t", 1, 2, 1_700_000_000_000]),
    (["id", "name"], [1, "x"]),
], ids=[f"shape{i}" for i in range(10)])
def test_a_rows_context_read_by_index_is_the_mappings(fields, values):
    row = _row(fields, values)
    for record_id in (None, lambda r: "mine"):
        assert context_of(row, lambda: "fb", record_id) == _mapped(row, lambda: "fb", record_id)
    other = _row(["id"], [1])   # a source function that returns the Kafka row
    assert (context_of(other, lambda: "fb", None, lambda _: row)
            == _mapped(other, lambda: "fb", None, lambda _: row))


def test_rows_of_other_field_lists_each_get_their_own_columns():
    a = _row(["topic", "partition", "offset"], ["a", 1, 2])
    b = _row(["offset", "partition", "topic"], [5, 4, "b"])
    names = ["topic", "partition", "offset"]
    c = _row(names, [7, 8, 9])
    assert [context_of(r, lambda: "fb").record_id for r in (a, b, a, c, b)] == [
        "a/1/2", "b/4/5", "a/1/2", "7/8/9", "b/4/5"]
    assert context_of(c, lambda: "fb").record_id == "7/8/9"
    names.reverse()   # a field list changed in place is read again
    assert context_of(c, lambda: "fb").record_id == "9/8/7"
