"""spillway sidecar exceptions. Foreign errors are mapped at the boundary with `raise X from exc`.

    SpillwayError
    ├── ConfigError                 a property is missing, malformed or out of range (names it)
    ├── JobError
    │   ├── UnknownJobError         a call names a job run that is not registered (or has ended)
    │   ├── JobConflictError        a live job run re-registered with a different policy or home
    │   ├── JobAccessError          the run's job token is missing or wrong (PERMISSION_DENIED)
    │   └── LiveRunsExhaustedError  jobs.max.live runs are live already (RESOURCE_EXHAUSTED)
    ├── DlqError
    │   ├── TopicGuardrailError     a DLQ topic name or auto-create rule was refused
    │   ├── KafkaUnreachableError   the sidecar's Kafka did not answer a check (names it)
    │   ├── BackpressureError       the spool is at its high-water mark: retry later
    │   ├── ReportTooLargeError     a report larger than the whole spool: split it, never retry
    │   └── FlushTimeoutError       a flush barrier's deadline passed before Kafka acknowledged
    └── HandlerError                a user handler raised (KIP-1033: fails the job)
"""

from __future__ import annotations


class SpillwayError(Exception):
    """Root of every error the sidecar raises on purpose."""


class ConfigError(SpillwayError, ValueError):
    def __init__(self, prop: str, message: str) -> None:
        self.property = prop
        super().__init__(f"{prop}: {message}")


class JobError(SpillwayError):
    pass


class UnknownJobError(JobError, KeyError):
    def __init__(self, job: str, run_id: str = "", hint: str = "") -> None:
        self.job = job
        self.run_id = run_id
        self.hint = hint
        super().__init__(job)

    def __str__(self) -> str:
        run = f" run {self.run_id!r}" if self.run_id else ""
        return (f"job {self.job!r}{run} is not registered with this sidecar (call RegisterJob "
                f"first; a run that ended or expired must be registered again){self.hint}")


class JobConflictError(JobError):
    pass


class JobAccessError(JobError):
    """The caller did not present the run's job token (or presented another run's)."""


class LiveRunsExhaustedError(JobError):
    pass


class RunStateError(JobError):
    """The state a sidecar kept for a run before a restart cannot be read (DATA_LOSS): the run
    is not resumed, since its counted errors and remembered records are unknown."""


class DlqError(SpillwayError):
    pass


class KafkaUnreachableError(DlqError):
    """The sidecar's Kafka did not answer (or refused) a check a request needed: the sidecar
    itself is up, its Kafka is the problem."""

    def __init__(self, servers: str, cause: str) -> None:
        self.servers = servers
        super().__init__(
            f"the sidecar's Kafka at {servers} is unreachable or refused the DLQ topic check: "
            f"{cause}. The sidecar is up; check its bootstrap.servers and that those brokers "
            f"are reachable from the sidecar's host")


class TopicGuardrailError(DlqError, ConfigError):
    def __init__(self, prop: str, message: str) -> None:
        ConfigError.__init__(self, prop, message)


class BackpressureError(DlqError):
    pass


class ReportTooLargeError(DlqError):
    """A report that could not be admitted even into an empty spool (FAILED_PRECONDITION: no
    retry of the same report can succeed; smaller reports can)."""


class FlushTimeoutError(DlqError, TimeoutError):
    pass


class HandlerError(SpillwayError):
    pass
