"""What the service is asked and what it answers, as plain values.

The transport (transport/servicer.py, transport/convert.py) turns protobuf into these and back;
the service never sees a message. One value per call, never one per record: a report's records
stay the sequence the transport decoded (`convert.failed_records`, `columns.records`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from spillway.sidecar.core.model import JobSummary, StageRef, TaskIdentity, Verdict
from spillway.sidecar.service.ended import EndedRun, Totals


@dataclass(frozen=True, slots=True)
class Registration:
    """RegisterJob: a run of a job and its policy; ``home`` (and the instance id the driver
    was answered with) when the run is homed at another sidecar; ``peer``, from a node
    sidecar registering a run at its home, that node's advertised address."""

    job: str
    run_id: str
    properties: Mapping[str, str]
    home: str = ""
    home_instance_id: str = ""
    peer: str = ""
    # token escrow (streaming over Spark Connect): the driver asks the home to keep the run's
    # token; an executor without it claims it (`service.registration`)
    token_escrow: bool = False
    claim_token: bool = False


@dataclass(frozen=True, slots=True)
class Registered:
    """RegisterJob's answer: the run, its token, its policy and where it is homed."""

    job: str
    run_id: str
    job_token: str
    effective_properties: Mapping[str, str]
    home: str
    home_instance_id: str
    process_port: int = 0
    report_columns: bool = False


@dataclass(frozen=True, slots=True)
class Report:
    """ReportFailures: `records` failed in `task` of a run. ``size``: the report's bytes on the
    wire, asked only when backpressure needs it. ``decide_only`` and ``undo_ids`` are a node
    sidecar's, asking the run's home (it dead-letters itself)."""

    job: str
    run_id: str
    task: TaskIdentity
    records: Sequence
    recovered_ids: Sequence[str] = ()
    undo_ids: Sequence[str] = ()
    decide_only: bool = False
    size: Callable[[], int] = field(default=lambda: 0)


@dataclass(frozen=True, slots=True)
class Flush:
    """FlushTask: what a task attempt processed, by stage; ``progress_only`` is a node
    sidecar's, recording the counts at the run's home without waiting for DLQ records."""

    job: str
    run_id: str
    task: TaskIdentity
    processed: Mapping[StageRef, int]
    recovered_ids: Sequence[str] = ()
    progress_only: bool = False


@dataclass(frozen=True, slots=True)
class RunSummary:
    """A run's summary as one sidecar counts it."""

    summary: JobSummary
    sidecar_id: str


@dataclass(slots=True)
class Ended:
    """EndJob's answer: the run's final summary here (first), then one per node sidecar it was
    released on; the node sidecars that could not be reached."""

    summaries: list[RunSummary] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StatusQuery:
    """GetStatus: the runs of ``job`` (every job: empty), a page of ``page_size`` (0: the
    default) after ``page_token``."""

    job: str = ""
    page_size: int = 0
    page_token: str = ""


@dataclass(frozen=True, slots=True)
class StatusPage:
    """GetStatus's answer before it is cut to a page: the sidecar-wide counters and totals,
    and the runs the caller may see after the page token, lazily with their summaries (a run
    that ended meanwhile is left out); ``jobs_hidden``: live runs (of the job asked) the caller
    may not see. On the first page, the ended runs the caller may see, newest first. The
    transport fills a page of at most ``size`` runs that fits a message
    (`convert.status_to_pb`)."""

    sidecar_id: str
    version: str
    counters: Mapping[str, float]
    instance_id: str
    advertised_address: str
    jobs_total: int
    size: int
    last: tuple[str, str] | None    # (job, run id) of the last run the caller may see
    summaries: Iterator[tuple[tuple[str, str], JobSummary]]
    totals: Totals | None = None
    ended: Sequence[EndedRun] = ()
    jobs_hidden: int = 0


# a report's answers in order: (verdict, dead_letter) and how many consecutive records it is
# for (a run's verdict has no record id: `convert.report_response` gives each record its own)
Answer = tuple[tuple[Verdict, bool], int]


__all__ = ["Answer", "Ended", "Flush", "Registered", "Registration", "Report", "RunSummary",
           "StatusPage", "StatusQuery"]
