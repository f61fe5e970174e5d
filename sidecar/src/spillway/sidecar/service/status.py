"""GetStatus's answer: the sidecar-wide counters and one page of the runs a caller may see.

A page is bounded twice: by the caller's page size and by bytes (it stays under a default
4 MiB client limit), and each run's summary is cut for listing (reason and breakdowns; the full
summary is GetJobSummary's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spillway.sidecar import __version__
from spillway.sidecar.errors import UnknownJobError
from spillway.sidecar.service.registry import (
    Caller,
    decode_page_token,
    encode_page_token,
    page_size,
    visible,
)
from spillway.v1 import sidecar_pb2 as pb

if TYPE_CHECKING:
    from spillway.sidecar.service.sidecar import Sidecar

_STATUS_REASON_CHARS = 1024       # a run's failure reason in GetStatus (full in GetJobSummary)
_STATUS_BREAKDOWN_KEYS = 20       # per breakdown in GetStatus, the rest summed as "(other)"
_STATUS_KEY_CHARS = 256
# GetStatus pages stop short of this many bytes, so any page fits a default 4 MiB client limit
_STATUS_PAGE_BYTES = 3 * 1024 * 1024


def _status_summary(s: pb.JobSummary) -> pb.JobSummary:
    """A run's summary bounded for GetStatus (which lists many): reason and breakdowns cut."""
    if len(s.failure_reason) > _STATUS_REASON_CHARS:
        s.failure_reason = s.failure_reason[:_STATUS_REASON_CHARS] + "…"
    for entries in (s.by_stage, s.by_category, s.by_exception_class):
        if len(entries) <= _STATUS_BREAKDOWN_KEYS and all(
                len(e.key) <= _STATUS_KEY_CHARS for e in entries):
            continue
        ranked = sorted(entries, key=lambda e: (-e.count, e.key))
        kept = ranked[:_STATUS_BREAKDOWN_KEYS]
        other = sum(e.count for e in ranked[_STATUS_BREAKDOWN_KEYS:])
        cut = [pb.CountEntry(key=e.key[:_STATUS_KEY_CHARS], count=e.count) for e in kept]
        if other:
            cut.append(pb.CountEntry(key="(other)", count=other))
        del entries[:]
        entries.extend(cut)
    return s


def status_page(sidecar: Sidecar, request: pb.GetStatusRequest, caller: Caller,
                token: str | None) -> pb.SidecarStatus:
    """Counters, and a page of the runs the caller may see (by job name, then run id)."""
    size = page_size(request.page_size)
    after = decode_page_token(request.page_token) if request.page_token else None
    runs = visible(sidecar.registry.runs(request.job), caller, token)
    out = pb.SidecarStatus(
        sidecar_id=sidecar.sidecar_id, version=__version__,
        counters=sidecar.sidewide_counters(),
        instance_id=sidecar.instance_id, advertised_address=sidecar.advertised_address,
        jobs_total=len(runs))
    if after is not None:
        runs = [r for r in runs if (r.job, r.run_id) > after]
    budget = _STATUS_PAGE_BYTES - out.ByteSize()
    last = None
    for run in runs:
        if len(out.jobs) >= size:
            break
        try:
            summary = _status_summary(sidecar.summary_pb(run.key))
        except UnknownJobError:  # ended meanwhile
            continue
        cost = summary.ByteSize() + 8
        if cost > budget and out.jobs:
            break
        budget -= cost
        out.jobs.append(summary)
        last = run
    if last is not None and runs and runs[-1] is not last:
        out.next_page_token = encode_page_token(last.job, last.run_id)
    return out


__all__ = ["status_page"]
