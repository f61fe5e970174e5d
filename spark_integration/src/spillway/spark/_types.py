"""Schemas and types given to wrappers on the driver: a StructType or DDL string, a DataType or
DDL type string; anything else is refused with a message naming what was expected."""

from __future__ import annotations

from typing import Any

from ._compat import parse_ddl


def struct(schema: Any):
    from pyspark.sql.types import StructType

    if isinstance(schema, StructType):
        return schema
    if isinstance(schema, str):
        parsed = parse_ddl(schema)
        if isinstance(parsed, StructType):
            return parsed
    raise TypeError(f"schema: expected a StructType or a DDL string like 'id int, name string', "
                    f"got {schema!r}")


def datatype(dt: Any):
    from pyspark.sql.types import DataType

    if isinstance(dt, DataType):
        return dt
    if isinstance(dt, str):
        return parse_ddl(dt)
    raise TypeError(f"expected a pyspark DataType or a DDL type string, got {dt!r}")
