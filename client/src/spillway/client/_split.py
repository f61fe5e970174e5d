"""Sending a report that is too large for the sidecar's spool: halves, sent again.

The sidecar answers FAILED_PRECONDITION (`ReportTooLargeError`) for a report that could not be
admitted even into its empty DLQ spool (``spool.max.bytes`` / ``spool.max.records``): waiting
never helps, smaller reports do. Nothing of a refused report was decided, so its halves can be
sent as new reports; each half that is still too large is halved again. The verdicts come back
in the records' order, as one report's would. The recovered record ids travel with the first
half only (the sidecar must see each of them once).

A single record that does not fit cannot be split: its ReportTooLargeError is raised, naming the
record, and the task fails as for any report the sidecar refuses for good.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from .errors import ReportTooLargeError

log = logging.getLogger("spillway.client")

R = TypeVar("R")
V = TypeVar("V")


def send_splitting(send: Callable[[Sequence[R], Sequence[str]], list[V]],
                   records: Sequence[R], recovered: Sequence[str]) -> list[V]:
    """``send(records, recovered)``, and on ReportTooLargeError the same for each half (the
    depth is log2 of the record count: ReportFailures takes at most 65,536 records)."""
    records, recovered = list(records), list(recovered)
    try:
        return send(records, recovered)
    except ReportTooLargeError as exc:
        if len(records) <= 1:
            rid = getattr(records[0], "record_id", "") if records else ""
            raise ReportTooLargeError(
                f"record {rid!r} alone cannot fit in the sidecar's DLQ spool, so the report "
                f"cannot be split further: {exc}", code=exc.code) from exc
        mid = len(records) // 2
        log.info("spillway: a report of %d records is larger than the sidecar's DLQ spool; "
                 "sending it again as two reports of %d and %d", len(records), mid,
                 len(records) - mid)
    first = send_splitting(send, records[:mid], recovered)
    return first + send_splitting(send, records[mid:], [])
