"""What differs between the PySpark versions spillway-spark supports (3.5.x and 4.x), in one place.

- DDL strings: ``DataType.fromDDL`` (4.0+) or, on 3.5, ``_parse_datatype_string``; both ask
  the driver's JVM, so both need a running SparkContext;
- Arrow <-> Row conversion for DataFrame wrappers: pyspark's own converters, ``pyspark.sql.
  conversion`` (recent 4.x), ``pyspark.sql.connect.conversion`` (earlier 4.x and 3.5, where it
  needs pandas and pyarrow: ``spillway-spark[pandas]``); 3.5's has no large-variable-type flag;
- Spark Connect (``SparkSession.builder.remote(...)``, Databricks serverless and standard access
  mode, ``spark.api.mode=connect``): no SparkContext, RDD, accumulator or broadcast on the
  client. A run is one Connect session (`active_run_id`); ``DataFrame.foreachPartition``
  exists over Connect only from Spark 4.0 (`check_foreach_partition`).

`UnsupportedOnThisSparkError` names what is missing, the installed PySpark and what to do.
tests/compat runs every wrapper on PySpark 3.5.0, 3.5.x and 4.x.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


class UnsupportedOnThisSparkError(RuntimeError):
    """A feature of spillway.spark that the installed PySpark cannot provide."""


def pyspark_version() -> str:
    import pyspark

    return pyspark.__version__


def parse_ddl(text: str) -> Any:
    """A pyspark DataType from a DDL string ("id int, name string", "struct<a:int>", "int")."""
    from pyspark.sql.types import DataType

    from_ddl = getattr(DataType, "fromDDL", None)  # PySpark 4.0+
    if from_ddl is not None:
        return from_ddl(text)
    from pyspark import SparkContext
    from pyspark.sql.types import _parse_datatype_string

    if SparkContext._active_spark_context is None:
        raise UnsupportedOnThisSparkError(
            f"DDL schema strings need a running SparkSession on PySpark {pyspark_version()} "
            f"(DataType.fromDDL arrived in 4.0): start the session first or pass a "
            f"pyspark.sql.types DataType instead of {text!r}")
    return _parse_datatype_string(text)


def arrow_conversions() -> tuple[Any, Callable[[list, Any, bool], Any]]:
    """(ArrowTableToRowsConversion, to_arrow(rows, schema, large_var_types) -> pyarrow.Table)."""
    try:
        from pyspark.sql.conversion import ArrowTableToRowsConversion, LocalDataToArrowConversion
    except ImportError:  # PySpark 3.5 and earlier 4.x
        try:
            from pyspark.sql.connect.conversion import (  # type: ignore[no-redef]
                ArrowTableToRowsConversion,
                LocalDataToArrowConversion,
            )
        except ImportError as exc:
            raise UnsupportedOnThisSparkError(
                f"DataFrame wrappers need pyspark's Arrow converters, which on PySpark "
                f"{pyspark_version()} live in pyspark.sql.connect.conversion and need pandas "
                f"and pyarrow: install spillway-spark[pandas] ({exc})") from exc
    convert = LocalDataToArrowConversion.convert
    if len(inspect.signature(convert).parameters) >= 3:
        def to_arrow(rows: list, schema: Any, large: bool) -> Any:
            return convert(rows, schema, large)
    else:  # PySpark 3.5: no large variable types (its Arrow batches never carry them)
        def to_arrow(rows: list, schema: Any, large: bool) -> Any:
            return convert(rows, schema)
    return ArrowTableToRowsConversion, to_arrow


def is_connect(obj: Any) -> bool:
    """Whether ``obj`` (a SparkSession or DataFrame) is a Spark Connect one."""
    return type(obj).__module__.startswith("pyspark.sql.connect.")


def _active_session() -> Any:
    from pyspark.sql import SparkSession

    try:
        session = SparkSession.getActiveSession()   # classic, or Connect once a remote exists
    except Exception:  # noqa: BLE001 - e.g. a half-configured environment: no session
        session = None
    if session is not None:
        return session
    try:  # a remote session made while pyspark's process-wide Connect mode was off
        from pyspark.sql.connect.session import SparkSession as ConnectSession
    except ImportError:  # without pyspark[connect]'s packages there is no Connect session
        return None
    try:
        return ConnectSession.getActiveSession()
    except Exception:  # noqa: BLE001
        return None


def active_session() -> Any:
    """The active SparkSession (classic, or Spark Connect), or None."""
    return _active_session()


def connect_session_id(session: Any) -> str | None:
    """A Spark Connect session's id (``session_id`` on 4.x, the client's on 3.5)."""
    sid = getattr(session, "session_id", None)
    if not sid:
        sid = getattr(getattr(session, "client", None), "_session_id", None)
    return str(sid) if sid else None


def active_run_id() -> str | None:
    """The run the active Spark session stands for: the application id on classic Spark, one
    run per session on Spark Connect (``connect-<session id>``: every `Job` object made in the
    session joins the same run); None without a session."""
    session = _active_session()
    if session is None:
        return None
    if is_connect(session):
        sid = connect_session_id(session)
        return f"connect-{sid}" if sid else None
    try:
        return session.sparkContext.applicationId
    except Exception:  # noqa: BLE001 - a stopped or odd session: the caller picks a fresh id
        return None


def check_foreach_partition(data: Any) -> None:
    """``DataFrame.foreachPartition`` over Spark Connect arrived in Spark 4.0."""
    if is_connect(data) and int(pyspark_version().split(".")[0]) < 4:
        raise UnsupportedOnThisSparkError(
            f"foreach_partition over Spark Connect needs Spark 4.0 or later (this client is "
            f"PySpark {pyspark_version()}, whose Connect DataFrame has no foreachPartition): "
            f"use job.map_partitions(...) and write inside it, or run on Spark 4.x")
