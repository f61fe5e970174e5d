"""Provisional verdicts: what a node answers at once, without its run's home, for a report whose
verdicts nothing but the records' identity decides (docs/POLICY.md, "Provisional verdicts").

Under the built-in CONTINUE handler with no tolerance limit, a data error is skipped whether
its record is new or was skipped before; what the record's identity changes is only whether
it is counted, logged and dead-lettered (once per record, job-wide: the home's to say). So
the node answers SKIP now, holds the DLQ record, and lets the home say later whether the held
copy is the record's first (released to Kafka) or not (dropped). The verdict is the one the
home gives a record it meets first (same category, attempt and reason), so an executor sees
no difference. Pure: imports nothing but the core.
"""

from __future__ import annotations

from collections.abc import Sequence

from .decide import DATA_WHY, streaks_allowed  # the home's words for a data error
from .jobstate import JobState, describe
from .model import Action, Category, FailedRecord, Verdict


def provisional_verdicts(j: JobState, records: Sequence[FailedRecord], *, sliced: bool = False
                         ) -> list[tuple[Verdict, int]] | None:
    """The verdicts a node may answer for `records` before their home does, as streaks (a
    verdict and how many consecutive records it is for: records failing the same way share
    one, with no record id), as the home answers a record it meets first (SKIP, a data error,
    dead-lettered); or None when the home could answer any record of the report otherwise: an
    error that is not a data error (retried, or failing the task or the job), a user handler
    or a tolerance limit (either may fail the run), no DLQ topic, or a run already failed.
    ``sliced``: the node holds room in a slice of the run's error budget (`slices.py`), so a
    limit that slices allow does not stop it."""
    if not records or j.failure_reason:
        return None
    if not streaks_allowed(j) and not (sliced and j.slices is not None):
        return None
    return _first_seen_streaks(j, records, every=True)


def first_seen_skips(j: JobState, records: Sequence[FailedRecord]
                     ) -> list[Verdict | None] | None:
    """Per record, the verdict its home gives a data error it meets first within the run's
    limits (SKIP, dead-lettered), or None for a record that is not a data error; None for the
    whole report when the run has no DLQ topic. What a node holds a copy of before its home
    answers (`confirm.py`)."""
    streaks = _first_seen_streaks(j, records)
    if streaks is None:
        return None
    out: list[Verdict | None] = []
    i = 0
    for v, n in streaks:
        if v is None:
            out += [None] * n
        else:
            out += [Verdict(r.record_id, v.action, v.category, v.reason, v.attempt)
                    for r in records[i:i + n]]
        i += n
    return out


def _first_seen_streaks(j: JobState, records: Sequence[FailedRecord], *, every: bool = False
                      ) -> list[tuple[Verdict | None, int]] | None:
    """`first_seen_skips` as streaks of records failing the same way (None: not a data error;
    with `every`, the whole report is None then)."""
    s = j.settings
    if not s.dlq.enabled:
        return None
    classify = j.classifier.classify
    where = f"skipped, dead-lettered to {s.dlq.topic}: "
    out: list[tuple[Verdict | None, int]] = []
    last_exc: object = None
    verdict: Verdict | None = None
    start = 0
    skip, data = Action.SKIP, Category.DATA
    for i, r in enumerate(records):
        exc = r.exception
        if exc is not last_exc:   # records failing the same way share one exception value
            if i:
                out.append((verdict, i - start))
            start = i
            cls = classify(exc)
            if cls.category is not data:
                if every:
                    return None
                verdict = None
            else:
                verdict = Verdict("", skip, data,
                                  f"{where}{describe(r)} [{cls.describe()}]; {DATA_WHY}", 1)
            last_exc = exc
    if records:
        out.append((verdict, len(records) - start))
    return out


__all__ = ["first_seen_skips", "provisional_verdicts"]
