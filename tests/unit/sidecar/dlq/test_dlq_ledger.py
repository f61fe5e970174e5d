"""The DLQ ledger's pure parts: keys both sides (redrive, read_dlq/reprocess) compute alike,
the resolution format, what a reprocessed record's dead letter says its payload is."""

from __future__ import annotations

import pytest
from spillway.client import dlq_ledger
from spillway.client.dlq_ledger import Resolution, decode, encode, ledger_key
from spillway.sidecar.dlq.ledger import message_key, read_resolutions
from spillway.sidecar.dlq.tools import DlqMessage
from spillway.spark._dlq_reader import to_row
from spillway.spark._records import RecordContext, payload_for
from spillway.spark._reprocess import _history
from spillway.v1 import sidecar_pb2 as pb

HEADERS = [("spillway.job", b"orders"), ("spillway.run.id", b"run-1"),
           ("spillway.record.id", b"TRANSFORMATION:orders/parse#1:p0:r3")]


def _key(**kw):
    base = dict(job="orders", run_id="run-1", record_id="r", key=b"k", value=b"v",
                topic="dlq", partition=0, offset=5)
    base.update(kw)
    return ledger_key(base.pop("job"), base.pop("run_id"), base.pop("record_id"),
                      base.pop("key"), base.pop("value"), **base)


def test_a_record_written_twice_into_the_dlq_has_one_key_and_different_records_two():
    assert _key() == _key(offset=9, partition=1)          # a repeat elsewhere in the DLQ
    assert _key() != _key(value=b"w")                     # same id, another record
    assert _key() != _key(run_id="run-2") != _key(job="refunds")
    assert _key(key=None) != _key(key=b"")                # null is not empty
    # no record id: the DLQ copy is the record
    assert _key(record_id=None) != _key(record_id=None, offset=6)
    assert len(_key()) == 32 and int(_key(), 16) >= 0


def test_the_sidecars_redrive_and_sparks_read_dlq_compute_the_same_key():
    msg = DlqMessage("dlq.orders", 2, 41, 1, b"k", b"v", tuple(HEADERS))
    row = to_row("dlq.orders", 2, 41, ts_ms=1, key=b"k", value=b"v", headers=list(HEADERS))
    assert message_key(msg) == row["ledger_key"]
    bare = DlqMessage("dlq.orders", 2, 41, 1, None, b"v", ())
    assert message_key(bare) == to_row("dlq.orders", 2, 41, ts_ms=1, key=None, value=b"v",
                                       headers=[])["ledger_key"]


def test_resolutions_round_trip_and_junk_is_not_one():
    r = Resolution("redriven", 17, "spillway dlq redrive", job="orders", record_id="r1",
                   dlq="dlq[0]@5", target="orders")
    assert decode(encode(r)) == r
    for junk in (None, b"", b"{", b"[]", b'{"v":2,"resolution":"redriven","at":1}',
                 b'{"v":1,"resolution":"deleted","at":1}', b'{"v":1,"resolution":"redriven"}',
                 b'{"v":1,"resolution":"redriven","at":true}', b"x" * 20000):
        assert decode(junk) is None
    with pytest.raises(ValueError, match="resolution"):
        Resolution("fixed", 1, "me")
    assert "redriven to 'orders'" in dlq_ledger.describe(r)


def test_the_latest_resolution_per_key_wins_and_the_bound_is_stated():
    def m(key, r):
        return DlqMessage("dlq.ledger", 0, 0, None, key, encode(r), ())

    got = read_resolutions([m(b"a", Resolution("reprocessed", 1, "x")),
                            m(b"a", Resolution("superseded", 2, "x")),
                            m(b"b", Resolution("redriven", 3, "x")),
                            DlqMessage("dlq.ledger", 0, 1, None, b"c", b"junk", ()),
                            DlqMessage("dlq.ledger", 0, 2, None, None, b"{}", ())])
    assert {k: v.resolution for k, v in got.items()} == {"a": "superseded", "b": "redriven"}
    from spillway.sidecar.errors import DlqError
    with pytest.raises(DlqError, match="more than 1 resolutions.*--no-ledger"):
        read_resolutions([m(b"a", Resolution("redriven", 1, "x")),
                          m(b"b", Resolution("redriven", 1, "x"))], limit=1)


def test_a_reprocessed_records_dead_letter_keeps_the_payload_kind_it_had():
    src = RecordContext("r", ("orders", 0, 1), b"k", b"v", (), None, "source")
    # a transformation's input is the stage's input, unless the row is a dead letter's bytes
    assert payload_for(pb.STAGE_TRANSFORMATION, src) == "stage-input"
    again = src._replace(headers=(("spillway.redrive.payload", b"source"),))
    assert payload_for(pb.STAGE_TRANSFORMATION, again) == "source"
    was_json = src._replace(headers=(("spillway.redrive.payload", b"stage-input"),))
    assert payload_for(pb.STAGE_TRANSFORMATION, was_json) == "stage-input"
    assert payload_for(pb.STAGE_DESERIALIZATION, src) == "source"
    # no Kafka columns: never "source", whatever a header claims
    assert payload_for(pb.STAGE_TRANSFORMATION,
                       RecordContext("r", headers=again.headers)) == "stage-input"


def test_history_headers_from_rows_and_reports():
    from pyspark.sql import Row

    row_headers = [Row(key="app", value=b"1"), Row(key="spillway.redrive.from", value=b"ab"),
                   Row(key="spillway.redrive.dlq", value=b"dlq.o")]
    assert _history(row_headers) == {"spillway.redrive.from": b"ab",
                                     "spillway.redrive.dlq": b"dlq.o"}
    report = [pb.Header(key="spillway.redrive.from", value=b"cd"), pb.Header(key="x")]
    assert _history(report) == {"spillway.redrive.from": b"cd"}
    assert _history(None) == {}
