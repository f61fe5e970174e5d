"""The executor and argument side of native deserialization (`spillway.spark._native`), without
Spark: options, messages, and how corrupt rows become units of the verdict loop."""

from __future__ import annotations

import pyarrow as pa
import pytest
from spillway.client.markers import DataError
from spillway.spark import CorruptRecordError
from spillway.spark._engine import StageFailure, StageRef
from spillway.spark._native import (
    NativeAdapter,
    NativeStep,
    corrupt_message,
    corrupt_units,
    options_of,
)

VALUE = NativeStep("value", "json", StageRef.of("VALUE_CONVERTER"), "parsed_value",
                   "struct<id:int>")
KEY = NativeStep("key", "csv", StageRef.of("KEY_CONVERTER"), "parsed_key", "struct<n:int>")


def test_options_are_strings_and_spillways_own_are_refused():
    assert options_of("value", None) == ()
    assert options_of("value", {"allowComments": True, "sep": ";", "mode": "Permissive"}) == (
        ("allowComments", "true"), ("sep", ";"), ("mode", "Permissive"))
    for mode in ("FAILFAST", "dropMalformed"):
        with pytest.raises(ValueError, match=f"value_options: mode={mode!r} is not supported"):
            options_of("value", {"MODE": mode})
    with pytest.raises(ValueError, match="key_options: columnNameOfCorruptRecord is spillway's"):
        options_of("key", {"columnnameofcorruptrecord": "_c"})
    with pytest.raises(TypeError, match="value_options: expected a dict"):
        options_of("value", [("sep", ";")])


def test_the_failure_is_a_data_error_naming_the_spark_function_and_what_it_could_not_parse():
    adapter = NativeAdapter(ids=lambda i: f"pos-{i}")
    row = {"key": b"k", "value": b"{oops", "topic": "t", "partition": 1, "offset": 9,
           "timestamp": None, "timestampType": 0, "headers": [{"key": "h", "value": b"v"}]}
    [unit] = corrupt_units([pa.RecordBatch.from_pylist([{**row, "__spillway_bad_value": True}])],
                           [VALUE], lambda n: None)
    with pytest.raises(StageFailure) as info:
        adapter.run(unit)
    failure = info.value
    assert failure.stage == StageRef.of("VALUE_CONVERTER")
    assert failure.function_name == "spark:from_json"
    assert isinstance(failure.exc, CorruptRecordError)
    assert isinstance(failure.exc, DataError) and isinstance(failure.exc, ValueError)
    assert str(failure.exc).startswith("Spark's from_json (PERMISSIVE) could not parse the "
                                       "record's value as struct<id:int>; Spark marked it "
                                       "corrupt: Expecting")
    ctx = adapter.context(unit)
    assert (ctx.record_id, ctx.source, ctx.key, ctx.value, ctx.headers, ctx.payload) == (
        "t/1/9", ("t", 1, 9), b"k", b"{oops", (("h", b"v"),), "source")


def test_messages_give_a_cheap_hint():
    assert corrupt_message(VALUE, b"").endswith("Spark marked it corrupt: it is empty")
    assert corrupt_message(VALUE, b'{"id": "x"}').endswith(
        ": well-formed JSON that does not fit the declared type")
    assert corrupt_message(KEY, b"1,2").endswith(
        "from_csv (PERMISSIVE) could not parse the record's key as struct<n:int>; "
        "Spark marked it corrupt")
    avro = NativeStep("value", "avro", StageRef.of("VALUE_CONVERTER"), "v", '{"type": "int"}')
    assert "from_avro" in corrupt_message(avro, b"\x01") and '{"type": "int"}' in \
        corrupt_message(avro, b"\x01")


def test_corrupt_units_take_the_first_failing_step_and_count_the_good_rows():
    rows = [{"key": b"a", "value": b"1", "__spillway_bad_key": False,
             "__spillway_bad_value": False},
            {"key": b"b", "value": b"2", "__spillway_bad_key": True,
             "__spillway_bad_value": True},
            {"key": None, "value": None, "__spillway_bad_key": False,
             "__spillway_bad_value": False},
            {"key": b"d", "value": b"4", "__spillway_bad_key": False,
             "__spillway_bad_value": True}]
    batch = pa.RecordBatch.from_pylist(rows)
    counted: list[int] = []
    units = list(corrupt_units([batch, batch.slice(0, 0), batch.slice(3, 1)], [KEY, VALUE],
                               counted.append))
    assert [(u.payload[0]["key"], u.payload[1].part, u.offset) for u in units] == [
        (b"b", "key", 0), (b"d", "value", 1), (b"d", "value", 2)]
    assert all("__spillway_bad_key" not in u.payload[0] for u in units)
    assert counted == [2]
