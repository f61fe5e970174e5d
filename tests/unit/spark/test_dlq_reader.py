"""read_dlq's pure parts: a DLQ record's headers as typed columns, the filters, the arguments."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from spillway.spark._dlq_reader import _ALL_COLUMNS, _COLUMNS, DLQ_SCHEMA, _Filter, _ms, to_row
from spillway.spark._reprocess import redrive_record_id

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _headers(fam="__connect.errors.", **extra):
    h = [("app", b"1"), (fam + "topic", b"orders"), (fam + "partition", b"2"),
         (fam + "offset", b"41"), (fam + "stage", b"TRANSFORMATION"),
         (fam + "class.name", b"etl.parse"),
         (fam + "exception.class.name", b"builtins.ValueError"),
         (fam + "exception.message", "bad é".encode()),
         ("spillway.record.id", b"r-1"), ("spillway.error.category", b"data"),
         ("spillway.attempts", b"3"), ("spillway.job", b"orders-etl"),
         ("spillway.run.id", b"app-1"), ("spillway.timestamp", b"1700000000123"),
         ("spillway.record.copied", b"true"), ("spillway.payload", b"source"),
         ("traceparent", TP.encode())]
    if fam == "__dlq.errors.":
        h.append((fam + "group", b"orders-etl"))
    return h + list(extra.items())


@pytest.mark.parametrize("fam", ["__connect.errors.", "__dlq.errors."])
def test_context_headers_become_typed_columns(fam):
    row = to_row("dlq.o", 0, 5, ts_ms=1700000000999, key=b"k", value=b"v", headers=_headers(fam))
    assert set(row) == set(_COLUMNS) | {"_when"}
    assert (row["job"], row["run_id"], row["stage"], row["record_id"]) == (
        "orders-etl", "app-1", "TRANSFORMATION", "r-1")
    assert (row["source_topic"], row["source_partition"], row["source_offset"]) == (
        "orders", 2, 41)
    assert (row["exception_class"], row["exception_message"], row["function"]) == (
        "builtins.ValueError", "bad é", "etl.parse")
    assert (row["category"], row["attempts"], row["payload"], row["record_copied"]) == (
        "data", 3, "source", True)
    assert row["dead_lettered_at"] == datetime(2023, 11, 14, 22, 13, 20, 123000, timezone.utc)
    assert row["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert row["_when"] == 1700000000123 and row["redrive_count"] is None


def test_a_record_without_headers_has_null_columns_and_the_kafka_time():
    row = to_row("dlq.o", 1, 0, ts_ms=1700000000999, key=None, value=None, headers=[])
    assert row["job"] is None and row["attempts"] is None and row["trace_id"] is None
    assert row["_when"] == 1700000000999 and row["record_copied"] is None
    assert len(_ALL_COLUMNS) == DLQ_SCHEMA.count(",") - 1 + 1   # headers' struct: one comma


def test_filters():
    row = to_row("dlq.o", 0, 5, ts_ms=None, key=b"k", value=b"v", headers=_headers())
    assert _Filter(exception_class="ValueError").keep(row)
    assert not _Filter(exception_class="Error").keep(row)
    assert _Filter(job="orders-etl", stage="TRANSFORMATION").keep(row)
    assert not _Filter(stage="TASK_PUT").keep(row)
    assert _Filter(since_ms=1700000000123, until_ms=1700000000124).keep(row)
    assert not _Filter(until_ms=1700000000123).keep(row)


def test_times():
    assert _ms("2023-11-14T22:13:20Z", "since") == 1_700_000_000_000
    assert _ms("2023-11-14T22:13:20", "since") == 1_700_000_000_000    # UTC without a zone
    assert _ms(5, "since") == 5 and _ms(None, "since") is None
    with pytest.raises(ValueError, match="since: not an ISO 8601 time"):
        _ms("yesterday", "since")
    with pytest.raises(TypeError, match="until"):
        _ms(True, "until")


def test_redrive_record_ids_carry_the_first_id_and_the_round():
    row = {"headers": [("spillway.redrive.of", b"j/T/0/3"), ("spillway.redrive.count", b"2")],
           "topic": "orders", "partition": 0, "offset": 3}
    assert redrive_record_id(row) == "j/T/0/3#redrive2"
    assert redrive_record_id({**row, "headers": []}) == "orders/0/3#redrive"
