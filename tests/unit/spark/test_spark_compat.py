"""spillway.spark._compat: the PySpark 3.5 paths, taken here on PySpark 4 by removing what 3.5
lacks (tests/compat runs them on a real PySpark 3.5)."""

from __future__ import annotations

import sys
import types

import pytest
from pyspark import SparkContext
from pyspark.sql.types import DataType
from spillway.spark import UnsupportedOnThisSparkError
from spillway.spark._compat import arrow_conversions, parse_ddl


def test_without_from_ddl_and_without_a_session_the_error_says_what_to_do(monkeypatch):
    monkeypatch.delattr(DataType, "fromDDL")
    monkeypatch.setattr(SparkContext, "_active_spark_context", None)
    with pytest.raises(UnsupportedOnThisSparkError) as info:
        parse_ddl("id int")
    text = str(info.value)
    assert "running SparkSession" in text and "DataType.fromDDL arrived in 4.0" in text
    assert "'id int'" in text


def _fake_pyspark_conversion(monkeypatch, convert):
    """Only the connect module, with a LocalDataToArrowConversion.convert of that shape."""
    rows_cls = type("ArrowTableToRowsConversion", (), {})
    local_cls = type("LocalDataToArrowConversion", (), {"convert": staticmethod(convert)})
    monkeypatch.setitem(sys.modules, "pyspark.sql.conversion", None)  # import fails
    mod = types.ModuleType("pyspark.sql.connect.conversion")
    mod.ArrowTableToRowsConversion, mod.LocalDataToArrowConversion = rows_cls, local_cls
    monkeypatch.setitem(sys.modules, "pyspark.sql.connect.conversion", mod)
    return rows_cls


def test_pyspark_35_converter_is_called_without_the_large_types_flag(monkeypatch):
    calls = []
    rows_cls = _fake_pyspark_conversion(monkeypatch, lambda data, schema: calls.append(
        (data, schema)) or "table")
    got_rows, to_arrow = arrow_conversions()
    assert got_rows is rows_cls
    assert to_arrow([1], "schema", True) == "table" and calls == [([1], "schema")]


def test_pyspark_4_converter_gets_the_large_types_flag(monkeypatch):
    calls = []
    _fake_pyspark_conversion(monkeypatch, lambda data, schema, large: calls.append(large))
    _, to_arrow = arrow_conversions()
    to_arrow([], "schema", True)
    assert calls == [True]


def test_missing_converters_name_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyspark.sql.conversion", None)
    monkeypatch.setitem(sys.modules, "pyspark.sql.connect.conversion", None)
    with pytest.raises(UnsupportedOnThisSparkError, match=r"spillway-spark\[pandas\]"):
        arrow_conversions()
