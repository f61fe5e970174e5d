"""The pure parts of ``spillway dlq redrive``: filters, header rewriting, which records are
left out and why, the summary lines, progress estimates, parsing of its options.

A record matching the filters is either sent, or left out for one of these reasons:

- refused (the command would not do what it was asked for that record): loop protection
  (``--max-redrives``), context-only (no original record), stage input (its key/value are a
  stage's input and the target is, or may be, its source topic; ``--allow-stage-input``);
- already dealt with: resolved in the ledger, or a repeat within the run.

`RedriveSummary.refusals` says why the refused ones were refused, in one line; a run that sent
nothing while refusing records fails (`RedriveSummary.sent_nothing`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

from ..core.dlq_record import (
    CONNECT_PREFIX,
    DLQ_PREFIX,
    H_COPIED,
    H_JOB,
    H_PAYLOAD,
    H_REDRIVE_COUNT,
    H_TIMESTAMP,
    H_TRACEPARENT,
    H_TRACESTATE,
    SPILLWAY_PREFIX,
)
from ..core.model import Header
from .tools import DlqMessage


def parse_time_ms(text: str) -> int:
    """ISO 8601 to ms since the epoch; a time without zone is UTC."""
    try:
        dt = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"not an ISO 8601 time: {text!r} (e.g. 2024-05-01T12:00:00Z)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)


def _context_prefix(msg: DlqMessage) -> str | None:
    """Which context family the record was written with (None: context headers were off)."""
    names = {n for n, _ in msg.headers}
    if DLQ_PREFIX + "group" in names or DLQ_PREFIX + "stage" in names:
        return DLQ_PREFIX
    if CONNECT_PREFIX + "connector.name" in names or CONNECT_PREFIX + "stage" in names:
        return CONNECT_PREFIX
    return None


@dataclass(frozen=True, slots=True)
class RedriveFilter:
    stage: str | None = None
    exception_class: str | None = None  # exact, or the class's simple name
    job: str | None = None
    since_ms: int | None = None  # inclusive
    until_ms: int | None = None  # exclusive

    def matches(self, msg: DlqMessage) -> bool:
        prefix = _context_prefix(msg)
        if self.stage is not None:
            if prefix is None or msg.text(prefix + "stage") != self.stage:
                return False
        if self.exception_class is not None:
            cls = msg.text(prefix + "exception.class.name") if prefix else None
            if cls is None or not (cls == self.exception_class
                                   or cls.endswith("." + self.exception_class)):
                return False
        if self.job is not None:
            job = msg.text(H_JOB)
            if job is None and prefix is not None:
                job = msg.text(prefix + ("group" if prefix == DLQ_PREFIX else "connector.name"))
            if job != self.job:
                return False
        if self.since_ms is not None or self.until_ms is not None:
            when: int | None = None
            raw = msg.text(H_TIMESTAMP)
            if raw is not None and raw.isdigit():
                when = int(raw)
            elif msg.timestamp_ms is not None:
                when = msg.timestamp_ms
            if when is None:
                return False
            if self.since_ms is not None and when < self.since_ms:
                return False
            if self.until_ms is not None and when >= self.until_ms:
                return False
        return True


def redrive_count(msg: DlqMessage) -> int:
    raw = msg.text(H_REDRIVE_COUNT)
    return int(raw) if raw is not None and raw.strip().isdigit() else 0


def original_headers(msg: DlqMessage) -> list[Header]:
    """The DLQ record's headers without the error-context family it was written with, without
    spillway's own headers (the redrive count is handled by the caller) and without its trace
    context (the dead-letter's, which a redriven record links to but never continues)."""
    prefix = _context_prefix(msg)
    out: list[Header] = []
    for name, value in msg.headers:
        if prefix is not None and name.startswith(prefix):
            continue
        if name.startswith(SPILLWAY_PREFIX) or name in (H_TRACEPARENT, H_TRACESTATE):
            continue
        out.append((name, value))
    return out


def is_context_only(msg: DlqMessage) -> bool:
    return msg.text(H_COPIED) == "false"


# Why a stage's input is not sent to a target (`stage_input_conflict`).
SOURCE_TOPIC = "source topic"       # the target is the source topic its context headers name
UNKNOWN_SOURCE = "unknown source"   # written without context headers: the target may be it


def stage_input_conflict(msg: DlqMessage, target: str) -> str | None:
    """Why `msg` must not go to `target` unless told (`--allow-stage-input`), or None.

    Its key/value are not the source record as read (``spillway.payload`` is not ``source``: a
    stage's input, e.g. a transformed row as JSON, or a record written before the header
    existed), and `target` is its source topic (SOURCE_TOPIC), or may be: it was written without
    context headers, so its source topic is unknown (UNKNOWN_SOURCE). A record whose context
    headers name no source topic did not come from Kafka: no source topic to protect."""
    if msg.text(H_PAYLOAD) == "source":
        return None
    prefix = _context_prefix(msg)
    if prefix is None:
        return UNKNOWN_SOURCE
    return SOURCE_TOPIC if msg.text(prefix + "topic") == target else None


def stage_input_skip(msg: DlqMessage, target: str, why: str) -> str:
    """The per-record line for a stage input left out (after ``skip <where> record <id>: ``)."""
    kind = msg.text(H_PAYLOAD)
    what = (f"its key/value are a stage's input (spillway.payload={kind}, e.g. a transformed "
            f"row), not a record as read" if kind else
            "its key/value may be a stage's input (no spillway.payload: written by an older "
            "spillway)")
    if why == SOURCE_TOPIC:
        where = f"{target!r} is its source topic"
    else:
        where = (f"it was dead-lettered without context headers: its source topic is unknown, "
                 f"so spillway cannot tell that {target!r} is not it")
    return f"{what}, and {where} (--allow-stage-input sends it)"


# Record ids a redrive run remembers to skip repeats (a DLQ topic may hold a record twice):
# past this many, ids are no longer remembered and a repeat may be redriven again (counted).
MAX_REMEMBERED_IDS = 1_000_000

def parse_rate(text: str) -> float:
    """``100``, ``100/s`` or ``2.5/s`` records per second."""
    raw = text.strip().lower().removesuffix("/s")
    try:
        rate = float(raw)
    except ValueError:
        raise ValueError(f"not a rate: {text!r} (e.g. 100/s)") from None
    if rate <= 0:
        raise ValueError(f"the rate must be > 0, got {text!r}")
    return rate


@dataclass(slots=True)
class RedriveSummary:
    scanned: int = 0
    matched: int = 0
    redriven: int = 0
    skipped_loop: int = 0
    skipped_context_only: int = 0
    skipped_stage_input: int = 0
    stage_input_unknown_source: int = 0   # of skipped_stage_input: no context headers
    skipped_repeat: int = 0
    skipped_resolved: int = 0
    unremembered: int = 0   # redriven after MAX_REMEMBERED_IDS: repeats not detectable
    failed: int = 0
    ledger_failed: int = 0  # redriven but not recorded in the ledger
    errors: list[str] = field(default_factory=list)

    def line(self, dry_run: bool) -> str:
        verb = "would redrive" if dry_run else "redriven"
        return (f"scanned={self.scanned} matched={self.matched} {verb}={self.redriven} "
                f"skipped (loop protection)={self.skipped_loop} "
                f"skipped (context-only)={self.skipped_context_only} "
                f"skipped (stage input)={self.skipped_stage_input} "
                f"skipped (already redriven)={self.skipped_repeat} "
                f"skipped (resolved)={self.skipped_resolved} failed={self.failed}"
                + (f" not in ledger={self.ledger_failed}" if self.ledger_failed else ""))

    @property
    def refused(self) -> int:
        return self.skipped_loop + self.skipped_context_only + self.skipped_stage_input

    def sent_nothing(self) -> bool:
        """Records were to be sent, none was, and some were refused (not merely resolved
        before or repeated): the command did nothing it was asked."""
        return self.redriven == 0 and self.failed == 0 and self.refused > 0

    def refusals(self, target: str, max_redrives: int, dry_run: bool) -> str | None:
        """One line: how many matching records were refused and why (counts by reason, with
        the option that changes each); None when none was."""
        if not self.refused:
            return None
        why = []
        at_source = self.skipped_stage_input - self.stage_input_unknown_source
        if at_source:
            why.append(f"{at_source} stage input whose source topic is {target!r}")
        if self.stage_input_unknown_source:
            why.append(f"{self.stage_input_unknown_source} stage input of unknown source "
                       f"(dead-lettered without context headers: spillway cannot tell that "
                       f"{target!r} is not their source topic)")
        if self.skipped_stage_input:
            why[-1] += (": their key/value are a stage's input (e.g. a transformed row), not "
                        "records as read; --allow-stage-input sends them")
        if self.skipped_loop:
            why.append(f"{self.skipped_loop} at the loop protection's limit (redriven "
                       f"{max_redrives} or more times already; --max-redrives raises it)")
        if self.skipped_context_only:
            why.append(f"{self.skipped_context_only} context-only (dead-lettered with "
                       f"errors.deadletterqueue.copy.record.enable=false: no record to send)")
        head = ""
        if self.sent_nothing():
            head = "would send nothing: " if dry_run else "sent nothing: "
        verb = "would refuse" if dry_run else "refused"
        return (f"{head}{verb} {self.refused} of {self.matched} matching record(s): "
                + "; ".join(why))


def eta_s(done: int, total: int | None, elapsed_s: float) -> float | None:
    """Seconds left at the rate so far, when the total is known and not yet passed."""
    if not total or done <= 0 or done >= total or elapsed_s <= 0:
        return None
    return elapsed_s / done * (total - done)


def progress_line(summary: RedriveSummary, total: int | None, elapsed_s: float,
                  dry_run: bool) -> str:
    """A running line: scanned of the total (when the watermarks gave one), percent, ETA."""
    if total is not None and summary.scanned <= total:
        pct = 100.0 * summary.scanned / total if total else 100.0
        scanned = f"scanned {summary.scanned}/{total} ({pct:.0f}%)"
    else:
        scanned = f"scanned {summary.scanned}"
    eta = eta_s(summary.scanned, total, elapsed_s)
    verb = "would redrive" if dry_run else "redriven"
    return (f"redrive progress: {scanned}, matched={summary.matched} {verb}={summary.redriven} "
            f"refused={summary.refused} failed={summary.failed}, {elapsed_s:.0f}s elapsed"
            + (f", ETA {eta:.0f}s" if eta is not None else ""))
