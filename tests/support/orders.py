"""The examples' order records for Spark tests: source rows shaped like Spark's Kafka source
(every tenth undecodable, every tenth without an amount), the functions that parse them, and a
counter Spark's Python workers share through a file.

Spark's workers cannot import tests/: this module is pickled by value, as the test modules
that use it are."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path

from pyspark import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def order_rows(n: int = 30, base: int = 0) -> list[tuple]:
    """Records ``base`` to ``base + n - 1`` in KAFKA_SOURCE_SCHEMA's shape: id % 10 == 3 is
    not JSON (JSONDecodeError), id % 10 == 7 has no amount (KeyError)."""
    ts = datetime(2026, 1, 1)
    out = []
    for i in range(base, base + n):
        if i % 10 == 3:
            value = b"{oops"                                   # JSONDecodeError
        elif i % 10 == 7:
            value = json.dumps({"id": i}).encode()             # KeyError: 'amount'
        else:
            value = json.dumps({"id": i, "amount": i * 1.5}).encode()
        out.append((f"k{i}".encode(), value, "orders", i % 3, 100 + i, ts, 0,
                    [("source", b"example")]))
    return out


def parse(row):
    order = json.loads(row.value)
    return (order["id"], float(order["amount"]))


def parse_fixed(row):
    """The fix: a missing amount is 0; undecodable JSON still fails."""
    order = json.loads(row.value)
    return (order["id"], float(order.get("amount", 0.0)))


def bump(path) -> int:
    """A counter shared by every Python worker (a file at ``path``): the new count."""
    path = Path(path)
    n = int(path.read_text()) + 1 if path.exists() else 1
    path.write_text(str(n))
    return n
