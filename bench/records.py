"""The records the benchmarks send: 200-byte values, failed the way a poison record fails.

Shared by the load-generator processes (`bench.loadgen`), the plain-producer baseline
(`bench.produce`) and the Spark workloads, so every variant carries the same bytes.
"""

from __future__ import annotations

import json
import socket

VALUE_SIZE = 200
SOURCE_TOPIC = "orders"


def value_bytes(i: int, size: int = VALUE_SIZE) -> bytes:
    """A ``size``-byte record value: truncated JSON (a poison record), numbered ``i``."""
    head = b'{"order_id": %d, "amount": ' % i
    return (head + b"x" * max(0, size - len(head)))[:size]


def key_bytes(i: int) -> bytes:
    return b"order-%d" % i


def poison_exception(i: int = 0) -> Exception:
    """The JSONDecodeError a poison value raises, with its real traceback."""
    try:
        json.loads(value_bytes(i))
    except json.JSONDecodeError as exc:
        return exc
    raise AssertionError("value_bytes() must not be valid JSON")


def spillway_like_headers(job: str, record_id: str,
                          sidecar_id: str = "") -> list[tuple[str, bytes]]:
    """Headers of the same names and sizes the sidecar adds to every DLQ record
    (`spillway.sidecar.core.dlq_record`), for the plain-producer baseline."""
    host = sidecar_id or socket.gethostname()
    return [
        ("spillway.record.id", record_id.encode()),
        ("spillway.error.category", b"data"),
        ("spillway.attempts", b"1"),
        ("spillway.reason", b"data error: json.decoder.JSONDecodeError (tolerated: "
                            b"errors.tolerance=all)"),
        ("spillway.job", job.encode()),
        ("spillway.task", f"1.0.0 tid=1 executor=0 host={host}".encode()),
        ("spillway.sidecar", host.encode()),
        ("spillway.timestamp", b"1763700000000"),
        ("spillway.record.copied", b"true"),
    ]
