"""The pure parts of `spillway dlq tail|redrive`: rendering, filters, header rewriting, parsing."""

from __future__ import annotations

import pytest
from spillway.sidecar.dlq.redrive_rules import (
    RedriveFilter,
    is_context_only,
    original_headers,
    parse_rate,
    parse_time_ms,
    redrive_count,
)
from spillway.sidecar.dlq.tools import DlqMessage, format_message, render_bytes


def msg(headers, *, ts=1_000, key=b"k", value=b"v") -> DlqMessage:
    return DlqMessage("dlq.t", 0, 5, ts, key, value, tuple(headers))


CONNECT = [("app", b"1"), ("__connect.errors.stage", b"TRANSFORMATION"),
           ("__connect.errors.connector.name", b"orders"),
           ("__connect.errors.exception.class.name", b"builtins.ValueError"),
           ("spillway.job", b"orders"), ("spillway.timestamp", b"5000"),
           ("spillway.record.copied", b"true"), ("traceparent", b"00-abc")]


@pytest.mark.parametrize("data,limit,expected", [
    (None, 10, "(null)"),
    (b"", 10, ""),
    (b"hello\nworld", 100, "hello\nworld"),
    (b"abcdef", 3, "abc …(+3 bytes)"),
    ("é".encode() * 3, 3, "é …(+4 bytes)"),           # a character cut in two stays text
    (b"\x00\x01\xff", 10, "hex:0001ff"),
    (bytes(range(40)), 100, "base64:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJw=="),
    (b"\x1b[31mred", 100, "hex:1b5b33316d726564"),  # control characters are not "printable"
])
def test_render_bytes(data, limit, expected):
    assert render_bytes(data, limit) == expected


def test_format_message_is_one_block_with_every_header():
    text = format_message(msg([("a", b"1"), ("trace", b"line1\nline2"), ("n", None)]))
    assert text == ("── dlq.t [0] @5  1970-01-01T00:00:01.000+00:00\n"
                    "key:   k\n"
                    "value: v\n"
                    "headers:\n"
                    "  a: 1\n"
                    "  trace: line1\n"
                    "      line2\n"
                    "  n: (null)")
    assert format_message(msg([], ts=None)).endswith("headers: (none)")


def test_filters_read_the_context_family_the_record_was_written_with():
    m = msg(CONNECT)
    assert RedriveFilter().matches(m)
    assert RedriveFilter(stage="TRANSFORMATION", job="orders").matches(m)
    assert RedriveFilter(exception_class="ValueError").matches(m)
    assert RedriveFilter(exception_class="builtins.ValueError").matches(m)
    assert not RedriveFilter(exception_class="Error").matches(m)  # not a name suffix
    assert not RedriveFilter(stage="DESERIALIZATION").matches(m)
    assert not RedriveFilter(job="billing").matches(m)
    dlq = msg([("__dlq.errors.group", b"billing"), ("__dlq.errors.stage", b"TASK_PUT")])
    assert RedriveFilter(stage="TASK_PUT", job="billing").matches(dlq)
    assert not RedriveFilter(stage="TASK_PUT").matches(msg([("app", b"1")]))


def test_time_window_uses_the_dead_letter_time_then_the_kafka_timestamp():
    m = msg(CONNECT, ts=999_999)  # spillway.timestamp=5000 wins
    assert RedriveFilter(since_ms=5000, until_ms=5001).matches(m)
    assert not RedriveFilter(since_ms=5001).matches(m)
    assert not RedriveFilter(until_ms=5000).matches(m)  # until is exclusive
    bare = msg([], ts=7000)
    assert RedriveFilter(since_ms=7000).matches(bare)
    assert not RedriveFilter(since_ms=1).matches(msg([], ts=None))


def test_original_headers_drop_the_context_family_spillway_headers_and_trace_context():
    m = msg(CONNECT + [("spillway.redrive.count", b"2"), ("tracestate", b"k=v")])
    # the dead-letter's trace context is linked to, never continued
    assert original_headers(m) == [("app", b"1")]
    assert redrive_count(m) == 2
    assert redrive_count(msg([])) == 0
    assert redrive_count(msg([("spillway.redrive.count", b"x")])) == 0
    # dlq-format record: __connect.* headers are the original record's own and stay
    dlq = msg([("__dlq.errors.group", b"g"), ("__connect.errors.stage", b"orig")])
    assert original_headers(dlq) == [("__connect.errors.stage", b"orig")]
    assert is_context_only(msg([("spillway.record.copied", b"false")]))
    assert not is_context_only(m)


def test_parsers():
    assert parse_rate("100/s") == 100.0 and parse_rate("2.5") == 2.5
    with pytest.raises(ValueError, match="the rate must be > 0"):
        parse_rate("0/s")
    assert parse_time_ms("1970-01-01T00:00:01Z") == 1000
    assert parse_time_ms("1970-01-01T00:00:01") == 1000  # no zone: UTC
    assert parse_time_ms("1970-01-01T01:00:01+01:00") == 1000
