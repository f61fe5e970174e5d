"""Spark workloads: input DataFrames built in the JVM (no driver-side data), the user functions
(bare and wrapped alike) and the actions that force every row through them.

The harness ships this module's functions to Spark's Python workers by value (cloudpickle), so
the workers need not be able to import ``bench``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from .records import VALUE_SIZE

OUT_SCHEMA = "order_id long, amount double"
OUT_NAMES = ["order_id", "amount"]
VECTOR_SCHEMA = "id long, total double"

KAFKA_SOURCE_COLUMNS = ("key", "value", "topic", "partition", "offset", "timestamp",
                        "timestampType", "headers")


def poison_every(fail_percent: float) -> int:
    """Rows whose id is divisible by this are poison: 1 % -> every 100th, 10 % -> every 10th
    (0: none fail)."""
    if fail_percent <= 0:
        return 0
    every = round(100 / fail_percent)
    if every < 1 or abs(100 / every - fail_percent) > 1e-9:
        raise ValueError(f"fail_percent: must divide 100 evenly, got {fail_percent}")
    return every


def value_sql(fail_every: int, size: int = VALUE_SIZE) -> str:
    """SQL for a ``size``-byte JSON order value; every ``fail_every``-th row truncated JSON."""
    good = (f"rpad(concat('{{\"order_id\": ', cast(id as string), ', \"amount\": ', "
            f"cast(id * 1.5 as string), ', \"note\": \"'), {size - 2}, 'x') || '\"}}'")
    poison = f"rpad(concat('{{\"order_id\": ', cast(id as string), ', \"amount\": '), {size}, 'x')"
    if fail_every == 1:
        return poison
    if fail_every <= 0:
        return good
    return f"CASE WHEN id % {fail_every} = 0 THEN {poison} ELSE {good} END"


def kafka_frame(spark, rows: int, partitions: int, fail_every: int, topic: str = "orders"):
    """A DataFrame with Spark's Kafka source schema: key, value (binary, ``VALUE_SIZE`` bytes),
    topic, partition, offset, timestamp, timestampType, headers."""
    return spark.range(0, rows, 1, partitions).selectExpr(
        "cast(concat('order-', cast(id as string)) as binary) as key",
        f"cast({value_sql(fail_every)} as binary) as value",
        f"'{topic}' as topic",
        f"cast(id % {partitions} as int) as partition",
        "id as offset",
        "timestamp_millis(1763700000000 + id) as timestamp",
        "0 as timestampType",
        "cast(array() as array<struct<key:string,value:binary>>) as headers",
    )


def orders_frame(spark, rows: int, partitions: int, fail_every: int = 0):
    """id, amount and a JSON ``value`` string: the input of the vectorized and UDF workloads."""
    return spark.range(0, rows, 1, partitions).selectExpr(
        "id", "cast(id * 1.5 as double) as amount", f"{value_sql(fail_every)} as value")


def order_values(sc, rows: int, partitions: int, fail_every: int):
    """An RDD of JSON order values (bytes) generated in the Python workers."""
    pad = b"x" * 120

    def make(i: int) -> bytes:
        if fail_every and i % fail_every == 0:
            return b'{"order_id": %d, "amount": ' % i + pad
        return b'{"order_id": %d, "amount": %d.5, "note": "%s"}' % (i, i, pad)

    return sc.range(0, rows, 1, partitions).map(make)


# --- user functions ---------------------------------------------------------------------------


def parse_order(row: Any) -> tuple[int, float]:
    """Per-row user function: parse the JSON value (a Row with ``value``, or raw bytes)."""
    value = row if isinstance(row, (bytes, str)) else row.value
    order = json.loads(value)
    return order["order_id"], order["amount"] * 1.1


def order_json(value: bytes | None) -> Any:
    """Value deserializer of target 10's Python variant: the JSON order as a dict."""
    return json.loads(value)


def amount_of(value):
    """UDF body: the order's amount from its JSON value (no type hints: Spark would try to
    infer a pandas/Arrow UDF kind from them)."""
    return json.loads(value)["amount"] * 1.1


def pandas_total(pdf):
    """Vectorized (pandas) user function: one output row per input row."""
    import pandas as pd

    return pd.DataFrame({"id": pdf["id"], "total": pdf["amount"] * 1.1 + 1.0})


def arrow_total(batch):
    """Vectorized (Arrow) user function: one output row per input row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    total = pc.add(pc.multiply(batch.column("amount"), 1.1), 1.0)
    return pa.RecordBatch.from_arrays([batch.column("id"), total], names=["id", "total"])


# --- bare PySpark equivalents --------------------------------------------------------------------


def bare_rows(it: Iterator[Any]) -> Iterator[tuple[int, float]]:
    for row in it:
        yield parse_order(row)


def bare_rows_dropping(it: Iterator[Any]) -> Iterator[tuple[int, float]]:
    """The error-path baseline: catch and drop failed rows locally."""
    for row in it:
        try:
            yield parse_order(row)
        except Exception:  # noqa: BLE001 - the baseline drops them, as ad-hoc jobs do
            continue


def bare_pandas(it):
    for pdf in it:
        yield pandas_total(pdf)


def bare_arrow(it):
    for batch in it:
        yield arrow_total(batch)


def noop_write(df) -> None:
    """Force every row through the plan without writing anything."""
    df.write.format("noop").mode("overwrite").save()
