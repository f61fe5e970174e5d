"""What a job reports back on the driver: `JobReport` (a run's counts summed over sidecars) and
`failure_message` (the real cause inside the exception of a failed Spark action)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from spillway.client.errors import SpillwayClientError
from spillway.v1 import sidecar_pb2 as pb

_SPILLWAY_ERROR = re.compile(r"spillway\.client\.errors\.(\w+Error): ([^\n]+)")
_TRACEBACK = "Traceback (most recent call last):"
_RAISED = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Invalid|Exit|Interrupt|Warning|"
                     r"Failure|Fault|Timeout)\b[^:\n]*)(?::\s*(.*))?$")


def _traceback_exception(text: str) -> str:
    """``Type: message`` of the exception that ends the last Python traceback in ``text``."""
    at = text.rfind(_TRACEBACK)
    if at < 0:
        return ""
    for line in text[at + len(_TRACEBACK):].splitlines():
        if not line.strip() or line.startswith((" ", "\t")) or line.startswith("^"):
            continue          # frames, source lines, carets
        m = _RAISED.match(line.strip())
        if m:
            return f"{m.group(1)}: {m.group(2).strip()}" if m.group(2) else m.group(1)
    return ""


def failure_message(exc: BaseException) -> str:
    """The real cause inside a failed Spark action's exception.

    Spark wraps the executor's Python exception (with its traceback) in its own ("An
    exception was thrown from the Python worker", a Py4J error, a SparkException ...). This
    finds the last spillway error in it, e.g. ``ToleranceExceededError: spillway job
    'orders' failed in stage TRANSFORMATION: ...``; else the exception that ended the last
    Python traceback in it, e.g. ``pyarrow.lib.ArrowInvalid: Could not convert ...``; else
    the exception's first line.
    """
    if isinstance(exc, SpillwayClientError):
        return f"{type(exc).__name__}: {exc}"
    texts, seen = [], set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:   # Spark's wrappers chain the cause
        seen.add(id(cur))
        texts.append(str(cur))
        cur = cur.__cause__ or cur.__context__
    text = "\n".join(texts)
    found = _SPILLWAY_ERROR.findall(text)
    if found:
        name, message = found[-1]
        return f"{name}: {message.strip()}"
    raised = _traceback_exception(text)
    if raised:
        return raised
    lines = [ln.strip() for ln in texts[0].splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


@dataclass
class JobReport:
    """A job's counts summed over sidecars (KIP-298 task-error-metrics names, snake_case)."""

    job: str
    run_id: str = ""
    failed: bool = False
    failure_reasons: list[str] = field(default_factory=list)
    records_processed: int = 0
    total_record_failures: int = 0
    total_record_errors: int = 0
    total_records_skipped: int = 0
    total_retries: int = 0
    total_errors_logged: int = 0
    dlq_records_written: int = 0
    dropped_records: int = 0
    retry_budget_exhausted: int = 0   # retries the job's retry budget deferred or refused
    #: Distinct records reported under an id already known with another payload (each decided
    #: and dead-lettered on its own; a sign that record ids are not unique: docs/POLICY.md).
    record_id_collisions: int = 0
    last_error_timestamp_ms: int = 0
    by_stage: dict[str, int] = field(default_factory=dict)
    by_category: dict[str, int] = field(default_factory=dict)
    by_exception_class: dict[str, int] = field(default_factory=dict)
    per_sidecar: dict[str, pb.JobSummary] = field(default_factory=dict, repr=False)
    #: Node sidecars `Job.close()` could not reach (they end the run on their idle timeout).
    unreachable: list[str] = field(default_factory=list)

    _SUMS = ("records_processed", "total_record_failures", "total_record_errors",
             "total_records_skipped", "total_retries", "total_errors_logged",
             "dlq_records_written", "dropped_records", "retry_budget_exhausted",
             "record_id_collisions")

    def add(self, target: str, s: pb.JobSummary) -> None:
        self.per_sidecar[target] = s
        self.failed = self.failed or s.failed
        if s.failure_reason and s.failure_reason not in self.failure_reasons:
            self.failure_reasons.append(s.failure_reason)
        for name in self._SUMS:
            setattr(self, name, getattr(self, name) + getattr(s, name))
        self.last_error_timestamp_ms = max(self.last_error_timestamp_ms, s.last_error_timestamp_ms)
        for table, entries in ((self.by_stage, s.by_stage), (self.by_category, s.by_category),
                               (self.by_exception_class, s.by_exception_class)):
            for e in entries:
                table[e.key] = table.get(e.key, 0) + e.count
