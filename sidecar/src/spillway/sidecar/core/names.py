"""Names and ids that arrive with requests: one rule each, applied to every call.

A job name is refused (never trimmed) when it has leading or trailing whitespace, so a job never
registers under one spelling and reports under another. Every rule bounds length (in characters
and UTF-8 bytes, so the name fits a Kafka header) and refuses control characters. Each check
raises ValueError whose text starts with the field's name; the gRPC adapter answers
INVALID_ARGUMENT with it. The same job-name rule is mirrored for the driver in
``spillway.client._names`` (a test checks that both agree).

Kafka topic names (a DLQ topic, a topic-name prefix) are checked here too, so that `config`
(which parses ``dlq.topic.required.prefix``) and `guardrails` (the operator's rules over a job's
DLQ topic) share them without importing each other. This module imports nothing of the core.
"""

from __future__ import annotations

import re
import unicodedata

MAX_JOB_NAME_CHARS = 200
MAX_JOB_NAME_BYTES = 255
MAX_RUN_ID_CHARS = 128
MAX_RECORD_ID_BYTES = 1024
MAX_CUSTOM_STAGE_CHARS = 128
MAX_FUNCTION_NAME_CHARS = 512

MAX_TOPIC_LENGTH = 249
MAX_SHOWN = 64  # characters of a bad value a message repeats

_RUN_ID = re.compile(r"[A-Za-z0-9._:@+=-]*")
# Unicode categories never allowed in a name: control, format, surrogate, private-use,
# unassigned, and line/paragraph separators (a name is one line in a log and a header).
_BAD_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
_LEGAL_TOPIC = re.compile(r"[a-zA-Z0-9._-]+")


def shown(text: str, limit: int = MAX_SHOWN) -> str:
    """A bad value as an error message may repeat it: at most `limit` characters, escaped."""
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


def _bad_char(text: str) -> str | None:
    for ch in text:
        if ch.isascii():
            if ch.isprintable():
                continue
        elif unicodedata.category(ch) not in _BAD_CATEGORIES and ch.isprintable():
            continue
        return ch
    return None


def check_text(field: str, value: str, *, max_chars: int, max_bytes: int | None = None,
               required: bool = False) -> str:
    """Length and character bounds shared by every name below; returns `value` unchanged."""
    if not value:
        if required:
            raise ValueError(f"{field}: required")
        return value
    if len(value) > max_chars:
        raise ValueError(f"{field}: at most {max_chars} characters (got {len(value)})")
    if max_bytes is not None and len(value.encode("utf-8", "surrogatepass")) > max_bytes:
        raise ValueError(f"{field}: at most {max_bytes} bytes in UTF-8")
    bad = _bad_char(value)
    if bad is not None:
        raise ValueError(f"{field}: contains a control or unprintable character "
                         f"(U+{ord(bad):04X}) in {shown(value)}")
    return value


def check_job_name(value: str, field: str = "job") -> str:
    """A job name: required, 1..200 printable characters (<= 255 UTF-8 bytes), no leading or
    trailing whitespace (refused rather than trimmed)."""
    if not value or not value.strip():
        raise ValueError(f"{field}: a job name is required")
    if value != value.strip():
        raise ValueError(f"{field}: {shown(value)} has leading or trailing whitespace; "
                         f"a job name is used exactly as given, so remove it")
    return check_text(field, value, max_chars=MAX_JOB_NAME_CHARS,
                      max_bytes=MAX_JOB_NAME_BYTES, required=True)


def check_run_id(value: str, field: str = "run_id") -> str:
    """A run id: empty (none) or up to 128 of [A-Za-z0-9._:@+=-] (Spark application ids fit)."""
    if len(value) > MAX_RUN_ID_CHARS:
        raise ValueError(f"{field}: at most {MAX_RUN_ID_CHARS} characters (got {len(value)})")
    if _RUN_ID.fullmatch(value) is None:
        raise ValueError(f"{field}: use only [A-Za-z0-9._:@+=-]; got {shown(value)}")
    return value


def check_record_id(value: str, field: str = "record_id") -> str:
    if not value:
        raise ValueError(f"{field}: required (stable across task attempts)")
    if len(value) > MAX_RECORD_ID_BYTES or len(value.encode("utf-8", "surrogatepass")) > \
            MAX_RECORD_ID_BYTES:
        raise ValueError(f"{field}: at most {MAX_RECORD_ID_BYTES} bytes in UTF-8 "
                         f"(got {len(value.encode('utf-8', 'surrogatepass'))})")
    return value


def check_custom_stage(value: str, field: str = "custom_stage") -> str:
    return check_text(field, value, max_chars=MAX_CUSTOM_STAGE_CHARS)


def check_function_name(value: str, field: str = "function_name") -> str:
    return check_text(field, value, max_chars=MAX_FUNCTION_NAME_CHARS)


def valid_topic_name(name: str) -> bool:
    return (0 < len(name) <= MAX_TOPIC_LENGTH and name not in (".", "..")
            and _LEGAL_TOPIC.fullmatch(name) is not None)


def invalid_topic_message(name: str) -> str:
    # a topic name is legal up to 249 characters: show a bad one nearly whole
    return (f"{shown(name, 300)} is not a valid Kafka topic name: use 1 to {MAX_TOPIC_LENGTH} "
            f"characters from [a-zA-Z0-9._-], other than '.' and '..'")


def prefix_fragment_error(prefix: str) -> str | None:
    """Why `prefix` cannot start a DLQ topic name, or None when it can ('' can)."""
    if not prefix:
        return None
    if len(prefix) >= MAX_TOPIC_LENGTH or _LEGAL_TOPIC.fullmatch(prefix) is None:
        return (f"{shown(prefix, 300)} is not a legal topic-name fragment: use at most "
                f"{MAX_TOPIC_LENGTH - 1} characters from [a-zA-Z0-9._-]")
    if prefix.startswith("__"):
        return (f"{prefix!r} starts with '__', which is reserved for Kafka's internal topics")
    return None
