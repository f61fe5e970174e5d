"""Error details a caller can always receive: short, one line, no control characters.

A detail that echoes a 100 KB property value would exceed what HTTP/2 trailers may carry and the
caller would see "Stream removed" instead of the status. Every abort goes through `safe_details`
(`rpc.SafeContext` applies it to the servicer's `context.abort` calls).
"""

from __future__ import annotations

import re

import grpc

MAX_DETAILS_CHARS = 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")
_ELLIPSIS = " ... [truncated]"


def safe_details(message: object) -> str:
    """`message` as at most MAX_DETAILS_CHARS printable characters (runs of control characters
    become one space; a cut message says so)."""
    text = _CONTROL.sub(" ", str(message))
    if len(text) > MAX_DETAILS_CHARS:
        text = text[:MAX_DETAILS_CHARS - len(_ELLIPSIS)] + _ELLIPSIS
    return text


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: object):
    """`context.abort` with a safe detail; never returns (raises as grpc's abort does)."""
    context.abort(code, safe_details(message))
