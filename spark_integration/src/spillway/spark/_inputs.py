"""What the wrappers accept: a pyspark DataFrame (classic or Spark Connect) or an RDD.

Misuse is refused on the driver with an error naming the call and the type it got.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_dataframe", "is_rdd", "require"]


def is_dataframe(obj: Any) -> bool:
    from pyspark.sql import DataFrame

    if isinstance(obj, DataFrame):
        return True
    # A Spark Connect DataFrame is another class, from a module that is loaded once such a
    # DataFrame exists. Not imported here: without the connect extras, importing it calls
    # sys.exit(0) when __main__ has no __file__ (python -c, pytest-xdist workers), which ended
    # the program with success on any RDD passed to map_partitions.
    connect = sys.modules.get("pyspark.sql.connect.dataframe")
    return connect is not None and isinstance(obj, connect.DataFrame)


def is_rdd(obj: Any) -> bool:
    from pyspark import RDD

    return isinstance(obj, RDD)


def require(what: str, data: Any, *, rdd: bool = False) -> None:
    """Misuse gets a clear error on the driver, never an AttributeError deep in a wrapper."""
    if is_dataframe(data) or (rdd and is_rdd(data)):
        return
    kinds = "a pyspark DataFrame or RDD" if rdd else "a pyspark DataFrame"
    raise TypeError(f"{what}: expected {kinds}, got {type(data).__module__}."
                    f"{type(data).__qualname__}; spillway wraps Spark work (build one with "
                    f"spark.createDataFrame(...) or sc.parallelize(...))")
