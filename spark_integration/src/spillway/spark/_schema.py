"""Output checks (executor side): an output of a wrapped function that does not fit the Spark type
the user declared for it is a failure of that record, reported like any other (a data error,
with the stage and the field named), never a task killed later by Spark's Arrow conversion.

Each check first runs pyspark's own type verifier (about a microsecond per value; a value of
an atomic type pyspark takes by its exact Python type, a ``float`` for a ``double``, an ``int``
in range for a ``bigint``, passes a test of that first, which is what the verifier would
check: ~0.1 µs a value against ~0.4 µs for the verifier on a UDF's happy path); only when it
refuses a value is the value converted exactly as the wrapper will convert it (pyspark's
``LocalDataToArrowConversion``), so what the conversion accepts and the verifier does not (an
``int`` for a ``double``) still passes, and what fails is reported with the verifier's message,
which names the field.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

_ERROR_CLASS = re.compile(r"^\[[A-Z0-9_]+\]\s*")


class OutputSchemaError(TypeError):
    """A wrapped function's output does not fit its declared Spark type (a data error)."""


_convert_fn: list[Callable[[list, Any], Any]] = []


def _convert(rows: list, schema: Any) -> Any:
    """pyspark's own local-data -> Arrow conversion (``convert(data, schema[, large types])``:
    the third argument only exists from pyspark 4)."""
    if not _convert_fn:
        import inspect

        try:
            from pyspark.sql.conversion import LocalDataToArrowConversion
        except ImportError:  # pragma: no cover - pyspark 3.5 and early 4.x
            from pyspark.sql.connect.conversion import (  # type: ignore[no-redef]
                LocalDataToArrowConversion,
            )
        conv = LocalDataToArrowConversion.convert
        if len(inspect.signature(conv).parameters) >= 3:
            _convert_fn.append(lambda r, s: conv(r, s, False))
        else:  # pragma: no cover - pyspark 3.5
            _convert_fn.append(conv)
    return _convert_fn[0](rows, schema)


# Spark's atomic types whose pyspark verifier checks only the value's exact Python type (and,
# for the integer types, its range): (type, range or None), by ``DataType.simpleString()``
_FAST: dict[str, tuple[type, tuple[int, int] | None]] = {
    "boolean": (bool, None),
    "tinyint": (int, (-(1 << 7), (1 << 7) - 1)),
    "smallint": (int, (-(1 << 15), (1 << 15) - 1)),
    "int": (int, (-(1 << 31), (1 << 31) - 1)),
    "bigint": (int, (-(1 << 63), (1 << 63) - 1)),
    "float": (float, None),
    "double": (float, None),
    "string": (str, None),
    "binary": (bytes, None),
}


def _fast_ok(dtype: Any, nullable: bool) -> Callable[[Any], bool] | None:
    """A test that a value of Spark type ``dtype`` certainly passes pyspark's verifier (False:
    no answer, ask the verifier), or None when ``dtype`` has none."""
    fast = _FAST.get(dtype.simpleString())
    if fast is None:
        return None
    kind, bounds = fast
    if bounds is None:
        if nullable:
            return lambda v: type(v) is kind or v is None
        return lambda v: type(v) is kind
    lo, hi = bounds
    if nullable:
        return lambda v: (type(v) is int and lo <= v <= hi) or v is None
    return lambda v: type(v) is int and lo <= v <= hi


def _why(exc: BaseException) -> str:
    return _ERROR_CLASS.sub("", str(exc)).strip().rstrip(".")


def value_checker(dtype: Any, name: str, stage: str, *, exact: bool = True,
                  ) -> Callable[[Any], None]:
    """A check of one value of Spark type ``dtype`` (the column ``name`` of stage ``stage``).

    ``exact=False``: for Python UDFs, whose results Spark converts without Arrow, turning a
    value of the wrong type into a silent null: the verifier decides, except that a string
    (anywhere in the type) accepts any value, as Spark's conversion turns it into its text."""
    from pyspark.sql.types import StructField, StructType, _make_type_verifier

    verify = _make_type_verifier(dtype, nullable=True, name=name)
    struct = StructType([StructField(name, dtype, True)])
    declared = dtype.simpleString()
    fast = _fast_ok(dtype, nullable=True)

    def check(value: Any) -> None:
        if fast is not None and fast(value):
            return
        try:
            verify(value)
            return
        except Exception as exc:  # noqa: BLE001 - pyspark's verifier raises several types
            refused = exc
        if exact:
            try:
                _convert([(value,)], struct)
                return
            except Exception:  # noqa: BLE001 - Arrow raises several types
                pass
        elif _udf_accepts(dtype, value):
            return
        raise OutputSchemaError(f"{stage} output does not fit the declared type {declared}: "
                                f"{_why(refused)}")

    # (kind, bounds) of the fast test, for a caller that inlines it per row (`_udf`)
    check.fast_type = _FAST.get(declared)  # type: ignore[attr-defined]
    return check


def _udf_accepts(dtype: Any, value: Any) -> bool:
    """Whether Spark's (non-Arrow) conversion of a Python UDF result keeps ``value``: as the
    verifier, but a string takes any value (Spark stores its text)."""
    from pyspark.sql.types import ArrayType, MapType, StringType, StructType, _make_type_verifier

    if value is None or isinstance(dtype, StringType):
        return True
    if isinstance(dtype, ArrayType):
        return isinstance(value, (list, tuple)) and all(
            _udf_accepts(dtype.elementType, v) for v in value)
    if isinstance(dtype, MapType):
        return isinstance(value, dict) and all(
            _udf_accepts(dtype.keyType, k) and _udf_accepts(dtype.valueType, v)
            for k, v in value.items())
    if isinstance(dtype, StructType):
        fields = dtype.fields
        if isinstance(value, dict):
            values = [value.get(f.name) for f in fields]
        elif isinstance(value, (tuple, list)) and len(value) == len(fields):
            values = list(value)
        else:
            return False
        return all(_udf_accepts(f.dataType, v) for f, v in zip(fields, values))
    try:
        _make_type_verifier(dtype)(value)
    except Exception:  # noqa: BLE001 - pyspark's verifier raises several types
        return False
    return True


def row_checker(schema: Any, stage: str) -> Callable[[Any], Any]:
    """A check of one output row (a Row by field name, a dict, or a tuple in schema order)
    against the StructType ``schema``; returns the row as the conversion takes it."""
    from pyspark.sql import Row
    from pyspark.sql.types import _make_type_verifier

    verify = _make_type_verifier(schema, nullable=False, name="output")
    declared = schema.simpleString()
    # every field of an atomic type with a fast test: a tuple or dict of such values passes
    # without the verifier (which costs a microsecond and more per row)
    tests = [_fast_ok(f.dataType, f.nullable) for f in schema.fields]
    fields = [(f.name, t) for f, t in zip(schema.fields, tests, strict=True)]
    all_fast = bool(tests) and all(t is not None for t in tests)
    width = len(tests)

    def fits(out: Any) -> bool:
        kind = type(out)
        if kind is tuple:
            if len(out) != width:
                return False
            for t, v in zip(tests, out):
                if not t(v):
                    return False
            return True
        if kind is dict:
            get = out.get
            for name, t in fields:
                if not t(get(name)):
                    return False
            return True
        return False

    def check(out: Any) -> Any:
        if out is None:   # a row is required: Arrow has no null rows
            raise OutputSchemaError(
                f"{stage} output is None; return a Row, dict or tuple of the declared schema "
                f"{declared} (to drop a record, use flat=True and return [])")
        if isinstance(out, Row) and hasattr(out, "__fields__"):
            out = out.asDict()
        if all_fast and fits(out):
            return out
        try:
            verify(out)
            return out
        except Exception as exc:  # noqa: BLE001 - pyspark's verifier raises several types
            refused = exc
        try:
            _convert([out], schema)
            return out
        except Exception:  # noqa: BLE001 - Arrow raises several types
            raise OutputSchemaError(f"{stage} output does not fit the declared schema "
                                    f"{declared}: {_why(refused)}") from None

    return check


# --- vectorized outputs ---------------------------------------------------------------------


def arrow_conformer(schema: Any, stage: str) -> Callable[[Any], Any]:
    """RecordBatch -> the same rows with the declared Arrow types (columns by name when every
    declared name is present, else by position; cast where the types differ); OutputSchemaError
    naming the column otherwise."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    target = to_arrow_schema(schema)

    def same(have: Any, want: Any) -> bool:
        # string/large_string and binary/large_binary: Spark takes either (useLargeVarTypes)
        return have.equals(want) or (
            (pa.types.is_string(want) and pa.types.is_large_string(have))
            or (pa.types.is_binary(want) and pa.types.is_large_binary(have)))

    def conform(batch: Any) -> Any:
        if batch.schema.equals(target, check_metadata=False):
            return batch
        names = batch.schema.names
        by_name = all(f.name in names for f in target)
        if not by_name and batch.num_columns != len(target):
            raise OutputSchemaError(
                f"{stage} output has {batch.num_columns} column(s) "
                f"{batch.schema.names}, the declared schema {schema.simpleString()} has "
                f"{len(target)}")
        arrays, fields = [], []
        for i, field in enumerate(target):
            i = names.index(field.name) if by_name else i
            col = batch.column(i)
            if same(col.type, field.type):
                field = field.with_type(col.type)
            else:
                try:
                    col = col.cast(field.type)
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                    raise OutputSchemaError(
                        f"{stage} output column {field.name!r} ({names[i]!r} "
                        f"returned as {col.type}) does not fit the declared type "
                        f"{field.type}: {exc}") from None
            arrays.append(col)
            fields.append(field)
        return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))

    return conform


def pandas_checker(schema: Any, stage: str) -> Callable[[Any], Any]:
    """A check that a pandas DataFrame converts to the declared schema (columns by name when
    every declared name is present, else by position, as Spark assigns them); OutputSchemaError
    naming the column otherwise. Returns the frame unchanged."""
    import numpy as np
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    target = to_arrow_schema(schema)
    # numpy dtype -> whether it is exactly the Arrow type of that field: such a column always
    # converts (a plain numpy array of the very type: no nulls to refuse, nothing to cast), so
    # the happy path skips the trial conversion, which cost about as much as Spark's own
    exact: dict[tuple[Any, int], bool] = {}

    def is_exact(dtype: Any, i: int) -> bool:
        key = (dtype, i)
        known = exact.get(key)
        if known is None:
            try:
                known = (isinstance(dtype, np.dtype) and dtype.kind in "biuf"
                         and dtype != np.float16  # Arrow's from_pandas has no half floats
                         and pa.from_numpy_dtype(dtype).equals(target.field(i).type))
            except (pa.ArrowNotImplementedError, TypeError):
                known = False
            if len(exact) < 256:
                exact[key] = known
        return known

    def check(frame: Any) -> Any:
        names = [f.name for f in target]
        by_name = all(n in frame.columns for n in names)
        if not by_name and len(frame.columns) != len(names):
            raise OutputSchemaError(
                f"{stage} output has columns {list(frame.columns)}, the declared schema "
                f"{schema.simpleString()} has {names}")
        for i, field in enumerate(target):
            series = frame[field.name] if by_name else frame.iloc[:, i]
            if is_exact(series.dtype, i):
                continue
            try:
                pa.Array.from_pandas(series, type=field.type, safe=False)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError,
                    TypeError, ValueError) as exc:
                raise OutputSchemaError(
                    f"{stage} output column {field.name!r} does not fit the declared type "
                    f"{field.type}: {exc}") from None
        return frame

    return check
