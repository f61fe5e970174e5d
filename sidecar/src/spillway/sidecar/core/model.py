"""Domain values of the policy core: what a failed record is and what the sidecar answers.

These mirror `spillway.v1` messages but import nothing from grpc or protobuf: the servicer
translates at the boundary (`spillway.sidecar.transport.convert`).

Values built once per reported record (`FailedRecord`, `ExceptionInfo`, `SourceCoordinates`,
`Verdict`, `Decision`) are plain slotted dataclasses, not frozen ones: a frozen dataclass's
``__init__`` sets every field through ``object.__setattr__`` and costs about four times as much,
which at hundreds of thousands of records per second is most of the sidecar's CPU. Treat them
as values all the same: nothing mutates one after it is built, except the servicer marking its
own fresh `Verdict` ``dead_lettered`` once the DLQ record is spooled. Values used as keys
(`StageRef`, `TaskIdentity`) and `DlqRecord` stay frozen.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Stage(enum.Enum):
    """Where a failure happened. Values are the KIP-298 stage names written to DLQ headers."""

    DESERIALIZATION = "DESERIALIZATION"
    KEY_CONVERTER = "KEY_CONVERTER"
    VALUE_CONVERTER = "VALUE_CONVERTER"
    HEADER_CONVERTER = "HEADER_CONVERTER"
    TRANSFORMATION = "TRANSFORMATION"
    SINK = "TASK_PUT"  # Connect's name for the sink's put() stage
    PRODUCE = "KAFKA_PRODUCE"
    CUSTOM = "CUSTOM"

    __hash__ = object.__hash__   # see _identity_hash below


class Category(enum.Enum):
    """KIP-1050 categories, plus DATA for poison records (never retried; tolerance decides),
    and CRASH / TIMEOUT for a record whose processing killed its Python worker or outlasted
    ``errors.record.timeout.ms`` (decided as DATA is: never retried unless a rule says so)."""

    RETRIABLE = "retriable"
    REFRESH_RETRIABLE = "refresh-retriable"
    ABORTABLE = "abortable"
    APPLICATION_RECOVERABLE = "application-recoverable"
    INVALID_CONFIGURATION = "invalid-configuration"
    DATA = "data"
    CRASH = "crash"
    TIMEOUT = "timeout"

    __hash__ = object.__hash__   # see _identity_hash below

    @property
    def retriable(self) -> bool:
        return self in (Category.RETRIABLE, Category.REFRESH_RETRIABLE)


class Action(enum.Enum):
    RETRY = "RETRY"
    SKIP = "SKIP"
    FAIL = "FAIL"

    __hash__ = object.__hash__   # see _identity_hash below


# _identity_hash: Enum hashes a member by its name in Python code (``hash(self._name_)``),
# ~50 ns per dict lookup; the sidecar looks these up several times per record. Members are
# singletons compared by identity, so the C-level identity hash is equivalent (hash values are
# per process and never persisted).


@dataclass(frozen=True, slots=True)
class StageRef:
    """A stage plus, for CUSTOM, its user-given name. `name` is what headers and counters show."""

    stage: Stage
    custom: str = ""

    @property
    def name(self) -> str:
        return self.custom if self.stage is Stage.CUSTOM and self.custom else self.stage.value


@dataclass(slots=True)
class SourceCoordinates:
    topic: str
    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class TaskIdentity:
    stage_id: int = 0
    partition_id: int = 0
    attempt_number: int = 0
    task_attempt_id: int = 0
    executor_id: str = ""
    host: str = ""

    @property
    def task_id(self) -> str:
        """Connect's task.id analogue: Spark's stage and partition (stable across attempts)."""
        return f"{self.stage_id}.{self.partition_id}"


@dataclass(slots=True)
class ExceptionInfo:
    class_name: str
    class_chain: tuple[str, ...] = ()
    message: str = ""
    stack_trace: str = ""
    grpc_status_code: int | None = None
    http_status_code: int | None = None
    kafka_retriable: bool | None = None
    kafka_fatal: bool | None = None
    kafka_txn_requires_abort: bool | None = None
    marker_category: Category | None = None
    causes: tuple[str, ...] = ()
    kafka_error_code: str | None = None     # confluent_kafka.KafkaError.name()


Header = tuple[str, bytes | None]


@dataclass(slots=True)
class FailedRecord:
    record_id: str
    stage: StageRef
    exception: ExceptionInfo
    function_name: str = ""
    source: SourceCoordinates | None = None
    key: bytes | None = None
    value: bytes | None = None
    headers: tuple[Header, ...] = ()
    timestamp_ms: int | None = None
    attempt: int = 1
    traceparent: str = ""
    tracestate: str = ""
    # what key/value are: PAYLOAD_SOURCE (the source record as read) or PAYLOAD_STAGE_INPUT
    # (the failing stage's input, e.g. a row as JSON; also what an older client's means)
    payload: str = "stage-input"
    # its payload digest (`tolerance.payload_tag`) when it came without its payload (a node's
    # tally to the job's home); -1: computed from key and value
    tag: int = -1

    @property
    def trace(self) -> tuple[str, str]:
        """(traceparent, tracestate); a view over a report's columns gives the records of one
        trace the same tuple, which `DlqBuilder` checks once (`transport/columns.py`)."""
        return (self.traceparent, self.tracestate)


PAYLOAD_SOURCE = "source"
PAYLOAD_STAGE_INPUT = "stage-input"


@dataclass(slots=True)
class Verdict:
    record_id: str
    action: Action
    category: Category
    reason: str
    attempt: int
    retry_delay_ms: int = 0
    dead_lettered: bool = False
    job_failed: bool = False
    retry_budget_exhausted: bool = False   # the retry budget deferred or refused a retry


@dataclass(slots=True)
class Decision:
    """The policy's answer for one record: the verdict, and whether to dead-letter it.

    `dead_letter` is True only for SKIP verdicts of jobs with a DLQ topic; the servicer spools
    the DLQ record before it answers, then sets `Verdict.dead_lettered`.
    """

    verdict: Verdict
    dead_letter: bool = False


@dataclass(frozen=True, slots=True)
class DlqRecord:
    """A record ready for the DLQ topic: produce exactly this."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: tuple[Header, ...]
    record_id: str
    job: str
    task_key: str  # identifies the task attempt whose flush barrier waits for this record
    traceparent: str = ""


@dataclass(slots=True)
class Counts:
    """KIP-298 task-error-metrics plus KIP-1033 dropped-records, for one scope."""

    total_record_failures: int = 0
    total_record_errors: int = 0
    total_records_skipped: int = 0
    total_retries: int = 0
    total_errors_logged: int = 0
    dropped_records: int = 0
    last_error_timestamp_ms: int = 0


@dataclass(slots=True)
class JobSummary:
    job: str
    run_id: str = ""
    failed: bool = False
    failure_reason: str = ""
    records_processed: int = 0
    counts: Counts = field(default_factory=Counts)
    dlq_records_written: int = 0
    by_stage: dict[str, int] = field(default_factory=dict)
    by_category: dict[str, int] = field(default_factory=dict)
    by_exception_class: dict[str, int] = field(default_factory=dict)
    retry_budget_exhausted: int = 0   # retries the budget deferred or refused
    records_refused: int = 0          # records of reports refused for backpressure
    # distinct records reported under an id already known with another payload (each decided
    # on its own; see policy, record identity)
    record_id_collisions: int = 0


def task_key(job: str, task: TaskIdentity) -> str:
    """The flush barrier's key: one task attempt of one job."""
    return f"{job}/{task.stage_id}.{task.partition_id}.{task.attempt_number}/{task.task_attempt_id}"


def task_run_prefix(key: str) -> str:
    """The run part of a `task_key`, as the prefix ``job + "/"`` that all of its run's task keys
    share (a run key may hold '/', the task's two parts never do)."""
    return key.rsplit("/", 2)[0] + "/"
