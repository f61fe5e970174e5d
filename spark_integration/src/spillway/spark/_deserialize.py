"""Planning `Job.deserialize` on the driver: its Python steps (a function per part, with the
declared type and the output check), its native steps (a part given as a format name: Spark
parses it, see `_native`), and the checks of the input frame and the output columns."""

from __future__ import annotations

import json
from typing import Any

from spillway.client import report

from ._adapters import Deserializer
from ._engine import StageRef
from ._native import CORRUPT_FIELD, FORMATS, NativeStep, options_of
from ._records import KAFKA_COORDINATES
from ._schema import value_checker
from ._types import datatype

#: (part, function or format, type, output column, stage, reader options)
Part = tuple[str, Any, Any, str, str, Any]


def python_steps(parts) -> tuple[list[Deserializer], list]:
    """The parts given as functions: their steps and output fields."""
    from pyspark.sql.types import StructField

    steps: list[Deserializer] = []
    fields: list = []
    for part, fn, dtype, column, stage in parts:
        if fn is None or isinstance(fn, str):
            continue
        if not callable(fn):
            raise TypeError(f"{part}: expected a function, got {type(fn).__name__}")
        if dtype is None:
            raise ValueError(f"{part}_type: required with {part}=")
        spark_type = datatype(dtype)
        steps.append(Deserializer(part, fn, StageRef.of(stage), report.qualified_name(fn),
                                  check=value_checker(spark_type, column, stage)))
        fields.append(StructField(column, spark_type, True))
    return steps, fields


def native_steps(parts) -> tuple[list[NativeStep], list]:
    """The key / value steps given as a format name (see `_native`), with their types."""
    steps, types = [], []
    for part, fn, dtype, column, stage, options in parts:
        if not isinstance(fn, str):
            if options is not None:
                raise ValueError(f"{part}_options: only with a native format "
                                 f"({part}={' / '.join(map(repr, FORMATS))})")
            continue
        fmt = fn.strip().lower()
        if fmt not in FORMATS:
            raise ValueError(f"{part}: unknown format {fn!r}; a function, or one of "
                             f"{', '.join(map(repr, FORMATS))} (parsed by Spark)")
        opts = options_of(part, options)
        if fmt == "avro":
            try:
                json.loads(dtype if isinstance(dtype, str) else "")
            except ValueError:
                raise ValueError(f"{part}_type: with {part}='avro', the Avro schema as a "
                                 f"JSON string, got {dtype!r}") from None
            spark_type, text = None, dtype
        else:
            if dtype is None:
                raise ValueError(f"{part}_type: required with {part}={fmt!r}")
            spark_type = datatype(dtype)
            text = spark_type.simpleString()
            names = [f.name for f in getattr(spark_type, "fields", [])]
            if CORRUPT_FIELD in names:
                raise ValueError(f"{part}_type: the field name {CORRUPT_FIELD} "
                                 f"is spillway's corrupt-record field; rename yours")
        steps.append(NativeStep(part, fmt, StageRef.of(stage), column, text, opts))
        types.append(spark_type)
    return steps, types


def check_frame(df: Any, fields: list, native: list[NativeStep], steps: list) -> None:
    """The input has the Kafka source columns; the output columns are new and distinct."""
    if not steps and not native:
        raise ValueError("deserialize: give at least one of key=, value=, record=")
    missing = [c for c in ("key", "value", *KAFKA_COORDINATES) if c not in df.columns]
    if missing:
        raise ValueError(f"deserialize: the DataFrame lacks the Kafka source columns "
                         f"{missing}; expected Spark's Kafka source schema (key, value, "
                         f"topic, partition, offset, timestamp, timestampType, headers)")
    names = [f.name for f in fields] + [n.column for n in native]
    clash = [n for n in names if n in df.columns]
    if clash or len(set(names)) < len(names):
        raise ValueError(f"deserialize: output column(s) {clash or names} already exist or "
                         f"repeat; choose other key_column / value_column / record_column "
                         f"names")


def wrapper_name(steps: list, name: str | None) -> str:
    """The wrapper's name in record ids: given, or the parts and their functions."""
    return name or "deserialize:" + "+".join(f"{s.part}={s.function_name}" for s in steps)

