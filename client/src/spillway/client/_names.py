"""The job-name rule, checked on the driver before anything is sent.

A mirror of the sidecar's ``spillway.sidecar.core.names.check_job_name`` (the client cannot
import the sidecar); tests/unit/client/test_names_agree.py checks that both accept and refuse
the same names with the same message.
"""

from __future__ import annotations

import unicodedata

MAX_JOB_NAME_CHARS = 200
MAX_JOB_NAME_BYTES = 255
_BAD_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def _shown(text: str, limit: int = 64) -> str:
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


def check_job_name(value: str, field: str = "job") -> str:
    """ValueError naming `field` unless `value` is a job name the sidecar accepts."""
    if not isinstance(value, str) or not value or not value.strip():
        raise ValueError(f"{field}: a job name is required")
    if value != value.strip():
        raise ValueError(f"{field}: {_shown(value)} has leading or trailing whitespace; "
                         f"a job name is used exactly as given, so remove it")
    if len(value) > MAX_JOB_NAME_CHARS:
        raise ValueError(f"{field}: at most {MAX_JOB_NAME_CHARS} characters (got {len(value)})")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_JOB_NAME_BYTES:
        raise ValueError(f"{field}: at most {MAX_JOB_NAME_BYTES} bytes in UTF-8")
    for ch in value:
        if ch.isascii():
            if ch.isprintable():
                continue
        elif unicodedata.category(ch) not in _BAD_CATEGORIES and ch.isprintable():
            continue
        raise ValueError(f"{field}: contains a control or unprintable character "
                         f"(U+{ord(ch):04X}) in {_shown(value)}")
    return value
